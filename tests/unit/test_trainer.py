"""The trainer's micro-batch loop and the merge of data-parallel ranks' metrics: two ranks, each
normalising by the global token count, take exactly the step one rank takes on the whole batch."""

import copy

import pytest
import torch

from model.decoder import Decoder
from rl.config import GRPOStage, OptimConfig, SFTStage
from rl.train.losses import group_advantages
from rl.train.objectives import GRPOObjective, SFTObjective
from rl.train.trainer import StepMetrics, TrainBatch, Trainer, merge_step_metrics, micro_batches, padded_length
from tests.conftest import debug_config
from tests.numerics import assert_close_to_reference, decoder_rounding, float64_reference


def test_sums_add_means_are_token_weighted_ratios_recomputed_shared_is_rank0s():
    r0 = StepMetrics(sums={"rl/loss": 0.25, "opd/kl_sum": 6.0, "opd/kl_tokens": 30.0, "teachers/loads": 2.0,
                           "teachers/load_wait_s": 0.01, "teachers/compute_s": 0.5},
                     means={"rl/clip_frac": 0.5}, tokens=30, shared={"train/grad_norm": 3.0})
    r1 = StepMetrics(sums={"rl/loss": 0.5, "opd/kl_sum": 6.0, "opd/kl_tokens": 10.0, "teachers/loads": 1.0,
                           "teachers/load_wait_s": 0.04, "teachers/compute_s": 0.5},
                     means={"rl/clip_frac": 0.0}, tokens=10, shared={"train/grad_norm": 3.0})
    m = merge_step_metrics([r0, r1])
    assert m["rl/loss"] == pytest.approx(0.75)
    assert m["rl/clip_frac"] == pytest.approx(0.375)  # (0.5·30 + 0·10) / 40
    assert m["opd/kl_per_token"] == pytest.approx(12.0 / 40) and m["opd/kl_tokens"] == 40.0
    assert m["teachers/loads"] == 3.0 and m["teachers/overhead"] == pytest.approx(0.05 / 1.0)
    assert m["train/grad_norm"] == 3.0


def _rows(n: int, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [tuple(torch.randint(3, 99, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()) for _ in range(n)]
    responses = [tuple(torch.randint(3, 99, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()) for _ in range(n)]
    rewards = torch.rand(n, generator=g).tolist()
    adv = group_advantages(rewards, [f"g{i // 4}" for i in range(n)], std_normalize=False)
    logprobs = [tuple((-torch.rand(len(r), generator=g)).tolist()) for r in responses]
    return TrainBatch(prompts, responses, float(sum(map(len, responses))), logprobs, [(0,) * len(r) for r in responses],
                      None, adv)


def _float64_step(model: Decoder, rows: TrainBatch, make) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The step's exact gradients and metrics: the same objective on a float64 copy of `model`, one batch
    (tests/numerics.py: `float64_reference` keeps the code's float32 casts in float64)."""
    ref = Trainer(copy.deepcopy(model).double(), OptimConfig())
    with float64_reference():
        metrics = merge_step_metrics([ref.accumulate(rows, make(ref.model))])
    return [p.grad for p in ref.model.parameters()], metrics


def _assert_step_is_the_reference(model: Decoder, trainer: Trainer, metrics: dict[str, float] | None,
                                  reference: tuple[list[torch.Tensor], dict[str, float]], rows: TrainBatch,
                                  seq_bucket: int = 1) -> None:
    """`trainer`'s float32 gradients (and merged `metrics`) are the float64 step's to float32 rounding, whatever
    order its micro-batches, ranks and kernels summed in: the bound of tests/numerics.py with the decoder's chain
    of roundings and the step's packed positions as the longest sum."""
    longest = max(len(p) + len(r) - 1 for p, r in zip(rows.prompts_B, rows.responses_B))
    positions = len(rows) * padded_length(longest, seq_bucket)
    grads, ref_metrics = reference
    for (name, p), g in zip(trainer.model.named_parameters(), grads, strict=True):
        assert_close_to_reference(p.grad, g, dtype=torch.float32, msg=name,
                                  **decoder_rounding(model.config, positions, backward=True))
    if metrics is not None:
        assert metrics.keys() == ref_metrics.keys()
        for k, v in ref_metrics.items():  # a metric's scale: its own magnitude (sums of like-signed terms)
            assert_close_to_reference(metrics[k], v, dtype=torch.float32, msg=k,
                                      **decoder_rounding(model.config, positions, backward=False))


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_two_ranks_with_the_global_normaliser_take_the_one_rank_step(objective):
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).float()
    rows = _rows(12)
    stage = SFTStage(micro_batch_size=3) if objective == "sft" else GRPOStage(group_size=4, micro_batch_size=3)

    def make(m):
        return (SFTObjective(stage) if objective == "sft"
                else GRPOObjective(stage, model=m, temperature=1.0, current_version=0))

    one = Trainer(copy.deepcopy(model), OptimConfig())
    whole = one.accumulate(rows, make(one.model))
    two = Trainer(copy.deepcopy(model), OptimConfig())
    parts = [two.accumulate(rows.select(range(0, 8)), make(two.model)),   # rank 0's groups
             two.accumulate(rows.select(range(8, 12)), make(two.model))]  # rank 1's: grads add up, as all-reduce
    exact = _float64_step(model, rows, make)  # both float32 steps are the float64 one-rank step to rounding
    _assert_step_is_the_reference(model, one, merge_step_metrics([whole]), exact, rows)
    _assert_step_is_the_reference(model, two, merge_step_metrics(parts), exact, rows)
    # the same two shards with rank 1 normalising by its own tokens: not the one-rank step
    local = Trainer(copy.deepcopy(model), OptimConfig())
    local.accumulate(rows.select(range(0, 8)), make(local.model))
    shard = rows.select(range(8, 12))
    local.accumulate(TrainBatch(**{**shard.__dict__, "num_tokens": shard.response_tokens}), make(local.model))
    with pytest.raises(AssertionError, match="off the float64 reference"):
        _assert_step_is_the_reference(model, local, None, exact, rows)


def test_micro_batches_by_tokens_keep_each_padded_size_within_the_budget():
    rows = _rows(40, seed=3)
    length = [len(p) + len(r) - 1 for p, r in zip(rows.prompts_B, rows.responses_B)]  # packed row lengths
    for budget in (1, 12, 25, 60, 10_000):
        parts = micro_batches(rows, 7, budget)  # rows=7 is ignored once a token budget is set
        assert sorted(i for p in parts for i in p) == list(range(40))  # every row once
        flat = [i for p in parts for i in p]
        assert [length[i] for i in flat] == sorted(length)  # shortest first, so a micro-batch pads to its last row
        for p in parts:
            assert len(p) == 1 or len(p) * max(length[i] for i in p) <= budget, (budget, p)
        for a, b in zip(parts, parts[1:]):  # greedy: the next row would not have fitted
            assert (len(a) + 1) * length[b[0]] > budget
    assert len(micro_batches(rows, None, 10_000)) == 1 and len(micro_batches(rows, None, 1)) == 40
    assert [len(p) for p in micro_batches(rows, 16, None)] == [16, 16, 8]


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_token_budget_takes_the_same_step_as_whole_batches(objective):
    torch.manual_seed(0)
    model, rows = Decoder(debug_config(moe=False)).float(), _rows(12)

    def make(m, extra):
        stage = SFTStage(**extra) if objective == "sft" else GRPOStage(group_size=4, micro_batch_size=12, **extra)
        return SFTObjective(stage) if objective == "sft" else GRPOObjective(stage, model=m, temperature=1.0,
                                                                            current_version=0)

    exact = _float64_step(model, rows, lambda m: make(m, {}))
    for extra in ({}, {"micro_batch_tokens": 20}):  # whole batches, then the budget: both the float64 step
        trainer = Trainer(copy.deepcopy(model), OptimConfig())
        metrics = merge_step_metrics([trainer.accumulate(rows, make(trainer.model, extra))])
        _assert_step_is_the_reference(model, trainer, metrics, exact, rows)
    assert len(micro_batches(rows, None, 20)) > 3  # the budget did split the step


def test_a_step_leaves_no_gradient_behind_for_the_next():
    torch.manual_seed(0)
    trainer = Trainer(Decoder(debug_config(moe=False)).float(), OptimConfig())
    rows, stage = _rows(4), SFTStage()
    trainer.train_step(rows, SFTObjective(stage))
    assert all(p.grad is None for p in trainer.model.parameters())


def test_kl_to_the_reference_is_zero_at_the_reference_and_pulls_back_towards_it():
    """k3 per token is 0 where the policy equals the reference, positive elsewhere, and its gradient
    step moves the policy's log-probabilities back towards the reference's."""
    torch.manual_seed(0)
    ref = Decoder(debug_config(moe=False)).float().eval().requires_grad_(False)
    rows = _rows(8)
    rows = TrainBatch(**{**rows.__dict__, "advantages_B": [0.0] * len(rows)})  # the KL term alone
    stage = GRPOStage(group_size=4, micro_batch_size=4, kl_ref_coef=1.0)

    same = Trainer(copy.deepcopy(ref).requires_grad_(True), OptimConfig(lr=1e-2))
    m = merge_step_metrics([same.accumulate(rows, GRPOObjective(stage, model=same.model, temperature=1.0,
                                                                current_version=0, reference=ref))])
    assert m["rl/kl_ref"] == pytest.approx(0.0, abs=1e-6)

    moved = copy.deepcopy(ref).requires_grad_(True)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    trainer = Trainer(moved, OptimConfig(lr=1e-3))

    def kl() -> float:
        return merge_step_metrics([trainer.accumulate(rows, GRPOObjective(stage, model=moved, temperature=1.0,
                                                                          current_version=0, reference=ref))])["rl/kl_ref"]

    before = kl()
    trainer.model.zero_grad()
    for _ in range(5):
        trainer.train_step(rows, GRPOObjective(stage, model=moved, temperature=1.0, current_version=0, reference=ref))
    assert before > 1e-3 and kl() < before


def test_tool_output_tokens_are_masked_out_of_the_loss():
    """A multi-turn sample's tool-output tokens (Sample.turns, loss mask 0) get mask 0 in the packed batch, and
    the step's token count covers only the sampled tokens."""
    from rl.types import Sample, Turn

    turns = (Turn("model", 0, 2, "ab"), Turn("tool", 2, 5, "out", tool="python", status="ok"), Turn("model", 5, 6, "c"))
    s = Sample("s", "p", "d", "p", (1, 2, 3), (4, 5, 6, 7, 8, 9), "", "", (0.0,) * 6, (0,) * 6, 1.0, True, "eos",
               turns=turns)
    plain = Sample("t", "p", "d", "p", (1, 2), (4, 5), "", "", (0.0,) * 2, (0,) * 2, 1.0, True, "eos")
    assert s.loss_mask_T() == (1, 1, 0, 0, 0, 1) and s.num_trained_tokens == 3 and plain.num_trained_tokens == 2
    b = TrainBatch.from_samples([s, plain], [1.0, 1.0], num_tokens=5.0).pack("cpu")
    assert b.mask[0, 2:8].tolist() == [1, 1, 0, 0, 0, 1] and b.mask[0].sum() == 3
    assert b.mask[1, 1:3].tolist() == [1, 1] and b.mask[1].sum() == 2


def _renorm(rows: TrainBatch) -> TrainBatch:
    return TrainBatch(**{**rows.__dict__, "num_tokens": rows.response_tokens})


def test_mini_batches_take_one_optimizer_step_each_in_order_and_merge_their_metrics():
    torch.manual_seed(0)
    model, rows = Decoder(debug_config(moe=False)).float(), _rows(12)
    stage = GRPOStage(group_size=4, micro_batch_size=3)
    first, second = _renorm(rows.select(range(0, 8))), _renorm(rows.select(range(8, 12)))

    def objective(m):
        return GRPOObjective(stage, model=m, temperature=1.0, current_version=0)

    mini = Trainer(copy.deepcopy(model), OptimConfig(lr=1e-2))
    merged = merge_step_metrics([mini.train_step([first, second], objective(mini.model))])
    steps = Trainer(copy.deepcopy(model), OptimConfig(lr=1e-2))  # the same two batches as two train steps
    a = merge_step_metrics([steps.train_step(first, objective(steps.model))])
    b = merge_step_metrics([steps.train_step(second, objective(steps.model))])
    for p, q in zip(mini.model.parameters(), steps.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert mini.sched.last_epoch == 2 and merged["train/optimizer_steps"] == 2
    share = first.num_tokens / (first.num_tokens + second.num_tokens)
    assert merged["rl/loss"] == pytest.approx(share * a["rl/loss"] + (1 - share) * b["rl/loss"])
    assert merged["train/grad_norm"] == pytest.approx((a["train/grad_norm"] + b["train/grad_norm"]) / 2)
    assert merged["rl/clip_frac"] == pytest.approx(share * a["rl/clip_frac"] + (1 - share) * b["rl/clip_frac"])
    # one mini-batch is the plain step
    one, plain = Trainer(copy.deepcopy(model), OptimConfig(lr=1e-2)), Trainer(copy.deepcopy(model), OptimConfig(lr=1e-2))
    m1 = merge_step_metrics([one.train_step([rows], objective(one.model))])
    m2 = merge_step_metrics([plain.train_step(rows, objective(plain.model))])
    timing = {k for k in m1 if k.startswith("train/") and k.endswith("_s")}  # the step's time split (wall clock)
    assert timing == {"train/forward_s", "train/backward_s", "train/optimizer_s"} and all(m1[k] > 0 for k in timing)
    assert {k: v for k, v in m1.items() if k not in timing} == pytest.approx(
        {k: v for k, v in m2.items() if k not in timing}) and "train/optimizer_steps" not in m1
    for p, q in zip(one.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _group(tokens: int) -> list:
    """A group of one sample of `tokens` prompt + response tokens (all the deal reads)."""
    from types import SimpleNamespace
    return [SimpleNamespace(prompt_tokens=[0] * 3, response_tokens=[0] * (tokens - 3))]


def test_mini_batch_groups_deal_whole_groups_balanced_with_a_group_per_worker():
    from rl.algo.async_grpo import mini_batch_groups

    tokens = (40, 10, 35, 12, 30, 9, 8, 20)
    groups = [_group(t) for t in tokens]
    parts = mini_batch_groups(groups, 4, n_workers=1)
    assert len(parts) == 4 and sorted(i for p in parts for i in p) == list(range(8))  # every group once
    loads = [sum(tokens[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 12  # LPT: 164 tokens in four parts of 38-47
    assert [p[0] for p in parts] == sorted(p[0] for p in parts)
    assert len(mini_batch_groups(groups, 4, n_workers=3)) == 2  # 8 groups, 3 workers: 2 mini-batches of >= 3
    assert all(len(p) >= 3 for p in mini_batch_groups(groups, 4, n_workers=3))
    assert mini_batch_groups(groups, 1, n_workers=2) == [list(range(8))]
    assert mini_batch_groups(groups[:1], 4, n_workers=2) == [[0]]


def test_padded_length_rounds_up_to_the_bucket_within_the_models_positions():
    from rl.train.trainer import padded_length

    assert [padded_length(t, 64) for t in (1, 63, 64, 65, 250)] == [64, 64, 64, 128, 256]
    assert padded_length(250, 1) == 250 and padded_length(250, 64, max_len=255) == 255
    assert padded_length(300, 64, max_len=255) == 300  # never below the longest row (the model refuses it itself)


@pytest.mark.parametrize("case", ["sft", "grpo", "grpo_moe_replay"])
def test_micro_batches_padded_to_a_bucket_take_the_unpadded_step(case):
    """With cuDNN attention the CUDA trainer pads each micro-batch's length up to a multiple of `seq_bucket` (one
    cuDNN graph per bucket, not per length): the extra positions are right padding, so the gradients and the metrics are the
    unpadded step's. MoE with routing replay: the padded positions carry no trace and no loss."""
    import numpy as np

    torch.manual_seed(0)
    moe = case == "grpo_moe_replay"
    model = Decoder(debug_config(moe=moe)).float()
    rows = _rows(12)
    if moe:
        g = np.random.default_rng(0)
        traces = [g.integers(0, 4, (len(p) + len(r) - 1, 2, 2)).astype(np.int16)
                  for p, r in zip(rows.prompts_B, rows.responses_B)]
        rows = TrainBatch(**{**rows.__dict__, "routing_B": traces})
    stage = SFTStage(micro_batch_size=5) if case == "sft" else GRPOStage(group_size=4, micro_batch_size=5)

    def make(m):
        return (SFTObjective(stage) if case == "sft"
                else GRPOObjective(stage, model=m, temperature=1.0, current_version=0))

    assert make(model).pads and rows.pack("cpu", pad_to=16).input_ids.shape[1] == 16  # rows of at most 13 tokens
    plain, padded = (Trainer(copy.deepcopy(model), OptimConfig(), seq_bucket=b) for b in (1, 16))
    assert make(plain.model).routing_replay == moe
    m1, m2 = (merge_step_metrics([t.accumulate(rows, make(t.model))]) for t in (plain, padded))
    exact = _float64_step(model, rows, make)  # the unpadded step in float64: both float32 steps are it to rounding
    _assert_step_is_the_reference(model, plain, m1, exact, rows)
    _assert_step_is_the_reference(model, padded, m2, exact, rows, seq_bucket=16)


def test_opd_does_not_pad_and_only_a_cuda_trainer_with_cudnn_attention_does():
    from rl.train.objectives import OPDObjective
    from rl.train.trainer import SEQ_BUCKET_CUDNN

    assert OPDObjective.pads is False  # its teachers read the packed ids with their own position limits
    model = Decoder(debug_config(moe=False))
    assert Trainer(model, OptimConfig()).seq_bucket == 1 and SEQ_BUCKET_CUDNN == 64
    assert Trainer(model, OptimConfig(), cudnn_attention=True).seq_bucket == 1  # the CPU has no cuDNN attention
    assert Trainer(model, OptimConfig(), device="cuda").seq_bucket == 1  # (the device is only named here)
    assert Trainer(model, OptimConfig(), device="cuda", cudnn_attention=True).seq_bucket == SEQ_BUCKET_CUDNN


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention is CUDA's")
def test_training_attention_on_cuda_takes_flash_not_cudnn_and_the_same_gradients():
    """cuDNN's SDPA kernels build a graph per new shape (`SEQ_BUCKET_CUDNN` says what that costs): the CUDA trainer
    leaves them out by default; with them allowed the step's gradients agree to bf16 precision."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).float().cuda()
    rows, stage = _rows(12), SFTStage(micro_batch_size=5)
    default, cudnn = (Trainer(copy.deepcopy(model), OptimConfig(), device="cuda", autocast=torch.bfloat16,
                              cudnn_attention=c) for c in (False, True))
    ops = {}
    for name, t in (("default", default), ("cudnn", cudnn)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t.accumulate(rows, SFTObjective(stage))
        ops[name] = {e.key for e in prof.key_averages() if "attention" in e.key}
    assert "aten::_scaled_dot_product_flash_attention" in ops["default"], ops
    assert not [k for k in ops["default"] if "cudnn" in k], ops
    for a, b in zip(default.model.parameters(), cudnn.model.parameters()):
        assert (a.grad - b.grad).norm() <= 2e-2 * b.grad.norm() + 1e-6
