"""The foundation: user-facing errors, atomic file writes, resource budgets, the model-dtype rule.

Imports nothing from odeify but itself; every other layer may import it."""
