"""The foundation: user-facing errors, the rule for paths read and written, file reading and atomic
writes, the bounds on what a file may ask for and the resource budgets, the run lock, the model-dtype
rule.

Imports nothing from odeify but itself; every other layer may import it."""
