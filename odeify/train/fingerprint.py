"""What a fine-tuning run started from, recorded with it so that a resume can tell it is the same run.

A resumed run continues the recorded one only if it starts from the same model (manifestation and
weights), distills from the same teacher and reads the same data. The settings alone do not say
so: the model file at the recorded path can be replaced (a 2-knot or rk4 version, other weights),
the data folder's contents swapped. :func:`run_fingerprint` records all three when a run begins;
:func:`check_fingerprint` refuses a resume where any differs, saying what changed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError
from odeify.core.words import plural
from odeify.train.datasets import LabelledData, fingerprint

__all__ = ["check_fingerprint", "run_fingerprint"]


def run_fingerprint(model: nn.Module, teacher: nn.Module | None, data: LabelledData) -> dict[str, Any]:
    """The model's manifestation and per-tensor hashes, the teacher's hash and the data's fingerprint."""
    return {
        "manifestation": _manifestation(model),
        "weights": {name: _digest(t) for name, t in model.state_dict().items()},
        "teacher": _weights_digest(teacher) if teacher is not None else None,
        "data": fingerprint(data),
    }


def check_fingerprint(recorded: object, current: Mapping[str, Any], folder: Path | None) -> None:
    """Refuse to resume when the model, teacher or data differ from what the recorded run began with.

    A state written before fingerprints were recorded (``recorded`` is None) is not checked.
    """
    if recorded is None:
        return
    if not isinstance(recorded, Mapping):
        raise ConfigError(f"cannot resume {folder}: its training state's fingerprint is not an object.")
    changes = [*_model_changes(recorded, current), *_data_changes(recorded.get("data"), current["data"])]
    if recorded.get("teacher") != current["teacher"]:
        changes.append(
            "the teacher differs from the one the run distilled from (its weights or manifestation)"
        )
    if changes:
        raise ConfigError(
            f"cannot resume {folder}: the run would not continue the recorded one: {'; '.join(changes[:3])}. "
            "Resume with the model (file) and data the run began with, or start a new run in another "
            "--out folder."
        )


def _model_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    was, now = recorded.get("manifestation"), current["manifestation"]
    if was != now:
        if not isinstance(was, dict):
            return ["the model's manifestation differs from the recorded one"]
        differing = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
        return [
            f"the model to fine-tune is not the one the run began with: stage {k!r} was "
            f"{was.get(k, 'absent')!r}, now {now.get(k, 'absent')!r}"
            for k in differing[:2]
        ]
    weights = recorded.get("weights")
    if weights != current["weights"]:
        if not isinstance(weights, dict):
            return ["the model's weights differ from the ones the run began with"]
        names = sorted(
            k for k in {*weights, *current["weights"]} if weights.get(k) != current["weights"].get(k)
        )
        return [
            f"the model's weights differ from the ones the run began with ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''})"
        ]
    return []


def _data_changes(was: object, now: Mapping[str, Any]) -> list[str]:
    if not isinstance(was, dict):
        return ["the data's fingerprint is not the recorded one"]
    changes = []
    if was.get("classes") != now["classes"]:
        changes.append(
            f"the data's classes changed (recorded {_classes(was.get('classes'))}, "
            f"now {_classes(now['classes'])})"
        )
    for split in ("train", "val"):
        before, after = was.get(split), now[split]
        if isinstance(before, dict) and None in (before.get("content"), after["content"]):
            after = {**after, "content": before.get("content")}  # a dataset odeify cannot look into: its size
        if before != after:
            count = (before or {}).get("samples") if isinstance(before, dict) else None
            changes.append(
                f"the data's {split} split changed (recorded {count} samples, now {after['samples']}"
                f"{'; the same count, other files or contents' if count == after['samples'] else ''})"
            )
    return changes


def _classes(value: object) -> str:
    if isinstance(value, list):
        shown = ", ".join(map(str, value[:5])) + (", ..." if len(value) > 5 else "")
        return f"{len(value)}: {shown}"
    return str(value)


def _manifestation(model: nn.Module) -> dict[str, str]:
    return {
        s.stage_name: (
            f"{s.integrator.name}, {plural(s.steps, 'step')}, {plural(s.num_knots, s.basis + ' knot')}, "
            f"backward {s.backward}"
        )
        for s in converted_stages(model)
    }


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode() + data).hexdigest()[:16]


def _weights_digest(model: nn.Module) -> str:
    """One hash of a model's manifestation (where it has ODE stages) and weights."""
    digest = hashlib.sha256(repr(sorted(_manifestation(model).items())).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}={_digest(tensor)};".encode())
    return digest.hexdigest()[:32]
