"""Effort with exactly two training levels (rewards/effort.py): τ is λ times the one gap between them, so the length
penalty's coefficient falls by e^(-1/λ) from the lower level to the higher, whatever order the recipe lists them in;
the deduction is capped at C_max. (One level has no decay; tests/unit/test_effort.py has four.)"""

import math

import pytest

from rewards.effort import EffortConfig


def test_two_levels_decay_over_their_one_gap():
    cfg = EffortConfig(levels=[80, 20], samples_per_level=3, k0=2.0, lam=0.5, c_max=10.0, l_norm=10)
    assert cfg.levels == [20, 80] and cfg.group_size == 6
    assert cfg.tau == pytest.approx(30.0)  # λ · (80 − 20) / 1
    assert cfg.coefficient(20) == pytest.approx(2.0)
    assert cfg.coefficient(80) == pytest.approx(2.0 * math.exp(-2))
    assert cfg.length_penalty(80, 5) == pytest.approx(-2.0 * math.exp(-2) * 0.5)
    assert EffortConfig(levels=[20, 80]).coefficient(80) == pytest.approx(math.exp(-1))  # λ = 1: one gap is one τ


def test_the_deduction_is_capped_at_c_max():
    cfg = EffortConfig(levels=[10, 90], k0=1.0, c_max=0.25, l_norm=10)
    assert cfg.length_penalty(10, 1000) == -0.25
    assert cfg.length_penalty(10, 1) == pytest.approx(-0.1)
