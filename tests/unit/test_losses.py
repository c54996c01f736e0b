"""GRPO loss against a hand-computed example; advantages; SFT loss masking."""

import math

import pytest
import torch

from rl.train.losses import PolicyLossInputs, group_advantages, grpo_loss, sft_loss, token_logprobs
from rl.train.trainer import pack


def test_group_advantages_mean_centred_within_group():
    adv = group_advantages([1, 0, 0, 1, 1, 1, 0.5], ["a", "a", "a", "b", "b", "b", "c"], std_normalize=False)
    assert adv == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0])  # singleton group gets 0, not its reward
    adv = group_advantages([1, 0, 0, 0], ["a"] * 4, std_normalize=True)
    std = math.sqrt(0.1875)
    assert adv == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)


def test_grpo_loss_hand_computed():
    # Sample A (advantage +0.5): ratios 1.25 and 1.0; sample B (advantage -0.5): ratio 0.6.
    new = torch.tensor([[math.log(0.5), math.log(0.6)], [math.log(0.3), 0.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.6)], [math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    x = PolicyLossInputs(new, old, torch.tensor([0.5, -0.5]), mask, num_tokens=3.0)
    loss, m = grpo_loss(x, clip_low=0.2, clip_high=0.2)
    # A1: max(-0.625, -0.5*1.2=-0.6) = -0.6 (clipped); A2: -0.5; B: max(0.3, 0.5*0.8=0.4) = 0.4 (clipped)
    assert loss.item() == pytest.approx((-0.6 - 0.5 + 0.4) / 3, abs=1e-6)
    assert m["rl/clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # Clipped tokens get no gradient; A2: d/dlogp (-A·ρ) / N = -0.5·1/3; padding gets none.
    assert torch.allclose(new.grad, torch.tensor([[0.0, -0.5 / 3], [0.0, 0.0]]), atol=1e-6)


def test_grpo_decoupled_clip_bounds():
    new = torch.log(torch.tensor([[1.25, 0.75]]))  # ratios vs behaviour logprob 0
    x = PolicyLossInputs(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 2.0)
    loss, m = grpo_loss(x, clip_low=0.2, clip_high=0.28)
    # positive advantage: 1.25 is inside 1 + 0.28 (not clipped), 0.75 < 1 - 0.2 but min() keeps the unclipped
    assert loss.item() == pytest.approx(-(1.25 + 0.75) / 2)
    assert m["rl/clip_frac"] == 0.0


def test_kl_behavior_zero_on_policy():
    lp = torch.log(torch.rand(3, 5) * 0.9 + 0.05)
    x = PolicyLossInputs(lp.clone(), lp, torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 5), 15.0)
    _, m = grpo_loss(x, clip_low=0.2, clip_high=0.2)
    assert m["rl/kl_behavior"] == pytest.approx(0.0, abs=1e-7) and m["rl/clip_frac"] == 0.0


def test_pack_and_sft_loss_mask_only_response():
    b = pack([[1, 5, 6], [1, 7]], [[8, 9, 2], [2]])
    assert b.input_ids.tolist() == [[1, 5, 6, 8, 9], [1, 7, 0, 0, 0]]
    assert b.targets.tolist() == [[5, 6, 8, 9, 2], [7, 2, 0, 0, 0]]
    assert b.mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    logits = torch.zeros(2, 5, 12, requires_grad=True)
    loss, _ = sft_loss(token_logprobs(logits, b.targets), b.mask)
    assert loss.item() == pytest.approx(math.log(12))
    loss.backward()
    assert logits.grad[0, :2].abs().sum() == 0 and logits.grad[1, 2:].abs().sum() == 0


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    assert token_logprobs(logits, torch.tensor([[0]]), 2.0).item() == pytest.approx(math.log(math.e / (math.e + 1)))


def test_staleness_mask_keeps_the_normaliser():
    from rl.train.losses import staleness_keep

    versions = torch.tensor([[5, 6, 7, 7], [3, 3, 7, 0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    keep = staleness_keep(versions, mask, current_version=7, max_staleness=1)
    assert keep.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    logp = torch.zeros(2, 4, requires_grad=True)
    x = PolicyLossInputs(logp, torch.zeros(2, 4), torch.tensor([1.0, 1.0]), mask, num_tokens=7.0, keep=keep)
    loss, m = grpo_loss(x, clip_low=0.2, clip_high=0.2)
    # 4 fresh tokens with ratio 1 and advantage 1 contribute -1 each; the normaliser stays 7, not 4
    assert loss.item() == pytest.approx(-4 / 7)
    assert m["stale/masked_frac"] == pytest.approx(3 / 7)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0, -1 / 7, -1 / 7, -1 / 7], [0, 0, -1 / 7, 0]]))
    # whole-sample discard: sample 1 has 2 of 3 tokens stale (> 0.5) and leaves the loss entirely
    keep = staleness_keep(versions, mask, current_version=7, max_staleness=1, max_sample_stale_frac=0.5)
    assert keep[1].sum() == 0 and keep[0].tolist() == [0, 1, 1, 1]


def test_proximal_ratio_with_truncated_importance_weight():
    # behaviour logprobs: ratios π_θ/π_behav = 2.0 and 0.5; cap 1.5 truncates the first
    logp = torch.log(torch.tensor([[0.4, 0.2]])).requires_grad_()
    behav = torch.log(torch.tensor([[0.2, 0.4]]))
    x = PolicyLossInputs(logp, behav, torch.tensor([1.0]), torch.ones(1, 2), num_tokens=2.0)
    loss, m = grpo_loss(x, clip_low=0.2, clip_high=0.2, ratio="proximal", tis_cap=1.5)
    # ρ = 1 in value, so each token contributes -A·w: w = [1.5, 0.5]
    assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2)
    assert m["rl/tis_truncated_frac"] == pytest.approx(0.5) and m["rl/tis_weight_mean"] == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5 / 2, -0.5 / 2]]))  # the weight is detached
    # the behaviour ratio instead clips 2.0 at 1.2 (no gradient) and keeps 0.5
    logp2 = logp.detach().clone().requires_grad_()
    loss_b, _ = grpo_loss(PolicyLossInputs(logp2, behav, torch.tensor([1.0]), torch.ones(1, 2), 2.0),
                          clip_low=0.2, clip_high=0.2)
    assert loss_b.item() == pytest.approx(-(1.2 + 0.5) / 2)
