"""Shared fixtures: cached random-weight test models, fixed random inputs, the shipped digits model."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

from odeify.models._testing import make_test_model

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core: one torch thread each, or the workers' thread pools
    # oversubscribe the cores and spin against each other.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one torch thread is as fast, and immune to oversubscription on a shared machine.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def test_model() -> Callable[..., nn.Module]:
    """``test_model(name, dtype=..., **timm_kwargs)``: a fresh copy of a cached ``make_test_model``."""
    cache: dict[tuple, nn.Module] = {}

    def get(name: str, dtype: torch.dtype = torch.float32, **kwargs: object) -> nn.Module:
        key = (name, dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = make_test_model(name, dtype=dtype, **kwargs)
        return copy.deepcopy(cache[key])

    return get


@pytest.fixture(scope="session")
def image() -> Callable[..., torch.Tensor]:
    """``image(shape, dtype=..., seed=...)``: a deterministic standard-normal input."""

    def make(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)

    return make


@pytest.fixture(scope="module")
def native() -> nn.Module:
    """The shipped digits model, converted: one knot and one Euler step per block (the source network)."""
    import odeify
    from odeify.models import DEFAULT_MODEL_PATH

    return odeify.convert(str(DEFAULT_MODEL_PATH))


@pytest.fixture(scope="module")
def digits(native: nn.Module):
    """The digits data set (train/val/test splits) as ``native`` reads it."""
    from odeify.train.datasets import open_data

    return open_data("digits", native)
