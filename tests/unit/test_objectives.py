"""The OPD objective through the trainer's micro-batch loop: rows scored by their own teachers (two
architectures), masked to response tokens, normalised by the step's global token count, equal to the
full-vocabulary reverse KL computed naively. On CPU and, where present, CUDA (where the fused Triton
kernel runs)."""

import pytest
import torch

from model.decoder import Decoder
from rl.config import OPDStage, OptimConfig
from rl.objectives import OPDObjective
from rl.trainer import TrainBatch, Trainer, merge_step_metrics
from teachers.config import TeacherPoolConfig
from teachers.pool import TeacherPool
from tests.conftest import debug_config

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rows(teachers: list[str]) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(3, 99, (3 + i % 3,), generator=g).tolist()) for i in range(len(teachers))]
    responses = [tuple(torch.randint(3, 99, (2 + i % 4,), generator=g).tolist()) for i in range(len(teachers))]
    return TrainBatch(prompts, responses, float(sum(map(len, responses))) + 5.0,  # a step bigger than this rank's rows
                      [(0.0,) * len(r) for r in responses], [(0,) * len(r) for r in responses], None,
                      [0.0] * len(teachers), teachers)


def _naive_kl(student: Decoder, teachers: dict[str, Decoder], rows: TrainBatch) -> float:
    """Σ over response positions of Σ_v π_s(v) (log π_s(v) − log π_t(v)), ÷ the step's tokens."""
    total = 0.0
    for p, r, name in zip(rows.prompts_B, rows.responses_B, rows.teachers_B):
        ids = torch.tensor([list(p) + list(r)[:-1]], device=next(student.parameters()).device)
        with torch.no_grad():
            ls = torch.log_softmax(student(ids)[0][0, len(p) - 1 :].double(), -1)
            lt = torch.log_softmax(teachers[name](ids)[0][0, len(p) - 1 :].double(), -1)
        total += float((ls.exp() * (ls - lt)).sum())
    return total / rows.num_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_opd_objective_is_the_full_vocabulary_reverse_kl_to_each_rows_teacher(device):
    torch.manual_seed(0)
    student = Decoder(debug_config(moe=False)).to(device)
    teachers = {"deep": Decoder(debug_config(moe=False, num_layers=3)).to(device),
                "moe": Decoder(debug_config(moe=True, hidden_size=96, head_dim=24)).to(device)}
    pool = TeacherPool([], 64, prefetch=False, device=device)
    for name, t in teachers.items():
        pool.add_weights(name, t.config, {k: v.detach().cpu() for k, v in t.state_dict().items()})
    stage = OPDStage(group_size=2, micro_batch_size=3, teachers=TeacherPoolConfig(), routing_replay=False)
    rows = _rows(["deep", "moe", "deep", "moe", "moe", "deep", "deep"])
    expected = _naive_kl(student, teachers, rows)

    trainer = Trainer(student, OptimConfig(lr=1e-3), device=device)
    objective = OPDObjective(stage, model=student, temperature=1.0, current_version=0, pool=pool)
    m = merge_step_metrics([trainer.train_step(rows, objective)])
    assert m["opd/kl_loss"] == pytest.approx(expected, rel=2e-3 if device == "cuda" else 1e-4)
    response_tokens = sum(map(len, rows.responses_B))
    assert m["opd/kl_tokens"] == response_tokens and m["opd/teachers_in_step"] == 2
    assert m["opd/kl_per_token"] == pytest.approx(expected * rows.num_tokens / response_tokens, rel=2e-3)
    pool.close()
