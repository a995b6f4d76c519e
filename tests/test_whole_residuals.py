"""A residual add on part of a stream (CoaT's conv position encoding) becomes a block of the stream.

CoaT updates the image tokens with ``conv(img) + img`` in the image layout and concatenates the
class token back: no block, no glue, so its attention and MLP blocks got one-block stages. The pass
``whole_residuals`` rewrites it as ``x + pad(conv(img))`` (exact: the class token plus zero is
itself), and each CoaT stage becomes one deep stage of period 3.

Oracles: eager timm in float64 (exact at native depth), backprop's float64 gradients for the
memory-saving modes, and a model written in the whole form from the start (the rewritten graph must
compute what it computes at every depth, not only at native).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from precision import rel
from torch import nn

import odeify
from odeify.compiler.conversion import converted_stages
from odeify.models._testing import make_test_model

pytestmark = pytest.mark.usefixtures("one_thread")

NATIVE_TOLERANCE = 1e-13  # float64, against eager timm; measured 0 (the blocks' own code at native depth)
GRADIENT_TOLERANCE = 1e-10  # float64, against backprop; measured 0 (checkpoint) and ~1e-15 (ALF)
SAME_FUNCTION_TOLERANCE = 1e-13  # float64, rewritten graph against the whole form; measured 0
COAT = {"img_size": 32, "embed_dims": (16, 24, 24, 32), "serial_depths": (3, 2, 2, 2), "num_heads": 8}


def _image(dtype: torch.dtype = torch.float64, size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3), dtype=dtype)


@pytest.fixture(scope="module")
def coat() -> tuple[nn.Module, torch.fx.GraphModule]:
    model = make_test_model("coat_lite_tiny", dtype=torch.float64, **COAT)
    return model, odeify.convert(model, input_size=(2, 3, 32, 32))


def test_coat_serial_blocks_are_deep_stages_of_period_three(coat) -> None:
    model, converted = coat
    stages = converted_stages(converted)
    assert [s.depth for s in stages] == list(COAT["serial_depths"])
    assert {s.num_fields for s in stages} == {3}, "position encoding, attention, MLP"
    with torch.no_grad():
        assert rel(converted(_image()), model(_image())) <= NATIVE_TOLERANCE


@pytest.mark.parametrize(
    "settings",
    [{"backward": "checkpoint"}, {"backward": "reversible", "integrator": "alf"}],
    ids=["checkpoint", "reversible-alf"],
)
def test_coat_memory_saving_gradients_equal_backprop(coat, settings: dict) -> None:
    _, converted = coat
    plain = odeify.retarget(converted, backward="backprop", integrator=settings.get("integrator", "euler"))
    saving = odeify.retarget(converted, **settings)
    grads = []
    for model in (plain, saving):
        model.zero_grad()
        model(_image()).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert rel(grads[1], grads[0]) <= GRADIENT_TOLERANCE


def test_coat_saves_and_loads_bit_for_bit(tmp_path) -> None:
    """Built with kwargs a file may not carry, so load takes the architecture (its weights ignored)."""
    converted = odeify.convert(make_test_model("coat_lite_tiny", **COAT), input_size=(2, 3, 32, 32))
    path = tmp_path / "coat.safetensors"
    with pytest.warns(UserWarning, match="embed_dims"):
        odeify.save(converted, path)
    loaded = odeify.load(path, model=make_test_model("coat_lite_tiny", seed=1, **COAT))
    x = _image(torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(x), converted(x))


class _PositionConv(nn.Module):
    """CoaT's ConvPosEnc as timm writes it; ``cls_last`` puts the class token at the end,
    ``scrambled`` flattens the image transposed, so the tokens do not come back in their order, and
    ``rotated`` puts the class token back at the other end."""

    def __init__(
        self, dim: int, size: int, cls_last: bool = False, scrambled: bool = False, rotated: bool = False
    ) -> None:
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.size, self.cls_last, self.scrambled, self.rotated = size, cls_last, scrambled, rotated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        cls, img = (x[:, -1:], x[:, :-1]) if self.cls_last else (x[:, :1], x[:, 1:])
        feat = img.transpose(1, 2).view(B, C, self.size, self.size)
        y = self.proj(feat) + feat
        y = (y.transpose(2, 3) if self.scrambled else y).flatten(2).transpose(1, 2)
        return torch.cat((y, cls) if self.cls_last != self.rotated else (cls, y), dim=1)


class _WholePositionConv(_PositionConv):
    """The same map written as a residual of the whole stream: what the pass rewrites into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        img = x[:, :-1] if self.cls_last else x[:, 1:]
        update = self.proj(img.transpose(1, 2).view(B, C, self.size, self.size)).flatten(2).transpose(1, 2)
        return x + F.pad(update, (0, 0, 0, 1) if self.cls_last else (0, 0, 1, 0))


class _Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _TokenNet(nn.Module):
    """Patch embedding, a class token, ``depth`` pairs of (position conv, MLP half), a mean head."""

    def __init__(self, position: type[_PositionConv], depth: int = 3, **kwargs: bool) -> None:
        super().__init__()
        dim, self.cls_last = 8, kwargs.get("cls_last", False)
        self.embed = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.Sequential(
            *[m for _ in range(depth) for m in (position(dim, 4, **kwargs), _Mlp(dim))]
        )
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        cls = self.cls.expand(tokens.shape[0], -1, -1)
        x = torch.cat((tokens, cls) if self.cls_last else (cls, tokens), dim=1)
        return self.head(self.blocks(x).mean(1))


def _token_nets(**kwargs: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    written = _TokenNet(_PositionConv, **kwargs).double().eval()
    whole = _TokenNet(_WholePositionConv, **kwargs).double().eval()
    whole.load_state_dict(written.state_dict())
    return written, whole


@pytest.mark.parametrize("cls_last", [False, True], ids=["class-token-first", "class-token-last"])
def test_rewritten_graph_computes_the_whole_form_at_every_depth(cls_last: bool) -> None:
    written, whole = _token_nets(cls_last=cls_last)
    x = _image(size=16)
    converted = [odeify.convert(m, input_size=(2, 3, 16, 16)) for m in (written, whole)]
    assert [s.depth for s in converted_stages(converted[0])] == [3]
    for steps in ("x0.5", "x2"):
        ours, reference = (odeify.retarget(c, steps=steps) for c in converted)
        with torch.no_grad():
            assert rel(ours(x), reference(x)) <= SAME_FUNCTION_TOLERANCE, steps
    with torch.no_grad():
        assert rel(converted[0](x), written(x)) <= NATIVE_TOLERANCE


def test_a_slice_that_does_not_come_back_in_order_stays_as_written() -> None:
    """Transposing the image before flattening it back moves tokens: no residual of the stream."""
    written, _ = _token_nets(scrambled=True)
    converted = odeify.convert(written, input_size=(2, 3, 16, 16))
    assert {s.depth for s in converted_stages(converted)} == {1}, "each position conv and MLP alone"
    assert any(n.target is torch.cat for n in converted.graph.nodes if n.op == "call_function")
    with torch.no_grad():
        assert rel(converted(_image(size=16)), written(_image(size=16))) <= NATIVE_TOLERANCE


def test_a_class_token_put_back_at_the_other_end_stays_as_written() -> None:
    """cat((y, x[:, :1])): the slices split the stream, but in the other order (tokens rotate)."""
    written, _ = _token_nets(rotated=True)
    converted = odeify.convert(written, input_size=(2, 3, 16, 16))
    assert {s.depth for s in converted_stages(converted)} == {1}
    with torch.no_grad():
        assert rel(converted(_image(size=16)), written(_image(size=16))) <= NATIVE_TOLERANCE
