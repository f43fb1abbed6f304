"""runtime/ — the floor every file may stand on: one-line errors (faults), out-of-memory halving (oom),
torchrun's primitives (distributed), files replaced whole (atomic), the CPU thread policy (threads), names
drawn as written in figures (figures). It imports nothing of the project above it."""
