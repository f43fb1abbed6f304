"""models.py: the embedded models load offline, tiny models build from a config, run folders resolve."""
import errno
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from fault_injection import folder_hash, run_cli

import models


@pytest.mark.slow
def test_embedded_smollm2_loads_offline_and_generates_text(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = models.load_policy("smollm2-135m")
    assert model.config.model_type == "llama"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert any(c.isalpha() or c.isdigit() for c in text)      # a real model answers with words or digits


def test_embedded_embedder_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    embedder = models.load_embedder("all-minilm-l6-v2")
    vecs = embedder.encode(["We add 3 and 4.", "Adding three and four.", "The cat sat on the mat."])
    assert vecs.shape == (3, 384)
    sim = vecs @ vecs.T / (abs(vecs) ** 2).sum(1) ** 0.5 / ((abs(vecs) ** 2).sum(1) ** 0.5)[:, None]
    assert sim[0, 1] > sim[0, 2]                                # paraphrases are closer than unrelated text


def test_tiny_random_model_is_built_from_a_config_and_seeded(smollm_tokenizer):
    a = models.tiny_random_model(len(smollm_tokenizer), seed=0)
    b = models.tiny_random_model(len(smollm_tokenizer), seed=0)
    c = models.tiny_random_model(len(smollm_tokenizer), seed=1)
    assert a.config.num_hidden_layers == 2 and a.config.vocab_size == len(smollm_tokenizer)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_resolve_checkpoint_follows_latest(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "config.json").write_text("{}")                    # the run's Config, not a model config
    (run / "checkpoints" / "latest").write_text("step_000003")
    assert models.resolve_checkpoint(str(run)) == str(run / "checkpoints" / "step_000003")
    assert models.resolve_checkpoint("Qwen/Qwen2.5-3B") == "Qwen/Qwen2.5-3B"


def test_precision_helpers():
    assert (models.policy_dtype("bf16") == torch.bfloat16
            and models.policy_dtype("bf16-autocast") == torch.float32)
    with models.autocast("cpu", "bf16-autocast"):
        assert torch.is_autocast_enabled("cpu")
    with models.autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")


def test_custom_code_is_found_wherever_a_model_names_it(tmp_path):
    """auto_map in config.json or tokenizer_config.json, at the top or in a sentence-transformers module's
    folder, and a module class that is not sentence-transformers' own: each would run the model's code."""
    folder = tmp_path / "m"
    (folder / "2_Custom").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert models.custom_code(str(folder)) == []
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tok.Slow", "owner/repo--tok_fast.Fast"]}}))
    (folder / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "2_Custom", "type": "custom_module.Pooler"}]))
    (folder / "2_Custom" / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "deep.Model"}}))
    assert models.custom_code(str(folder)) == ["modules.json's module custom_module.Pooler",
                                               "tokenizer_config.json's auto_map (tok.py, tok_fast.py)",
                                               "2_Custom/config.json's auto_map (deep.py)"]
    with pytest.raises(models.UserError, match="--embed_model .*pass --trust_remote_code true only"):
        models.check_trusted(str(folder), "--embed_model", False)
    models.check_trusted(str(folder), "--embed_model", True)           # the user vouched for it
    models.check_trusted("Qwen/Qwen2.5-3B", "--model", False)   # no auto_map (or not cached: HF refuses code)
    with pytest.raises(models.UserError, match="gte-base-en-v1.5: runs its own Python code from the HF hub"):
        models.check_trusted("Alibaba-NLP/gte-base-en-v1.5", "--embed_model", False)
    # transformers' own refusal (a hub model not downloaded yet, so its files were not read here)
    with pytest.raises(models.UserError, match="^--model o/m: runs its own Python code; pass --trust_remote"):
        models.code_refused(ValueError("The repository o/m contains custom code which must be executed"),
                            "--model", "o/m")
    models.code_refused(ValueError("Unrecognized model in o/m"), "--model", "o/m")   # another error: kept


def test_the_cards_command_passes_the_flag_check_and_gte_large_still_needs_the_flag(monkeypatch, capsys):
    """`python train.py --model Qwen/Qwen2.5-3B` (--preset paper's embedder) passes the pre-flight check with
    no --trust_remote_code, before anything is downloaded (offline here); the paper's gte-large-en-v1.5
    named by the user still needs the flag; the default embedder says in one line what it is and how to get
    the paper's."""
    import config as C

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = C.make_config("paper")
    assert cfg.embed_model == models.DEFAULT_EMBEDDER and not cfg.trust_remote_code
    models.check_loadable("Qwen/Qwen2.5-3B", cfg.embed_model, cfg.trust_remote_code)      # no error
    with pytest.raises(models.UserError, match="gte-large-en-v1.5: runs its own Python code .*--trust"):
        models.check_loadable("Qwen/Qwen2.5-3B", models.PAPER_EMBEDDER, False)
    models.check_loadable("Qwen/Qwen2.5-3B", models.PAPER_EMBEDDER, True)                # consent given
    note = models.embedder_note(cfg.embed_model)
    assert "all-mpnet-base-v2" in note and "62.9" in note and "63.5" in note and "\n" not in note
    assert note.endswith(f"--embed_model {models.PAPER_EMBEDDER} --trust_remote_code true")
    assert models.embedder_note("all-minilm-l6-v2") is None
    models.load_embedder("all-minilm-l6-v2")                   # no note for another embedder
    assert "embedder:" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------
# DATPO_CACHE: the embedded model's converted copy, in the right folder or one line, nothing left behind
# ------------------------------------------------------------------------------------------------------
TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]


def test_an_empty_datpo_cache_is_the_default_never_the_working_directory(program_name, tmp_path, monkeypatch,
                                                                       smollm_tokenizer):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATPO_CACHE", "")                     # the case: converted 517 MiB here
    assert models.cache_dir() == Path.home() / ".cache" / "datpo"
    assert models.smollm2_folder() == Path.home() / ".cache" / "datpo" / "smollm2-135m-instruct"
    assert folder_hash(tmp_path) == {}
    monkeypatch.setenv("DATPO_CACHE", "~/elsewhere")
    assert models.cache_dir() == Path.home() / "elsewhere"


CACHE_LINE = ("expected a folder you can create and write for the embedded model's converted copy (517 MiB), "
              "or DATPO_CACHE pointing at one")


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_a_datpo_cache_that_is_a_file_is_one_line(program_name, tmp_path, capsys, monkeypatch, kind):
    file = tmp_path / "cache"
    file.write_text("not a folder")
    cache = file if kind == "a file" else file / "sub"        # the case, then a variant
    monkeypatch.setenv("DATPO_CACHE", str(cache))
    before = folder_hash(tmp_path)
    line = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(tmp_path / "run")], code=2,
                   one_error_line=True)[-1]
    assert line == ({"a file": f"train.py: error: DATPO_CACHE={cache}: is a file, not a folder; expected a "
                               f"folder for the embedded model's converted copy (517 MiB), or DATPO_CACHE "
                               f"unset (~/.cache/datpo)",
                     "under a file": f"train.py: error: DATPO_CACHE={cache}: cannot write there (Not a "
                                     f"directory); {CACHE_LINE}"}[kind])
    assert folder_hash(tmp_path) == before                    # the file as it was; no file in --out_dir


def _mount_tmpfs(folder: Path, options: str) -> bool:
    folder.mkdir(exist_ok=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def test_a_read_only_cache_is_read_or_one_line(program_name, tmp_path, capsys, monkeypatch, smollm_tokenizer):
    cache = tmp_path / "cache"
    if not _mount_tmpfs(cache, "size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (cache / "smollm2-135m-instruct").symlink_to(models.smollm2_folder())
        leftover = cache / f".smollm2-{socket.gethostname().replace('-', '_')}-{_dead_pid()}-abcd1234"
        leftover.mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
        monkeypatch.setenv("DATPO_CACHE", str(cache))
        assert models.smollm2_folder() == cache / "smollm2-135m-instruct"      # a shared cache, read only
        assert leftover.exists() and capsys.readouterr().err == ""             # cannot be removed: no line
    finally:
        subprocess.run(["umount", str(cache)], capture_output=True)
    empty = tmp_path / "empty"
    if not _mount_tmpfs(empty, "ro,size=1m"):
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        monkeypatch.setenv("DATPO_CACHE", str(empty))
        line = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(tmp_path / "run")], code=2,
                       one_error_line=True)[-1]
        assert line == (f"train.py: error: DATPO_CACHE={empty}: cannot write there (Read-only file system); "
                        f"{CACHE_LINE}")
    finally:
        subprocess.run(["umount", str(empty)], capture_output=True)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def partial_conversion(error: BaseException):
    """A conversion that writes part of the model, then stops with `error` (Ctrl-C, a full disk)."""
    def convert(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)
        raise error
    return convert


@pytest.mark.parametrize("error, code, line", [
    (KeyboardInterrupt(), 130, "train.py: interrupted"),
    (OSError(errno.ENOSPC, "No space left on device"), 4,
     "train.py: error: DATPO_CACHE={cache}: converting the embedded model into it failed (disk full (No "
     "space left on device)); nothing of it is kept; free space (it takes 517 MiB) or point DATPO_CACHE at "
     "another folder"),
])
def test_an_interrupted_first_conversion_leaves_nothing(program_name, tmp_path, capsys, monkeypatch, error,
                                                        code, line):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DATPO_CACHE", str(cache))
    monkeypatch.setattr(models, "_convert_smollm2", partial_conversion(error))
    lines = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(tmp_path / "run")], code=code)
    assert lines[-1] == line.format(cache=cache) and len(lines) == 1
    assert folder_hash(cache) == {}                           # the partial folder removed, nothing cached


def test_a_conversion_killed_outright_is_cleared_by_the_next_run(program_name, tmp_path, capsys, monkeypatch,
                                                                smollm_tokenizer):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "smollm2-135m-instruct").symlink_to(models.smollm2_folder())
    host = socket.gethostname().replace("-", "_")
    killed = cache / f".smollm2-{host}-{_dead_pid()}-k1ll3d00"
    running = cache / f".smollm2-{host}-{os.getpid()}-l1v3l1v3"   # a conversion still running: kept
    other = cache / f".smollm2-otherhost-{_dead_pid()}-0th3r000"   # another host's: its pid tells nothing
    for folder in (killed, running, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    monkeypatch.setenv("DATPO_CACHE", str(cache))
    assert models.smollm2_folder() == cache / "smollm2-135m-instruct"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"DATPO_CACHE={cache}: removed {killed.name}, left by a conversion of the embedded model that was "
        f"interrupted (process {killed.name.split('-')[2]} is gone)"]
    assert not killed.exists() and running.exists() and other.exists()
def test_gguf_conversion_refuses_a_transformers_older_than_its_floor(tmp_path, monkeypatch):
    """requirements.txt admits the GPU image's transformers 5.17, which runs everything but the embedded
    GGUF conversion (before 5.18 it gives SmolLM2 <|im_start|> as EOS): the conversion says so in one line
    before reading anything, and writes nothing."""
    import transformers

    from runtime.faults import UserError

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(UserError, match=r"needs transformers >= 5\.18, and this one is 5\.17\.0 "):
        models._convert_smollm2(tmp_path)
    assert not any(tmp_path.iterdir())
