"""harness/ — the shell around the algorithm, which only the two commands reach (train.py's `train` through
loop.Run; evaluate.py's command line): the run folder and checkpoints, pre-flight checks, stop signals,
the weight guard, tracking and the tree viewer, the command line and its aliases, custom rewards, the
evaluation's folders and journal. No stage file imports it; what it needs below it is in runtime/."""
