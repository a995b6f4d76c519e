"""The runtime: ``ODEStage`` (the IR made runnable) and the backward modes that re-run its step and
field graphs: the dispatch table, checkpoint and reverse, reversible integrators on the lattice, the
shared re-run machinery and RNG replay."""
