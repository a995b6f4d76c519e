"""Property tests on generated architectures: timm's ResNet, ResNetV2, ByobNet, ConvNeXt, RegNet and
MobileNetV2-style inverted residuals, built from random valid settings (hypothesis).

For every generated model two oracles that can disagree with odeify:

* the runs odeify finds (the stages of the converted model) equal what a walk of the *module
  tree* predicts: per stage, the count of blocks whose shortcut is the identity, read from the
  block's own attributes (``downsample is None``, ``shortcut`` is ``nn.Identity``, ``has_skip``),
  never from the graph;
* the native Euler conversion (:func:`odeify.convert` with its defaults) reproduces eager timm in
  fp64, with random non-zero branches (``zero_init_last=False``, randomised norm statistics); for
  norm layers without running statistics (ConvNeXt's LayerNorm, ResNetV2's GroupNorm) also in train
  mode, where every block's DropPath draws the same random numbers as eager.

Every generated stage after the first starts with a strided (projection) block, so runs never
span two stages and the walk's per-stage count is the whole prediction.

Profiles (``ODEIFY_HYPOTHESIS``): ``default`` runs ``test_generated_architectures`` on 20
examples (4 per family, 24 in all) in the ordinary suite; ``ci`` (150: 25 per family) and ``full``
(1000, not derandomised) also run the ``slow`` sweep ``test_generated_architectures_sweep``.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from timm.layers import BatchNormAct2d, GroupNormAct, get_act_layer
from timm.models._efficientnet_builder import decode_arch_def
from timm.models.byobnet import ByoBlockCfg, ByobNet, ByoModelCfg
from timm.models.convnext import ConvNeXt
from timm.models.efficientnet import EfficientNet
from timm.models.regnet import PreBottleneck, RegNet, RegNetCfg, generate_regnet
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from timm.models.resnetv2 import ResNetV2
from torch import nn

import odeify
from odeify.core.errors import NoResidualBlocksError
from odeify.models._testing import _randomize

pytestmark = pytest.mark.usefixtures("one_thread")

PROFILE = os.environ.get("ODEIFY_HYPOTHESIS", "default")
EXAMPLES = {"default": 20, "ci": 150, "full": 1000}
"""Examples per profile, shared evenly by the six families (rounded up)."""
if PROFILE not in EXAMPLES:
    raise ValueError(f"ODEIFY_HYPOTHESIS must be one of {', '.join(EXAMPLES)}; got {PROFILE!r}")

RTOL = 1e-10
"""fp64, relative to the output's largest magnitude. Measured over the ci profile (204 examples then):
0 to 1e-15 for nine examples in ten, at most 1.4e-12, on a 16-block BatchNorm ResNetV2 whose
random-weight activations reach 1e26: all of that is BatchNorm folding's round-off (the converted
model equals the folded graph bit for bit). A wrong weight, variant or step is off by 1e-3 or more."""

ACTIVATIONS = ("relu", "silu", "gelu", "leaky_relu")
ATTENTION = (None, "se", "eca")


@dataclass(frozen=True)
class Arch:
    """One generated architecture: how to build it, how to walk its stages, what input it takes."""

    family: str
    settings: dict
    build: Callable[[], nn.Module] = field(repr=False, compare=False)
    size: int
    batchnorm: bool  # whether it has BatchNorm (folded: train-mode outputs then differ by design)


# --- the module-tree walk (the oracle for runs) ----------------------------------------------------------


def _stages(family: str, model: nn.Module) -> list[list[nn.Module]]:
    """The residual blocks of each stage, in forward order, from the module tree."""
    if family == "resnet":
        return [list(getattr(model, f"layer{i}")) for i in range(1, 5)]
    if family in ("resnetv2", "convnext"):
        return [list(stage.blocks) for stage in model.stages]
    if family == "byobnet":
        return [list(stage) for stage in model.stages]
    if family == "regnet":
        return [list(getattr(model, f"s{i}").children()) for i in range(1, 5)]
    if family == "mobilenet":
        return [list(stage) for stage in model.blocks]
    raise AssertionError(family)


def _identity_shortcut(family: str, block: nn.Module) -> bool:
    """Whether a block's shortcut is the identity, from its attributes (how timm builds it)."""
    if family in ("resnet", "resnetv2"):
        return block.downsample is None
    if family in ("byobnet", "convnext"):
        return isinstance(block.shortcut, nn.Identity)
    if family == "regnet":
        return isinstance(block.downsample, nn.Identity)
    if family == "mobilenet":
        return bool(block.has_skip)
    raise AssertionError(family)


def predicted_runs(family: str, model: nn.Module) -> list[int]:
    """Per stage, the number of identity-shortcut blocks (they follow at most one projection block).

    RegNet's pre-activation block normalises its input before the shortcut forks off
    (``shortcut = norm1(x)``): block k + 1 does not read block k's output itself, so no two chain
    and each identity block is a run of one.
    """
    runs = []
    for blocks in _stages(family, model):
        identity = [_identity_shortcut(family, b) for b in blocks]
        assert all(identity[1:]), f"a projection block after the first in a stage: {identity}"
        if any(identity) and all(isinstance(b, PreBottleneck) for b in blocks):
            runs.extend([1] * sum(identity))
        elif any(identity):
            runs.append(sum(identity))
    return runs


# --- strategies --------------------------------------------------------------------------------------


def _act(name: str) -> type[nn.Module]:
    return get_act_layer(name)


layers4 = st.lists(st.integers(1, 6), min_size=4, max_size=4)
sizes = st.sampled_from([32, 48, 64])
drop_path = st.sampled_from([0.0, 0.0, 0.1, 0.3])  # half the examples without DropPath


@st.composite
def resnets(draw) -> Arch:
    bottleneck = draw(st.booleans())
    s = {
        "block": "bottleneck" if bottleneck else "basic",
        "layers": draw(layers4),
        "stem_type": draw(st.sampled_from(["", "deep", "deep_tiered"])),
        "stem_width": draw(st.sampled_from([8, 16])),
        "avg_down": draw(st.booleans()),
        "act": draw(st.sampled_from(ACTIVATIONS)),
        "attn": draw(st.sampled_from(ATTENTION)),
        "drop_path_rate": draw(drop_path),
    }
    c = draw(st.sampled_from([4, 8]) if bottleneck else st.sampled_from([8, 16]))
    s["channels"] = [c, c * draw(st.sampled_from([1, 2])), 2 * c, 2 * c]
    s["cardinality"], s["base_width"] = (
        draw(st.sampled_from([(1, 64), (2, 32), (4, 16)])) if bottleneck else (1, 64)
    )

    def build() -> nn.Module:
        return ResNet(
            Bottleneck if bottleneck else BasicBlock,
            s["layers"],
            num_classes=5,
            channels=s["channels"],
            stem_type=s["stem_type"],
            stem_width=s["stem_width"],
            avg_down=s["avg_down"],
            act_layer=_act(s["act"]),
            cardinality=s["cardinality"],
            base_width=s["base_width"],
            block_args={"attn_layer": s["attn"]},
            drop_path_rate=s["drop_path_rate"],
            zero_init_last=False,
        )

    return Arch("resnet", s, build, draw(sizes), batchnorm=True)


@st.composite
def resnetv2s(draw) -> Arch:
    preact = draw(st.booleans())
    basic = preact and draw(st.booleans())
    s = {
        "layers": draw(layers4),
        "preact": preact,
        "basic": basic,
        "stem_type": draw(
            st.sampled_from(["", "fixed", "same", "deep", "deep_fixed", "deep_same", "tiered"])
        ),
        "avg_down": draw(st.booleans()),
        "act": draw(st.sampled_from(ACTIVATIONS)),
        "norm": draw(st.sampled_from(["groupnorm", "batchnorm"])),
        "drop_path_rate": draw(drop_path),
    }
    c = draw(st.sampled_from([16, 32]))
    s["channels"] = [c, c, 2 * c, 2 * c] if basic else [c, 2 * c, 2 * c, 4 * c]
    groupnorm = s["norm"] == "groupnorm"

    def build() -> nn.Module:
        norm = partial(GroupNormAct, num_groups=4) if groupnorm else BatchNormAct2d
        return ResNetV2(
            s["layers"],
            channels=s["channels"],
            num_classes=5,
            stem_chs=32,  # the tiered stem's first conv has 3/8 of it: a multiple of 4 groups
            stem_type=s["stem_type"],
            avg_down=s["avg_down"],
            preact=preact,
            basic=basic,
            act_layer=_act(s["act"]),
            norm_layer=norm,
            drop_path_rate=s["drop_path_rate"],
            zero_init_last=False,
        )

    return Arch("resnetv2", s, build, draw(sizes), batchnorm=not groupnorm)


@st.composite
def byobnets(draw) -> Arch:
    stem_chs = draw(st.sampled_from([8, 16]))
    n_stages = draw(st.integers(2, 4))
    blocks = []
    c = stem_chs * draw(st.sampled_from([1, 2]))  # equal to the stem: the first block is identity
    for i in range(n_stages):
        blocks.append(
            {
                "type": draw(st.sampled_from(["basic", "bottle", "dark", "edge"])),
                "d": draw(st.integers(1, 6)),
                "c": c,
                "s": 1 if i == 0 else 2,
                "gs": draw(st.sampled_from([0, 4])),
                "br": draw(st.sampled_from([0.5, 1.0])),
            }
        )
        c *= draw(st.sampled_from([1, 2]))
    s = {
        "blocks": blocks,
        "stem_chs": stem_chs,
        "stem_type": draw(st.sampled_from(["3x3", "tiered", "deep", "quad", "7x7"])),
        "stem_pool": draw(st.sampled_from(["", "maxpool"])),
        "downsample": draw(st.sampled_from(["conv1x1", "avg"])),
        "act": draw(st.sampled_from(ACTIVATIONS)),
        "attn": draw(st.sampled_from(ATTENTION)),
        "drop_path_rate": draw(drop_path),
    }

    def build() -> nn.Module:
        cfg = ByoModelCfg(
            blocks=tuple(ByoBlockCfg(**b) for b in blocks),
            stem_chs=stem_chs,
            stem_type=s["stem_type"],
            stem_pool=s["stem_pool"],
            downsample=s["downsample"],
            act_layer=s["act"],
            attn_layer=s["attn"],
        )
        return ByobNet(cfg, num_classes=5, drop_path_rate=s["drop_path_rate"], zero_init_last=False)

    return Arch("byobnet", s, build, draw(sizes), batchnorm=True)


@st.composite
def convnexts(draw) -> Arch:
    c = draw(st.sampled_from([8, 16]))
    s = {
        "depths": draw(layers4),
        "dims": [c, 2 * c, 4 * c, 8 * c],
        "kernel_size": draw(st.sampled_from([3, 5, 7])),
        "conv_mlp": draw(st.booleans()),
        "use_grn": draw(st.booleans()),
        "ls_init_value": draw(st.sampled_from([None, 0.5, 1.0])),  # timm's 1e-6 would hide the branch
        "act": draw(st.sampled_from(ACTIVATIONS)),
        "drop_path_rate": draw(drop_path),
    }

    def build() -> nn.Module:
        return ConvNeXt(
            depths=s["depths"],
            dims=s["dims"],
            kernel_sizes=s["kernel_size"],
            conv_mlp=s["conv_mlp"],
            use_grn=s["use_grn"],
            ls_init_value=s["ls_init_value"],
            act_layer=s["act"],
            num_classes=5,
            drop_path_rate=s["drop_path_rate"],
        )

    return Arch("convnext", s, build, draw(sizes), batchnorm=False)


REGNET_WIDTHS = [
    (depth, w0, wa, wm, group_size)
    for depth, w0, wa, wm, group_size in itertools.product(
        range(4, 17), (8, 16), (4.0, 8.0), (1.5, 2.0), (4, 8)
    )
    if generate_regnet(wa, w0, wm, depth, group_size)[1] == 4
]
"""(depth, w0, wa, wm, group_size) whose width schedule has the four stages timm's RegNet requires."""


@st.composite
def regnets(draw) -> Arch:
    depth, w0, wa, wm, group_size = draw(st.sampled_from(REGNET_WIDTHS))
    s = {
        "depth": depth,
        "w0": w0,
        "wa": wa,
        "wm": wm,
        "group_size": group_size,
        "se_ratio": draw(st.sampled_from([0.0, 0.25])),
        "downsample": draw(st.sampled_from(["conv1x1", "avg"])),
        "preact": draw(st.booleans()),
        "act": draw(st.sampled_from(ACTIVATIONS)),
        "drop_path_rate": draw(drop_path),
    }

    def build() -> nn.Module:
        cfg = RegNetCfg(
            depth=s["depth"],
            w0=s["w0"],
            wa=s["wa"],
            wm=s["wm"],
            group_size=s["group_size"],
            se_ratio=s["se_ratio"],
            stem_width=8,
            downsample=s["downsample"],
            preact=s["preact"],
            act_layer=s["act"],
        )
        return RegNet(cfg, num_classes=5, drop_path_rate=s["drop_path_rate"], zero_init_last=False)

    return Arch("regnet", s, build, draw(sizes), batchnorm=True)


@st.composite
def mobilenets(draw) -> Arch:
    """MobileNetV2-style: a depthwise-separable block, then inverted-residual stages."""
    se = draw(st.booleans())
    c = draw(st.sampled_from([8, 16]))
    arch = [[f"ds_r1_k3_s1_c{c}"]]
    for _ in range(draw(st.integers(2, 4))):
        c += 8  # more channels than the stage before: each stage starts with a projection block
        d, k, stride, e = (
            draw(st.integers(1, 6)),
            draw(st.sampled_from([3, 5])),
            draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([1, 3, 6])),
        )
        arch.append([f"ir_r{d}_k{k}_s{stride}_e{e}_c{c}" + ("_se0.25" if se else "")])
    s = {
        "arch": arch,
        "stem_size": draw(st.sampled_from([8, 16])),
        "act": draw(st.sampled_from(ACTIVATIONS)),
        "drop_path_rate": draw(drop_path),
    }

    def build() -> nn.Module:
        return EfficientNet(
            decode_arch_def(arch),
            num_classes=5,
            num_features=32,
            stem_size=s["stem_size"],
            act_layer=_act(s["act"]),
            drop_path_rate=s["drop_path_rate"],
        )

    return Arch("mobilenet", s, build, draw(sizes), batchnorm=True)


FAMILIES = {
    "resnet": resnets(),
    "resnetv2": resnetv2s(),
    "byobnet": byobnets(),
    "convnext": convnexts(),
    "regnet": regnets(),
    "mobilenet": mobilenets(),
}
"""One strategy per family; each test runs per family so every family gets its share of examples."""

for _name, _total in EXAMPLES.items():
    settings.register_profile(
        _name,
        max_examples=math.ceil(_total / len(FAMILIES)),
        derandomize=_name != "full",  # the default and ci runs are the same examples every time
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


# --- the property -----------------------------------------------------------------------------------


def build_test_model(arch: Arch, seed: int = 0) -> nn.Module:
    """The architecture with random weights whose every branch does something, in fp64, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = arch.build()
        _randomize(model)
    return model.eval().to(torch.float64)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _checks_train_mode(arch: Arch) -> bool:
    """Train mode is compared where it can agree: no BatchNorm (folded), and DropPath to draw."""
    return not arch.batchnorm and arch.settings["drop_path_rate"] > 0


def _magnitude(error: float) -> str:
    return "0" if error == 0 else f"~1e{math.floor(math.log10(error))}"


def check_architecture(arch: Arch) -> dict[str, float]:
    """Both properties for one architecture; returns the measured relative errors.

    The runs found are read from the converted model (one stage per run, in graph order; a run that
    cannot be lifted is listed with its reason in ``not_lifted``), so each example traces once.
    """
    model = build_test_model(arch)
    shape = (2, 3, arch.size, arch.size)
    expected_runs = predicted_runs(arch.family, model)
    if not expected_runs:
        event(f"family {arch.family}, no identity block")
        with pytest.raises(NoResidualBlocksError, match="has no residual block odeify can turn into"):
            odeify.convert(model, input_size=shape)
        return {}
    converted = odeify.convert(model, input_size=shape)
    assert not converted.meta["odeify"]["not_lifted"], converted.meta["odeify"]["not_lifted"]
    assert [stage.depth for stage in odeify.converted_stages(converted)] == expected_runs
    event(f"family {arch.family}, {'train and eval' if _checks_train_mode(arch) else 'eval'} mode")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    errors = {}
    with torch.no_grad():
        errors["eval"] = _relative_error(converted(x), model(x))
        assert errors["eval"] <= RTOL, errors
        event(f"eval relative error {_magnitude(errors['eval'])}")
        if _checks_train_mode(arch):
            model.train()
            converted.train()
            torch.manual_seed(2)
            want = model(x)
            torch.manual_seed(2)
            errors["train"] = _relative_error(converted(x), want)
            assert errors["train"] <= RTOL, errors
    return errors


@pytest.mark.parametrize("family", list(FAMILIES))
@given(data=st.data())
@settings(settings.get_profile("default"))
def test_generated_architectures(family: str, data: st.DataObject) -> None:
    check_architecture(data.draw(FAMILIES[family], label="architecture"))


@pytest.mark.slow
@pytest.mark.skipif(PROFILE == "default", reason="set ODEIFY_HYPOTHESIS=ci (150 examples) or full (1000)")
@pytest.mark.parametrize("family", list(FAMILIES))
@given(data=st.data())
@settings(settings.get_profile(PROFILE))
def test_generated_architectures_sweep(family: str, data: st.DataObject) -> None:
    check_architecture(data.draw(FAMILIES[family], label="architecture"))
