"""Per-dataset and per-effort rollout metrics of a train batch (rl.metrics.rollout_breakdown)."""

import pytest

from rl.metrics import rollout_breakdown
from tests.unit.test_store import make_sample


def test_breakdown_per_dataset_only_when_the_batch_mixes_datasets():
    one = [make_sample(f"s{i}", dataset="arith", reward=float(i % 2)) for i in range(4)]
    assert rollout_breakdown(one) == {}
    mixed = one + [make_sample("u0", dataset="upper", reward=1.0, versions=(1, 1)),
                   make_sample("u1", dataset="upper", reward=-0.5, versions=(1, 1, 1, 1))]
    m = rollout_breakdown(mixed)
    assert m["rollout/reward/arith"] == pytest.approx(0.5) and m["rollout/accuracy/arith"] == pytest.approx(0.5)
    assert m["rollout/reward/upper"] == pytest.approx(0.25) and m["rollout/accuracy/upper"] == pytest.approx(0.5)
    assert m["rollout/response_len/upper"] == pytest.approx(3.0) and m["rollout/response_len/arith"] == pytest.approx(6.0)


def test_breakdown_per_effort_level():
    batch = [make_sample("a", effort=25, versions=(1,) * 2, reward=0.0),
             make_sample("b", effort=25, versions=(1,) * 4, reward=1.0),
             make_sample("c", effort=100, versions=(1,) * 9, reward=1.0)]
    m = rollout_breakdown(batch)
    assert set(m) == {f"rollout/{k}/effort{b}" for k in ("reward", "accuracy", "response_len") for b in (25, 100)}
    assert m["rollout/response_len/effort25"] == pytest.approx(3.0) and m["rollout/response_len/effort100"] == 9.0
    assert m["rollout/accuracy/effort25"] == pytest.approx(0.5) and m["rollout/reward/effort100"] == 1.0


def test_breakdown_per_teacher():
    batch = [make_sample("a", teacher="t0", reward=0.0), make_sample("b", teacher="t0", reward=1.0),
             make_sample("c", teacher="math-7b", reward=1.0, versions=(1,) * 3), make_sample("d", reward=1.0)]
    m = rollout_breakdown(batch)
    assert set(m) == {f"rollout/{k}/teacher_{t}" for k in ("reward", "accuracy", "response_len") for t in ("t0", "math-7b")}
    assert m["rollout/reward/teacher_t0"] == pytest.approx(0.5) and m["rollout/response_len/teacher_math-7b"] == 3.0
