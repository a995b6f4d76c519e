"""Data that cannot train the model is refused where it enters fine-tuning, and a run that stops
because of its data says so (issue 18, parts 6 to 8).

Each case is the digits set with one thing wrong; the oracle is what is wrong with it (the message
must name it), and for the divergence messages, the batch that caused them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import odeify
from odeify.core.errors import ConfigError
from odeify.train.datasets import DataError, LabelledData, open_data
from odeify.train.finetune import DEFAULT_RECIPE, TrainingDiverged, finetune

pytestmark = pytest.mark.usefixtures("one_thread")

ONE = replace(DEFAULT_RECIPE, epochs=1, batch_size=16)


def _train(native, data, **kwargs):
    return finetune(
        odeify.retarget(native, steps=1),
        data,
        ONE,
        max_batches=2,
        progress=False,
        calibrate_first=False,
        **kwargs,
    )


def _with_train(digits, x=None, y=None) -> LabelledData:
    tx, ty = digits.train.tensors
    return replace(digits, train=TensorDataset(tx if x is None else x, ty if y is None else y))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("labels out of range", "training split's labels hold 12 (sample 0), outside the 10 classes [0, 9]"),
        (
            "float labels",
            "training split's labels must be int64 class indices (torch.long); got torch.float32",
        ),
        ("int32 labels", "got torch.int32: pass y.long()"),
        ("three channels", "training split's inputs have 3 channel(s), the model takes 1"),
        ("integer images", "must be floating-point images [N, C, H, W]; got torch.uint8"),
        ("NaN training sample", "training split's inputs hold NaN or inf values (sample 5 is the first)"),
        ("NaN validation", "validation split's inputs hold NaN or inf values (sample 0 is the first)"),
        ("no samples", "the training split is empty"),
    ],
)
def test_data_that_cannot_train_is_refused_before_any_work(native, digits, case: str, message: str) -> None:
    x, y = digits.train.tensors
    nan5 = x.clone().index_fill_(0, torch.tensor([5]), float("nan"))
    vx, vy = digits.val.tensors
    data = {
        "labels out of range": lambda: _with_train(digits, y=torch.where(torch.arange(len(y)) == 0, 12, y)),
        "float labels": lambda: _with_train(digits, y=y.float()),
        "int32 labels": lambda: _with_train(digits, y=y.int()),
        "three channels": lambda: _with_train(digits, x=x.repeat(1, 3, 1, 1)),
        "integer images": lambda: _with_train(digits, x=(x * 16).to(torch.uint8)),
        "NaN training sample": lambda: _with_train(digits, x=nan5),
        "NaN validation": lambda: replace(digits, val=TensorDataset(torch.full_like(vx, float("nan")), vy)),
        "no samples": lambda: _with_train(digits, x=x[:0], y=y[:0]),
    }[case]()  # fmt: skip
    with pytest.raises(DataError) as info:
        _train(native, data)
    assert message in str(info.value)


def test_float64_images_train_a_float32_model(native, digits) -> None:
    """Cast to the model's dtype as timm's --model-dtype does: not a refusal."""
    x, _ = digits.train.tensors
    result = _train(native, _with_train(digits, x=x.double()))
    assert next(result.model.parameters()).dtype == torch.float32


def test_huge_inputs_warn_and_the_divergence_they_cause_says_so(native, digits) -> None:
    x, _ = digits.train.tensors
    with (
        pytest.warns(UserWarning, match=r"reach 1.\d+e\+30 in magnitude"),
        pytest.raises(TrainingDiverged) as info,
    ):
        _train(native, _with_train(digits, x=x * 1e30))
    assert "The batch's inputs reach" in str(info.value) and "normalise the data" in str(info.value)
    assert "Lower the learning rate" not in str(info.value)


class _NaNAt(Dataset):
    """The digits training split with NaN images from ``index`` on (a dataset checked by its first sample)."""

    def __init__(self, base: TensorDataset, index: int) -> None:
        self.base, self.index = base, index

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return (torch.full_like(x, float("nan")) if i >= self.index else x), y


def test_a_divergence_from_nan_data_blames_the_data_not_the_learning_rate(native, digits) -> None:
    with pytest.raises(TrainingDiverged, match="the loss is nan") as info:
        _train(native, replace(digits, train=_NaNAt(digits.train, 1)))
    assert "The batch holds non-finite inputs (NaN or inf): check the data, not the learning rate" in str(
        info.value
    )


def test_a_divergence_from_ignored_labels_says_so(native, digits) -> None:
    _, y = digits.train.tensors
    with pytest.raises(TrainingDiverged) as info:
        _train(native, _with_train(digits, y=torch.full_like(y, -100)))
    assert "Every label in the batch is the ignore index -100" in str(info.value)


@pytest.mark.parametrize("seed", [2**64, -1, 1e23, "0", True])
def test_a_seed_torch_cannot_take_is_refused(native, digits, seed) -> None:
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\^63\)"):
        _train(native, digits, seed=seed)


def test_the_digits_set_at_a_huge_input_size_is_refused_before_it_is_made(native) -> None:
    """A file's input shape [1, 1, 4096, 4096] is within the schema; the digits set at it is 112 GiB."""
    model = odeify.retarget(native, steps=1)
    model.meta["odeify"]["input_shape"] = [1, 1, 4096, 4096]
    with pytest.raises(ConfigError, match="ODEIFY_MAX_INPUT_BYTES") as info:
        open_data("digits", model)
    assert "[1797, 1, 4096, 4096] would hold 112.3 GiB" in str(info.value)
