"""The rank-side half of tests/test_distributed.py, launched there with torchrun (2 CPU processes, gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py CASE OUT [ARGS...]

CASE eval OUT: sharded evaluation on fixed samples; rank 0 saves the gathered result.
The fixed inputs are built by functions the test also calls in one process, so both sides see the same data.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import config as C  # noqa: E402
import distributed as D  # noqa: E402
import models  # noqa: E402


# --------------------------------------------------------------------------------------------------------
# Fixed inputs shared with the one-process side
# --------------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------------------
def main(case: str, out: str, *args: str) -> None:
    torch.distributed.init_process_group("gloo")
    tokenizer = models.load_tokenizer("tiny-random")
    if case == "eval":
        result = run_eval(models.tiny_random_model(len(tokenizer), seed=1), tokenizer)
        if D.is_main():
            torch.save(result, out)
    else:
        raise SystemExit(f"unknown case {case!r}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
