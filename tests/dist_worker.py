"""The rank-side half of tests/test_distributed.py, launched there with torchrun (2 CPU processes, gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py CASE OUT [ARGS...]

CASE update OUT: a PPO update on fixed trees with FSDP2 and with DDP; rank 0 saves the full weights and stats.
CASE eval OUT: sharded evaluation on fixed samples; rank 0 saves the gathered result.
CASE train OUT RUN_A RUN_B: a tiny 2-step run, then a resume from its step-1 checkpoint (stand-in grader).
The fixed inputs are built by functions the test also calls in one process, so both sides see the same data.
"""
import contextlib
import hashlib
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import config as C  # noqa: E402
import methods  # noqa: E402
import models  # noqa: E402
import train  # noqa: E402
import tree as T  # noqa: E402
from runtime import distributed as D  # noqa: E402


# --------------------------------------------------------------------------------------------------------
# Fixed inputs shared with the one-process side
# --------------------------------------------------------------------------------------------------------
def fixed_trees(n_trees: int = 3) -> list[T.Tree]:
    """Trees of varied shapes and lengths with random token ids (seeded): a forked base response with
    branches of different lengths, an unforked one, and a zero-advantage tree in the middle."""
    gen = random.Random(7)
    trees = []
    for t in range(n_trees):
        tok = lambda n: [gen.randrange(100, 1000) for _ in range(n)]  # noqa: E731
        blocks = [
            T.Block(None, tok(3 + t), [0.0] * (3 + t), base=0, start=0),
            T.Block(0, tok(4), [0.0] * 4, reward=float(t % 2), base=0, start=3 + t),
            T.Block(0, tok(2 + 2 * t), [0.0] * (2 + 2 * t), reward=1.0, base=0, start=3 + t, branch=True),
            T.Block(0, tok(5), [0.0] * 5, reward=0.0, base=0, start=3 + t, branch=True),
            T.Block(None, tok(6 - t), [0.0] * (6 - t), reward=float(t != 1), base=1, start=0),
        ]
        trees.append(T.Tree(f"p{t}", [1, 2 + t, 3], "a", blocks, v_root=0.5, k_hat=1, b_hat=2,
                            forks=[[3 + t], []]))
    return trees


def update_trees(trees: list[T.Tree]) -> list:
    """DATPO training trees with hand-set advantages (the middle tree's are all zero: its blocks count only
    in the normaliser)."""
    out = []
    for t, tr in enumerate(trees):
        adv = [0.0] * len(tr.blocks) if t == 1 else [0.3, -0.5, 0.8, -0.4, 0.2 * (t - 1)]
        out.append(train.train_tree(tr, adv, methods.METHODS["datpo"]))
    return out


def update_config(precision: str = "fp32", layout: str = "packed") -> C.Config:
    # Mini-batches of ~10 blocks (two trees, then one), micro-batches of at most 16 packed tokens or 1 row: a
    # tree splits into micro-batches that deal unevenly over 2 ranks (idle passes), and 2 epochs exercise the
    # old log-probs of every block.
    # lr: SGD's for fp32, AdamW's for the bf16 precisions (run_update)
    return C.make_config("tiny", lr=0.05 if precision == "fp32" else 5e-4, mini_batch_size=10,
                         micro_batch_size=1, max_tokens_per_micro_batch=16, ppo_epochs=2, precision=precision,
                         train_layout=layout)


def run_update(model, tokenizer, parallel: str = "fsdp", precision: str = "fp32",
               layout: str = "packed") -> tuple[dict, dict]:
    """Wrap, run one ppo_update on the fixed trees, return (full weights on rank 0 / None, stats)."""
    cfg = update_config(precision, layout)
    model = model.to(models.policy_dtype(precision))
    policy = D.wrap(model, parallel, cfg.precision)
    # fp32 (compared tightly): SGD, not AdamW — a weight moves by lr × its (clipped) gradient, so float noise
    # in the gradient (summed in another order over ranks) stays noise of that size in the weights, where
    # Adam's first steps divide a near-zero gradient by its own magnitude and turn the noise into a step of
    # ~lr (AdamW at lr 5e-4 once missed a 1e-5 bound by 1.3e-5 on a loaded machine). bf16 (compared to a bf16
    # ulp): AdamW, whose steps of ~lr stay above the ulp, where SGD's smaller ones round either way.
    optim = torch.optim.SGD if precision == "fp32" else torch.optim.AdamW
    optimizer = optim(model.parameters(), lr=cfg.lr)
    policy.train()
    with recording_grad_norms() as step_grad_norms:
        stats = train.ppo_update(policy, optimizer, update_trees(fixed_trees()), cfg, tokenizer.pad_token_id,
                                 "cpu", random.Random(3))
    return D.model_state_dict(model), {**stats, "step_grad_norms": step_grad_norms}


@contextlib.contextmanager
def recording_grad_norms():
    """The gradient norm of each optimizer step, in order, as ppo_update's torch.nn.utils.clip_grad_norm_
    returned it (before clipping): stats["grad_norm"] is only their mean, and after the first step the two
    sides' weights may differ by float noise (bf16: one ulp), which the later steps' gradients inherit."""
    norms, clip = [], torch.nn.utils.clip_grad_norm_

    def clip_and_record(*args, **kwargs):
        norm = clip(*args, **kwargs)
        norms.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = clip_and_record
    try:
        yield norms
    finally:
        torch.nn.utils.clip_grad_norm_ = clip


UPDATE_CASES = [  # name, --parallel, --precision, --train_layout
    ("fsdp", "fsdp", "fp32", "packed"), ("ddp", "ddp", "fp32", "packed"), ("hsdp", "hsdp", "fp32", "packed"),
    ("fsdp-rows", "fsdp", "fp32", "rows"), ("fsdp-bf16-autocast", "fsdp", "bf16-autocast", "packed"),
    ("fsdp-bf16", "fsdp", "bf16", "packed"),
]


def eval_problems() -> list[dict]:
    import data

    return data.load_problems("arith-test", limit=5)   # 5 problems: shards of 3 and 2


def fixed_sampler(tokenizer, problems, cfg):
    """A stand-in for rollout.sample_base that returns fixed samples: for sample j of a problem, its gold
    answer or a wrong one, decided by a hash of (problem, j), so scores are neither 0 nor 1 and majority
    votes vary."""
    import data
    import rollout as R

    gold = {}
    for p in problems:
        prompt = data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot)
        gold[tuple(tokenizer(prompt, add_special_tokens=False).input_ids)] = p["answer"]

    def sample_base(sampler, prompt_ids, n, max_new_tokens, keep_cache=False):
        tokens = []
        for ids in prompt_ids:
            for j in range(n):
                coin = hashlib.sha256(f"{ids}-{j}".encode()).digest()[0] % 3
                text = f"The answer is \\boxed{{{gold[tuple(ids)] if coin else 1000 + coin + j}}}"
                tokens.append(tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
        rows_prompt = [p for p in prompt_ids for _ in range(n)]
        return R.BaseBatch(rows_prompt, tokens, [[0.0] * len(t) for t in tokens])

    return sample_base


def run_eval(model, tokenizer, k: int = 3) -> dict:
    import evaluate
    import rollout as R

    cfg = C.make_config("tiny")
    problems = eval_problems()
    real = R.sample_base
    R.sample_base = fixed_sampler(tokenizer, problems, cfg)
    try:
        result = evaluate.evaluate_problems(model, tokenizer, problems, cfg, k=k, runs=2, progress=False)
    finally:
        R.sample_base = real
    result.pop("seconds")
    return result


def step_1(run: str) -> str:
    """The step-1 checkpoint of a run folder (what the resumes start from)."""
    return os.path.join(run, "checkpoints", "step_000001")


def stand_in_reward(text, answer, fallback=False):
    """The deterministic grader of tests/test_train.py (half of all texts score 1, by hash)."""
    return float(hashlib.sha256(text.encode()).digest()[0] % 2)


# --------------------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------------------
def main(case: str, out: str, *args: str) -> None:
    torch.distributed.init_process_group("gloo")   # train.py's own init/shutdown then leave this group alone
    tokenizer = models.load_tokenizer("tiny-random")
    if case == "update":
        results = {}
        os.environ["LOCAL_WORLD_SIZE"] = "1"   # HSDP as on 2 nodes of 1 GPU: replicated over the 2 ranks
        for name, parallel, precision, layout in UPDATE_CASES:
            weights, stats = run_update(models.tiny_random_model(len(tokenizer), seed=1), tokenizer, parallel,
                                        precision, layout)
            results[name] = {"weights": weights, "stats": stats}
        if D.is_main():
            torch.save(results, out)
    elif case == "eval":
        result = run_eval(models.tiny_random_model(len(tokenizer), seed=1), tokenizer)
        if D.is_main():
            torch.save(result, out)
    elif case == "train":
        import rollout as R

        R.compute_reward = stand_in_reward
        run_a, run_b = args
        common = ["--preset", "tiny", "--eval_every", "2", "--eval_limit", "3", "--alpha_start", "0"]
        train.main(common + ["--out_dir", run_a, "--save_every", "1"])
        train.main(common + ["--out_dir", run_b, "--resume", step_1(run_a)])
    elif case == "offpolicy":   # one-step off-policy: the in-flight batch is gathered, saved and resumed
        import rollout as R

        R.compute_reward = stand_in_reward
        run_a, run_b = args
        common = ["--preset", "tiny", "--steps", "3", "--eval_every", "0", "--alpha_start", "0",
                  "--off_policy_steps", "1", "--lr", "3e-2"]
        train.main(common + ["--out_dir", run_a, "--save_every", "1"])
        train.main(common + ["--out_dir", run_b, "--resume", step_1(run_a)])
    else:
        raise SystemExit(f"unknown case {case!r}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
