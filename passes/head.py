"""Mark where timm's ``forward_head`` starts in a converted graph, and make its classifier one call.

timm models split into ``forward_features`` and ``forward_head``; a converted model is one fx graph,
so the split has to be found in it. :func:`mark_head` traces ``source.forward_head`` alone and
matches its operations against the tail of the model's graph; the matching nodes are tagged
(``NodeTag.head``), so ``ConvertedModel.forward_features``/``forward_head`` find the cut after any
retarget. When the head ends in the classifier as a plain ``F.linear`` over its weights (or an
``nn.Identity``), those nodes become one ``call_module`` of a real classifier module, which
``reset_classifier`` can then replace. A head that cannot be traced alone, or does not match, is
left unmarked: the rest of the timm interface keeps working and the cut says so when asked for.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.fx as fx
from torch import nn

from odeify.core.errors import OdeifyError
from odeify.ir.meta import node_tag, tag
from odeify.passes.contract import PassResult, graph_pass, transformation
from odeify.passes.properties import STAGE_CALLS
from odeify.passes.tracing import trace

__all__ = ["MARK_HEAD", "head_input", "head_nodes", "mark_head"]

MARK_HEAD = transformation(  # the classifier's F.linear becomes the same Linear module's call
    "mark_head",
    requires={STAGE_CALLS},  # the head as traced: before lowering writes the stages out
)


@graph_pass(MARK_HEAD)
def mark_head(gm: fx.GraphModule, source: nn.Module, classifier: str) -> PassResult:
    """Tag the graph's tail that is ``source.forward_head``; make its classifier one module call.

    The result's ``value``: whether the classifier is now a single ``call_module`` (so
    reset_classifier can swap it). A head that does not match leaves ``gm`` unmodified.
    """
    found = _traced_head(source)
    if found is None:
        return PassResult(gm, modified=False, value=False)
    head, pre = found
    body = _compute_nodes(gm.graph)
    tail = body[-len(head) :] if head else []
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    matches = bool(head) and [_op(n, "source.") for n in head] == [_op(n) for n in tail]
    if not matches or output.args[0] is not tail[-1]:
        return PassResult(gm, modified=False, value=False)
    for node in tail:
        tag(node, head=True)
    is_prefix = [_op(n, "source.") for n in pre] == [_op(n) for n in tail[: len(pre)]]
    return PassResult(gm, True, is_prefix and _classifier_as_call(gm, source, classifier, tail, len(pre)))


def head_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes :func:`mark_head` tagged as timm's ``forward_head``, in graph order."""
    return [n for n in gm.graph.nodes if node_tag(n).head]


def head_input(nodes: Iterable[fx.Node]) -> fx.Node:
    """The one node outside ``nodes`` (not a parameter) that they read: the features."""
    inside = set(nodes)
    found = {a for n in inside for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
    if len(found) != 1:
        raise OdeifyError(
            f"forward_features/forward_head: the head reads {len(found)} values of the graph, not one; "
            "this model's features cannot be cut out. Use model(x) (or convert the source with "
            "forward_features as its forward)."
        )
    return found.pop()


_LINEAR_WITH_BIAS = ["get_attr", "get_attr", "call_function"]  # weight, bias, F.linear
_LINEAR_WITHOUT_BIAS = ["get_attr", "call_function"]


class _Head(nn.Module):
    """``source.forward_head`` as a module's forward, to trace it on its own."""

    def __init__(self, source: nn.Module, pre_logits: bool) -> None:
        super().__init__()
        self.source = source
        self.pre_logits = pre_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.source.forward_head(x, pre_logits=self.pre_logits)


def _traced_head(source: nn.Module) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """The compute nodes of ``forward_head`` and of ``forward_head(pre_logits=True)``, traced alone."""
    training = source.training
    try:  # in eval mode, as the model itself was traced
        head = _compute_nodes(trace(_Head(source.eval(), False)).graph_module.graph)
        pre = _compute_nodes(trace(_Head(source, True)).graph_module.graph)
    except Exception:  # a head fx cannot trace alone: no split, the rest of the interface stays
        return None
    finally:
        source.train(training)
    return head, pre


def _classifier_as_call(
    gm: fx.GraphModule, source: nn.Module, classifier: str, tail: list[fx.Node], pre_length: int
) -> bool:
    """Replace the head's classifier ops (after the pre-logits part) by one call of a real module."""
    original = source.get_submodule(classifier)
    ops = tail[pre_length:]
    linear = (
        isinstance(original, nn.Linear)
        and [_op(n)[0] for n in ops] in (_LINEAR_WITH_BIAS, _LINEAR_WITHOUT_BIAS)
        and all(n.target.startswith(f"{classifier}.") for n in ops if n.op == "get_attr")
        and getattr(ops[-1].target, "__name__", "") == "linear"
    )
    identity = not ops and isinstance(original, nn.Identity)
    if not (linear or identity):
        return False
    pre_value = tail[pre_length - 1] if pre_length else head_input(tail)
    with gm.graph.inserting_after(tail[-1]):
        call = gm.graph.call_module(classifier, (pre_value,))
    tag(call, head=True)
    call.meta["tensor_meta"] = tail[-1].meta.get("tensor_meta")
    tail[-1].replace_all_uses_with(call)
    holder = gm.get_submodule(classifier) if linear else None
    for node in reversed(ops):
        gm.graph.erase_node(node)
    module = copy.deepcopy(original)
    if holder is not None:  # the converted model's own parameters, under the same names
        module.weight = holder.weight
        module.bias = getattr(holder, "bias", None)
    gm.set_submodule(classifier, module)
    return True


def _op(node: fx.Node, prefix: str = "") -> tuple[str, str]:
    target = node.target
    target = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return node.op, target.removeprefix(prefix) if node.op in ("call_module", "get_attr") else target


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]
