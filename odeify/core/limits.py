"""The bounds on what a file may ask for: one set of numbers, read by every reader and writer.

A saved model, a checkpoint's settings and a training state are data from anywhere, so every number
in them is bounded before anything acts on it (a few hundred bytes must not ask for a huge build).
``odeify.save`` checks a model against the same numbers before it writes, so a file that odeify
writes is one that odeify reads. Bounds on work and memory that depend on the machine are budgets
instead (:mod:`odeify.core.budget`, with environment variables that raise them).
"""

from __future__ import annotations

MAX_RECIPE_BYTES = 256 * 1024  # the JSON recipe of a saved model
MAX_CONFIG_BYTES = 1 << 20  # a checkpoint folder's config.json, a file's build kwargs
MAX_DATA_CONFIG_BYTES = 4096  # the data config (input size, mean/std, crop) kept in a saved model
MAX_STAGES = 64  # ODE stages of one model
MAX_STEPS = 100_000  # steps of one stage (the graph-size budget bounds the work further)
MAX_TABLEAU_STAGES = 16  # stages of a custom Butcher tableau
MAX_TABLEAU_ORDER = 8  # the order conditions to check grow fast with the order
MAX_TABLEAU_DIGITS = 20  # digits of a numerator or denominator of a tableau entry
MAX_NAME = 64  # characters of a tableau name
MAX_BATCH = 64  # the batch of a recorded example input
MAX_SIDE = 4096  # channels, height and width of an input; an image size
MAX_IN_CHANS = 64  # input channels of an architecture built from a file
MAX_NUM_CLASSES = 100_000  # classifier size of an architecture built from a file
MAX_STATE_BYTES = 16 * 2**20  # the JSON record of a training state (its history grows with the epochs)
MAX_EPOCHS = 100_000  # epochs of a recorded fine-tuning run
