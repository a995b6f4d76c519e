"""Load checks the fold records, which the forward never reads and fine-tuning trains by.

A record (``folds.*``: a folded BatchNorm's gamma, inv_std and offset) must be what folding gives:
an inv_std of a BatchNorm, and coordinates that rebuild the folded tensors
(``odeify.serialization.records``). The oracle is the file ``save`` wrote: it loads; the same file
with one record changed is refused, naming the record. The digits model's conv records and inv_std
of 0, 1e30 and -1 are among the hostile files (``tests/hostile_files.py``); here, a pre-activation
ResNet's per-channel affine records (a BatchNorm that reads no conv).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
from safetensors import safe_open

import odeify
from odeify.core.errors import ModelLoadError
from odeify.ir.fold_records import fold_records
from odeify.models._testing import make_test_model
from odeify.serialization.io import RECIPE_KEY

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = odeify.convert(make_test_model("resnetv2_18", num_classes=10), input_size=(1, 3, 32, 32))
    assert fold_records(model)["norm"].kind == "affine"  # the final norm reads the last stage's sum
    path = tmp_path_factory.mktemp("records") / "r.safetensors"
    odeify.save(model, path)
    return path


def _altered(saved: Path, path: Path, key: str, scale: float) -> Path:
    with safe_open(str(saved), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = safetensors.torch.load_file(str(saved))
    tensors[key] = tensors[key] * scale
    path.write_bytes(safetensors.torch.save(tensors, metadata=metadata))
    return path


def test_a_saved_pre_activation_resnet_loads(saved: Path) -> None:
    """Measured: its records rebuild their folded tensors within 0.02x of the allowance."""
    with safe_open(str(saved), framework="pt") as handle:
        assert json.loads(handle.metadata()[RECIPE_KEY])["version"] == 3
    odeify.load(saved)


@pytest.mark.parametrize(
    "key, scale, message",
    [
        ("folds.norm.gamma", 2.0, "folds.norm does not rebuild norm.scale"),  # scale = gamma * inv_std
        (
            "stages_0_blocks_ode.folds.norm1.inv_std",
            1e3,
            "holds inv_std from",
        ),  # 1/sqrt(var + eps) <= 1/sqrt(eps)
    ],
)
def test_an_altered_affine_record_is_refused(
    saved: Path, tmp_path: Path, key: str, scale: float, message: str
) -> None:
    """A conv record's gamma or offset alone is not pinned by the file (any nonzero factor rebuilds
    the folded tensors): only an affine record's scale is its gamma * inv_std."""
    with pytest.raises(ModelLoadError, match=message):
        odeify.load(_altered(saved, tmp_path / "altered.safetensors", key, scale))
