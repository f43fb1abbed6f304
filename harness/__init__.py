"""harness/ — what wraps the algorithm from outside: faults and guards, run folders and checkpoints,
tracking, torchrun, the tree viewer. The stage files at the top level hold the algorithm; nothing here is
needed to read one step of it (README: "read in this order")."""
