"""runtime/threads.py — the CPU thread policy, set in the environment before `import torch`.

Why: OpenMP's idle threads spin at every barrier, waiting for a sibling. On a CPU shared with other busy
processes the sibling is often descheduled, so the spinners burn the time slices it needs and the threads
starve each other. The same decode forward (SmolLM2-135M, 32 rows, 100-token cache) on a 2-core machine at
load 7 took 4.8-7.7 s with torch's default 2 threads, 0.7-1.2 s with OMP_WAIT_POLICY=PASSIVE (idle threads
sleep) and 1.1-1.4 s with 1 thread (docs/measurements.md, "CPU threads under load"; bench/bench_threads.py).
OpenMP (libgomp) reads OMP_WAIT_POLICY once, when `import torch` loads it: afterwards only the thread count
can still change (torch.set_num_threads), so an entry point applies the policy before its first import of
torch:

    from runtime import threads
    os.environ.update(threads.policy_env(sys.argv[1:], os.environ))   # before `import torch`

(ruff's E402 allows os.environ changes between imports, so `import torch` may follow that line.)

Passive waiting alone costs speed on a quiet machine: a thread that sleeps at once is woken through the
kernel at the next barrier, microseconds that add up over the many small operations of a decode step (the
demo's evaluation slice 27 % slower, a demo step 20 %). libgomp, the OpenMP of torch's Linux wheels, takes
a spin count that wins back most of it: GOMP_SPINCOUNT=1000 (about 10 µs of spinning, then sleep) was 7 %
slower than torch's default alone, and beside two busy processes 2× its time alone, within the spread of
PASSIVE's own runs there — where the default (300,000 spins, ~3 ms) and 100,000 collapsed (over 15× and 5×;
docs/measurements.md). Other OpenMP runtimes read OMP_WAIT_POLICY only.

The policy, each part only where the user has not chosen:
  OMP_WAIT_POLICY   PASSIVE
  GOMP_SPINCOUNT    1000, unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (libgomp: it overrides
                    the spin count that PASSIVE implies, 0)
  OMP_NUM_THREADS   --threads N (N > 0) on the command line, else OMP_NUM_THREADS as set, else the cores this
                    process may use (os.sched_getaffinity, hyperthreads of a core counted once, capped by a
                    cgroup CPU quota), shared among torchrun's processes on this machine (LOCAL_WORLD_SIZE;
                    torchrun itself sets OMP_NUM_THREADS=1 when it starts several and none is set)
GPU runs are unaffected in what matters: their CPU threads only feed the GPU.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
SYSFS_CPU = Path("/sys/devices/system/cpu")
SPIN_COUNT = "1000"   # libgomp: spins before a waiting thread sleeps (~10 µs; the module docstring says why)


def threads_flag(argv: Sequence[str]) -> int | None:
    """The value of --threads N / --threads=N in argv (the last one wins, as in argparse), or None; N = 0
    (config.py: "torch default") counts as not given."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
    try:
        n = int(value) if value is not None else 0
    except ValueError:   # argparse will reject it with its own message
        return None
    return n if n > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP) -> int | None:
    """Whole CPUs a cgroup quota allows (cgroup v2 cpu.max "QUOTA PERIOD", v1 cpu.cfs_quota_us and
    cpu.cfs_period_us), rounded up; None without a quota. Containers often show every core of the host in
    the affinity mask but allow only a few by quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def physical_cores(cpus: set[int], sysfs: Path = SYSFS_CPU) -> int:
    """How many physical cores the logical CPUs `cpus` lie on: hyperthreads of one core share its arithmetic
    units, so a second OpenMP thread there buys little for matmuls (torch's own default counts cores, not
    hyperthreads, but ignores the affinity mask). Without the sysfs topology, every CPU counts as a core."""
    cores = set()
    for cpu in cpus:
        try:
            cores.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def usable_cores(cgroup: Path = CGROUP, sysfs: Path = SYSFS_CPU) -> int:
    """The physical cores this process may run on: its affinity mask (taskset, cpusets, SLURM), capped by a
    cgroup CPU quota. os.cpu_count() would count the whole machine."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:   # macOS, Windows: no affinity API
        cpus = set(range(os.cpu_count() or 1))
    limit = cgroup_cpu_limit(cgroup)
    cores = physical_cores(cpus, sysfs)
    return max(1, min(cores, limit) if limit else cores)


def thread_count(argv: Sequence[str], environ: Mapping[str, str], cores: int) -> int:
    """--threads N, else a positive OMP_NUM_THREADS, else `cores` shared among LOCAL_WORLD_SIZE processes."""
    flag = threads_flag(argv)
    if flag:
        return flag
    try:
        if int(environ.get("OMP_NUM_THREADS", "")) > 0:
            return int(environ["OMP_NUM_THREADS"])
    except ValueError:
        pass
    try:
        local_ranks = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, cores // local_ranks)


def policy_env(argv: Sequence[str], environ: Mapping[str, str], cores: int | None = None,
               torch_loaded: bool | None = None) -> dict[str, str]:
    """The environment variables to set before `import torch` (module docstring): OMP_WAIT_POLICY=PASSIVE
    and GOMP_SPINCOUNT=1000 unless the user chose, and OMP_NUM_THREADS from thread_count. Nothing where
    torch is already loaded (an entry point imported by a test or a notebook): OpenMP has read its settings,
    and a change would only reach child processes, such as torchrun's ranks, which choose their own. Pure:
    reads its arguments (torch_loaded: by default whether sys.modules holds torch), changes nothing."""
    if torch_loaded if torch_loaded is not None else "torch" in sys.modules:
        return {}
    env = {"OMP_NUM_THREADS": str(thread_count(argv, environ, usable_cores() if cores is None else cores))}
    if not environ.get("OMP_WAIT_POLICY"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        if not environ.get("GOMP_SPINCOUNT"):
            env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return env
