"""External baselines the benchmarks run on odeify's own field, for a like-for-like comparison."""

from __future__ import annotations

from fractions import Fraction

import torch

import odeify


def torchdiffeq_euler_adjoint(stage: odeify.ODEStage, x: torch.Tensor) -> torch.Tensor:
    """``stage`` on ``x`` by torchdiffeq's continuous adjoint: ``odeint_adjoint``, fixed-grid Euler
    with the stage's steps, every stage parameter an adjoint parameter."""
    from torchdiffeq import odeint_adjoint

    steps = stage.steps

    class Field(torch.nn.Module):
        def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # torchdiffeq's grid points are floats: map each to its exact grid time
            return stage.field(Fraction(round(float(t) * steps), steps), y)

    t = torch.tensor([0.0, 1.0], dtype=x.dtype, device=x.device)
    options = {"step_size": 1.0 / steps}
    params = tuple(stage.parameters())
    return odeint_adjoint(Field(), x, t, method="euler", options=options, adjoint_params=params)[-1]
