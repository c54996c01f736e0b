"""The staleness mask in every loss term (rl/train/losses.py `staleness_keep`, rl/train/objectives.py): a token more
than `max_staleness` versions old leaves the GRPO loss, OPD's reverse KL, the KL to the reference policy and the
entropy bonus alike, and a sample whose share of stale *response* tokens passes `max_sample_stale_frac` leaves
whole; the boundaries are inclusive. The objectives run for real on a tiny model (one micro-batch, CPU)."""

import pytest
import torch

from model.decoder import Decoder
from rl.config import GRPOStage, OPDStage, OptimConfig
from rl.train.losses import staleness_keep
from rl.train.objectives import build_objective
from rl.train.trainer import TrainBatch, Trainer, merge_step_metrics
from teachers.config import TeacherPoolConfig
from teachers.pool import TeacherPool
from tests.conftest import debug_config


def test_the_stale_share_boundary_is_inclusive_and_counts_response_tokens_only():
    # row 0: 2 of 4 response tokens stale (exactly 0.5); row 1: 1 of 2 response tokens stale, then 2 padding
    # positions (versions 0: "stale" but off the response); row 2: 3 of 4 stale
    versions = torch.tensor([[7, 0, 0, 7], [0, 7, 0, 0], [0, 0, 0, 7]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
    keep = staleness_keep(versions, mask, current_version=7, max_staleness=2, max_sample_stale_frac=0.5)
    assert keep.tolist() == [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]]
    keep = staleness_keep(versions, mask, current_version=7, max_staleness=2, max_sample_stale_frac=0.4)
    assert keep.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # 0.5 > 0.4: rows 0 and 1 leave too
    # a token exactly max_staleness versions old is kept
    assert staleness_keep(torch.tensor([[5, 4]]), torch.ones(1, 2), current_version=7, max_staleness=2).tolist() == [[1, 0]]


def _rows(versions: list[tuple[int, ...]], teachers: list[str] | None = None) -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(3, 99, (3,), generator=g).tolist()) for _ in versions]
    responses = [tuple(torch.randint(3, 99, (len(v),), generator=g).tolist()) for v in versions]
    return TrainBatch(prompts, responses, float(sum(map(len, responses))), [(0.0,) * len(r) for r in responses],
                      list(versions), None, [0.0] * len(versions), teachers)


def _step(stage, rows: TrainBatch, current_version: int, **handles) -> dict[str, float]:
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False))
    objective = build_objective(stage, model=model, temperature=1.0, current_version=current_version, **handles)
    return merge_step_metrics([Trainer(model, OptimConfig(lr=1e-3)).accumulate(rows, objective)])


def test_the_grpo_objective_drops_a_sample_past_max_sample_stale_frac():
    rows = _rows([(1, 1, 1, 1), (0, 0, 0, 1)])  # the second: 3 of 4 stale at version 1 with max_staleness 0
    stage = GRPOStage(micro_batch_size=4, max_staleness=0, max_sample_stale_frac=0.5)
    assert _step(stage, rows, 1)["stale/masked_frac"] == pytest.approx(4 / 8)  # the whole second sample
    stage = GRPOStage(micro_batch_size=4, max_staleness=0)
    assert _step(stage, rows, 1)["stale/masked_frac"] == pytest.approx(3 / 8)


@pytest.mark.parametrize("term", ["kl_ref_coef", "entropy_coef"])
def test_stale_tokens_leave_the_kl_to_the_reference_and_the_entropy_bonus(term):
    """Advantages 0: the policy loss is 0, so the loss is the term alone; all tokens stale: it must be 0 too."""
    torch.manual_seed(1)
    reference = Decoder(debug_config(moe=False)).requires_grad_(False)
    stage = GRPOStage(micro_batch_size=4, max_staleness=0, **{term: 0.5})
    rows = _rows([(0, 0, 0), (0, 0, 0, 0)])
    assert _step(stage, rows, 0, reference=reference)["rl/loss"] != 0.0  # fresh: the term is there
    assert _step(stage, rows, 1, reference=reference)["rl/loss"] == 0.0  # every token one version too old


def test_stale_tokens_leave_opds_reverse_kl():
    torch.manual_seed(2)
    teacher = Decoder(debug_config(moe=False))
    pool = TeacherPool([], 64, prefetch=False, device="cpu")
    pool.add_weights("t", teacher.config, {k: v.detach() for k, v in teacher.state_dict().items()})
    stage = OPDStage(group_size=2, micro_batch_size=4, teachers=TeacherPoolConfig(), routing_replay=False, max_staleness=0)
    rows = _rows([(1, 1, 1), (0, 1, 0, 1)], ["t", "t"])  # 3 + 2 fresh tokens at version 1
    try:
        m = _step(stage, rows, 1, pool=pool)
        assert m["opd/kl_tokens"] == 5
        fresh = _step(stage, _rows([(1, 1, 1), (1, 1, 1, 1)], ["t", "t"]), 1, pool=pool)
        assert fresh["opd/kl_tokens"] == 7 and fresh["opd/kl_sum"] > m["opd/kl_sum"] > 0
    finally:
        pool.close()
