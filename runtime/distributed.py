"""distributed.py — data-parallel training on several GPUs or nodes with torchrun and torch.distributed.

    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen2.5-3B                      # one node, 8 GPUs
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 --rdzv_backend c10d \\
             --rdzv_endpoint HOST:29500 train.py --model Qwen/Qwen2.5-3B               # two nodes (R = 0, 1)

`python train.py` never starts a process group: every helper here is then a no-op that returns its input
(rank 0 of 1), so the single-process loop reads as before. Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK
set):

  prompts     every rank draws the step's prompts the same way (same data cursor, same skips) and rolls out
              its contiguous share (`shard_range`) with its own RNG stream (`rollout_rng`);
  trees       the step's trees and block advantages are all-gathered (`gather_lists`), so every rank holds the
              whole step in prompt order: metrics, AttnRL's dynamic batch size and the skipped-prompt count
              are global, and every rank forms the same PPO mini-batches as one process would;
  update      each global mini-batch's micro-batches are dealt to ranks (`deal`, over `my_share`); a rank with
              fewer runs a zero-gradient pass (`idle_pass`) so every rank joins every collective and takes
              the same optimizer steps; the loss normaliser is the global mini-batch's token count (every
              rank knows all its rows), and the loss is scaled by the world size because DDP and FSDP average
              gradients (`backward`);
  model       FSDP2 `fully_shard` (parameters, gradients and AdamW states sharded; per-decoder-layer units;
              MixedPrecisionPolicy from --precision) or DDP (`--parallel ddp`): `wrap`;
  generation  rollouts, old log-probs and evaluation run on gathered parameters (`full_params`), so ranks may
              run different numbers of forward passes without deadlocking FSDP's all-gathers;
  files       only rank 0 writes logs, plots and checkpoints; a checkpoint holds the full (unsharded) weights
              for `from_pretrained` and an FQN-keyed full optimizer state, so it resumes on any number of
              ranks.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
import sys

import torch
import torch.distributed as dist

_OWNED = False    # did init() start the process group (then shutdown() ends it)?


# --------------------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------------------
# What env:// (torch.distributed's rendezvous from the environment) needs besides WORLD_SIZE; torchrun sets
# them all, with LOCAL_RANK, for every process it starts.
LAUNCH_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """True when torchrun (or another launcher) set the env:// variables for more than one process. A
    launcher's variable that cannot be one (WORLD_SIZE empty or not a number; WORLD_SIZE=2 with no RANK,
    MASTER_ADDR, MASTER_PORT: set by hand outside torchrun) is one line (UserError), not torch's ValueError
    from inside init_process_group."""
    from runtime.faults import UserError

    env = os.environ
    value = env.get("WORLD_SIZE")
    if value is None:
        return False
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    expected = (f"expected a command started by torchrun (`torchrun --nproc_per_node N {script} ...` sets "
                f"WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT), or WORLD_SIZE unset (or 1) for one process")
    if not (value.strip().isascii() and value.strip().isdigit() and int(value) >= 1):
        raise UserError(f"WORLD_SIZE={value!r} in the environment: not a number of processes >= 1; "
                        f"{expected}")
    world = int(value)
    if world == 1:
        return False
    missing = [name for name in LAUNCH_VARIABLES if not env.get(name, "").strip()]
    if missing:
        raise UserError(f"WORLD_SIZE={world} in the environment but {', '.join(missing)} not set: this "
                        f"process was not started by torchrun; {expected}")
    rank = env["RANK"].strip()
    if not (rank.isascii() and rank.isdigit() and int(rank) < world):
        raise UserError(f"RANK={env['RANK']!r} in the environment: expected a number 0 to {world - 1} "
                        f"(WORLD_SIZE={world}), as torchrun sets it")
    return True


def init(device: str = "auto") -> None:
    """Start the process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT):
    NCCL with one GPU per local rank, gloo on CPU. Nothing happens in a single process or when the caller
    already started a group."""
    global _OWNED
    if not launched() or dist.is_initialized():
        return
    use_cuda = torch.cuda.is_available() and not str(device).startswith("cpu")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))   # "cuda" now means this rank's GPU
    dist.init_process_group("nccl" if use_cuda else "gloo")
    _OWNED = True


def shutdown() -> None:
    global _OWNED
    if _OWNED and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _OWNED = False


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes logs, plots and checkpoints."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


# --------------------------------------------------------------------------------------------------------
# Sharding and collectives over plain Python values
# --------------------------------------------------------------------------------------------------------
def shard_range(n: int, rank_: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[lo, hi) of this rank's contiguous share of n items; the first n % world ranks take one more, so shares
    differ by at most one and, concatenated in rank order, give back 0..n-1."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    base, extra = divmod(n, w)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order ([obj] in one process). Pickled: for trees, records, small lists."""
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_lists(*lists: list):
    """Each list concatenated over ranks in rank order, on every rank. With contiguous shards this restores
    the global order (prompt i of the step stays at position i). One list in → one list out."""
    if not active():
        return lists[0] if len(lists) == 1 else lists
    per_rank = all_gather_objects(lists)
    joined = tuple([x for part in per_rank for x in part[i]] for i in range(len(lists)))
    return joined[0] if len(lists) == 1 else joined


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum or max of a list of numbers over ranks (float64, on the collective's device)."""
    if not active():
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def merge_shares(values: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-rank partial results over ranks: each rank filled `values` where `present` is True (its
    share, e.g. the old log-probs of its micro-batches); every rank gets all of them (the mean where shares
    overlap). One process: unchanged."""
    if not active():
        return values, present
    counts = present.to(values.dtype)
    total = torch.where(present, values, torch.zeros_like(values))
    dist.all_reduce(total)
    dist.all_reduce(counts)
    return total / counts.clamp(min=1), counts > 0


def any_rank(flag) -> bool:
    """True on every rank when it is true on any: a stop signal one rank received stops all at the same
    step."""
    return bool(all_reduce([float(bool(flag))], "max")[0])


# --------------------------------------------------------------------------------------------------------
# Per-rank random streams
# --------------------------------------------------------------------------------------------------------
def stream_seed(seed: int, step: int, rank_: int) -> int:
    """A 63-bit seed for (run seed, step, rank): independent streams that need no saved state, so a run
    resumes with any number of ranks."""
    digest = hashlib.sha256(f"datpo/{seed}/{step}/{rank_}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rollout_rng(rng: random.Random, seed: int, step: int) -> random.Random:
    """The RNG a rank's rollouts draw from (fork choice, AttnRL's expansion) and a reseeded torch generator
    (token sampling). One process: the run's own stream, untouched. Several ranks: a fresh stream per
    (seed, step, rank), while `rng` stays shared and identical on every rank (it orders the PPO
    mini-batches)."""
    if not active():
        return rng
    s = stream_seed(seed, step, rank())
    torch.manual_seed(s)
    return random.Random(s)


# --------------------------------------------------------------------------------------------------------
# The model: FSDP2 or DDP
# --------------------------------------------------------------------------------------------------------
def mixed_precision(precision: str):
    """FSDP2 MixedPrecisionPolicy for --precision: bf16-autocast = bf16 compute over fp32 sharded master
    weights; bf16 = pure bf16 weights; fp32 = none. Gradients are reduced in fp32 in every case."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-autocast":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "bf16":
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def wrap(model: torch.nn.Module, parallel: str, precision: str) -> torch.nn.Module:
    """The module the update runs (`policy`). One process: `model` itself. FSDP2: `model` sharded in place,
    one FSDP unit per decoder layer (HF's `_no_split_modules`) plus the root (embeddings, norm, lm_head).
    HSDP (`hsdp`): sharded within a node, replicated across nodes (a 2-D mesh nodes × LOCAL_WORLD_SIZE), so
    the per-layer all-gathers stay on the node's fast links. DDP: a wrapper around `model`; generation keeps
    calling `model` (no collectives there)."""
    if not active():
        return model
    device = next(model.parameters()).device
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # forward_sync_buffers=False: the only buffers (rotary frequencies) are equal everywhere, and a buffer
        # broadcast in every forward would make the no-grad forwards collective.
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       forward_sync_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if parallel == "hsdp":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
        if world_size() % local:
            raise ValueError(f"--parallel hsdp: {world_size()} ranks do not split into nodes of {local}")
        mesh = init_device_mesh(device.type, (world_size() // local, local),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size(),))
    policy = mixed_precision(precision)
    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ValueError(f"--parallel fsdp: found no decoder layers ({sorted(layer_names)}) in "
                         f"{type(model).__name__}; use --parallel ddp")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    return model


def unwrap(policy: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a DDP wrapper (FSDP2 shards in place: the policy is the model)."""
    from torch.nn.parallel import DistributedDataParallel

    return policy.module if isinstance(policy, DistributedDataParallel) else policy


def _fsdp_units(policy) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in policy.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_params(policy: torch.nn.Module):
    """Inside: FSDP parameters are gathered once and stay gathered, so forwards need no collective and ranks
    may run different numbers of them (generation lengths differ). A no-op for DDP and one process."""
    units = _fsdp_units(policy) if active() else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


# --------------------------------------------------------------------------------------------------------
# The update: the same optimizer steps on every rank
# --------------------------------------------------------------------------------------------------------
def my_share(micro_batches: list, rank_: int | None = None, world: int | None = None) -> list:
    """This rank's micro-batches of one global mini-batch, dealt round-robin (micro-batches come sorted by
    length, so ranks get similar work), padded with None to ceil(n / world) so every rank runs the same
    number of forward/backward passes. One process: all of them, unpadded."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    mine = list(micro_batches[r::w])
    return mine + [None] * (-(-len(micro_batches) // w) - len(mine))


def sync_gradients(policy: torch.nn.Module, now: bool) -> None:
    """DDP: all-reduce gradients only in the last micro-batch of a mini-batch (what DDP's no_sync() does;
    a flag because our micro-batch loop has several exits). FSDP keeps reducing every micro-batch: deferring
    it would hold unsharded fp32 gradients, the memory FSDP is there to save."""
    if active() and hasattr(policy, "require_backward_grad_sync"):
        policy.require_backward_grad_sync = now


def grad_scale() -> float:
    """DDP and FSDP average gradients over ranks; the objective is a global sum over the mini-batch's tokens
    divided by its global token count, so each rank's loss is multiplied by the world size."""
    return float(world_size())


def idle_pass(policy: torch.nn.Module, pad_id: int, device) -> None:
    """A forward and backward of one pad token with a zero loss: zero gradients, but the rank joins the
    all-gathers and reduce-scatters (FSDP) or all-reduce (DDP) of a micro-batch it has no rows for."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    logits = policy(input_ids=ids, logits_to_keep=1).logits
    (logits.float().sum() * 0.0).backward()


def deal(policy: torch.nn.Module, micro_batches: list, pad_id: int, device):
    """The micro-batches of one global mini-batch that this rank trains on, for gradient accumulation: what
    the update loops over. One process: all of them. Under torchrun: this rank's share (`my_share`); where it
    has fewer than another rank, a zero-gradient `idle_pass` runs in their place so every rank joins every
    collective; DDP all-reduces gradients in the backward of the last one only (`sync_gradients`)."""
    share = my_share(micro_batches)
    for j, micro in enumerate(share):
        sync_gradients(policy, now=j == len(share) - 1)
        if micro is None:
            idle_pass(policy, pad_id, device)
            continue
        yield micro


def mine(micro_batches: list) -> list:
    """This rank's share of the micro-batches for no-grad passes (nothing to join): no padding."""
    return [micro for micro in my_share(micro_batches) if micro is not None]


def backward(loss: torch.Tensor) -> None:
    """loss.backward() for an objective summed over the global mini-batch: under torchrun scaled by the world
    size (`grad_scale`), because DDP and FSDP average gradients over ranks."""
    (loss * grad_scale()).backward()


# --------------------------------------------------------------------------------------------------------
# Checkpoints: full state on rank 0, loadable with any number of ranks
# --------------------------------------------------------------------------------------------------------
def model_state_dict(model: torch.nn.Module) -> dict | None:
    """The full (unsharded) weights for save_pretrained: collective under FSDP (call on every rank); rank 0
    gets them on CPU, other ranks None. DDP and one process: model.state_dict()."""
    if not active():
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if is_main() else None


def optimizer_state_dict(model: torch.nn.Module, optimizer) -> dict | None:
    """The full optimizer state keyed by parameter names (not positions), the same format for one process,
    DDP and FSDP, so a checkpoint resumes on any number of ranks. Collective under torchrun."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=active()))
    return full if is_main() else None


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load `optimizer_state_dict`'s output (every rank passes the full state; FSDP keeps its shard).
    An older checkpoint keyed by parameter positions loads with optimizer.load_state_dict in one process."""
    if all(isinstance(key, int) for key in state.get("state", {})) and not active():
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # it creates empty states with a zero step, only where no grads exist
    optimizer.zero_grad(set_to_none=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
