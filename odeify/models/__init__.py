"""Models in: architecture names, checkpoint files, ``load_model``, the shipped digits model and
the timm interface a converted model keeps (``ConvertedModel``)."""

from pathlib import Path

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent.parent / "data" / "digits_resnet.safetensors"
"""The project's own trained model (a small ResNet on scikit-learn's digits): the default MODEL.
Defined here, without torch, because the command-line parser reads it."""
