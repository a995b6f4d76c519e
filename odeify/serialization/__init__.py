"""Saved files: the recipe (what rebuilds a converted model, and its schema) and ``save``/``load``
(safetensors plus the recipe; never pickles; atomic writes)."""
