"""Resource estimates checked before odeify builds anything large, so a request fails at once.

A manifestation's cost is known before any graph is written or tensor allocated: the number of
fx nodes of an unrolled stage, the bytes of its knots, the exact-arithmetic work of a least-squares
refit. So is every size that comes from a file or an argument: the parameters of a model built by
name (estimated on the meta device first), the bytes of an example input or of a data split held
in memory. Each check compares the estimate with a limit and, past it, raises a ConfigError that
says what was asked, the estimate, the limit, and the environment variable that raises it.
"""

from __future__ import annotations

import os

from odeify.core.errors import ConfigError

__all__ = [
    "check_fit_work",
    "check_graph_nodes",
    "check_input_bytes",
    "check_knot_bytes",
    "check_model_bytes",
    "check_probe_bytes",
    "limit",
]

LIMITS = {
    # fx nodes of one stage's unrolled graph: ~1e6 nodes take about a minute to write and compile
    "ODEIFY_MAX_GRAPH_NODES": 1_000_000,
    # bytes of one stage's knot tensors (default: half of this machine's memory, set at first use)
    "ODEIFY_MAX_KNOT_BYTES": 0,
    # K^2 * L exact Fraction operations of a least-squares fit (x16 for the cubic basis): ~10 s at 4e6
    "ODEIFY_MAX_FIT_WORK": 64_000_000,
    # parameters and buffers of a model built from a name, a file's settings or an argument (num_classes,
    # in_chans, ...): a billion float32 numbers; the largest timm ResNet-family models hold under a quarter
    "ODEIFY_MAX_MODEL_BYTES": 4 * 2**30,
    # input data held at once: an example batch (tracing, --verify, the load-time probe) or a data split
    # kept in memory (the digits set at the model's input size); 64 x 3 x 1024 x 1024 float32 is 0.75 GiB;
    # and what the probe's float64 forward holds at once (resnet50 at 224: 0.07 GiB, at 1024: 0.49 GiB)
    "ODEIFY_MAX_INPUT_BYTES": 2**30,
}
_IN_BYTES = {"ODEIFY_MAX_KNOT_BYTES", "ODEIFY_MAX_MODEL_BYTES", "ODEIFY_MAX_INPUT_BYTES"}
PROBE_WEIGHTS_FACTOR = 4
"""A probe may hold this many times its model's weights in float64 (the copy it computes with) at once,
where that is above the input limit. The weights are tensors the file carries, so a file cannot raise
its own bound without being as large. qwen3_vit_88m at its 768x768 holds 1.7 GiB, 2.6x its 0.65 GiB
of float64 weights; a recipe asking the digits model (0.7 MiB of float64 weights) for a 4096x4096
input (3.1 GiB) stays refused."""


def limit(name: str) -> int:
    """The limit ``name``: the environment variable if set (a positive integer), else the default."""
    text = os.environ.get(name)
    if text is not None:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"the environment variable {name} must be a positive integer; got {text!r}.")
        return value
    if name == "ODEIFY_MAX_KNOT_BYTES":
        return _physical_memory() // 2
    return LIMITS[name]


def check_graph_nodes(stage: str, steps: int, evaluations_per_step: int, nodes_per_evaluation: int) -> None:
    """Refuse a manifestation whose unrolled graph would exceed the node limit."""
    estimate = steps * evaluations_per_step * (nodes_per_evaluation + 2)
    _refuse_above(
        "ODEIFY_MAX_GRAPH_NODES",
        estimate,
        f"stage '{stage}' with {steps} steps x {evaluations_per_step} field evaluations per step would "
        f"unroll into about {estimate:,} graph nodes",
        "use fewer steps",
    )


def check_knot_bytes(stage: str, knots: int, bytes_per_knot: int) -> None:
    """Refuse a knot count whose stacked tensors would exceed the memory limit."""
    estimate = knots * bytes_per_knot
    _refuse_above(
        "ODEIFY_MAX_KNOT_BYTES",
        estimate,
        f"stage '{stage}' with {knots} knots would hold {_gib(estimate)} of knot tensors",
        "use fewer knots",
    )


def check_fit_work(stage: str, knots: int, samples: int, basis: str) -> None:
    """Refuse a least-squares refit (knots < samples) whose exact arithmetic would take too long."""
    if knots >= samples:
        return  # refinement evaluates the spline: cheap
    estimate = knots * knots * samples * (16 if basis == "cubic" else 1)
    _refuse_above(
        "ODEIFY_MAX_FIT_WORK",
        estimate,
        f"fitting {knots} '{basis}' knots to {samples} samples in stage '{stage}' takes about {estimate:,} "
        "exact operations",
        "fit fewer knots, or use the linear or constant basis",
    )


def check_model_bytes(what: str, nbytes: int) -> None:
    """Refuse building a model whose parameters and buffers would exceed the memory limit."""
    _refuse_above(
        "ODEIFY_MAX_MODEL_BYTES",
        nbytes,
        f"{what} would hold {_gib(nbytes)} of parameters and buffers",
        "ask for a smaller model (fewer classes, channels or blocks)",
    )


def check_input_bytes(
    what: str, shape: tuple[int, ...], itemsize: int, fix: str = "use a smaller input size"
) -> None:
    """Refuse input data of ``shape`` (``itemsize`` bytes per element) over the input limit (``fix``
    says how to ask for less).

    ``shape`` may come straight from a file or the command line: its product is computed exactly
    (Python integers), never allocated.
    """
    count = 1
    for size in shape:
        count *= size
    _refuse_above(
        "ODEIFY_MAX_INPUT_BYTES",
        count * itemsize,
        f"{what} of shape {list(shape)} would hold {_gib(count * itemsize)}",
        fix,
    )


def check_probe_bytes(what: str, nbytes: int, weight_bytes: int) -> None:
    """Refuse a probe (a saved model's float64 forward on its recorded input size) that would hold
    ``nbytes`` at once: the size comes from a file, and the activations grow with it.

    The limit is the input limit or :data:`PROBE_WEIGHTS_FACTOR` x ``weight_bytes`` (the float64 bytes
    of the tensors the model's file carries), whichever is larger: a model whose own forward at its
    size is in proportion to its weights saves and loads, while a few bytes of recipe asking a small
    model for a huge input are still refused before anything is allocated.
    """
    by_weights = PROBE_WEIGHTS_FACTOR * weight_bytes
    _refuse_above(
        "ODEIFY_MAX_INPUT_BYTES",
        nbytes,
        f"{what} would hold {_gib(nbytes)} at once",
        "convert at a smaller input size (input_size=, --input-size)",
        floor=by_weights,
        why=f" ({PROBE_WEIGHTS_FACTOR}x the {_gib(weight_bytes)} of its weights in float64, or the input "
        "limit if larger)",
    )


def _refuse_above(name: str, estimate: int, what: str, fix: str, floor: int = 0, why: str = "") -> None:
    """Refuse ``estimate`` over the limit ``name`` (or over ``floor``, if larger; ``why`` says how the
    limit was set)."""
    bound = max(limit(name), floor)
    if estimate > bound:
        shown = _gib(bound) if name in _IN_BYTES else f"{bound:,}"
        raise ConfigError(
            f"{what}, over the limit of {shown}{why}. To proceed anyway, {fix}, or raise the limit with the "
            f"environment variable {name}."
        )


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a modest machine
        return 16 * 2**30


def _gib(n: int) -> str:
    if n >= 2**70:  # an estimate from a hostile size: its order of magnitude, never a float overflow
        return f"about 1e{len(str(n)) - 1} bytes"
    return f"{n / 2**30:.1f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"
