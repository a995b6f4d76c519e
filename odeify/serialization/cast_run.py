"""Run a model as its copy in another dtype runs, casting each weight where an operation uses it.

The probe (:mod:`odeify.serialization.probe`) computes a model in float64 beside its own dtype. A
float64 copy of the whole model holds twice a float32 model's weights at once: for a 412M-parameter
ViT, 3.1 GiB beside the model, the peak of ``save`` and of ``load``. :class:`CastRun` interprets the
model's own graph instead and casts a parameter or floating buffer where an operation computes with
it, so that one weight (or one called submodule's) at a time is held in the other dtype; a stage's
stacked knots are never cast whole.

Its results are the copy's, to the bit. A cast is elementwise, so it commutes with operations that
only move data (a knot taken from its stack, a weight transposed): those run on the model's own
tensors and stay deferred. An operation that computes gets each deferred input cast with the layout
the copy's tensor has: the same strides and the same offset within a :data:`ALIGNMENT`-byte block,
since kernels may take other paths (and round otherwise) for other strides or alignments.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["CastRun"]

ALIGNMENT = 64
"""Bytes: torch's CPU allocator starts every tensor's storage at a multiple of this."""
MOVING_FUNCTIONS = frozenset({operator.getitem, torch.unbind})
"""Functions that only move data (take or rearrange elements): they run on deferred weights. These and
:data:`MOVING_METHODS` are what converted graphs apply to weights alone (knots taken from their stacks,
relative position tables rearranged); any other operation gets its inputs cast, which costs memory
for the time of the operation, never exactness."""
MOVING_METHODS = frozenset({"squeeze", "unsqueeze", "view", "reshape", "permute", "contiguous", "expand"})
"""Tensor methods that only move data."""


class CastRun(fx.Interpreter):
    """Run ``module`` with its floating parameters and buffers in ``dtype`` (None: as they are),
    each cast where an operation computes with it; what only moves data runs on them deferred."""

    def __init__(self, module: fx.GraphModule, dtype: torch.dtype | None) -> None:
        super().__init__(module)
        self.dtype = dtype
        self.castable = {name for name, _ in _castable(module, dtype, remove_duplicate=False)}
        self.deferred: set[fx.Node] = set()  # nodes whose value is still in the model's dtype

    def run_node(self, node: fx.Node) -> Any:
        if self._defers(node):
            self.deferred.add(node)
        return super().run_node(node)

    def get_attr(self, target: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        value = super().get_attr(target, args, kwargs)
        return _laid_out_as_copy(value) if target in self.castable else value

    def fetch_attr(self, target: str) -> Any:
        """A submodule (called, or read as a value: a segment calls the modules it is handed) comes
        as a copy with its own tensors cast, all at once; a stage's knots are read by get_attr."""
        value = super().fetch_attr(target)
        return _in_dtype(value, self.dtype) if isinstance(value, nn.Module) else value

    def map_nodes_to_values(self, args: Any, n: fx.Node) -> Any:
        """The values of ``n``'s inputs: deferred ones cast, unless ``n`` itself is deferred."""
        if n in self.deferred:
            return super().map_nodes_to_values(args, n)
        return fx.node.map_arg(args, self._cast_if_deferred)

    def _cast_if_deferred(self, node: fx.Node) -> Any:
        value = self.env[node]
        if node not in self.deferred:
            return value
        return tree_map_only(torch.Tensor, lambda tensor: _cast(tensor, self.dtype), value)  # type: ignore[arg-type]

    def _defers(self, node: fx.Node) -> bool:
        """A castable weight, or an operation that only moves data and whose floating tensor inputs
        are all deferred."""
        if node.op == "get_attr":
            return node.target in self.castable
        moving = (node.op == "call_function" and node.target in MOVING_FUNCTIONS) or (
            node.op == "call_method" and node.target in MOVING_METHODS
        )
        inputs = [arg for arg in node.all_input_nodes if _holds_floating(self.env[arg])]
        return moving and bool(inputs) and all(arg in self.deferred for arg in inputs)


def _castable(
    module: nn.Module, dtype: torch.dtype | None, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``module``'s floating parameters and buffers not in ``dtype`` (a tied one under its first name
    or, without ``remove_duplicate``, under each); none for ``dtype`` None."""
    if dtype is None:
        return iter(())
    named = chain(
        module.named_parameters(remove_duplicate=remove_duplicate),
        module.named_buffers(remove_duplicate=remove_duplicate),
    )
    return ((name, tensor) for name, tensor in named if tensor.is_floating_point() and tensor.dtype != dtype)


def _in_dtype(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """``module``, or a copy of it with its castable tensors in ``dtype`` where it has any."""
    memo: dict[int, Any] = {}
    for _, tensor in _castable(module, dtype):
        cast = tensor.detach().to(dtype)
        memo[id(tensor)] = (
            nn.Parameter(cast, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else cast
        )
    return copy.deepcopy(module, memo) if memo else module


def _holds_floating(value: object) -> bool:
    """Whether ``value`` (a node's: a tensor, a tuple of them, a size, a module) holds a floating tensor."""
    return any(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in tree_leaves(value))


def _laid_out_as_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where it is laid out as its cast copy is (its strides where they are dense, from
    offset 0), else a copy so laid out: then a view of it has the offset the copy's view has."""
    copy_strides = torch.empty_like(tensor, device="meta").stride()
    if tensor.storage_offset() == 0 and tensor.stride() == copy_strides:
        return tensor
    return tensor.clone()


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` (a view of a weight) in ``dtype``, as the same view of the weight's cast copy: the
    same strides, and the same offset within an :data:`ALIGNMENT`-byte block. Only the elements
    the view spans are cast."""
    per_block = ALIGNMENT // dtype.itemsize
    offset = tensor.storage_offset()
    lead = offset % per_block
    span = _span(tensor)
    window = tensor.as_strided((lead + span,), (1,), offset - lead).to(dtype)
    return window.as_strided(tensor.shape, tensor.stride(), lead)


def _span(tensor: torch.Tensor) -> int:
    """How many storage elements ``tensor`` spans, from its first element to its last."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
