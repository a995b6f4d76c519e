"""Every save of a converted zoo model is a round trip (issue 56, item 2).

Three ways ``save`` failed on timm models that convert: a device traced into the graph as a literal
(DINOv3's rotary grid: ``.to(device=device(type='cpu'))``) broke the probe's run on the meta device;
the classifier check compared the converted classifier (the Linear at ``pretrained_cfg['classifier']``)
with the rebuilt source's whole head (``get_classifier()``); and a model converted to no stage was told
to convert. The oracle of a round trip is the saved model itself: the loaded one computes the same
bits (and load's probe checks it against float64 on the way).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import odeify
import odeify.passes.tracing as tracing
from odeify.compiler.conversion import converted_stages
from odeify.core.errors import OdeifyError
from odeify.models._testing import make_test_model
from odeify.passes.residual_blocks import find_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

DINOV3 = ("vit_tiny_patch16_dinov3_qkvb", {"img_size": 32, "depth": 2})


def _round_trip(model: nn.Module, tmp_path, shape: tuple[int, ...]) -> nn.Module:
    """Save and load ``model``; the loaded one computes exactly what it does."""
    path = tmp_path / "model.safetensors"
    odeify.save(model, path)
    loaded = odeify.load(path)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))
    return loaded


def _devices(gm: fx.GraphModule) -> list[object]:
    """Every ``torch.device`` literal among the graph's arguments."""
    found: list[object] = []
    for node in gm.graph.nodes:
        fx.node.map_aggregate(
            (node.args, node.kwargs), lambda v: found.append(v) if isinstance(v, torch.device) else v
        )
    return found


def _blocks(model: nn.Module, shape: tuple[int, ...]) -> tuple[fx.GraphModule, list]:
    gm = tracing.trace(model).graph_module
    tracing.annotate_shapes(gm, shape)
    return gm, find_blocks(gm).value


@pytest.mark.parametrize(
    ("name", "kwargs", "shape", "reads"),
    [(*DINOV3, (1, 3, 32, 32), 1), ("resnet18", {}, (1, 3, 32, 32), 0)],
)
def test_a_traced_device_is_the_inputs_and_the_blocks_stay(monkeypatch, name, kwargs, shape, reads):
    model = make_test_model(name, **kwargs)
    gm, blocks = _blocks(model, shape)
    assert _devices(gm) == []  # DINOv3's rope read self.periods.device: a literal before
    read = [n for n in gm.graph.nodes if n.op == "call_function" and n.args[1:] == ("device",)]
    assert len(read) == reads and all(n.args[0].op == "placeholder" for n in read)
    monkeypatch.setattr(tracing, "read_input_device", lambda graph, device: False)
    literal, before = _blocks(model, shape)
    assert len(_devices(literal)) == reads
    assert [(b.fork, b.join, b.nodes) for b in blocks] == [(b.fork, b.join, b.nodes) for b in before]


def test_dinov3_saves_loads_and_runs_on_the_meta_device(tmp_path):
    converted = odeify.convert(make_test_model(DINOV3[0], **DINOV3[1]), input_size=(3, 32, 32))
    assert converted_stages(converted)
    loaded = _round_trip(converted, tmp_path, (2, 3, 32, 32))
    with torch.no_grad():
        features = converted(torch.zeros(2, 3, 32, 32)).shape  # a feature model: no classes
    for model in (converted, loaded):  # fx's tensor constant (the rope's periods) is a buffer: it moves too
        on_meta = copy.deepcopy(model).to("meta")
        assert all(b.is_meta for b in on_meta.buffers())
        with torch.no_grad():
            out = on_meta(torch.empty(2, 3, 32, 32, device="meta"))
        assert out.is_meta and out.shape == features


CLASSIFIED = [  # the classifier (pretrained_cfg) lies inside the head get_classifier() returns
    ("iformer_t", {"depths": (1, 1, 9, 6), "dims": (16, 32, 64, 128)}, 64),  # RepVitClassifier, bn + l
    ("samvit_base_patch16_224", {"img_size": 32, "depth": 2, "embed_dim": 64, "num_heads": 2}, 32),
    ("cpubone_nano", {}, 32),  # LinearLayer around its Linear
]


@pytest.mark.parametrize(("name", "kwargs", "size"), CLASSIFIED, ids=[c[0] for c in CLASSIFIED])
def test_a_classifier_inside_the_head_saves_and_a_replaced_one_is_refused(tmp_path, name, kwargs, size):
    converted = odeify.convert(make_test_model(name, **kwargs), input_size=(3, size, size))
    _round_trip(converted, tmp_path, (2, 3, size, size))
    classifier = converted.get_classifier()  # traced through: a Module holding the Linear's tensors
    replaced = copy.deepcopy(converted)
    replaced.set_submodule(
        converted.pretrained_cfg["classifier"], nn.Linear(classifier.weight.shape[1], 10, bias=False)
    )
    with pytest.raises(OdeifyError, match="is not the one its recipe rebuilds"):
        odeify.save(replaced, tmp_path / "replaced.safetensors")
    assert not (tmp_path / "replaced.safetensors").exists()


class _TableBlocks(nn.Module):
    """Residual blocks that read a table computed from a trainable weight outside them: a stage would
    have to take it as a constant input, which needs no gradient, so no run is lifted."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.randn(8))
        self.stem, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.freq.cos() * x.shape[-1]
        x = self.stem(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x)) * table
        return self.head(x)


def test_a_model_converted_to_no_stage_is_told_why_not_to_convert(tmp_path):
    converted = odeify.convert(_TableBlocks().eval(), input_size=(4,))
    assert not converted_stages(converted)
    with pytest.raises(OdeifyError) as refused:
        odeify.save(converted, tmp_path / "m.safetensors")
    said = str(refused.value)
    assert "it was converted, but no run of its residual blocks could be lifted" in said
    reasons = converted.meta["odeify"]["not_lifted"]
    assert reasons and all(f"{run}: {why}" in said for run, why in reasons.items())  # convert's reasons
    assert "use and save the source model itself" in said and "Convert it first" not in said
    assert not (tmp_path / "m.safetensors").exists()
