"""A step whose loss or gradient norm is not finite is never applied (issue 40, class 3): `--set
stages.0.optim.lr=inf` used to train NaN into every later checkpoint with exit 0. The trainer checks the values it
already reads on the host (the loss metrics, the clipped gradient norm) before the optimizer steps, raises `Diverged`
naming what is not finite, and leaves the weights, the optimizer state and the LR schedule as the last good step
left them (tests/integration/test_divergence.py: the job's exit code 5 and its checkpoints)."""

import copy
import math

import pytest
import torch

from model.decoder import Decoder
from rl.config import GRPOStage, OptimConfig, SFTStage
from rl.train.objectives import GRPOObjective, SFTObjective
from rl.train.trainer import Diverged, TrainBatch, Trainer
from tests.conftest import debug_config


def _rows(n: int = 4) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 99, (3,), generator=g).tolist()) for _ in range(n)]
    responses = [tuple(torch.randint(3, 99, (4,), generator=g).tolist()) for _ in range(n)]
    return TrainBatch(prompts, responses, float(4 * n), [(-0.5,) * 4] * n, [(0,) * 4] * n, None,
                      [1.0, -1.0] * (n // 2))


def _trainer(lr: float = 1e-3) -> Trainer:
    torch.manual_seed(0)
    return Trainer(Decoder(debug_config(moe=False)), OptimConfig(lr=lr))


def _state(t: Trainer) -> tuple[dict, dict, int]:
    return ({k: v.clone() for k, v in t.model.state_dict().items()}, copy.deepcopy(t.opt.state_dict()),
            t.sched.last_epoch)


def _assert_unchanged(t: Trainer, before: tuple[dict, dict, int]) -> None:
    weights, opt, epoch = before
    now = t.model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in weights.items() if v.isfinite().all())
    assert t.opt.state_dict()["state"].keys() == opt["state"].keys()
    for k, s in opt["state"].items():
        assert all(torch.equal(t.opt.state_dict()["state"][k][n], v) for n, v in s.items())
    assert t.sched.last_epoch == epoch
    assert all(p.grad is None for p in t.model.parameters())  # no NaN gradient left to leak into the next step


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_nan_loss_is_named_and_not_applied(objective):
    t = _trainer()
    obj = SFTObjective(SFTStage()) if objective == "sft" else GRPOObjective(
        GRPOStage(), model=t.model, temperature=1.0, current_version=0)
    t.train_step(_rows(), obj)  # a good step first: the optimizer has state that a NaN step must not touch
    with torch.no_grad():
        t.model.lm_head.weight[5, 0] = math.nan  # the logits of one token id: the loss of every position is NaN
    before = _state(t)
    with pytest.raises(Diverged, match=r"^the loss is not finite \(nan, (sft|rl)/loss\)$") as e:
        t.train_step(_rows(), obj)
    assert e.value.step is None and e.value.reason.startswith("the loss is not finite")
    _assert_unchanged(t, before)


@pytest.mark.parametrize("value, text", [(math.inf, "inf"), (math.nan, "nan")])
def test_a_non_finite_gradient_norm_of_a_finite_loss_is_named_and_not_applied(value, text):
    t = _trainer()
    obj = SFTObjective(SFTStage())
    t.train_step(_rows(), obj)
    before = _state(t)
    hook = t.model.lm_head.weight.register_hook(lambda g: g * value)  # the loss stays finite, one gradient does not
    with pytest.raises(Diverged, match=rf"^the gradient norm is {text} \(the loss is finite: [0-9.]+\)$"):
        t.train_step(_rows(), obj)
    _assert_unchanged(t, before)
    hook.remove()
    t.train_step(_rows(), obj)  # the trainer is still usable: the next good step applies
    assert t.sched.last_epoch == before[2] + 1


def test_a_finite_step_is_applied_as_before():
    t = _trainer()
    before = _state(t)
    metrics = t.train_step(_rows(), SFTObjective(SFTStage()))
    assert math.isfinite(metrics.shared["train/grad_norm"]) and t.sched.last_epoch == before[2] + 1
    assert any(not torch.equal(t.model.state_dict()[k], v) for k, v in before[0].items())


def test_a_huge_finite_lr_stops_at_the_first_non_finite_step_and_no_nan_reaches_the_weights():
    """lr=1e30 is finite (the recipe takes it): the first step moves the weights to ~1e30, and the next one's
    gradient overflows. The trainer stops there; the weights stay the first step's (finite)."""
    t = _trainer(lr=1e30)
    obj = SFTObjective(SFTStage())
    with pytest.raises(Diverged, match=r"^the (loss is not finite|gradient norm is (nan|inf))"):
        for _ in range(5):
            t.train_step(_rows(), obj)
    assert all(v.isfinite().all() for v in t.model.state_dict().values())
