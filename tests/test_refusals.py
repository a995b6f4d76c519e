"""The messages a user meets when a model does not (fully) convert: each names what the graph has.

* NoResidualBlocksError says "no residual add" only when the graph has none; otherwise it counts the
  adds and says why each is no block (partial-channel, tuple item, nested in a wider block, ...);
* a conversion that lifts none or only some of its runs warns (NotLiftedWarning), naming each run
  and why; an opaque module with weights is named with its class and what (checked) would help;
* a TraceError suggests ``leaf_modules=[...]`` only when tracing with it was checked to succeed and
  to keep residual adds; never a leaf that hides every block.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import odeify
from odeify.compiler.pipelines import NotLiftedWarning
from odeify.core.errors import NoResidualBlocksError, TraceError
from odeify.models._testing import make_test_model
from odeify.passes.tracing import opaque_weights_reason

# --- refusals: what the graph's adds are ------------------------------------------------------------


def _refusal(model: nn.Module, size: tuple[int, ...] = (1, 8, 8, 8)) -> str:
    with pytest.raises(NoResidualBlocksError) as info:
        odeify.analyze(model.eval(), size)
    return str(info.value)


class PartialChannel(nn.Module):
    """ReXNet's block: the shortcut is added to the first C channels of a wider output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 12, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return torch.cat([y[:, :8] + x, y[:, 8:]], dim=1)


class TupleItem(nn.Module):
    """One side of the add is an item of a chunk's tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(self.conv(x), 2, dim=1)
        return a + b


class SplitFork(nn.Module):
    """Res2Net-like: both sides are computed from items of one split, which is not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, 4, dim=1)
        return self.a(parts[0]) + self.b(parts[1])


class OpenRegion(nn.Module):
    """x + f(x), but f(x) is read after the add too: the branch has a second exit.

    The shortcut is a slice of all of x's channels: a slice, but no partial-channel add.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return (x[:, :8] + h) * torch.sigmoid(h)


class Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.relu(x))


class WrappedIdentities(nn.Module):
    """HRNet's shape: identity blocks inside the branch of one projection block around them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(Identity(), Identity())
        self.proj = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.body(x)


class BiasOnly(nn.Module):
    """Its only add is a broadcast bias: no residual add at all."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bias = nn.Parameter(torch.zeros(1, 8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.bias


def test_partial_channel_add_is_named() -> None:
    message = _refusal(PartialChannel())
    assert "no residual add" not in message
    assert "1 add of two same-shape tensors" in message and "1 add on a channel slice" in message
    assert "partial-channel" in message and "Plain feed-forward" not in message


def test_tuple_item_add_is_named() -> None:
    message = _refusal(TupleItem())
    assert "no residual add" not in message
    assert "one item of a tuple result" in message


def test_add_of_a_split_is_named() -> None:
    message = _refusal(SplitFork())
    assert "no residual add" not in message
    assert "1 add whose two sides start from no single tensor" in message


def test_add_with_an_open_branch_is_named() -> None:
    message = _refusal(OpenRegion())
    assert "no residual add" not in message
    assert "1 add whose sides do not close a region" in message


def test_identity_blocks_inside_a_projection_block_become_a_stage() -> None:
    """HRNet's shape: the projection block around them gives way (it stays a discrete layer anyway)."""
    model = WrappedIdentities().double().eval()
    converted = odeify.convert(model, input_size=(1, 8, 8, 8), verify=False)
    assert [stage.depth for stage in odeify.converted_stages(converted)] == [2]
    x = torch.randn(1, 8, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(converted(x), model(x))


def test_broadcast_adds_are_not_residual_adds() -> None:
    message = _refusal(BiasOnly())
    assert "none of the graph's 1 add is a residual add" in message and "each is a broadcast add" in message
    assert "Plain feed-forward" in message


def test_no_add_at_all_says_so() -> None:
    message = _refusal(nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU()))
    assert "the graph has no residual add" in message and "Plain feed-forward" in message


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("dpn48b", "16 adds on a channel slice"),
        ("rexnet_100", "11 adds on a channel slice"),
    ],
)
def test_timm_refusals_name_what_the_graph_has(name: str, found: str) -> None:
    message = _refusal(make_test_model(name), (1, 3, 64, 64))
    assert "no residual add" not in message and found in message


# --- runs found but not lifted: a warning, and an opaque module's reason --------------------------------


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(x))


class TableBlocks(nn.Module):
    """Two blocks that read a table computed outside them from a trainable weight: no constant input."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Parameter(torch.randn(8))
        self.stem = nn.Linear(8, 8)
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.freq.cos() * x.shape[-1]  # read by every block, from the input's size
        x = self.stem(x)
        for fc in self.fcs:
            x = x + fc(x) * table
        return x


def _convert_warning(model: nn.Module) -> tuple[nn.Module, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = odeify.convert(model.eval(), input_size=(1, 4, 6, 8), verify=False)
    (warning,) = [w for w in caught if issubclass(w.category, NotLiftedWarning)]
    assert warning.filename == __file__  # points at the caller's line
    return converted, str(warning.message)


def test_no_run_lifted_warns_zero_stages() -> None:
    torch.manual_seed(0)
    converted, message = _convert_warning(TableBlocks())
    assert not odeify.converted_stages(converted)
    assert "zero ODE stages" in message and "none of its 1 run" in message
    assert "Run '" in message and "trainable" in message


def test_some_runs_lifted_warns_which_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Mlp(), Mlp(), TableBlocks())
    converted, message = _convert_warning(model)
    assert len(odeify.converted_stages(converted)) == 1
    assert "converted with 1 of its 2 runs as ODE stages" in message and "zero" not in message
    (run,) = converted.meta["odeify"]["not_lifted"]
    assert f"Run '{run}'" in message


def test_all_runs_lifted_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotLiftedWarning)
        odeify.convert(nn.Sequential(Mlp(), Mlp()).eval(), input_size=(1, 4, 6, 8), verify=False)


class Upsampler(nn.Module):
    """Traceable, but with a ConvTranspose2d (kept whole with its weights) and a BatchNorm (folded) inside."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(4)
        self.up = nn.ConvTranspose2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.norm(x))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_opaque_module_reasons_say_what_was_checked() -> None:
    from timm.models.lowformer import ConvAttention

    lstm = opaque_weights_reason("a.rnn", nn.LSTM(4, 4))
    assert (
        "'a.rnn' (LSTM)" in lstm
        and "torch.nn's LSTM whole" in lstm
        and "fx cannot trace LSTM's forward" in lstm
    )
    timm = opaque_weights_reason("a.attn", ConvAttention(16))
    assert "timm registers ConvAttention" in timm and "keep ConvTranspose2d whole" in timm
    assert "BatchNorm" not in timm  # folded before lifting: not an obstacle
    held = opaque_weights_reason("a.up", Upsampler())
    assert "Upsampler is in leaf_modules" in held and "keep ConvTranspose2d whole" in held
    assert "leave it out of leaf_modules" in opaque_weights_reason("a.p", Plain())
    prelu = opaque_weights_reason("a.act", nn.PReLU())
    assert "would trace, but odeify has no option" in prelu


def test_a_leaf_with_weights_lifts_through_functional_call() -> None:
    """A module kept whole (here the user's leaf; ConViT's GPSA, an nn.LSTM) whose blocks hold
    tensors of one shape: the stage takes each block's as knots, exact at native depth, no warning."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Plain()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.body(x)

    model = nn.Sequential(Block(), Block()).double().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotLiftedWarning)
        converted = odeify.convert(model, input_size=(1, 4, 8, 8), leaf_modules=[Plain], verify=False)
    (stage,) = odeify.converted_stages(converted)
    assert stage.depth == 2 and not any(True for _ in stage.template.parameters())
    x = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(converted(x), model(x))


# --- trace errors: a leaf suggestion only where it was checked ---------------------------------------------


class Picky(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


class Choosy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.mean() > 0 else 2 * x


class PickyBlock(nn.Module):
    def __init__(self, gate: type[nn.Module] = Picky) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate(self.conv(x))


class Encoder(nn.Module):
    """Branches on values in its own forward, around every residual block (Gemma 4's ViT encoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Identity(), Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) if x.amax() > 0 else x


class WithEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x).mean((2, 3))


def _trace_error(model: nn.Module, size: tuple[int, ...], **kwargs) -> str:
    with pytest.raises(TraceError) as info:
        odeify.analyze(model, size, **kwargs)
    return str(info.value)


def test_leaf_suggestion_is_one_that_traces() -> None:
    model = nn.Sequential(PickyBlock(), PickyBlock())
    message = _trace_error(model, (1, 4, 8, 8))
    assert "leaf_modules=[Picky]" in message and "--leaf Picky" in message and "keeps 2 adds" in message
    assert odeify.analyze(model, (1, 4, 8, 8), leaf_modules=[Picky]).run_lengths == [2]


def test_leaf_suggestion_takes_every_module_the_trace_fails_in() -> None:
    model = nn.Sequential(PickyBlock(), PickyBlock(Choosy))
    message = _trace_error(model, (1, 4, 8, 8))
    assert "leaf_modules=[Picky, Choosy]" in message
    assert odeify.analyze(model, (1, 4, 8, 8), leaf_modules=[Picky, Choosy]).blocks


def test_leaf_suggestion_keeps_the_users_leaves() -> None:
    model = nn.Sequential(PickyBlock(), PickyBlock(Choosy))
    message = _trace_error(model, (1, 4, 8, 8), leaf_modules=[Picky])
    assert "leaf_modules=[Picky, Choosy]" in message


def test_no_leaf_is_suggested_that_hides_every_block() -> None:
    message = _trace_error(WithEncoder(), (1, 8, 8, 8))
    assert "in module 'encoder' (Encoder)" in message
    assert "Keeping Encoder opaque does not help" in message and "cannot convert this model" in message
    with pytest.raises(NoResidualBlocksError):  # what following the old suggestion led to
        odeify.analyze(WithEncoder(), (1, 8, 8, 8), leaf_modules=[Encoder])


def test_no_leaf_is_suggested_for_the_models_own_forward() -> None:
    message = _trace_error(Encoder(), (1, 8, 8, 8))
    assert "the model's own forward" in message and "leaf_modules=[" not in message


def _gate(i: int) -> type[nn.Module]:
    """A class of its own whose forward fx cannot trace (its own code, so the trace names it)."""
    namespace: dict = {}
    exec(f"def forward(self, x):\n    return x if x.sum() > {i} else -x\n", namespace)
    return type(f"Gate{i}", (nn.Module,), {"forward": namespace["forward"]})


def test_leaf_search_gives_up_after_a_few_classes() -> None:
    model = nn.Sequential(*(PickyBlock(_gate(i)) for i in range(4)))
    message = _trace_error(model, (1, 4, 8, 8))
    assert "The trace still fails with leaf_modules=[Gate0, Gate1, Gate2]" in message
    assert "(Gate3)" in message


def test_hrnet_converts_with_its_branches_identity_blocks_as_stages() -> None:
    model = make_test_model("hrnet_w18_small", dtype=torch.float64)
    converted = odeify.convert(model, input_size=(1, 3, 64, 64))
    depths = [stage.depth for stage in odeify.converted_stages(converted)]
    assert len(depths) == 9 and set(depths) == {2}  # two BasicBlocks per branch of stages 2-4
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        out, ref = converted(x), model(x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-13  # measured 9.3e-16 at 224
