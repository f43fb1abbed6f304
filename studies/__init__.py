"""studies/ — the paper's Section 3 analyses and its training-dynamics figures: experiments built on the
algorithm (the stage files at the top level), one file per study. Each writes runs/analysis/<study>/ (or
--out_dir): result.json, table.md and PNG figure(s).

    python -m studies STUDY [--scale paper|demo|tiny] [flags]

    study               file                 reproduces
    difficulty          difficulty.py        Sec. 3.1 / App. B: Easy/Medium/Hard split + the G sweep runs
    difficulty-report   difficulty.py        App. B figures: avg/pass vs G per subset, 3×3 pass@k curves
    tree-vs-parallel    tree_vs_parallel.py  Sec. 3.2 / App. C.2: PassRate vs generated tokens
    forks               forks.py             Sec. 3.3 / App. D.2–D.5: fork table, localization table
    show-forks          forks.py             App. D.2 figures "localization" / "case study"
    dynamics            dynamics.py          Sec. 5.2 "learning curve", "leaf count"; App. F.5 checkpoints
    main-table          main_table.py        Sec. 5.2 main table, App. F.3 tokens and wall clock, ± 95 %

growth.py holds grow_from_forks (K forks × B branches on given base responses), which tree-vs-parallel and
forks use.

`--scale` picks the paper's settings (`paper`: Qwen2.5-3B-Instruct on MATH/AIME, a GPU), the 2-core CPU
miniature (`demo`: the embedded SmolLM2-135M on synthetic arithmetic) or the test size (`tiny`). common.py
holds what the studies share (the Study, statistics with 95 % t-intervals, loading, outputs, plotting);
__main__.py the command line.
"""
