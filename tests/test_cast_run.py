"""The probe's float64 run casts each weight where it is used (odeify.serialization.cast_run).

Oracles: a copy of the whole model in the other dtype (what the probe ran before, and what its
values must stay, to the bit), and the float64 bytes torch holds at once, counted as each operation
makes its tensors and as each storage's last tensor goes.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import odeify
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models._testing import make_test_model
from odeify.serialization.cast_run import CastRun
from odeify.serialization.probe import record_probe

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUTS: list[tuple[tuple[int, ...], int]] = []


def _note(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A computing operation that notes how its weight is laid out: strides, address within 64 bytes."""
    LAYOUTS.append((weight.stride(), weight.data_ptr() % 64))
    return x * weight


fx.wrap("_note")


class _Views(torch.nn.Module):
    """Weights read as views: a knot from its stack (its second row starts 20 bytes in), a row of a
    weight that is itself a view at an offset of its storage, and a column (strided)."""

    def __init__(self) -> None:
        super().__init__()
        self.stacked = torch.nn.Parameter(torch.randn(3, 5))
        self.offset = torch.nn.Parameter(torch.randn(40)[3:33].view(6, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _note(x, torch.unbind(self.stacked)[1])
        x = _note(x, self.offset[2])
        return _note(x, self.offset[:5, 1])


def _vit() -> torch.nn.Module:
    """A ViT at 32x32 (4 tokens): its weights dwarf its activations."""
    return odeify.convert(make_test_model("vit_tiny_patch16_224", img_size=32), input_size=(1, 3, 32, 32))


def _float64_bytes_held(run: Callable[[], object]) -> int:
    """The most bytes of float64 CPU storage alive at once while ``run`` runs: each storage an operation
    makes counts until it goes (its Python object lives exactly as long as the storage)."""
    alive: set[int] = set()
    total, peak = [0], [0]

    def release(key: int, nbytes: int) -> None:
        alive.discard(key)
        total[0] -= nbytes

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64 and not tensor.is_meta:
                    storage = tensor.untyped_storage()
                    if storage._cdata not in alive:
                        alive.add(storage._cdata)
                        total[0] += storage.nbytes()
                        weakref.finalize(storage, release, storage._cdata, storage.nbytes())
            peak[0] = max(peak[0], total[0])
            return out

    with Count():
        run()
    return peak[0]


def test_the_probe_never_holds_the_weights_in_float64() -> None:
    """A float64 copy of the whole model beside it was save's and load's peak: a 412M-parameter ViT
    went past 8 GiB. The probe holds a few weights in float64 at a time (3.5% of this model's float64
    weights; its largest weight, 768x192, is 2.6%); the copy held all of them (100.2%)."""
    model = _vit()
    weights = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point()) * 8
    held = _float64_bytes_held(lambda: record_probe(model))
    assert 0 < held < weights / 4


def _digits(**manifestation: Any) -> torch.nn.Module:
    return odeify.retarget(odeify.convert(str(DEFAULT_MODEL_PATH)), **manifestation)


def _mixed_knots() -> torch.nn.Module:
    return _digits(knots=2, basis="linear", integrator="rk4", steps=3)


def _reversible() -> torch.nn.Module:
    return _digits(integrator="alf", backward="reversible")


def _float64_digits() -> torch.nn.Module:
    return odeify.convert(str(DEFAULT_MODEL_PATH)).double()


CASES = {
    "vit: knots taken from their stacks, a class token expanded": (_vit, torch.float64),
    "knots mixed at each step": (_mixed_knots, torch.float64),
    "segments handed modules, stages called": (_reversible, torch.float64),
    "a float64 model cast down to float32": (_float64_digits, torch.float32),
}


@pytest.mark.parametrize("case", CASES)
def test_every_value_is_the_whole_copy_s_to_the_bit(case: str) -> None:
    """Each node's value (the probe's points among them) is what a copy of the model in the dtype
    computes, bit for bit; a deferred one (a weight, or data moved from weights) once it is cast."""
    build, dtype = CASES[case]
    model = build().eval()
    shape = (1, *model.meta["odeify"]["input_shape"][1:])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    whole = copy.deepcopy(model).to(dtype)
    expected, run = _values(fx.Interpreter(whole), x), CastRun(model, dtype)
    actual = _values(run, x)
    deferred = {node.name for node in run.deferred}
    assert deferred and expected.keys() == actual.keys()
    for name, value in actual.items():
        value = value.to(dtype) if name in deferred else value
        assert value.dtype == dtype and torch.equal(value, expected[name]), name


def test_a_computing_operation_gets_each_weight_laid_out_as_the_copy_s() -> None:
    """Kernels may take other paths (and round otherwise) at other strides or another alignment: each
    weight reaches the operation with the strides and the address within 64 bytes it has in the copy."""
    model = fx.symbolic_trace(_Views())
    x = torch.randn(5, dtype=torch.float64)
    LAYOUTS.clear()
    fx.Interpreter(copy.deepcopy(model).double()).run(x)
    expected = list(LAYOUTS)
    LAYOUTS.clear()
    CastRun(model, torch.float64).run(x)
    assert LAYOUTS == expected and len({address for _, address in expected}) == 3


def _values(run: fx.Interpreter, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor value of the graph's nodes, by node name, after ``run`` on ``x``."""
    run.garbage_collect_values = False
    with torch.no_grad():
        run.run(x)
    return {node.name: value for node, value in run.env.items() if isinstance(value, torch.Tensor)}
