"""Merging one train step's metrics from data-parallel ranks (rl.async_grpo._merge_rank_metrics)."""

import pytest

from rl.async_grpo import _merge_rank_metrics


def test_losses_and_counters_add_ratios_are_weighted_and_opd_kl_uses_kl_tokens():
    r0 = {"rl/loss": 0.25, "rl/clip_frac": 0.5, "train/grad_norm": 3.0, "opd/kl_loss": 0.1, "opd/kl_tokens": 30.0,
          "opd/kl_per_token": 0.2, "teachers/loads": 2.0, "teachers/load_wait_s": 0.01, "teachers/compute_s": 0.5,
          "teachers/overhead": 0.02}
    r1 = {"rl/loss": 0.5, "rl/clip_frac": 0.0, "train/grad_norm": 3.0, "opd/kl_loss": 0.3, "opd/kl_tokens": 10.0,
          "opd/kl_per_token": 0.6, "teachers/loads": 1.0, "teachers/load_wait_s": 0.04, "teachers/compute_s": 0.5,
          "teachers/overhead": 0.08}
    m = _merge_rank_metrics([r0, r1], tokens=[30, 10])
    assert m["rl/loss"] == pytest.approx(0.75) and m["opd/kl_loss"] == pytest.approx(0.4)
    assert m["rl/clip_frac"] == pytest.approx(0.375)  # (0.5·30 + 0·10) / 40
    assert m["opd/kl_per_token"] == pytest.approx((0.2 * 30 + 0.6 * 10) / 40)
    assert m["opd/kl_tokens"] == 40.0 and m["teachers/loads"] == 3.0
    assert m["teachers/overhead"] == pytest.approx(0.05 / 1.0)
    assert m["train/grad_norm"] == 3.0
