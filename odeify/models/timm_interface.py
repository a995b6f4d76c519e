"""Converted models stay timm models: ``ConvertedModel`` keeps its source model's timm interface.

A converted model is a ``torch.fx.GraphModule`` (its code is the unrolled ODE graph). This subclass
adds what timm's tools ask a model for, answered from the source model:

- ``pretrained_cfg``/``default_cfg``, ``num_classes``, ``num_features``, ``feature_info``: so
  ``timm.data.resolve_model_data_config`` sees the real input size, mean/std and crop;
- ``get_classifier``/``reset_classifier``: the classifier is one real module (``model.fc``);
- ``forward_features``/``forward_head``: the graph cut where timm's ``forward_head`` starts;
- ``no_weight_decay``/``group_matcher``: a knot stack is grouped like the per-block tensors it came
  from (stacked biases stay out of weight decay; layer decay puts a stage's stack where its blocks were),
  so ``timm.optim.create_optimizer_v2`` (with ``layer_decay``) and ``timm.utils.ModelEmaV3`` work.

Everything lives in ``self.meta[META_TIMM]`` and node metadata, which ``copy.deepcopy`` (and so
``retarget``, ``set_backward``, ``ModelEmaV3``) carries along. :func:`adopt` makes one at convert time.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from timm.models._manipulate import group_with_matcher
from torch import nn

from odeify.core.errors import ConfigError, OdeifyError
from odeify.passes.head import head_input, head_nodes
from odeify.passes.segments import without_segments

__all__ = ["META_TIMM", "ConvertedModel", "adopt", "default_input_size"]

META_TIMM = "odeify_timm"  # GraphModule.meta key of the source model's timm interface (plain data)
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its code, its sub-graph views)


def default_input_size(model: nn.Module) -> tuple[int, int, int, int]:
    """(1, C, H, W) from timm's ``pretrained_cfg["input_size"]``, else (1, 3, 224, 224).

    C follows ``model.in_chans`` where timm records it, since ``in_chans=1`` does not update the cfg.
    """
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, Mapping) else None
    if not (isinstance(size, (tuple, list)) and len(size) == 3):
        size = (3, 224, 224)
    chans = getattr(model, "in_chans", None)
    c = chans if isinstance(chans, int) and chans > 0 else size[0]
    return (1, int(c), int(size[1]), int(size[2]))


class ConvertedModel(fx.GraphModule):
    """The output of ``odeify.convert``: an fx GraphModule that answers timm's model interface."""

    # --- timm's attributes -------------------------------------------------------------------------

    @property
    def _timm(self) -> dict[str, Any]:
        return self.meta.setdefault(META_TIMM, {})

    @property
    def pretrained_cfg(self) -> dict[str, Any]:
        """The source model's pretrained config (input size, mean/std, crop, classifier name, ...)."""
        return self._timm.setdefault("pretrained_cfg", {})

    @pretrained_cfg.setter
    def pretrained_cfg(self, value: Mapping[str, Any]) -> None:
        self._timm["pretrained_cfg"] = dict(value)

    default_cfg = pretrained_cfg  # timm's older name for the same dict

    @property
    def num_classes(self) -> int:
        return self._timm.get("num_classes", 0)

    @property
    def num_features(self) -> int | None:
        return self._timm.get("num_features")

    @property
    def head_hidden_size(self) -> int | None:
        return self._timm.get("head_hidden_size", self.num_features)

    @property
    def feature_info(self) -> list[dict[str, Any]]:
        """The source's feature_info (channels, reduction; ``module`` names refer to the source model)."""
        return self._timm.get("feature_info", [])

    # --- classifier --------------------------------------------------------------------------------

    def get_classifier(self) -> nn.Module:
        """The classifier module (``model.fc`` for ResNets), with the converted model's parameters."""
        return self.get_submodule(self._classifier_name())

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replace the classifier with a fresh ``nn.Linear(num_features, num_classes)`` (Identity for 0)."""
        name = self._classifier_name()
        if not self._timm.get("classifier_is_call"):
            raise OdeifyError(
                "reset_classifier: this model's head is not a single classifier call odeify can swap; "
                "reset the classifier of the source model and convert it again."
            )
        if global_pool is not None and global_pool != self._timm.get("global_pool"):
            raise OdeifyError(
                f"reset_classifier: changing the pooling ({self._timm.get('global_pool')!r} -> "
                f"{global_pool!r}) changes the graph; call source.reset_classifier(n, global_pool=...) and "
                "convert again."
            )
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise OdeifyError(f"reset_classifier: num_classes must be an integer >= 0, not {num_classes!r}")
        like = next(self.get_classifier().parameters(), None)
        like = like if like is not None else next(self.parameters())
        if num_classes > 0:
            new: nn.Module = nn.Linear(self.num_features, num_classes, device=like.device, dtype=like.dtype)
        else:
            new = nn.Identity()
        self.set_submodule(name, new)
        self._timm["num_classes"] = num_classes

    def _classifier_name(self) -> str:
        name = self._timm.get("classifier")
        if not isinstance(name, str):
            raise OdeifyError(
                "this converted model has no single named classifier (pretrained_cfg['classifier'])"
            )
        return name

    # --- features / head split ---------------------------------------------------------------------

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The converted graph up to where the source's ``forward_head`` starts."""
        return self._views()["features"](x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The source's ``forward_head`` on features ``x`` (pooled features with ``pre_logits=True``)."""
        return self._views()["pre_logits" if pre_logits else "head"](x)

    def _views(self) -> dict[str, fx.GraphModule]:
        """Sub-graph modules sharing this model's parameters, rebuilt when the graph changes."""
        cached = _VIEWS.get(self)
        if cached is not None and cached[0] is self._code:
            return cached[1]
        views = _head_views(self)
        _VIEWS[self] = (self._code, views)
        return views

    # --- optimizer grouping ------------------------------------------------------------------------

    def no_weight_decay(self) -> set[str]:
        """Parameters timm must not decay: the source's, plus every knot stack of 1-D per-block tensors.

        timm leaves tensors with ``ndim <= 1`` (biases, norm scales) out of weight decay; stacked over
        knots they are 2-D, so they are named here.
        """
        source_names = set(self._timm.get("no_weight_decay", []))
        names = source_names & {name for name, _ in self.named_parameters()}
        for attr, scopes in self._timm.get("stage_blocks", {}).items():
            for slot, knots in self.get_submodule(attr).knots.items():
                from_source = any(  # e.g. 'layer1.0.gamma' -> slot 'gamma' of its stage
                    n.startswith(f"{scope}.") and n[len(scope) + 1 :].replace(".", "_") == slot
                    for n in source_names
                    for scope in scopes
                )
                if knots.ndim <= 2 or from_source:
                    names.add(f"{attr}.knots.{slot}")
        return names

    @property
    def group_matcher(self) -> Callable[[bool], Callable[[str], int]]:
        """``group_matcher(coarse)``: timm's parameter grouping of the source, read through the knot stacks.

        A knot stack is grouped with the blocks it came from. Under layer decay each stage's stack
        counts as one layer, placed where its blocks were; everything else keeps the source's order.
        (A property so that ``hasattr`` is False, and timm falls back, when the source had none.)
        """
        matchers = self._timm.get("group_matcher")
        if not matchers:
            raise AttributeError("group_matcher: the source model defines none")

        def group_matcher(coarse: bool = False) -> Callable[[str], int]:
            origin = {name: self._source_name(name) for name, _ in self.named_parameters()}
            layer_of = group_with_matcher(
                ((n, n) for n in sorted(set(origin.values()))),
                matchers["coarse" if coarse else "fine"],
                reverse=True,
            )
            last = max(layer_of.values(), default=0) + 1
            return lambda name: layer_of.get(origin.get(name, ""), last)

        return group_matcher

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's switch for activation checkpointing. A converted model's equivalent is a backward
        mode, which re-emits its graph (a compiler job, so it is asked for by name): this accepts
        what the model already does and otherwise names the call that does it."""
        modes = {getattr(m, "backward", None) for m in self.modules() if hasattr(m, "adjoint_stats")}
        segmented = any(type(m).__name__ == "Segment" for m in self.modules())
        if modes == ({"checkpoint"} if enable else {"backprop"}) and segmented == enable:
            return
        raise ConfigError(
            f"set_grad_checkpointing({enable}): a converted model checkpoints by its backward mode. "
            + (
                "Call odeify.set_backward(model, 'checkpoint') (exact: each step's state and each part "
                "between the stages is recomputed in backward), or a memory-free mode ('reverse', or "
                "'reversible' for reversible_heun stages)."
                if enable
                else "Call odeify.set_backward(model, 'backprop') (autograd stores everything)."
            )
        )

    def __reduce__(self):
        """Pickle (``torch.save(model)``) as fx pickles a GraphModule, then unpickle as a ConvertedModel
        again, with its timm interface (fx would rebuild a plain GraphModule)."""
        rebuild, args = super().__reduce__()
        return (_as_converted, (rebuild, args, self.meta))

    def __prepare_scriptable__(self) -> ConvertedModel:
        """torch.jit.script calls this first: a converted model's stages run Python that TorchScript
        cannot compile (exact Fraction times, per-step graphs made on demand), so refuse, naming what
        records the same computation instead."""
        raise ConfigError(
            "torch.jit.script cannot compile a converted model: its ODE stages build their step graphs "
            "in Python (exact times, graphs made on demand). Record it instead, in eval mode: "
            "torch.jit.trace(model.eval(), example) or torch.export.export(model.eval(), (example,))."
        )

    def _source_name(self, name: str) -> str:
        """The source-model parameter name a converted parameter stands for (a stage's first block)."""
        for attr, scopes in self._timm.get("stage_blocks", {}).items():
            if name.startswith(f"{attr}.") and scopes:
                rest = name[len(attr) + 1 :]
                return f"{scopes[0]}.{rest.removeprefix('knots.')}"
        return name


# ---------------------------------------------------------------------------------------------------
# Making one at convert time


def adopt(gm: fx.GraphModule, source: nn.Module, stage_blocks: Mapping[str, list[str]]) -> ConvertedModel:
    """Make ``gm`` (a converted graph of ``source``) a ConvertedModel in place, recording timm's interface.

    ``stage_blocks`` maps each ODEStage attribute to the source block names of its run. Where the
    head starts is marked by the ``mark_head`` pass (``odeify.passes.head``), which the convert
    pipeline runs next; its result goes in ``record["classifier_is_call"]``.
    """
    cfg = getattr(source, "pretrained_cfg", None) or getattr(source, "default_cfg", None) or {}
    record: dict[str, Any] = {
        "pretrained_cfg": copy.deepcopy(dict(cfg)),
        "num_classes": getattr(source, "num_classes", 0),
        "num_features": getattr(source, "num_features", None),
        "head_hidden_size": getattr(source, "head_hidden_size", getattr(source, "num_features", None)),
        "feature_info": copy.deepcopy(list(getattr(source, "feature_info", []) or [])),
        "classifier": cfg.get("classifier") if isinstance(cfg.get("classifier"), str) else None,
        "global_pool": _pool_type(source),
        "no_weight_decay": sorted(_call_or(source, "no_weight_decay", set())),
        "group_matcher": _matchers(source),
        "stage_blocks": {k: list(v) for k, v in stage_blocks.items()},
        "classifier_is_call": False,
    }
    gm = _converted_class(gm)
    gm.meta[META_TIMM] = record
    return gm


def _converted_class(gm: fx.GraphModule) -> ConvertedModel:
    """``gm`` made a ConvertedModel in place: fx's per-instance class (as GraphModule.__new__ makes
    one), derived from ConvertedModel."""
    impl = type("GraphModuleImpl", (ConvertedModel,), {})
    impl.__name__ = type(gm).__name__
    gm.__class__ = impl
    return gm  # type: ignore[return-value]


def _as_converted(rebuild: Callable[..., fx.GraphModule], args: tuple, meta: dict) -> ConvertedModel:
    """Unpickling a ConvertedModel: fx's rebuild of the GraphModule, its ``meta`` (the conversion
    record and the timm interface; fx's rebuild starts a new one), then its class, onto which its
    code is compiled."""
    gm = _converted_class(rebuild(*args))
    gm.meta = meta
    gm.recompile()
    return gm


def _call_or(source: nn.Module, method: str, default: Any) -> Any:
    fn = getattr(source, method, None)
    return fn() if callable(fn) else default


def _pool_type(source: nn.Module) -> str | None:
    pool = getattr(source, "global_pool", None) or getattr(getattr(source, "head", None), "global_pool", None)
    kind = getattr(pool, "pool_type", pool)
    return kind if isinstance(kind, str) else None


def _matchers(source: nn.Module) -> dict[str, Any] | None:
    """The source's group_matcher(coarse) for both settings, when it is data (regex dicts), else None."""
    fn = getattr(source, "group_matcher", None)
    if not callable(fn):
        return None
    found = {"coarse": fn(coarse=True), "fine": fn(coarse=False)}
    return found if all(isinstance(m, Mapping) for m in found.values()) else None


def _head_views(model: ConvertedModel) -> dict[str, fx.GraphModule]:
    """Sub-GraphModules of ``model``: features (input -> head input), head, and head up to pre-logits.

    A model whose parts between stages are checkpointed segments (a whole-model backward mode) is
    cut in its inlined graph: the views compute the same values, without the segments' recompute.
    """
    gm = without_segments(model)  # shares the model's modules
    head = head_nodes(gm)
    if not head:
        raise OdeifyError(
            "forward_features/forward_head: odeify could not find where this model's forward_head starts "
            "(its head traced alone differs from the end of the model's graph). Use model(x)."
        )
    features = head_input(head)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    last = output.args[0]
    calls = [n for n in head if n.op == "call_module" and n.target == model._timm.get("classifier")]
    views = {"features": _view(gm, None, features), "head": _view(gm, features, last)}
    if calls and model._timm.get("classifier_is_call"):
        views["pre_logits"] = _view(gm, features, calls[-1].args[0])
    else:
        views["pre_logits"] = _unsupported(
            "forward_head(pre_logits=True): this head has no single classifier call"
        )
    return views


def _view(gm: fx.GraphModule, start: fx.Node | None, end: fx.Node) -> fx.GraphModule:
    """A GraphModule computing ``end`` from ``start`` (or from the model input), sharing gm's modules."""
    needed: set[fx.Node] = set()
    stack = [end]
    while stack:
        node = stack.pop()
        if node in needed or node is start:
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if start is not None:
        env[start] = graph.placeholder("x")
    for node in gm.graph.nodes:
        if node in needed:
            if node.op == "placeholder" and start is not None:
                raise OdeifyError("forward_head: the head reads the model input as well as the features")
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[end])
    return fx.GraphModule(gm, graph, type(gm).__name__)


def _unsupported(message: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def fail(x: torch.Tensor) -> torch.Tensor:
        raise OdeifyError(message)

    return fail  # type: ignore[return-value]
