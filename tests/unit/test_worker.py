"""PolicyWorker phases in-process: interrupt -> weight update in place -> resume, with no prefill."""

import numpy as np
import pytest
import torch

from rl.config import Recipe
from rl.runtime.worker import PolicyWorker
from rollout.types import GenerationRequest

RECIPE = {
    "run": {"name": "w", "seed": 0},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "init_std": 0.15,
              "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}},
    "datasets": [{"type": "arithmetic"}],
    "engine": {"max_batch_size": 8, "block_size": 4, "max_seq_len": 64, "max_new_tokens": 30},
    "runtime": {"ray": False},
    "stages": [{"type": "grpo", "prompts_per_step": 1, "group_size": 2, "dispatch": {"max_inflight": 8}}],
}


def _worker(**engine):
    return PolicyWorker(Recipe.model_validate({**RECIPE, "engine": {**RECIPE["engine"], **engine}} if engine else RECIPE))


def _reqs():
    return [GenerationRequest(f"s{i}", (1, 20 + i, 30, 40 + i), 30, seed=i) for i in range(4)]


@pytest.mark.parametrize("park", ["host", "pool"])
def test_interrupt_update_resume_continues_exact_tokens_without_prefill(park):
    """`engine.park_kv` host: the states leave the pool during TRAIN and come back slot for slot; pool (the default):
    they stay where they are, nothing copied. Either way the next segment continues without a prefill."""
    w = _worker(park_kv=park)
    w.add_requests(_reqs())
    for _ in range(5):
        w.rollout()
    free = w.engine.cache.num_free_blocks
    snapshot = {s.request.sample_id: s for s in w.engine.snapshot()}  # what a checkpoint would write now
    held = w.interrupt()
    if park == "pool":
        states = snapshot
        assert held["states"] == len(states) > 0 and held["bytes"] == 0 and not w._held
        assert w.engine.cache.num_free_blocks == free  # in place
        assert sorted(s.request.sample_id for s in w.engine.snapshot()) == sorted(states)  # what a checkpoint writes
    else:
        states = {s.request.sample_id: s for s in w._held}  # the parked states, white-box
        assert held["states"] == len(states) > 0 and held["bytes"] == sum(s.nbytes for s in states.values())
        assert w.engine.cache.num_free_blocks == w.engine.cache.num_blocks  # device KV released during TRAIN
        for sid, st in states.items():  # the same bytes a snapshot copies
            assert torch.equal(st.k, snapshot[sid].k) and st.tokens == snapshot[sid].tokens
    with torch.no_grad():  # the weight update, in place, on the module the engine shares
        for p in w.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    w.update_weights(1)
    prefills = w.engine.stats.prefill_calls
    w.resume()
    w.rollout()
    assert w.engine.stats.prefill_calls == prefills  # no prompt or response token prefilled again
    # The KV the engine now holds for each resumed sample is the persisted one, slot for slot.
    for seq in w.engine._active:
        st = states[seq.request.sample_id]
        n = st.k.shape[1]
        slots = torch.tensor(w.engine.cache.slots(seq.blocks, 0, n))
        assert torch.equal(w.engine.cache.k[:, slots], st.k) and torch.equal(w.engine.cache.v[:, slots], st.v)
    gens = []
    while w.engine.has_work():
        gens += w.rollout().finished
    for g in gens:
        st = states[g.sample_id]
        full = list(g.prompt_tokens) + list(g.response_tokens)
        assert full[: len(st.tokens)] == st.tokens  # tokens before the interrupt unchanged
        n0 = st.num_response_tokens
        assert list(g.policy_versions) == [0] * n0 + [1] * (len(g.response_tokens) - n0)
        # concatenated routing replay record: the first segment's trace, then the new segment's
        assert np.array_equal(g.routing_trace[: st.routing.shape[0]], st.routing)
        assert g.routing_trace.shape[0] == len(full) - 1
    assert w.engine.stats.reprefill_tokens == 0
    assert w.engine.cache.num_free_blocks == w.engine.cache.num_blocks  # finished samples freed


def test_new_segment_uses_new_weights():
    """After the update, continuation differs from what the old weights would have produced."""
    base = _worker()
    ref = {g.sample_id: g for g in base.generate(_reqs())}
    w = _worker()
    w.add_requests(_reqs())
    for _ in range(3):
        w.rollout()
    w.interrupt()
    with torch.no_grad():
        for p in w.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    w.resume()
    gens = []
    while w.engine.has_work():
        gens += w.rollout().finished
    assert any(g.response_tokens != ref[g.sample_id].response_tokens for g in gens)
    assert all(g.response_tokens[:2] == ref[g.sample_id].response_tokens[:2] for g in gens)


def test_a_stage_with_a_kl_penalty_keeps_the_runs_initial_policy_as_reference():
    from rl.train.trainer import TrainBatch, merge_step_metrics

    recipe = Recipe.model_validate({**RECIPE, "stages": [{**RECIPE["stages"][0], "kl_ref_coef": 0.1}]})
    w = PolicyWorker(recipe)
    with torch.no_grad():  # the policy moves away from its initial weights (e.g. an earlier stage)
        for p in w.model.parameters():
            p.add_(0.01)
    rng_before = torch.get_rng_state()
    w.begin_stage(recipe.stages[0])
    assert torch.equal(torch.get_rng_state(), rng_before)  # building the reference leaves the training RNG alone
    initial = PolicyWorker(recipe).model
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in zip(w.reference.parameters(), initial.parameters()))
    gens = w.generate(_reqs())
    batch = TrainBatch([g.prompt_tokens for g in gens], [g.response_tokens for g in gens],
                       float(sum(len(g.response_tokens) for g in gens)), [g.logprobs for g in gens],
                       [g.policy_versions for g in gens], [g.routing_trace for g in gens], [1.0, -1.0, 0.5, -0.5])
    m = merge_step_metrics([w.train_step(batch, recipe.stages[0])])
    assert m["rl/kl_ref"] > 0  # the policy had moved: a positive penalty


def test_bfloat16_trains_float32_master_weights_and_refreshes_the_engines_copy_in_place():
    """run.dtype bfloat16 (mixed precision): the trainer's master weights and AdamW state stay float32, the
    forward runs under bf16 autocast, and the engine decodes with a bf16 copy that `update_weights` refreshes
    in the same tensors (captured CUDA graphs keep their addresses)."""
    from rl.train.trainer import TrainBatch

    recipe = Recipe.model_validate({**RECIPE, "run": {**RECIPE["run"], "dtype": "bfloat16"}})
    w = PolicyWorker(recipe)
    engine_params = list(w.engine.model.parameters())
    assert w.engine.model is w.rollout_model is not w.model
    assert {p.dtype for p in w.model.parameters()} == {torch.float32}
    assert {p.dtype for p in engine_params} == {torch.bfloat16} and not any(p.requires_grad for p in engine_params)
    assert w.engine.cache.k.dtype == torch.bfloat16  # the unquantised cache in the engine's dtype
    assert all(torch.equal(e, m.to(torch.bfloat16)) for e, m in zip(engine_params, w.model.parameters()))
    addresses = [p.data_ptr() for p in engine_params]

    w.begin_stage(recipe.stages[0])
    gens = w.generate(_reqs())
    batch = TrainBatch([g.prompt_tokens for g in gens], [g.response_tokens for g in gens],
                       float(sum(len(g.response_tokens) for g in gens)), [g.logprobs for g in gens],
                       [g.policy_versions for g in gens], [g.routing_trace for g in gens], [1.0, -1.0, 0.5, -0.5])
    before = [p.detach().clone() for p in w.model.parameters()]
    w.train_step(batch, recipe.stages[0])
    assert {p.dtype for p in w.model.parameters()} == {torch.float32}
    assert {s["exp_avg"].dtype for s in w.trainer.opt.state.values()} == {torch.float32}
    assert any(not torch.equal(a, b) for a, b in zip(before, w.model.parameters()))  # it trained
    stale = [p.clone() for p in engine_params]
    w.update_weights(1)
    assert [p.data_ptr() for p in w.engine.model.parameters()] == addresses
    assert all(torch.equal(e, m.to(torch.bfloat16)) for e, m in zip(engine_params, w.model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(stale, engine_params))

    # the forward ran in bf16: the same step under float32 gives different weights
    w32 = PolicyWorker(Recipe.model_validate(RECIPE))
    w32.begin_stage(recipe.stages[0])
    w32.train_step(batch, recipe.stages[0])
    assert all(torch.equal(a, b) for a, b in zip(before, PolicyWorker(Recipe.model_validate(RECIPE)).model.parameters()))
    assert any(not torch.allclose(a, b, atol=0, rtol=0) for a, b in zip(w32.model.parameters(), w.model.parameters()))


def test_a_rollout_call_reports_how_long_the_worker_waited_for_it_since_the_last_one():
    """`StepResult.gap_s` (the job's `time/worker_gap_s`): the wait between two consecutive rollout calls; none for
    the first call, nor after an interrupt (a train step or a checkpoint came between: that time is theirs)."""
    import time

    w = _worker()
    w.add_requests(_reqs())
    assert w.rollout().gap_s == 0.0
    time.sleep(0.3)
    second = w.rollout()
    assert second.gap_s >= 0.3
    assert w.rollout().gap_s < 0.3  # called at once
    w.interrupt()
    time.sleep(0.3)
    w.resume()
    assert w.rollout().gap_s == 0.0
