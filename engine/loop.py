"""engine/loop.py — the decode loop: every prompt's rows in one running batch (App. C, Algorithm "Tree
Rollout"; Sec. 4.1; App. F's runtime: "branch rollouts cannot commence until the base rollouts are fully
generated" is what this loop removes).

    engine = Engine(model, stop_ids, warp, max_rows, max_kv_tokens)
    for done in engine.run(prompts, n, max_new_tokens, keep_hidden=True):    # BasesDone events
        requests = ...                        # the caller's plan: rewards → V(root) → K̂, B̂ → forks
        engine.grow(done.prompt, requests)    # its branches join the running batch
    results = engine.results                  # per prompt: N bases, branches by (j, f)

Each step: admit waiting work (branches first, then new or given prompts, within the scheduler's budgets),
then one decode step of every active row. A row leaves the batch the step it ends (stop id or budget): no
decode step is ever spent on an ended row. The moment a prompt's N base rows have ended, the loop yields
BasesDone and waits for the caller's grow — while other prompts' base responses are still decoding.

For every sampled token it records H_t of the sampling distribution (after temperature/top-k/top-p), the
log-probability of the sampled token under it, and (base rows whose prompt may branch) the final hidden
state, so a branch's first token is sampled from the distribution at its fork without running the prefix
again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from engine import kv, paged, shared
from engine.kv import KVPool
from engine.samples import BasesDone, BranchRequest, PromptResult, Sample
from engine.scheduler import Backoff, DecodeRow, Scheduler
from runtime import oom


@dataclass
class EngineRun:
    """One Engine.run call (a fresh one per call): its arguments, the results so far, each prompt's tree
    bookkeeping — which rows ended, when its bases are done, when its tree is done — and the counts the
    progress bar shows. Rows that end give their KV slots back to `pool`; what happens goes to `events`."""
    prompts: list[list[int]]
    n: int
    max_new_tokens: int
    keep_hidden: bool | set[int]
    given_bases: dict[int, list[Sample]]
    pool: KVPool
    events: list
    results: list[PromptResult] = field(default_factory=list)
    bases_left: list[int] = field(default_factory=list)   # per prompt: base rows not yet ended
    rows_left: list[int] = field(default_factory=list)    # per prompt: rows of its tree not yet ended
    base_rows: dict[int, list[DecodeRow]] = field(default_factory=dict)   # ended base rows, until grown
    ended: deque = field(default_factory=deque)           # prompts whose bases ended, not yet yielded
    ungrown: set = field(default_factory=set)             # prompts whose bases ended, not yet grown
    bar: object = None                                    # the tqdm bar, and what it shows:
    sampled: int = 0                                      # tokens sampled (given bases are not)
    rows_started: int = 0
    rows_done: int = 0
    trees_done: int = 0
    next_id: int = 0                                      # of the next row created (trace events name rows)
    prompt_lengths: list[int] = field(default_factory=list)

    def __post_init__(self):
        count = len(self.prompts)
        for p, samples in self.given_bases.items():
            if not 0 <= p < count or len(samples) != self.n or not all(s.tokens for s in samples):
                raise ValueError(f"engine.run: given_bases[{p}] must be {self.n} non-empty Samples of one of "
                                 f"the {count} prompts; got {len(samples)} "
                                 f"(lengths {[len(s.tokens) for s in samples]})")
        self.results = [PromptResult([None] * self.n) for _ in range(count)]
        self.prompt_lengths = [len(p) for p in self.prompts]
        self.bases_left, self.rows_left = [self.n] * count, [self.n] * count
        self.base_rows = {p: [] for p in range(count)}

    def keeps(self, p: int) -> bool:
        """Whether prompt p's base rows keep hidden states and slots for branches (run's keep_hidden)."""
        keep = self.keep_hidden
        return p in keep if isinstance(keep, (set, frozenset)) else bool(keep)

    def new_row(self, prompt: int, base: int, fork: int | None, slots: list[int], limit: int) -> DecodeRow:
        """A row numbered in the order rows are created; a base row of a prompt that keeps hidden states
        records them."""
        self.next_id += 1
        keep = fork is None and self.keeps(prompt)
        return DecodeRow(self.next_id - 1, prompt, base, fork, slots, limit, hidden=[] if keep else None)

    def finish(self, row: DecodeRow, step: int) -> None:
        """Row has ended: record it; a base row gives its slots back unless branches may read them, and the
        last base of its prompt is queued for BasesDone; the tree is done when its last row ends (after its
        branches were grown)."""
        p = row.prompt
        self.events.append((step, "end", row.id, p))
        self.rows_done += 1
        self.rows_left[p] -= 1
        if row.fork is None:
            self.results[p].bases[row.base] = row.out
            self.bases_left[p] -= 1
            self.base_rows[p].append(row)
            if not self.keeps(p):                 # no branch will read it: its slots go back now
                self.pool.release_context(row.slots)
                row.slots = []
            if self.bases_left[p] == 0:
                self.events.append((step, "bases_done", p))
                self.base_rows[p].sort(key=lambda r: r.base)
                self.ended.append(p)
                self.ungrown.add(p)
        else:
            self.results[p].branches.setdefault((row.base, row.fork), []).append(row.out)
            self.pool.release_context(row.slots)
        if self.rows_left[p] == 0 and p not in self.ungrown:
            self.tree_done(p, step)

    def tree_done(self, p: int, step: int) -> None:
        self.events.append((step, "tree_done", p, self.pool.used))
        self.trees_done += 1

    def branch_rows(self, prompt: int, requests: list[BranchRequest]) -> tuple[list[DecodeRow], list]:
        """B̂ rows per request, each reading its base row's first P + f slots by reference, and the base's
        hidden state at f that each one's first token is sampled from."""
        if prompt not in self.ungrown or prompt in self.ended:
            raise ValueError(f"engine.grow: prompt {prompt} is not the one whose BasesDone was just yielded")
        if requests and not self.keeps(prompt):
            raise ValueError(f"engine: branches requested for prompt {prompt} without keep_hidden "
                             f"(their first token needs the base rows' hidden states)")
        sources, made, hidden = [], [], []
        for req in requests:
            parent = self.base_rows[prompt][req.base]
            if not 0 <= req.fork < len(parent.out.tokens):
                raise ValueError(f"engine: fork {req.fork} of prompt {prompt}'s base {req.base} is outside "
                                 f"its {len(parent.out.tokens)} tokens (expected 0 <= f < length)")
            for _ in range(req.count):
                sources.append((parent.slots, len(self.prompts[prompt]) + req.fork))
                made.append(req)
                hidden.append(parent.hidden[req.fork])
        rows = [self.new_row(prompt, req.base, req.fork, slots, req.limit)
                for req, slots in zip(made, self.pool.share(sources))]
        self.rows_left[prompt] += len(rows)
        self.rows_started += len(rows)
        return rows, hidden

    def grown(self, prompt: int, step: int) -> None:
        """Prompt's branches are in: its base rows let go of their slots and hidden states."""
        for row in self.base_rows.pop(prompt):
            self.pool.release_context(row.slots)
            row.hidden = None
        self.ungrown.discard(prompt)
        if self.rows_left[prompt] == 0:
            self.tree_done(prompt, step)

    def show(self) -> None:
        """The bar: tokens sampled so far; rows ended / created, trees done / prompts."""
        self.bar.update(self.sampled - self.bar.n)
        self.bar.set_postfix(rows=f"{self.rows_done}/{self.rows_started}",
                             trees=f"{self.trees_done}/{len(self.prompts)}", refresh=False)


def draw(model, warp, hidden: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
    """Sample one token per row from lm_head(hidden) after the warpers; its H_t and log-probability, brought
    to the host in one transfer (float64 holds the token ids and the float32 values exactly)."""
    scores = warp(model.get_output_embeddings()(hidden).float())
    logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    tokens = torch.multinomial(probs, num_samples=1)
    entropy = torch.special.entr(probs).sum(-1)
    values = torch.stack((tokens[:, 0].double(), entropy.double(), logp.gather(1, tokens)[:, 0].double()))
    token_list, entropies, logprobs = paged.to_host(values)
    return [int(t) for t in token_list], entropies, logprobs


def decode_mode(decode: str, device: torch.device) -> str:
    """--decode_step as this engine runs it: auto is the paged step on a CUDA GPU outside torchrun (its
    graphs and compiled kernels were not tried under FSDP), the shared step on the CPU (engine/shared.py),
    the reference step elsewhere."""
    if decode != "auto":
        return decode
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    kind = torch.device(device).type
    if kind == "cpu":
        return "shared"
    return "paged" if kind == "cuda" and not distributed and not paged.DISABLED else "reference"


def paged_pool(model, max_kv_tokens: int, max_rows: int, param: torch.Tensor) -> kv.KVPool:
    """The paged step's pool: pages of paged.PAGE tokens, room for every row's partly filled first and last
    pages, rounded up to 512 pages (so the compiled kernels, whose shapes include the pool's size, serve many
    steps), a scratch page, and the keys/values in the autocast dtype when autocast is on (what the attention
    computes in)."""
    page = paged.PAGE
    pages = -(-max_kv_tokens // page) + 2 * max_rows
    pages = -(-pages // 512) * 512
    device = param.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else param.dtype
    return kv.KVPool(model, pages * page, device, dtype, page=page, scratch=True)


class Engine:
    """Decode loop over one KV pool (engine/kv.py) and its scheduler (engine/scheduler.py). `max_rows`: rows
    decoded at once; `max_kv_tokens`: pool capacity in tokens; `backoff`: what running out of memory taught
    earlier engines. `warp(scores)` applies temperature/top-k/top-p (rollout.Sampler.warp: HF's warpers, so
    the distribution is `generate`'s). `events` (step, kind, ...): prefill, end, bases_done, branches,
    tree_done, and with trace=True decode. `decode` (--decode_step): "reference" (engine/kv.py), "paged" (the
    static step of engine/paged.py; on CUDA graph-captured per bucket), "paged-eager" (the same, no graphs),
    or "auto" (decode_mode)."""

    def __init__(self, model, stop_ids, warp, max_rows: int, max_kv_tokens: int, trace: bool = False,
                 compile_decode: bool = False, backoff: Backoff | None = None, decode: str = "reference"):
        param = next(model.parameters())
        self.model, self.warp, self.stop_ids = model, warp, set(stop_ids)
        self.trace = trace
        self.decode, self.decode_auto = decode_mode(decode, param.device), decode == "auto"
        self.static = None
        self.draw = shared.draw if self.decode == "shared" else draw
        if self.decode in ("reference", "shared"):
            self.pool = kv.KVPool(model, max_kv_tokens, param.device, param.dtype)
        else:
            self.pool = paged_pool(model, max_kv_tokens, max_rows, param)
            mode = "compile" if compile_decode else \
                "graph" if self.decode == "paged" and param.device.type == "cuda" else "eager"
            self.static = paged.StaticDecoder(model, self.pool, warp, self.stop_ids, max_rows, mode)
        self.forward = (shared.Forward if self.decode == "shared" else kv.Forward)(model, self.pool,
                                                                                  compile_decode)
        self.scheduler = Scheduler(self.pool, max_rows, backoff or Backoff())
        self.events: list[tuple] = []
        # given_tokens: tokens of given base responses fed to the model (run's given_bases)
        self.stats = dict(decode_steps=0, row_steps=0, ended_row_steps=0, prefill_tokens=0, given_tokens=0,
                          recomputed_prefix_tokens=0, oom_retries=0)
        self.step = 0
        self.state: EngineRun | None = None

    @property
    def results(self) -> list[PromptResult]:
        """The last run's samples per prompt."""
        return self.state.results

    @torch.no_grad()
    def run(self, prompts: list[list[int]], n: int, max_new_tokens: int, keep_hidden: bool | set[int] = False,
            given_bases: dict[int, list[Sample]] | None = None, progress: bool = True):
        """N samples per prompt (then in `results`); yields BasesDone(p, samples) the moment prompt p's N base
        rows have ended, and grows the branches the caller asks for with grow(p, requests) before it decodes
        on (App. C, Sec. 4.1). keep_hidden: which prompts' base rows keep their hidden states and slots until
        grown, which branches need: True / False for all, or a set of prompt indices (the others' base rows
        give their slots back the step they end). given_bases: prompt index -> its N base Samples, already
        generated, fed instead of sampled (engine/__init__.py). progress: a tqdm bar of generated tokens,
        finished rows and trees (off when stderr is not a terminal)."""
        run = self.state = EngineRun(prompts, n, max_new_tokens, keep_hidden, given_bases or {}, self.pool,
                                     self.events)
        self.forward.prompt_lengths = run.prompt_lengths
        self.scheduler.start(len(prompts))
        run.bar = tqdm(desc="rollout", unit="tok", leave=False, dynamic_ncols=True,
                       disable=None if progress else True)
        try:
            while self.scheduler.busy():
                yield from self._admit()
                if not self.scheduler.active:
                    if self.scheduler.waiting_prompts or self.scheduler.waiting:
                        raise ValueError(f"--max_kv_tokens {self.pool.capacity} / --max_batch_rows "
                                         f"{self.scheduler.max_rows}: too small for one prompt and its "
                                         f"responses; expected more")
                    break
                yield from self._decode_step()
        finally:
            run.show()
            run.bar.close()

    def _bases_ready(self):
        """Yield BasesDone for each prompt whose bases ended since the last call, in the order they ended;
        a prompt the caller did not grow gets no branches."""
        run = self.state
        while run.ended:
            p = run.ended.popleft()
            yield BasesDone(p, [row.out for row in run.base_rows[p]])
            if p in run.ungrown:
                self.grow(p, [])

    @torch.no_grad()
    def grow(self, prompt: int, requests: list[BranchRequest]) -> None:
        """The answer to BasesDone(prompt): its branches (EngineRun.branch_rows) sample their first token
        from the base's hidden state at their fork and wait for room ahead of new prompts."""
        rows, hidden = self.state.branch_rows(prompt, requests)
        if rows:
            self.events.append((self.step, "branches", prompt, len(rows)))
            self._sample_next(rows, torch.stack(hidden), self.scheduler.waiting.append)
        self.state.grown(prompt, self.step)

    # ---- admission --------------------------------------------------------------------------------------
    def _admit(self):
        """Waiting rows first (branches, rows that took turns), then new or given prompts while room is
        left; a prompt whose bases all ended on admission (given, or one token each) is yielded at once."""
        while (p := self.scheduler.next_prompt()) is not None:
            try:
                if not (self._admit_given if p in self.state.given_bases else self._admit_new)(p):
                    return
            except RuntimeError as err:       # torch.OutOfMemoryError is one
                if not oom.is_oom(err):
                    raise
                self.scheduler.prefill_failed(err, self.forward.prefill_len)
                self.stats["oom_retries"] += 1
                continue
            self.scheduler.admitted()
            yield from self._bases_ready()

    def _admit_new(self, p: int) -> bool:
        """Prefill prompt p once; its N rows share its slots and sample their first token."""
        run = self.state
        rows = [run.new_row(p, j, None, [], run.max_new_tokens) for j in range(run.n)]
        if not self.scheduler.room(rows[:self.scheduler.max_rows], len(run.prompts[p])):
            return False                                              # N > max_rows: the rest wait for room
        # the prompt once, for all N rows
        hidden = self.forward.prefill(rows[0], run.prompts[p], self.scheduler.prefill_chunk)[-1:]
        self.events.append((self.step, "prefill", p))
        self.stats["prefill_tokens"] += len(run.prompts[p])
        run.rows_started += len(rows)
        for row, slots in zip(rows[1:], self.pool.share([(rows[0].slots, len(rows[0].slots))] * (run.n - 1))):
            row.slots = slots
        self._sample_next(rows, hidden.expand(run.n, -1), self.scheduler.place)
        return True

    def _admit_given(self, p: int) -> bool:
        """Prompt p's given bases: prefill the prompt once into the first row, every row shares its slots and
        feeds its response's tokens[:-1] once (keys/values, and hidden[t]: the state that produced token t),
        then they end at once."""
        run = self.state
        samples, keep = run.given_bases[p], run.keeps(p)
        need = len(run.prompts[p]) + sum(len(x.tokens) - 1 for x in samples) if keep else 0
        if not self.scheduler.room([], need, len(samples) if keep else 0):
            return False
        rows = [run.new_row(p, j, None, [], len(x.tokens)) for j, x in enumerate(samples)]
        if keep:
            self.forward.feed(rows, run.prompts[p], [x.tokens for x in samples], self.scheduler.prefill_chunk)
            self.events.append((self.step, "prefill", p))
            self.stats["prefill_tokens"] += len(run.prompts[p])
            self.stats["given_tokens"] += sum(len(x.tokens) - 1 for x in samples)
        run.rows_started += len(rows)
        for row, sample in zip(rows, samples):
            row.out = sample                  # returned as given: nothing is appended to it
            run.finish(row, self.step)
        return True

    # ---- one decode step of every active row ------------------------------------------------------------
    def _decode_step(self):
        """One token for every active row; ended rows leave at once, and a prompt whose last base ended is
        yielded before the step counter moves. Out of memory (more than one row): the scheduler halves the
        row budget, and the next loop iteration retries the step."""
        active = self.scheduler.active
        try:
            if self.static is not None:
                values, hidden = self.static.step(active)
            else:
                hidden = self.forward.decode(active)[:, -1]
        except Exception as err:                       # torch.OutOfMemoryError is one
            first_paged = self.static is not None and self.decode_auto and not self.stats["decode_steps"]
            if first_paged and not oom.is_oom(err):
                self.paged_failed(err)                 # --decode_step auto: the reference step takes over
                return
            if not isinstance(err, RuntimeError) or not oom.is_oom(err) or len(active) == 1:
                raise
            self.stats["oom_retries"] += 1
            self.scheduler.fewer_rows()
            return
        if self.trace:
            self.events.append((self.step, "decode", [r.id for r in active]))
        self.stats["decode_steps"] += 1
        self.stats["row_steps"] += len(active)
        still = []
        if self.static is not None:
            self._push(active, values, hidden, still.append)
        else:
            self._sample_next(active, hidden, still.append)
        self.scheduler.active = still
        yield from self._bases_ready()
        self.step += 1
        self.state.show()

    def paged_failed(self, err: Exception) -> None:
        """The paged step failed at its first step under --decode_step auto (e.g. a torch whose FlexAttention
        lacks something it uses): say so once, and decode with the reference step from now on, in this engine
        (its pool's pages serve it as they are) and every later one of the process."""
        first = str(err).splitlines()[0][:200] if str(err) else ""
        paged.DISABLED.append(f"{type(err).__name__}: {first}")
        print(f"engine: the paged decode step failed ({paged.DISABLED[-1]}); decoding with the reference "
              f"step", flush=True)
        self.static = None

    def _sample_next(self, rows: list[DecodeRow], hidden: torch.Tensor, place) -> None:
        """One token per row from its hidden state [rows, d]; a row that ends leaves now (never decoded
        again), the others go to place(row)."""
        tokens, entropies, logprobs = self.draw(self.model, self.warp, hidden)
        for row, h, token, entropy, logprob in zip(rows, hidden, tokens, entropies, logprobs):
            self.state.sampled += 1
            if row.push(token, entropy, logprob, h, self.stop_ids):
                self.state.finish(row, self.step)
            else:
                place(row)

    def _push(self, rows: list[DecodeRow], values: list, hidden: torch.Tensor | None, place) -> None:
        """The paged step's results, [token, H_t, log p, ended] per row (and its hidden states when rows keep
        them): as _sample_next, with the ended flag computed on the device (it must agree with the host's)."""
        for i, (row, (token, entropy, logprob, ended)) in enumerate(zip(rows, values)):
            self.state.sampled += 1
            if row.push(int(token), entropy, logprob, None if hidden is None else hidden[i],
                        self.stop_ids) != bool(ended):
                raise RuntimeError(f"engine: row {row.id}'s end differs between the device and the host")
            if ended:
                self.state.finish(row, self.step)
            else:
                place(row)
