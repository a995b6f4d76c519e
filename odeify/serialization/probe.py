"""The probe: a saved model proves at load time that it computes what was saved.

A file's tensors can fit the model its recipe rebuilds while the rebuilt model computes something
else (a build kwarg that changes the activation or the pooling, a stage entry missing from the
recipe). So ``save`` runs the model on a fixed seeded input of the recorded input size (batch 1)
and records, for each stage in graph order and for the whole model's output, a subsample of what
it computed; a model that keeps its source's tensors (:mod:`odeify.ir.source_tensors`: compressed,
refined or fine-tuned) records its source network's output too, the teacher fine-tuning distills
from, which the model's own forward never reads. ``load`` runs the rebuilt model in float64 on the
same input and compares: every probe point must lie within :data:`FACTOR` times the round-off of
the rebuilt model, measured at load, and the first point past it is named. Each float64 run casts
each weight where it is used (:mod:`odeify.serialization.cast_run`), never the whole model at once.

The allowance is never read from the file: a file that could name its own allowance could switch
its check off. Each recorded point still carries the round-off the saving machine measured (format
versions 2 and 3), which a refusal shows beside the allowance; nothing else reads it. A rebuilt
model whose own round-off is not finite (a weight so large that float32 overflows) is refused.

Why against float64: the same file loaded on another CPU computes with other kernels, whose float32
results differ from the saving machine's by float32 round-off of the whole model, which depends on
the CPU and on the model's conditioning. Both machines' float32 results lie within their measured
round-off of the float64 result, so the check holds on any CPU without a fixed tiny constant.
A float64 model has no wider reference: its round-off is estimated as its float32 copy's, scaled by
the ratio of the two dtypes' unit round-offs.

The input size comes from the file, so what the probe would hold is bounded before anything is
allocated: a run on the meta device (shapes only) counts the bytes its float64 forward holds at once,
which must fit the input budget or a few times the model's own weights in float64, whichever is larger
(:func:`odeify.core.budget.check_probe_bytes`; the count is within 6% of the measured peak on the
digits model at 1024 and 2048 pixels and resnet50 at 512 and 1024). A recipe asking the digits model
for a 4096x4096 input (3.1 GiB) is refused in 0.4 s, where the probe took 38 s and 4 GB; a model whose
forward at its size is in proportion to its weights (qwen3_vit_88m at 768x768: 1.7 GiB, 2.6x its
float64 weights) saves and loads.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from odeify.compiler.conversion import converted_stages
from odeify.compiler.record import META
from odeify.compiler.source_network import source_network, unknown_source
from odeify.core.budget import check_probe_bytes
from odeify.core.dtypes import model_dtype
from odeify.core.errors import ConfigError, ModelLoadError
from odeify.ir.meta import node_tag
from odeify.ir.source_tensors import SOURCE_PREFIX
from odeify.serialization.cast_run import CastRun
from odeify.serialization.file_schema import PROBE_OUTPUT, PROBE_SOURCE

__all__ = ["FACTOR", "PROBE_PREFIX", "PROBE_SEED", "check_probe", "record_probe"]

PROBE_SEED = 0
PROBE_PREFIX = "@probe/"  # tensor names of the probe values in the file ('@' is in no parameter name)
PROBE_VALUES = 4096  # at most this many values per point, evenly strided over the flattened output
ULPS_FLOOR = 8  # a point's round-off is taken as at least 8 ulps of its dtype at its largest value
FACTOR = 4.0
"""A loaded model's float64 probe may be FACTOR x its own measured round-off from the saved values.

In theory the distance is at most the saving machine's round-off plus float64's, about 1x. Measured
on AMD EPYC, loading with another convolution implementation than the one that saved (oneDNN off,
as another CPU's kernels would be): at most 1.0x on the digits model, resnet18 and resnet50 at
64x64, while their float32 results differ from the saved ones by up to 2.8e-3 (resnet50 layer4).
FACTOR leaves room for the estimated round-off of float64 models. A changed function (another
activation, pooling, depth, integrator or step count) is 1.7e4x to 1.3e5x past the allowance on the
digits model (tests/test_probe.py, tests/hostile_files.py)."""


def record_probe(model: nn.Module) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """The probe record (seed, points with their round-off) and its tensors, of a converted model.

    None when the model has nothing to probe (no stage output and no tensor output in its graph).
    """
    values, errors = _measure(model)
    if not values:
        return None, {}
    points = [[name, errors[name]] for name in values]
    tensors = {PROBE_PREFIX + name: value.contiguous() for name, value in values.items()}
    return {"seed": PROBE_SEED, "points": points}, tensors


def check_probe(
    model: nn.Module, record: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str
) -> None:
    """Refuse a loaded ``model`` whose probe is past round-off from the saved one; name the first point.

    The points must be those the rebuilt model has (a point left out would go unchecked), and the
    allowance is the rebuilt model's own round-off: finite, and never read from the file.
    """
    try:
        values, errors = _measure(model, seed=record["seed"], reference=True)
    except ConfigError as exc:  # over a budget: the file asks for it
        raise ModelLoadError(f"{where}: {exc}") from None
    _check_points([name for name, _ in record["points"]], list(values), where)
    for name, saved_error in record["points"]:
        value, mine = tensors.get(PROBE_PREFIX + name), values[name]
        if value is None or value.shape != mine.shape or value.dtype != model_dtype(model):
            raise ModelLoadError(
                f"{where}: the saved probe of {_label(name)} does not fit the model its recipe rebuilds "
                f"(saved {None if value is None else (tuple(value.shape), value.dtype)}, rebuilt "
                f"{(tuple(mine.shape), model_dtype(model))}); the file is damaged or was altered"
            )
        allowed = FACTOR * errors[name]
        if not math.isfinite(allowed):
            raise ModelLoadError(
                f"{where}: the rebuilt model's own {model_dtype(model)} round-off at {_label(name)} is "
                f"{allowed / FACTOR:.3g}: its tensors hold values so large that it overflows, so no probe "
                "can check it. The file is damaged or was altered; convert the source again."
            )
        distance = _distance(value, mine)
        if not distance <= allowed:  # NaN fails too
            raise ModelLoadError(
                f"{where}: the rebuilt model does not compute what was saved: at {_label(name)} its output "
                f"is {distance:.3g} from the saved one, over the {allowed:.3g} that round-off allows "
                f"(measured on the rebuilt model; the file says {saved_error:.3g} was measured when saving; "
                "the first difference is there or before it). The recipe or the tensors were altered, or "
                "this odeify, torch or timm builds the architecture differently; convert the source again."
            )


def _check_points(recorded: list[str], rebuilt: list[str], where: str) -> None:
    """The file's probe points are the rebuilt model's, in order; a missing source point is named."""
    if recorded == rebuilt:
        return
    if PROBE_SOURCE in rebuilt and PROBE_SOURCE not in recorded:
        raise ModelLoadError(
            f"{where}: the file keeps its source network's tensors ({SOURCE_PREFIX}*, the teacher "
            "fine-tuning distills from) but its probe does not check them: it was saved by an older "
            "odeify (format 2) or altered. If you trust the file, load it unchecked with "
            "odeify.load(path, verify=False) (CLI: --no-verify) and save it again to record a full probe."
        )
    raise ModelLoadError(
        f"{where}: its probe checks {', '.join(map(_label, recorded))}, but the model its recipe rebuilds "
        f"has {', '.join(map(_label, rebuilt))}; the file is damaged or was altered"
    )


def _label(name: str) -> str:
    labels = {PROBE_OUTPUT: "the model's output", PROBE_SOURCE: "the source network's output"}
    return labels.get(name, f"stage {name!r}")


def _measure(
    model: nn.Module, seed: int = PROBE_SEED, reference: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Each point's values at ``model``'s dtype (float64 with ``reference``) and its measured round-off:
    the model's stages and output, then its source network's output where it keeps one."""
    values, errors = _measure_network(model, seed, reference)
    teacher = _source_network(model)
    if teacher is not None:
        more, more_errors = _measure_network(teacher, seed, reference)
        values[PROBE_SOURCE], errors[PROBE_SOURCE] = more[PROBE_OUTPUT], more_errors[PROBE_OUTPUT]
    return values, errors


def _source_network(model: nn.Module) -> fx.GraphModule | None:
    """The network ``model``'s kept source tensors compute (on the CPU); None when it keeps none,
    or too few to run it (then fine-tuning has no teacher from it either)."""
    kept = any(name.rpartition(".")[2].startswith(SOURCE_PREFIX) for name, _ in model.named_buffers())
    if not kept or unknown_source(model) is not None:  # type: ignore[arg-type]
        return None
    return source_network(_on_cpu(model))


def _measure_network(
    model: nn.Module, seed: int, reference: bool
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """:func:`_measure` of ``model``'s own stages and output."""
    dtype = model_dtype(model)
    shape = (1, *model.meta[META]["input_shape"][1:])
    size = "x".join(map(str, shape[1:]))
    check_probe_bytes(
        f"the probe, on one {size} input (the size the model records),",
        _peak_bytes(model, shape),
        _float64_weight_bytes(model),
    )
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    twin = _on_cpu(model)
    own = _points(twin, x)
    exact = _points(twin, x.double(), torch.float64)
    if dtype == torch.float64:  # no wider reference: float32's round-off, scaled to float64's unit round-off
        low = _points(twin, x.float(), torch.float32)
        scale = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
        errors = {k: scale * _distance(low[k], exact[k]) for k in exact}
    else:
        errors = {k: _distance(own[k], exact[k]) for k in exact}
    floor = {k: ULPS_FLOOR * torch.finfo(dtype).eps * float(exact[k].abs().max()) for k in exact}
    errors = {k: max(errors[k], floor[k]) for k in exact}
    return (exact if reference else own), errors


def _peak_bytes(model: nn.Module, shape: tuple[int, ...]) -> int:
    """The most bytes a float64 forward of ``model`` on an input of ``shape`` holds at once, found by
    running a copy on the meta device (shapes only: nothing is allocated).

    Counted: every tensor from when an operation makes it until its last reference goes (views of one
    storage once), plus, during a convolution, its input unfolded into columns, as the CPU's float64
    convolution does (for the digits model at 4096x4096 that workspace is twice the activations).
    """
    memo: dict[int, Any] = {
        id(p): nn.Parameter(p.to("meta", torch.float64), False) for p in model.parameters()
    }
    memo.update(
        {id(b): b.to("meta", torch.float64 if b.is_floating_point() else b.dtype) for b in model.buffers()}
    )
    twin = copy.deepcopy(model, memo).eval()
    held: dict[int, list[int]] = {}  # storage -> [its tensors alive, its bytes]
    total, peak = [0], [0]

    def release(key: int) -> None:
        held[key][0] -= 1
        if held[key][0] == 0:
            total[0] -= held.pop(key)[1]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for tensor in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
                storage = tensor.untyped_storage()
                if storage._cdata not in held:
                    held[storage._cdata] = [0, storage.nbytes()]
                    total[0] += storage.nbytes()
                held[storage._cdata][0] += 1
                weakref.finalize(tensor, release, storage._cdata)
            workspace = _unfolded_bytes(args) if func is torch.ops.aten.convolution.default else 0
            peak[0] = max(peak[0], total[0] + workspace)
            return out

    with torch.no_grad(), Count():
        twin(torch.empty(shape, dtype=torch.float64, device="meta"))
    return peak[0]


def _float64_weight_bytes(model: nn.Module) -> int:
    """The bytes of the tensors ``model``'s file carries (its state dict, each tensor once), in float64
    where they are floating: what a float64 copy of them would hold."""
    tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}.values()
    return sum(t.numel() * (8 if t.is_floating_point() else t.element_size()) for t in tensors)


def _unfolded_bytes(args: tuple) -> int:
    """The bytes of a convolution's input unfolded into columns (one per output position and kernel
    entry): the workspace of the CPU's float64 convolution; none for a 1x1 kernel."""
    x, weight = args[0], args[1]
    kernel = math.prod(weight.shape[2:])
    if kernel == 1:
        return 0
    stride, padding, dilation = args[3], args[4], args[5]
    positions = 1
    for size, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation, strict=False):
        positions *= (size + 2 * p - d * (k - 1) - 1) // s + 1
    return x.shape[0] * weight.shape[1] * kernel * positions * x.element_size()


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _on_cpu(model: nn.Module) -> fx.GraphModule:
    """An eval-mode copy of ``model`` on the CPU, so the probe never changes the caller's.

    Each parameter and buffer goes straight to the CPU: a model training on a GPU is never duplicated
    on the GPU, whose memory it may fill. A CPU tensor is shared: the probe only reads it.
    """
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(param.detach().cpu(), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().cpu()
    return copy.deepcopy(model, memo).cpu().eval()


@torch.no_grad()
def _points(
    model: fx.GraphModule, x: torch.Tensor, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The subsampled output of each stage (graph order) and of the model, on input ``x``, computed
    as a copy of ``model`` in ``dtype`` would (None: ``model`` as it is), without the copy: the
    whole model's weights in float64 beside the model were the peak of save and load
    (:mod:`odeify.serialization.cast_run`)."""
    watched = _stage_outputs(model)
    found: dict[str, torch.Tensor] = {}

    class Recorder(CastRun):
        def run_node(self, node: fx.Node) -> Any:
            result = super().run_node(node)
            if node in watched and isinstance(result, torch.Tensor):
                found[watched[node]] = _subsample(result)
            return result

    out = Recorder(model, dtype).run(x)
    if isinstance(out, torch.Tensor):
        found[PROBE_OUTPUT] = _subsample(out)
    return found


def _stage_outputs(model: fx.GraphModule) -> dict[fx.Node, str]:
    """Each stage's output node in ``model``'s graph: its call, or the last node of its inlined steps."""
    names = {stage.stage_name for stage in converted_stages(model)}
    members: dict[str, list[fx.Node]] = {}
    for node in model.graph.nodes:
        stage = node_tag(node).stage
        if stage in names:
            members.setdefault(stage, []).append(node)
    outputs = {}
    for stage, nodes in members.items():
        inside = set(nodes)
        leaving = [n for n in nodes if any(user not in inside for user in n.users)]
        if leaving:
            outputs[leaving[-1]] = stage
    return outputs


def _subsample(tensor: torch.Tensor) -> torch.Tensor:
    """At most PROBE_VALUES entries of ``tensor``, evenly strided over its flattened values."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= PROBE_VALUES:
        return flat.clone()
    index = torch.linspace(0, flat.numel() - 1, PROBE_VALUES, dtype=torch.float64).round().long()
    return flat[index].clone()
