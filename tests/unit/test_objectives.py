"""The OPD objective through the trainer's micro-batch loop: rows scored by their own teachers (two
architectures), masked to response tokens, normalised by the step's global token count, equal to the
full-vocabulary reverse KL computed naively. On CPU and, where present, CUDA (where the fused Triton
kernel runs)."""

import pytest
import torch

from model.decoder import Decoder
from rl.config import OPDStage, OptimConfig
from rl.train.objectives import OPDObjective
from rl.train.trainer import TrainBatch, Trainer, merge_step_metrics
from teachers.config import TeacherPoolConfig
from teachers.pool import TeacherPool
from tests.conftest import debug_config
from tests.numerics import assert_close_to_reference, decoder_rounding, float64_reference

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


def _full_logits_loss(model: Decoder, reference: Decoder, rows: TrainBatch, stage, kind: str) -> torch.Tensor:
    """The loss as computed before response_logprobs: logits at every position of the padded batch."""
    from rl.train.losses import PolicyLossInputs, grpo_loss, reference_kl, sft_loss, token_logprobs

    b = rows.pack("cpu")
    lp = token_logprobs(model(b.input_ids)[0], b.targets, 0.7 if kind == "grpo" else 1.0)
    if kind == "sft":
        return sft_loss(lp, b.mask, rows.num_tokens)[0]
    x = PolicyLossInputs(logprobs=lp, behavior_logprobs=b.behavior_logprobs, advantages=torch.tensor(rows.advantages_B),
                         mask=b.mask, num_tokens=rows.num_tokens, keep=torch.ones_like(b.mask))
    loss, _ = grpo_loss(x, clip_low=stage.clip_low, clip_high=stage.clip_high, ratio=stage.importance.ratio,
                        tis_cap=stage.importance.tis_cap)
    with torch.no_grad():
        ref = token_logprobs(reference(b.input_ids)[0], b.targets, 0.7)
    return loss + stage.kl_ref_coef * (reference_kl(lp, ref) * b.mask).sum() / rows.num_tokens


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_logits_on_response_positions_only_give_the_full_logits_loss_and_gradient(kind):
    from rl.config import GRPOStage, SFTStage
    from rl.train.objectives import build_objective

    torch.manual_seed(0)
    model, reference = Decoder(debug_config(moe=False)), Decoder(debug_config(moe=False))
    g = torch.Generator().manual_seed(2)
    rows = _rows(["t"] * 5)  # prompts of 3-5 tokens, responses of 2-5: padding and prompt positions in the batch
    rows = TrainBatch(rows.prompts_B, rows.responses_B, rows.num_tokens,
                      [tuple((-torch.rand(len(r), generator=g)).tolist()) for r in rows.responses_B], rows.versions_B,
                      None, torch.randn(5, generator=g).tolist())
    stage = GRPOStage(kl_ref_coef=0.1) if kind == "grpo" else SFTStage()
    objective = build_objective(stage, model=model, temperature=0.7 if kind == "grpo" else 1.0, current_version=0,
                                reference=reference)
    b = rows.pack("cpu")
    assert (b.mask == 0).any()  # prompt and padding positions the head no longer sees
    loss = objective(model, b, rows, None).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = _full_logits_loss(model, reference, rows, stage, kind)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_grpo_step_reports_the_policys_mean_token_entropy_on_response_positions(monkeypatch):
    """`rl/entropy`: the token-weighted mean over response positions (micro-batches of 2 rows, summed in chunks
    of 3 positions) of -Σ_v p(v) log p(v) at the rollout temperature, computed here from the full-sequence logits."""
    from rl.train import objectives
    from rl.config import GRPOStage
    from rl.train.objectives import build_objective

    monkeypatch.setattr(objectives, "ENTROPY_CHUNK_ROWS", 3)

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False))
    rows = _rows(["t"] * 5)
    objective = build_objective(GRPOStage(micro_batch_size=2), model=model, temperature=0.7, current_version=0)
    want, n = 0.0, 0
    for p, r in zip(rows.prompts_B, rows.responses_B):
        ids = torch.tensor([list(p) + list(r)[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0][0, len(p) - 1:].double() / 0.7, -1)
        want += float(-(logp.exp() * logp).sum())
        n += len(r)
    m = merge_step_metrics([Trainer(model, OptimConfig(lr=1e-3)).train_step(rows, objective)])  # forward before the update
    assert m["rl/entropy"] == pytest.approx(want / n, rel=1e-4)
    assert 0 < m["rl/entropy"] < torch.log(torch.tensor(float(model.config.vocab_size)))


def test_entropy_bonus_subtracts_coef_times_the_summed_token_entropy_from_the_loss_and_its_gradient():
    """GRPOStage.entropy_coef c: loss and gradient are those of c = 0 minus c · Σ_positions H ÷ the step's tokens,
    H computed here from the full-sequence logits (micro-batches of 2 rows, temperature 0.7)."""
    from rl.config import GRPOStage
    from rl.train.objectives import build_objective

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False))
    rows = _rows(["t"] * 5)
    rows = TrainBatch(**{**rows.__dict__, "advantages_B": [1.0, -0.5, 0.0, 2.0, -1.0]})
    grads, metrics = [], []
    for coef in (0.0, 0.3):
        m = Decoder(debug_config(moe=False))
        m.load_state_dict(model.state_dict())
        objective = build_objective(GRPOStage(micro_batch_size=2, entropy_coef=coef), model=m, temperature=0.7,
                                    current_version=0)
        metrics.append(merge_step_metrics([Trainer(m, OptimConfig(lr=1e-3)).accumulate(rows, objective)]))
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    h_sum = 0.0
    for p, r in zip(rows.prompts_B, rows.responses_B):
        logp = torch.log_softmax(model(torch.tensor([list(p) + list(r)[:-1]]))[0][0, len(p) - 1:] / 0.7, -1)
        h_sum = h_sum - (logp.exp() * logp).sum()
    (h_sum / rows.num_tokens).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[1][k] - grads[0][k], -0.3 * p.grad, rtol=1e-3, atol=1e-6)
    assert any(float(p.grad.abs().max()) > 1e-4 for p in model.parameters())
    assert metrics[1]["rl/loss"] == pytest.approx(metrics[0]["rl/loss"] - 0.3 * float(h_sum.detach()) / rows.num_tokens, rel=1e-4)
    # the entropy metric, with the bonus (computed with gradient) and without (chunked, without): the float64 step's,
    # to float32 rounding (tests/numerics.py)
    exact = Decoder(debug_config(moe=False)).double()
    exact.load_state_dict(model.state_dict())
    with float64_reference():
        objective = build_objective(GRPOStage(micro_batch_size=2), model=exact, temperature=0.7, current_version=0)
        entropy = merge_step_metrics([Trainer(exact, OptimConfig(lr=1e-3)).accumulate(rows, objective)])["rl/entropy"]
    positions = len(rows) * max(len(p) + len(r) - 1 for p, r in zip(rows.prompts_B, rows.responses_B))
    for with_bonus in (False, True):
        assert_close_to_reference(metrics[with_bonus]["rl/entropy"], entropy, dtype=torch.float32, msg=with_bonus,
                                  **decoder_rounding(model.config, positions, backward=False))


def test_entropy_target_scales_the_bonus_by_the_shortfall_and_drops_it_above_the_target():
    """entropy_target T: the bonus's weight is coef · max(0, 1 - H / T), H the micro-batch's mean token entropy:
    the gradient is the fixed bonus's scaled by that factor below T, and no bonus at all above T."""
    from rl.config import GRPOStage
    from rl.train.objectives import build_objective

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False))
    rows = _rows(["t"] * 5)
    rows = TrainBatch(**{**rows.__dict__, "advantages_B": [1.0, -0.5, 0.0, 2.0, -1.0]})
    h_sum = 0.0
    for p, r in zip(rows.prompts_B, rows.responses_B):
        logp = torch.log_softmax(model(torch.tensor([list(p) + list(r)[:-1]]))[0][0, len(p) - 1:], -1)
        h_sum = h_sum - (logp.exp() * logp).sum()
    mean = float(h_sum.detach()) / rows.response_tokens
    (h_sum / rows.num_tokens).backward()

    def grads(**kw):
        m = Decoder(debug_config(moe=False))
        m.load_state_dict(model.state_dict())
        objective = build_objective(GRPOStage(micro_batch_size=5, **kw), model=m, temperature=1.0, current_version=0)
        metrics = merge_step_metrics([Trainer(m, OptimConfig(lr=1e-3)).accumulate(rows, objective)])
        return {k: p.grad.clone() for k, p in m.named_parameters()}, metrics

    plain, _ = grads()
    below, m_below = grads(entropy_coef=0.3, entropy_target=2 * mean)  # the entropy is half the target: factor 0.5
    above, m_above = grads(entropy_coef=0.3, entropy_target=0.5 * mean)
    assert m_below["rl/entropy_coef"] == pytest.approx(0.15, rel=1e-4) and m_above["rl/entropy_coef"] == 0.0
    for k, p in model.named_parameters():
        torch.testing.assert_close(below[k] - plain[k], -0.15 * p.grad, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(above[k], plain[k], rtol=0, atol=0)
    with pytest.raises(ValueError, match="entropy_target needs entropy_coef"):
        GRPOStage(entropy_target=0.3)
