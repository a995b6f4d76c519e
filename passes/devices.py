"""Devices traced into a graph as constants become the input's device, read at run time.

Code that reads a buffer's device (timm's DINOv3 rotary embedding builds its grid on the CPU, then
``coords.to(device=self.periods.device)``) traces to a literal: the buffer is a real tensor, so fx
records ``to(device=device(type='cpu'))``. That pins the op to the device the model was traced on:
moved to a GPU, the model would compute that part on the CPU and fail on mixing devices; moved to the
meta device (save's peak-memory count), it fails the same way. Every ``torch.device`` argument equal
to the tracing device is therefore replaced by ``getattr(x, "device")`` of the graph's first input.

The read is a metadata query (:func:`odeify.passes.graph_utils.is_metadata_query`), not data, so the
residual analysis finds the same blocks. A device written as a string in the model's source
(``torch.arange(n, device="cpu")``) is what its author asked for, and is kept; so is a device other
than the tracing one.

The tensors fx makes constants (``self._tensor_constant0``: a value computed from buffers while
tracing) need nothing here: ``fx.GraphModule`` registers them as buffers, which move with the module.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn


def tracing_device(model: nn.Module) -> torch.device:
    """The device ``model``'s tensors are on (its first parameter's, else first buffer's; CPU if none)."""
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def read_input_device(graph: fx.Graph, device: torch.device) -> bool:
    """Replace every ``torch.device`` argument equal to ``device`` by the first input's device, read at
    run time (one ``getattr`` node after the input, made only where needed); True if any was."""
    placeholder = next((node for node in graph.nodes if node.op == "placeholder"), None)
    if placeholder is None:
        return False
    read: list[fx.Node] = []

    def swap(value: object) -> object:
        if not (isinstance(value, torch.device) and value == device):
            return value
        if not read:
            with graph.inserting_after(placeholder):
                read.append(graph.call_function(getattr, (placeholder, "device")))
        return read[0]

    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method", "call_module"):
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    return bool(read)
