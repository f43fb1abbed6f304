"""bench/gpu_smoke.py: without CUDA it says so and exits 0; its own harness (phase timers, reward stand-in,
train.py's loop with the model swapped in) runs on CPU with a 2-layer model of the same family."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run for real")
def test_gpu_smoke_without_cuda_says_so_and_exits_0():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_smoke.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "needs a CUDA GPU" in out.stdout


@pytest.mark.slow
def test_gpu_smoke_harness_runs_train_loop_on_cpu(capsys):
    """Both presets of the device script (DATPO's paper preset, GRPO) one after the other: every phase is a
    row (rollout, the block embeddings DATPO's Div_sib needs, update, the final checkpoint), tokens generated
    and trained per step, the decode step, and the ratio of their seconds per step."""
    import gpu_smoke

    import advantage
    import models
    import rollout as R
    import train
    from harness import loop

    before = (models.load_policy, R.compute_reward, R.rollout_trees, train.ppo_update, loop.save_checkpoint,
              advantage.embed_blocks)
    gpu_smoke.main(["--device", "cpu", "--presets", "paper", "grpo", "--prompts", "2",
                    "--max_new_tokens", "6", "--ppo_epochs", "1", "--steps", "1", "--extra", "--precision",
                    "fp32", "--group_size", "4", "--gen_batch_size", "8",
                    "--max_tokens_per_micro_batch", "128"])
    out = capsys.readouterr().out
    runs = out.split("--preset ")[1:]
    assert [r.split(":")[0] for r in runs] == ["paper", "grpo"] and "FAILED" not in out

    def phases(text):
        return {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ") and
                line.split()[0] in ("rollout", "embedding", "update", "checkpoint")}

    for run, embeds in zip(runs, (True, False)):
        rows = phases(run)
        assert "1 step(s)" in run.splitlines()[0]
        assert int(rows["rollout"][1]) == 1 and float(rows["rollout"][3]) > 0
        assert rows["rollout"][4] == "tokens"
        assert int(rows["update"][1]) == 1 and float(rows["update"][3]) > 0
        assert int(rows["checkpoint"][1]) == 1 and float(rows["checkpoint"][2]) > 0   # only at the end
        assert ("embedding" in rows) == embeds
        generated = float(run.split("tokens generated ")[1].split(",")[0])
        assert generated == float(rows["rollout"][3])
        assert "decode step: reference" in run and "attention kernel: tree" in run
    assert float(phases(runs[0])["embedding"][3]) > 0 and phases(runs[0])["embedding"][4] == "blocks"
    ratio = out.split("seconds per step paper / grpo: ")[1].split()
    a, b, quotient = float(ratio[0]), float(ratio[2]), float(ratio[4])
    # a and b are printed to 0.1 s: the quotient of the unrounded seconds is within their rounding of a / b
    assert b > 0 and quotient > 0
    if b >= 0.2:
        assert abs(quotient - a / b) <= 0.05 / b + 0.05 * (a + 0.05) / (b * (b - 0.05)) + 0.005
    assert before == (models.load_policy, R.compute_reward, R.rollout_trees, train.ppo_update,
                      loop.save_checkpoint, advantage.embed_blocks)                        # restored


def test_checkpointing_default_follows_the_memory_estimate():
    """At paper scale the update's computed peak without activation checkpointing leaves under 20 % of an
    80 GB GPU free (the release's pure bf16, 8 B per parameter) or does not fit (fp32 states, 16 B); with it
    both fit with room: so it is on by default there, and off at the CPU scales."""
    import bench_update

    import config as C

    without = bench_update.update_memory_gb(8, 8192, False)
    assert without > 0.8 * 80 and bench_update.update_memory_gb(16, 8192, False) > 80
    assert bench_update.update_memory_gb(16, 8192, True) < 0.75 * 80
    assert without == pytest.approx(24.7 + 8192 * 4.69e6 / 1e9 + 5.0, abs=0.3)    # the README's figures
    assert C.make_config("paper").gradient_checkpointing is True
    assert C.make_config("release").gradient_checkpointing is True
    assert (C.make_config("demo").gradient_checkpointing is False
            is C.make_config("tiny").gradient_checkpointing)


@pytest.mark.slow
def test_bench_attention_on_cpu_prints_the_tree_kernel_equal_to_dense(capsys):
    """bench/bench_attention.py's own code on CPU (tree and dense; flex is CUDA's): one packed micro-batch of
    paper-shaped trees, forward + backward per kernel; the tree kernel's log-probs and gradients match the
    dense reference to float32 rounding, and the dense row differs from itself by nothing."""
    import bench_attention

    bench_attention.main(["--device", "cpu", "--budget", "512", "--repeats", "1"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith("  ") and line.split()[0] in ("tree", "dense")}
    assert set(rows) == {"tree", "dense"}
    assert [float(x) for x in rows["dense"][4:7]] == [0.0, 0.0, 0.0]
    assert float(rows["tree"][4]) < 1e-4 and max(float(x) for x in rows["tree"][5:7]) < 1e-4
    assert "one packed micro-batch of" in out and float(rows["tree"][1]) > 0


def test_a_part_missing_a_module_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    """bench/needs.check, each device part's first act: every missing module in one line (with why), a
    carried one pointed at DATPO_CACHE/site and gpu_assets.py; a part whose modules all import is silent."""
    from bench import needs

    monkeypatch.setitem(needs.NEEDS, "probe", ("json", "datpo_no_such_module", "datpo_no_such_carried"))
    monkeypatch.setitem(needs.CARRIED, "datpo_no_such_carried", "datpo-carried-dist")
    monkeypatch.setenv("DATPO_CACHE", "/somewhere/gpu_assets")
    with pytest.raises(SystemExit) as stop:
        needs.check("probe")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("probe: cannot start, missing datpo_no_such_module (ModuleNotFoundError")
    assert "datpo_no_such_carried (ModuleNotFoundError" in err and "json" not in err
    assert "carried ones (datpo-carried-dist) belong in /somewhere/gpu_assets/site" in err
    monkeypatch.setitem(needs.NEEDS, "probe", ("json",))
    needs.check("probe")
    assert capsys.readouterr().err == ""


def test_carried_packages_import_from_the_assets_folder_alone(tmp_path):
    """bench/gpu_assets.carry_packages copies pysbd (the paper preset's sentence splitter, which the device
    image lacks) without byte code or pysbd's stray top-level packages; a Python without site-packages (-S)
    imports it from there alone, splits sentences with it, and needs.origin calls it carried."""
    import gpu_assets

    site = tmp_path / "site"
    carried = gpu_assets.carry_packages(site)
    assert [c.split()[0] for c in carried] == list(gpu_assets.needs.CARRIED.values())
    packages = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")}
    assert packages == set(gpu_assets.needs.CARRIED)
    assert not [p for p in site.rglob("*") if p.suffix in (".pyc", ".so") or p.name == "__pycache__"]
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import pysbd; from bench import needs; "
            "seg = pysbd.Segmenter(language='en', clean=False); print(needs.origin('pysbd'), "
            "seg.segment('It is 5. Then 6.'))")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(site), ROOT], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "DATPO_CACHE": str(tmp_path), "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "carried ['It is 5. ', 'Then 6.']"


def test_the_tests_start_without_xdist_as_the_device_s_engine_part_runs_them():
    """The device image has no pytest-xdist, and gpu_check.sh's engine part runs pytest with `-p no:xdist
    -o addopts=""`. tests/conftest.py implements xdist's worker-count hook: pytest without xdist refused to
    start on it ("unknown hook", no test ran; the rehearsal found it). The same command here must collect
    and pass a test file."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-o", "addopts=", "tests/test_style.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
