"""Shared fixtures of the unit suite: seeded random sources, so every failure reproduces."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(1234)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)
