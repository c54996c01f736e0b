"""What the GRPO loop hands the trainer for one step (rl/algo/async_grpo.py `AsyncGRPO.train_step`). The per-step
token normaliser: the response tokens the loss trains over the whole step (tool-output tokens are appended, never
sampled, so never counted), one mini-batch's share of it when the step is split into PPO mini-batches, and the
groups whose gradient is exactly 0 (`skip_uniform_groups`) still in it. And OPD's teacher per row after a live
reconfiguration remapped a dataset while samples of its old teacher were in flight. A wrong value here trains
silently at the wrong scale or against the wrong teacher, so these tests read the TrainBatches the loop hands to
the policy (the real `TrainBatch.from_samples`, the real mini-batch deal), stopping the step there."""

from types import SimpleNamespace as S

import pytest

from rl.algo.async_grpo import AsyncGRPO
from rl.config import OPDStage
from rl.metrics import RolloutClock
from rl.reconfigure import LiveConfig
from rl.types import Sample, Turn
from teachers.config import TeacherPoolConfig, TeacherSpec


class _Handed(Exception):
    """Raised by the policy stand-in once it has the step's batches."""


class _Policy:
    """Takes the per-rank mini-batches of one step and stops it (the normaliser is all that is checked)."""

    def __init__(self):
        self.batches = None

    def train_step(self, batches, stage):
        self.batches = batches
        raise _Handed


def _sample(pid: str, j: int, reward: float, response: int, tool: tuple[int, int] | None = None, dataset: str = "d",
            teacher: str | None = None) -> Sample:
    """A sample of `response` tokens; `tool`: the [start, end) of one tool-output turn inside it."""
    turns = ()
    if tool is not None:
        turns = (Turn("model", 0, tool[0]), Turn("tool", *tool), Turn("model", tool[1], response))
    return Sample(f"{pid}-{j}", pid, dataset, pid, (1, 2, 3), tuple(range(5, 5 + response)), "p", "r",
                  (0.0,) * response, (0,) * response, reward, reward > 0, "eos", turns=turns, teacher=teacher)


def _step(groups: dict[str, list[Sample]], *, mini_batches: int = 1, skips_uniform: bool = False, stage=None,
          live: LiveConfig | None = None, moved: dict | None = None) -> list:
    """The mini-batches (of the one worker) that one train step of `groups` hands to the policy; `moved` gets the
    store's teacher changes."""
    loop = AsyncGRPO.__new__(AsyncGRPO)  # only the parts train_step reads before the policy's step
    store = S(set_teacher=lambda ids, name: (moved if moved is not None else {}).update({i: name for i in ids}))
    loop.job, loop.policy, loop.n_workers, loop.on_failure = S(store=store), _Policy(), 1, None
    loop.stage = stage or S(std_normalize=False, mini_batches=mini_batches)
    loop.disp, loop.clock, loop.skips_uniform, loop.live = S(), RolloutClock(), skips_uniform, live
    loop.finished = dict(groups)
    with pytest.raises(_Handed):
        loop.train_step(list(groups), held=[])
    (rank,) = loop.policy.batches
    return rank


def _trained(batch) -> int:
    masks = batch.loss_masks_B or [[1] * len(r) for r in batch.responses_B]
    return sum(sum(m) for m in masks)


def test_tool_output_tokens_leave_the_steps_normaliser():
    groups = {"a": [_sample("a", 0, 1.0, 12, tool=(4, 10)), _sample("a", 1, 0.0, 8)],
              "b": [_sample("b", 0, 0.0, 10, tool=(2, 5)), _sample("b", 1, 1.0, 6)]}
    (batch,) = _step(groups)
    assert batch.num_tokens == (12 - 6) + 8 + (10 - 3) + 6 == _trained(batch)


def test_mini_batch_normalisers_are_their_share_of_the_steps_trained_tokens():
    """Two PPO mini-batches: each divides by its own trained tokens, so the two together divide by the step's
    (not each by the whole step's, and not shares of response tokens counting tool output)."""
    groups = {"tools": [_sample("tools", 0, 1.0, 40, tool=(2, 38)), _sample("tools", 1, 0.0, 40, tool=(5, 39))],
              "b": [_sample("b", 0, 1.0, 20), _sample("b", 1, 0.0, 20)],
              "c": [_sample("c", 0, 1.0, 20), _sample("c", 1, 0.0, 20)],
              "d": [_sample("d", 0, 1.0, 22), _sample("d", 1, 0.0, 18)]}
    batches = _step(groups, mini_batches=2)
    assert len(batches) == 2
    step_trained = (40 - 36) + (40 - 34) + 40 + 40 + 40
    assert sum(_trained(b) for b in batches) == step_trained
    for b in batches:
        assert b.num_tokens == pytest.approx(_trained(b))


def test_skipped_uniform_groups_stay_in_every_mini_batchs_normaliser():
    """A group whose rewards are all equal leaves the forward (its gradient is 0) but not the normaliser: the
    mini-batches' normalisers still add up to every trained token of the step."""
    groups = {"a": [_sample("a", 0, 1.0, 10), _sample("a", 1, 0.0, 10)],
              "b": [_sample("b", 0, 1.0, 12), _sample("b", 1, 0.0, 8)],
              "same": [_sample("same", 0, 1.0, 30), _sample("same", 1, 1.0, 30)]}
    batches = _step(groups, mini_batches=2, skips_uniform=True)
    assert len(batches) == 2 and sum(len(b) for b in batches) == 4  # the uniform group is not computed
    assert sum(b.num_tokens for b in batches) == pytest.approx(10 + 10 + 12 + 8 + 60)
    (one,) = _step(groups, skips_uniform=True)
    assert len(one) == 4 and one.num_tokens == 100


def test_a_removed_teachers_samples_go_to_their_datasets_new_teacher_and_the_others_stay():
    """A patch mapped dataset `a` from `old` to `new` while samples `old` was to score were in flight: those go to
    `new` (the pool dropped `old`), and the store says so; a sample whose teacher is still active (`other`, now
    teaching `b` only) keeps it."""
    specs = {n: TeacherSpec(name=n, checkpoint=f"/t/{n}") for n in ("old", "new", "other")}
    live = LiveConfig(version=1, mixture={"a": 1.0, "b": 1.0}, caps={}, assignment={"a": "new", "b": "other"},
                      teachers=specs)
    groups = {"p1": [_sample("p1", 0, 1.0, 4, dataset="a", teacher="old"), _sample("p1", 1, 0.0, 4, dataset="a", teacher="old")],
              "p2": [_sample("p2", 0, 1.0, 4, dataset="a", teacher="other"),
                     _sample("p2", 1, 0.0, 4, dataset="a", teacher="other")],
              "p3": [_sample("p3", 0, 1.0, 4, dataset="a", teacher="new"), _sample("p3", 1, 0.0, 4, dataset="a", teacher="new")]}
    stage = OPDStage(group_size=2, teachers=TeacherPoolConfig(), routing_replay=False)
    moved: dict[str, str] = {}
    (batch,) = _step(groups, stage=stage, live=live, moved=moved)
    assert batch.teachers_B == ["new", "new", "other", "other", "new", "new"]
    assert moved == {"p1-0": "new", "p1-1": "new"}
