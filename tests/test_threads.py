"""runtime/threads.py: the CPU thread policy (OMP_WAIT_POLICY=PASSIVE, a thread count from the usable cores)
is computed from argv and the environment alone, and reaches torch when applied before `import torch`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import threads

ROOT = Path(__file__).resolve().parents[1]
OPENMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")   # the user's, left out


@pytest.mark.parametrize("argv,expected", [
    ([], None), (["--threads", "3"], 3), (["--threads=4"], 4),
    (["--threads", "0"], None),                                    # 0: config.py's "torch default"
    (["--threads", "2", "--threads", "5"], 5), (["--threads", "x"], None), (["--threads"], None),
    (["--preset", "demo", "--threads", "1", "--steps", "2"], 1),
])
def test_threads_flag_reads_the_command_line_as_argparse_would(argv, expected):
    assert threads.threads_flag(argv) == expected


def test_thread_count_prefers_the_flag_then_omp_num_threads_then_the_cores_per_local_rank():
    assert threads.thread_count(["--threads", "3"], {"OMP_NUM_THREADS": "7"}, cores=2) == 3
    assert threads.thread_count([], {"OMP_NUM_THREADS": "7"}, cores=2) == 7
    assert threads.thread_count([], {"OMP_NUM_THREADS": "junk"}, cores=2) == 2
    assert threads.thread_count([], {}, cores=16) == 16
    assert threads.thread_count([], {"LOCAL_WORLD_SIZE": "4"}, cores=16) == 4   # torchrun: 4 processes share
    assert threads.thread_count([], {"LOCAL_WORLD_SIZE": "4"}, cores=2) == 1    # never 0


def test_policy_env_sets_passive_waiting_and_a_short_spin_unless_the_user_chose():
    assert threads.policy_env([], {}, cores=2, torch_loaded=True) == {}   # too late: changes nothing
    fresh = threads.policy_env([], {}, cores=2, torch_loaded=False)
    assert fresh == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    chosen = threads.policy_env(["--threads", "1"], {"OMP_WAIT_POLICY": "ACTIVE"}, cores=2,
                                torch_loaded=False)
    assert chosen == {"OMP_NUM_THREADS": "1"}                      # ACTIVE's own spin count stays
    spins = threads.policy_env([], {"GOMP_SPINCOUNT": "0"}, cores=2, torch_loaded=False)
    assert spins == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}   # the user's spin count stays
    environ = {}
    threads.policy_env([], environ, cores=2, torch_loaded=False)
    assert environ == {}                                           # pure: the caller applies it


def test_cgroup_quota_caps_the_cores(tmp_path):
    assert threads.cgroup_cpu_limit(tmp_path) is None              # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")           # 1.5 CPUs: 2 threads can run
    assert threads.cgroup_cpu_limit(tmp_path) == 2
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()                                     # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 1
    assert threads.usable_cores(cgroup=tmp_path) == 1


def test_hyperthreads_of_one_core_count_once(tmp_path):
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3", "4"]):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert threads.physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3
    assert threads.physical_cores({0, 2}, tmp_path) == 1
    assert threads.physical_cores({7, 8}, tmp_path) == 2           # no topology: each CPU is a core


def _torch_threads(argv: list[str], **env: str) -> dict:
    """In a fresh process: apply the policy as an entry point does, then import torch and report."""
    code = ("import json, os, sys; from runtime import threads; "
            "os.environ.update(threads.policy_env(sys.argv[1:], os.environ)); import torch; "
            "print(json.dumps({'threads': torch.get_num_threads(), 'wait': os.environ['OMP_WAIT_POLICY'], "
            "'spin': os.environ.get('GOMP_SPINCOUNT')}))")
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env={**base, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_policy_reaches_torch_when_applied_before_import():
    cores = threads.usable_cores()
    assert _torch_threads([]) == {"threads": cores, "wait": "PASSIVE", "spin": "1000"}
    assert _torch_threads(["--threads", "1"]) == {"threads": 1, "wait": "PASSIVE", "spin": "1000"}
    user_chose = _torch_threads([], OMP_NUM_THREADS="1", OMP_WAIT_POLICY="ACTIVE")
    assert user_chose == {"threads": 1, "wait": "ACTIVE", "spin": None}


@pytest.mark.parametrize("entry", ["train", "evaluate", "studies.__main__"])
def test_each_entry_point_sets_the_policy_before_torch_loads(entry):
    """Importing the entry point in a fresh process (as `python train.py --threads 1` would run it) leaves
    torch with the policy's thread count and OpenMP with passive waiting."""
    code = (f"import sys; sys.argv = ['{entry}', '--threads', '1']; import json, os, {entry}, torch; "
            "print(json.dumps({'threads': torch.get_num_threads(), 'wait': os.environ['OMP_WAIT_POLICY'], "
            "'spin': os.environ.get('GOMP_SPINCOUNT')}))")
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {"threads": 1, "wait": "PASSIVE", "spin": "1000"}
