"""``torch.compile`` in a fine-tuning run: timm train.py's ``--torchcompile [BACKEND]`` and
``--torchcompile-mode MODE`` (``finetune(torchcompile=..., torchcompile_mode=...)``).

As timm's train.py does it: the training model is compiled once it is on its device (and in its
memory format), after the weight average is made and before DistributedDataParallel wraps it;
validation runs the compiled model, the weight average is validated through a compiled copy of its
own, and the teacher predicts compiled (timm's distillation task compiles its teacher). Saving,
the average's update and the optimizer read the modules themselves: a compiled run writes the same
files as an eager one. Compiling does not change the weights (``aot_eager`` trains eager's bit for
bit, tests/test_compile.py), so a run may be resumed with or without it; each epoch's record says
how it ran (``EpochRecord.torchcompile``, summary.csv's ``torchcompile`` column).

:func:`torch_compile` refuses, before any work, what cannot compile: a backend
``torch._dynamo.list_backends()`` does not name, a mode inductor does not know or a mode for
another backend (which ignores it), inductor on the CPU without a C++ compiler and on CUDA without
Triton.

Inductor's ``layout_optimization`` (on by default) saves channels_last copies of a compiled
region's conv inputs and weights for backward; in a model whose stages recompute in backward
(checkpoint, reverse, reversible) those copies raised the step's peak toward backprop's (resnet18,
batch 8, 160x160: checkpoint 34.5 -> 63.6 MiB; benchmarks/results/train_step_compiled.md). Such a
model is compiled with it off, which keeps the eager peak at the eager step's speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from odeify.compiler.conversion import converted_stages
from odeify.core.errors import ConfigError

__all__ = ["TorchCompile", "torch_compile"]


@dataclass(frozen=True)
class TorchCompile:
    """How a run compiles: ``torch.compile(module, backend=backend, mode=mode)``."""

    backend: str
    mode: str | None = None

    def __call__(self, module: nn.Module) -> nn.Module:
        if self.backend != "inductor" or not _recomputes_in_backward(module):
            return torch.compile(module, backend=self.backend, mode=self.mode)
        return torch.compile(module, backend=self.backend, options=_keeping_layout(self.mode))

    @property
    def label(self) -> str:
        """What an epoch record and summary.csv note: ``inductor``, ``inductor:max-autotune``."""
        return self.backend if self.mode is None else f"{self.backend}:{self.mode}"


def _keeping_layout(mode: str | None) -> dict[str, object]:
    """Inductor's options for ``mode`` (torch.compile takes a mode or options, not both), with
    ``layout_optimization`` off."""
    from torch._inductor import list_mode_options

    return {**(list_mode_options(mode) if mode is not None else {}), "layout_optimization": False}


def _recomputes_in_backward(module: nn.Module) -> bool:
    """A converted model with a stage whose backward is not backprop (the teacher, a source model
    or an all-backprop model keeps inductor's defaults)."""
    return any(stage.backward != "backprop" for stage in converted_stages(module))


def torch_compile(
    backend: str | None, mode: str | None, device: torch.device, cli: bool = False
) -> TorchCompile | None:
    """The run's compilation (None: eager), refused with a ConfigError where it cannot work."""
    flag, mode_flag = ("--torchcompile", "--torchcompile-mode")
    if not cli:
        flag, mode_flag = "torchcompile", "torchcompile_mode"
    if backend is None:
        if mode is not None:
            raise ConfigError(f"{mode_flag} {mode} sets the mode of {flag}; pass {flag} too.")
        return None
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(backend, str) or backend not in known:
        raise ConfigError(
            f"{flag} {backend!r} is not a torch.compile backend of this torch; torch._dynamo.list_backends() "
            f"names {', '.join(torch._dynamo.list_backends())} (and, for debugging, aot_eager and eager). "
            f"Pass one of them ({flag} alone is inductor, timm's default), or leave {flag} out to train "
            "eagerly."
        )
    if mode is not None:
        _check_mode(backend, mode, flag, mode_flag)
    if backend == "inductor":
        _check_inductor(device, flag)
    return TorchCompile(backend, mode)


def _check_mode(backend: str, mode: str, flag: str, mode_flag: str) -> None:
    if backend != "inductor":
        raise ConfigError(
            f"{mode_flag} {mode} is a mode of the inductor backend; {backend} ignores it. Leave "
            f"{mode_flag} out, or compile with inductor ({flag} inductor)."
        )
    from torch._inductor import list_mode_options

    modes = list(list_mode_options())
    if mode not in modes:
        raise ConfigError(f"{mode_flag} {mode!r} is not an inductor mode; inductor's are {', '.join(modes)}.")


def _check_inductor(device: torch.device, flag: str) -> None:
    """Inductor generates C++ for the CPU and Triton kernels for CUDA: refuse where either is missing."""
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()  # runs `<compiler> --version` once per process
        except Exception:  # noqa: BLE001 -- inductor's InvalidCxxCompiler, or a failed probe
            raise ConfigError(
                f"{flag} inductor on the CPU compiles C++ and found no C++ compiler (it looks for g++, or "
                f"$CXX). Install one (e.g. apt-get install g++), or pass {flag} aot_eager (no code "
                "generation)."
            ) from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                f"{flag} inductor on CUDA generates Triton kernels and Triton is not installed "
                f"(pip install triton), or pass {flag} aot_eager (no code generation)."
            )
