"""CSA2 sparse attention wired into the decoder (seed §2.3), with an FP4 main KV / FP8 SWA cache and
QAT (seed §2.4.4): decode == full forward, the engine (lockstep batching, interrupt/resume without
prefill), the trainer (indexer KL in the loss, indexer gradients) and the cache-size formula."""

import numpy as np
import pytest
import torch

from model.decoder import Decoder
from model.sparse_attention import CSA2Cache, bytes_per_token
from rl.config import GRPOStage, OptimConfig, SFTStage
from rl.train.losses import group_advantages, token_logprobs
from rl.train.objectives import GRPOObjective, SFTObjective
from rl.train.trainer import TrainBatch, Trainer, merge_step_metrics, pack
from rl.types import Sample
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.types import GenerationRequest, RolloutState
from tests.conftest import debug_config

SPARSE = dict(compress_ratio=2, topk=3, window=4, index_heads=2, index_dim=16, layer_modes=("full", "reindex", "reuse"))
TOKENS = [1, 20, 31, 5, 9, 44, 17, 3, 60, 2, 11, 12, 13, 40]
ATOL = 1e-4  # float32; the paths see bit-identical K/V entries, only summation order differs
EOS = 2


def _model(kv_dtype="fp4", qat=True, **sparse):
    torch.manual_seed(0)
    cfg = debug_config(moe=True, num_layers=3, kv_cache={"dtype": kv_dtype, "qat": qat},
                       sparse_attention={**SPARSE, **sparse})
    return Decoder(cfg).eval()


def _incremental(model, tokens, P=5):
    cache = CSA2Cache()
    with torch.no_grad():
        out = [model(torch.tensor([tokens[:P]]), csa2_cache=cache)[0][0]]
        for t in range(P, len(tokens)):
            out.append(model(torch.tensor([[tokens[t]]]), csa2_cache=cache)[0][0])
    return torch.cat(out), cache


def _engine(model, **kw):
    return Engine(model, EngineConfig(**{"max_batch_size": 4, "block_size": 4, "max_seq_len": 40, **kw}), eos_id=EOS)


def _requests(n=4, max_new=8):
    # pairs share a prompt (a GRPO group): they advance as one lockstep batch
    return [GenerationRequest(f"s{i}", (1, 10 + i // 2, 20, 30 + i // 2, 7)[: 4 + (i // 2) % 2], max_new, seed=50 + i,
                              temperature=0.9) for i in range(n)]


@pytest.fixture(scope="module")
def reference():
    """Uninterrupted, continuously batched generations of `_requests()` by `_model("fp4")`."""
    torch.set_num_threads(2)
    return _engine(_model("fp4")).generate(_requests(4))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp4"])
def test_decode_through_csa2_cache_equals_training_forward(kv_dtype):
    m = _model(kv_dtype, qat=True)
    inc, cache = _incremental(m, TOKENS)
    with torch.no_grad():
        full = m(torch.tensor([TOKENS]))[0][0]
    assert torch.allclose(full, inc, atol=ATOL), (full - inc).abs().max()
    entries = cache.layers[0].entries_k
    if kv_dtype == "fp4":  # the cache stores packed E2M1 main entries and an FP8 SWA window
        assert entries.dtype == torch.uint8 and entries.shape[-1] == m.config.head_dim // 2
        assert cache.layers[0].swa_k.dtype == torch.uint8 and cache.layers[0].swa_k.shape[-1] == m.config.head_dim
        with torch.no_grad():  # and QAT is what makes training see it: without, the two differ
            plain = _model(kv_dtype, qat=False)(torch.tensor([TOKENS]))[0][0]
        assert (plain - inc).abs().max() > 10 * ATOL
    else:
        assert entries.dtype == torch.float32


def test_cache_growth_equals_bytes_per_token_formula():
    m = _model("fp4")
    c, sc = m.config, m.config.sparse_attention
    # seed §2.3/§2.4.4: one Full layer (of 3) adds (2·KVH·D·4.5/8 + DI·4) bytes per m tokens
    want = (2 * c.num_kv_heads * c.head_dim * 4.5 / 8 + sc.index_dim * 4) / sc.compress_ratio
    assert bytes_per_token(c, 4) == want == _engine(m).kv_bytes_per_token
    _, a = _incremental(m, TOKENS[:8], P=8)  # window full, no pending group
    _, b = _incremental(m, TOKENS[:12], P=8)
    assert (b.nbytes() - a.nbytes()) / 4 == want


def test_engine_lockstep_batches_equal_one_at_a_time(reference):
    m = _model("fp4")
    reqs = _requests(4)
    batched = reference
    single = [_engine(m, max_batch_size=1).generate([r])[0] for r in reqs]
    for a, b in zip(batched, single):
        assert a.response_tokens == b.response_tokens
        assert np.allclose(a.logprobs, b.logprobs, atol=ATOL) and np.array_equal(a.routing_trace, b.routing_trace)
        assert a.routing_trace.shape == (len(a.prompt_tokens) + len(a.response_tokens) - 1, 3, 2)


def test_engine_interrupt_resume_equals_uninterrupted(reference):
    m = _model("fp4")
    reqs = _requests(4)
    reference = {g.sample_id: g for g in reference}
    eng = _engine(m, max_batch_size=3)  # one request waits: it is never admitted before the interrupt
    eng.add(reqs)
    done = []
    for _ in range(3):
        done += eng.step()
    prefills = eng.stats.prefill_calls
    states = [RolloutState.from_bytes(s.to_bytes()) for s in eng.interrupt()]
    admitted = [s for s in states if s.has_kv]
    assert admitted and all(s.k is None and s.kv_format == "fp4" for s in admitted)
    assert all(s.csa2["0.entries_k"].dtype == torch.uint8 for s in admitted)  # storage format, not floats
    eng.resume(states)
    while eng.has_work():
        done += eng.step()
    got = {g.sample_id: g for g in done}
    assert got.keys() == reference.keys()
    for sid, g in got.items():
        assert g.response_tokens == reference[sid].response_tokens
        assert np.allclose(g.logprobs, reference[sid].logprobs, atol=ATOL)
        assert np.array_equal(g.routing_trace, reference[sid].routing_trace)
    never_admitted = len(states) - len(admitted)
    assert eng.stats.prefill_calls - prefills <= (1 if never_admitted else 0)
    assert eng.stats.reprefill_tokens == 0
    dense = Engine(Decoder(debug_config(kv_cache={"dtype": "fp4"})), EngineConfig(block_size=4, max_seq_len=40), eos_id=EOS)
    with pytest.raises(ValueError, match="holds a fp4 CSA2 KV cache; this engine stores fp4 paged"):
        dense.resume(admitted[:1])


def test_trainer_grpo_and_sft_steps_train_the_indexer(reference):
    m, gens = _model("fp4"), reference
    # QAT: the trained policy is the sampled one (teacher-forced logprobs == behaviour logprobs)
    b = pack([g.prompt_tokens for g in gens], [g.response_tokens for g in gens], [g.logprobs for g in gens],
             routing_B=[g.routing_trace for g in gens])
    with torch.no_grad():
        lp = token_logprobs(m(b.input_ids, routing_replay=b.routing)[0], b.targets, temperature=0.9)
    mask = b.mask.bool()
    assert torch.allclose(lp[mask], b.behavior_logprobs[mask], atol=ATOL)

    samples = [Sample(g.sample_id, f"p{i // 2}", "toy", f"p{i // 2}", g.prompt_tokens, g.response_tokens, "", "",
                      g.logprobs, g.policy_versions, float(i % 2), bool(i % 2), g.finish_reason,
                      routing_trace=g.routing_trace)
               for i, g in enumerate(gens)]
    trainer = Trainer(m, OptimConfig(lr=1e-2))
    idx_before = [p.detach().clone() for p in m.indexer_parameters()]
    assert idx_before
    adv = group_advantages([s.reward for s in samples], [s.group_id for s in samples], std_normalize=False)
    batch = TrainBatch.from_samples(samples, adv, float(sum(s.num_response_tokens for s in samples)))
    grpo = GRPOObjective(GRPOStage(group_size=2, micro_batch_size=2), model=m, temperature=0.9, current_version=0)
    metrics = merge_step_metrics([trainer.train_step(batch, grpo)])
    assert np.isfinite(metrics["rl/loss"]) and metrics["train/indexer_kl"] > 0
    assert all(not torch.equal(a, p) for a, p in zip(idx_before, m.indexer_parameters()))  # indexer moved

    # the indexer's gradient comes only from the weighted indexer KL: check it directly
    m.zero_grad()
    out = m.forward_hidden(b.input_ids, compute_indexer_loss=True)
    m.logits(out.hidden).logsumexp(-1).mean().backward()  # main loss alone: no indexer gradient
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in m.indexer_parameters())
    m.zero_grad()
    m.forward_hidden(b.input_ids, compute_indexer_loss=True).indexer_loss.backward()
    grads = [p.grad for p in m.indexer_parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and sum(g.abs().sum() for g in grads) > 0

    demos = TrainBatch([g.prompt_tokens for g in gens], [g.response_tokens for g in gens],
                       float(sum(len(g.response_tokens) for g in gens)))
    metrics = merge_step_metrics([trainer.train_step(demos, SFTObjective(SFTStage()))])
    assert np.isfinite(metrics["sft/loss"]) and np.isfinite(metrics["train/indexer_kl"])


def test_indexer_loss_counts_real_tokens_only_in_a_right_padded_batch():
    """A short sequence padded to a longer one's length: with the batch's token mask, its indexer KL is
    the same as alone, unpadded (CSA2 is causal); without it the padding's queries leak in."""
    m = _model("bf16", qat=False)
    short, n = TOKENS[:9], 9
    padded = torch.tensor([short + [7] * (len(TOKENS) - n)])
    alone = m.forward_hidden(torch.tensor([short]), compute_indexer_loss=True).indexer_loss
    mask = torch.arange(len(TOKENS))[None] < n
    masked = m.forward_hidden(padded, compute_indexer_loss=True, indexer_query_mask=mask).indexer_loss
    unmasked = m.forward_hidden(padded, compute_indexer_loss=True).indexer_loss
    torch.testing.assert_close(masked, alone, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(unmasked, alone, atol=1e-4)

    b = pack([[1, 20, 31], [1, 20]], [[5, 9, 2], [44, 17, 3, 60, 2]])  # rows of 5 and 6 input tokens
    assert b.lengths.tolist() == [5, 6]
    assert b.token_mask().tolist() == [[True] * 5 + [False], [True] * 6]
