"""Packed micro-batches (issue #41, model/varlen.py): rows back to back with no padding, positions restarting per
row, attention masked to each row. On this CPU the packed layout runs for real (one causal attention call per row
over the concatenated tokens), so these compare it against the padded layout: the same hidden states at every real
token, and a training step whose gradients are the float64 padded step's to float32 rounding, for SFT and GRPO on a
dense model, an MoE model replaying recorded routing, and a model training with FP4 KV fake-quantisation (QAT)."""

import copy

import pytest
import torch

from model.decoder import Decoder
from model.varlen import PackedSequences, varlen_attention
from rl.config import GRPOStage, OPDStage, OptimConfig, SFTStage
from rl.train.objectives import GRPOObjective, SFTObjective
from rl.train.trainer import Trainer, merge_step_metrics, micro_batches, pack
from tests.conftest import debug_config
from tests.numerics import assert_close_to_reference, decoder_rounding
from tests.unit.test_trainer import _float64_step, _rows

VARIANTS = {"dense": dict(moe=False), "moe": dict(moe=True), "qat_fp4": dict(moe=False, kv_cache={"dtype": "fp4", "qat": True})}


def _model(variant: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(debug_config(**VARIANTS[variant])).float()


def _with_routing(model: Decoder, rows):
    """The rows with the routing trace a rollout of them records: each input token's expert ids, per layer."""
    traces = []
    with torch.no_grad():
        for p, r in zip(rows.prompts_B, rows.responses_B):
            ids = torch.tensor([list(p) + list(r)][0][:-1])[None]
            traces.append(model.forward_hidden(ids).routing[0].numpy())
    return type(rows)(**{**rows.__dict__, "routing_B": traces})


def test_varlen_attention_is_each_row_attended_alone():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 7, 5]
    q = torch.randn(1, sum(lengths), 4, 8, generator=g)
    k, v = torch.randn(2, 1, sum(lengths), 2, 8, generator=g)  # GQA: 2 KV heads for 4 query heads
    out = varlen_attention(q, k, v, PackedSequences.from_lengths(lengths, "cpu"))
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, sl].transpose(1, 2), k[:, sl].transpose(1, 2), v[:, sl].transpose(1, 2), is_causal=True,
            enable_gqa=True).transpose(1, 2)
        assert torch.equal(out[:, sl], alone)
        start += n
    # a row's output does not depend on its neighbours: change row 0's keys, rows 1-3 stay
    k2 = k.clone()
    k2[:, :3] += 1.0
    out2 = varlen_attention(q, k2, v, PackedSequences.from_lengths(lengths, "cpu"))
    assert torch.equal(out2[:, 3:], out[:, 3:]) and not torch.equal(out2[:, :3], out[:, :3])
    with pytest.raises(ValueError, match="at least one token"):
        PackedSequences.from_lengths([2, 0], "cpu")


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_packed_forward_gives_every_real_token_the_padded_forwards_hidden_state(variant):
    model = _model(variant).eval()
    rows = _rows(9, seed=1)
    if variant == "moe":
        rows = _with_routing(model, rows)
    padded = rows.pack("cpu", routing=variant == "moe")
    packed = rows.pack("cpu", routing=variant == "moe", packed=True)
    assert packed.flat_ids.shape == (1, int(padded.lengths.sum())) and packed.routing is None
    with torch.no_grad():
        a = model.forward_hidden(**padded.forward_kwargs(routing=variant == "moe"))
        b = model.forward_hidden(**packed.forward_kwargs(routing=variant == "moe"))
    real = padded.token_mask().nonzero(as_tuple=True)
    # float32 paths that differ only in how attention's reductions are blocked (one row alone or in a batch)
    bound = decoder_rounding(model.config, padded.input_ids.shape[1], backward=False)
    assert_close_to_reference(packed.at(b.hidden, real), a.hidden[real].double(), dtype=torch.float32, **bound)
    assert torch.equal(packed.unpack(b.hidden)[real], packed.at(b.hidden, real))
    assert (packed.unpack(b.hidden)[~padded.token_mask()] == 0).all()
    if variant == "moe":  # replayed: the same experts at every real token
        assert torch.equal(b.routing[0], a.routing[real])
    # without the document mask (one causal row over everything) the later rows would see the earlier ones
    with torch.no_grad():
        leaky = model.forward_hidden(packed.flat_ids, routing_replay=packed.flat_routing if variant == "moe" else None)
    assert not torch.allclose(leaky.hidden, b.hidden, atol=1e-3)


def _make(objective: str, model: Decoder, **extra):
    if objective == "sft":
        return SFTObjective(SFTStage(**extra))
    return GRPOObjective(GRPOStage(group_size=4, **{"micro_batch_size": 5, **extra}), model=model, temperature=0.9,
                         current_version=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_packed_step_is_the_padded_step(objective, variant):
    """Gradients and metrics of the packed step (micro-batches by rows, then by a token budget) against the float64
    padded step, within tests/numerics.py's bound for the decoder's chain of roundings."""
    model = _model(variant)
    rows = _rows(12, seed=2)
    if variant == "moe":
        rows = _with_routing(model, rows)
    exact = _float64_step(model, rows, lambda m: _make(objective, m, packing="padded"))
    positions = sum(len(p) + len(r) - 1 for p, r in zip(rows.prompts_B, rows.responses_B))
    for extra in ({"packing": "packed"}, {"packing": "packed", "micro_batch_tokens": 30}):
        trainer = Trainer(copy.deepcopy(model), OptimConfig())
        objective_ = _make(objective, trainer.model, **extra)
        assert trainer.packs(objective_)
        metrics = merge_step_metrics([trainer.accumulate(rows, objective_)])
        grads, ref_metrics = exact
        for (name, p), g in zip(trainer.model.named_parameters(), grads, strict=True):
            assert_close_to_reference(p.grad, g, dtype=torch.float32, msg=name,
                                      **decoder_rounding(model.config, positions, backward=True))
        assert metrics.keys() == ref_metrics.keys()
        for k, v in ref_metrics.items():
            assert_close_to_reference(metrics[k], v, dtype=torch.float32, msg=k,
                                      **decoder_rounding(model.config, positions, backward=False))


def test_which_steps_pack():
    dense = Decoder(debug_config(moe=False))
    cpu = Trainer(dense, OptimConfig())
    grpo = lambda **kw: GRPOObjective(GRPOStage(**kw), model=dense, temperature=1.0, current_version=0)  # noqa: E731
    assert not cpu.packs(grpo()) and cpu.packs(grpo(packing="packed")) and not cpu.packs(grpo(packing="padded"))
    assert Trainer(dense, OptimConfig(), packing="packed").packs(grpo())  # the trainer's override (benchmarks)
    assert Trainer(dense, OptimConfig(), device="cuda").packs(grpo())  # auto: packed on CUDA
    assert not Trainer(dense, OptimConfig(), device="cuda").packs(grpo(packing="padded"))

    class OPD:  # OPD's teachers read padded rows: an OPD objective never packs (its class says so)
        packs, packing = False, "packed"
    assert not cpu.packs(OPD()) and OPDStage.model_fields["packing"].default == "auto"
    sparse = Decoder(debug_config(moe=False, num_layers=1, sparse_attention={
        "compress_ratio": 2, "topk": 3, "window": 4, "index_heads": 2, "index_dim": 16, "layer_modes": ("full",)}))
    assert not Trainer(sparse, OptimConfig(), device="cuda").packs(grpo(packing="packed"))
    # on CUDA with neither micro-batch field set: token budgets; with micro_batch_size set: rows
    rows = _rows(40, seed=3)
    plan, packed = Trainer(dense, OptimConfig(), device="cuda").micro_batch_plan(rows, grpo())
    assert packed and len(plan) == 1  # 40 short rows fit in one 16,384-token micro-batch
    plan, _ = Trainer(dense, OptimConfig(), device="cuda").micro_batch_plan(rows, grpo(micro_batch_size=16))
    assert [len(p) for p in plan] == [16, 16, 8]


def test_packed_token_budgets_count_real_tokens():
    rows = _rows(40, seed=3)
    length = [len(p) + len(r) - 1 for p, r in zip(rows.prompts_B, rows.responses_B)]
    for budget in (1, 12, 25, 60):
        parts = micro_batches(rows, None, budget, packed=True)
        assert sorted(i for p in parts for i in p) == list(range(40))
        for p in parts:
            assert len(p) == 1 or sum(length[i] for i in p) <= budget, (budget, p)
        for a, b in zip(parts, parts[1:]):  # greedy: the next row would not have fitted
            assert sum(length[i] for i in a) + length[b[0]] > budget
        assert len(parts) <= len(micro_batches(rows, None, budget))  # never more forwards than padded budgets


def test_the_token_cap_splits_micro_batches_and_keeps_the_gradient():
    """Trainer.token_cap (the worker sets it from the device's free memory, rl/runtime/memory.py): a micro-batch of
    rows that would hold more tokens is split, packed or padded, and the step's gradient is the uncapped one's."""
    model = _model("dense")
    rows = _rows(12, seed=2)
    length = [len(p) + len(r) - 1 for p, r in zip(rows.prompts_B, rows.responses_B)]
    grads = {}
    for packing in ("packed", "padded"):
        for cap in (None, 25):
            trainer = Trainer(copy.deepcopy(model), OptimConfig())
            trainer.token_cap = cap
            objective = _make("grpo", trainer.model, packing=packing)  # micro_batch_size 5: three micro-batches
            plan, packed = trainer.micro_batch_plan(rows, objective)
            assert sorted(i for p in plan for i in p) == list(range(12))
            computed = [sum(length[i] for i in p) if packed else len(p) * max(length[i] for i in p) for p in plan]
            if cap is None:
                assert [len(p) for p in plan] == [5, 5, 2]
            else:
                assert len(plan) > 3 and all(len(p) == 1 or c <= cap for p, c in zip(plan, computed)), computed
            trainer.accumulate(rows, objective)
            grads[packing, cap] = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        rel = float((grads[packing, 25] - grads[packing, None]).norm() / grads[packing, None].norm())
        assert rel < 1e-5, (packing, rel)  # float32: the same sums in other groupings


def test_packing_lays_rows_back_to_back():
    b = pack([[5, 6], [7]], [[8, 9, 10], [11, 12]], packed=True, routing_B=[
        torch.arange(4 * 2).view(4, 1, 2).numpy(), torch.arange(100, 104).view(2, 1, 2).numpy()])
    assert b.flat_ids.tolist() == [[5, 6, 8, 9, 7, 11]]  # row 0: 4 inputs, row 1: 2
    assert b.packed.offsets == (0, 4, 6) and b.packed.positions("cpu").tolist() == [[0, 1, 2, 3, 0, 1]]
    assert b.flat_routing[0, :, 0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [100, 101], [102, 103]]
    assert b.targets.tolist() == [[6, 8, 9, 10], [11, 12, 0, 0]]  # the losses' [B, T] view is the padded one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel is CUDA's")
def test_on_cuda_the_packed_step_takes_flash_varlen_and_the_padded_steps_gradients():
    """bf16 autocast on CUDA: the packed forward runs FlashAttention's variable-length kernel (model/varlen.py), one
    launch per layer for all the rows, and the
    step's gradient is the padded step's within bf16 rounding (2% of the gradient's norm: different kernels and sums)."""
    from model.varlen import flash_varlen_ok

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False, max_position_embeddings=512)).float().cuda()
    rows = _rows(16, seed=4)
    grads = {}
    for mode in ("padded", "packed"):
        trainer = Trainer(copy.deepcopy(model), OptimConfig(), device="cuda", autocast=torch.bfloat16)
        objective = _make("grpo", trainer.model, packing=mode)
        assert trainer.packs(objective) == (mode == "packed")
        if mode == "packed":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                trainer.accumulate(rows, objective)
            # FlashAttention's forward kernel once per layer and packed micro-batch, not once per row (the per-row
            # SDPA fallback would launch it once per row: 16 rows here)
            plan, packed = trainer.micro_batch_plan(rows, objective)
            launches = sum(e.count for e in prof.key_averages() if "flash_fwd" in e.key.lower())
            assert packed and launches == model.config.num_layers * len(plan) < len(rows), \
                (launches, len(plan), [e.key for e in prof.key_averages()][:40])
        else:
            trainer.accumulate(rows, objective)
        grads[mode] = torch.cat([p.grad.float().flatten() for p in trainer.model.parameters()])
    q = torch.zeros(1, 4, 4, 16, device="cuda", dtype=torch.bfloat16)
    assert flash_varlen_ok(q)
    rel = float((grads["packed"] - grads["padded"]).norm() / grads["padded"].norm())
    assert rel < 2e-2, rel
