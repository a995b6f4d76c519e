"""Two threads running a cold converted model at once build its graph caches once and correctly.

The first forward+backward of a stage builds its step graphs and exact rows. Two threads doing
that at the same moment used to race (a coefficient buffer rebuilt while another thread's graph
indexed it: ``IndexError``). The caches are now built under one lock; a pause injected into graph
building widens the window the race needs. The oracle: both threads' gradients together equal
twice one serial pass's.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import odeify
from odeify.codegen import emit
from odeify.models import DEFAULT_MODEL_PATH
from odeify.models.digits import DIGITS_SIZE
from odeify.models.loading import load_model


def grads_after(model: torch.nn.Module, x: torch.Tensor, threads: int) -> dict[str, torch.Tensor]:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            model(x).square().sum().backward()
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("trial", range(6))
def test_cold_model_in_two_threads(monkeypatch, trial: int) -> None:
    base = odeify.convert(load_model(DEFAULT_MODEL_PATH).double())  # float64: exactness is checkable
    cold = odeify.retarget(base, basis="linear", knots=8, steps=16, backward="checkpoint")
    cold = odeify.retarget(cold, basis="cubic", knots="native")  # dense rows: the path that raced
    cold = odeify.retarget(cold, knots=8)
    x = torch.randn(
        2, 1, DIGITS_SIZE, DIGITS_SIZE, generator=torch.Generator().manual_seed(trial), dtype=torch.float64
    )
    serial = grads_after(copy.deepcopy(cold), x, threads=1)

    build = emit.build_step_graph

    def slow_build(*args, **kwargs):
        time.sleep(0.002)  # widen the window in which another thread could see half-built caches
        return build(*args, **kwargs)

    monkeypatch.setattr(emit, "build_step_graph", slow_build)
    both = grads_after(cold, x, threads=2)
    assert serial.keys() == both.keys()
    for name, grad in serial.items():
        # float64 round-off (measured on AMD EPYC: 0.0, the same kernels twice); a race is far off
        torch.testing.assert_close(
            both[name], 2 * grad, rtol=1e-12, atol=1e-12 * float(grad.abs().max()), msg=name
        )
