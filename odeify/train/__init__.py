"""Training and measuring: image datasets, evaluation, manifestation sweeps and fine-tuning."""
