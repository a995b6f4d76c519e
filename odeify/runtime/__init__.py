"""The runtime: ``ODEStage`` (the IR made runnable) and the backward modes that re-run its step and
field graphs: the dispatch table (``stage``), checkpoint and reverse (``adjoint``), the reversible
integrators' programs run on the fixed-point lattice (``reversible``, ``lattice``), the shared
re-run machinery and warning policy (``rerun``) and RNG replay (``rng_tape``)."""
