"""Saved files: the recipe (``file_recipe``: what rebuilds a converted model), its schema
(``file_schema``: applied by ``save`` and ``load`` alike), the probe (what the model computed when
saved, checked when loaded) and ``save``/``load`` (safetensors plus the recipe; never pickles;
atomic writes)."""
