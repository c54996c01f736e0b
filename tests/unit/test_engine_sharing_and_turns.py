"""The engine's shared prompt KV (a GRPO group prefills its prompt once) and multi-turn pauses (a sample stops at
a tool call, tool output is appended and prefilled over the cached context). Real engine, tiny models, CPU."""

import numpy as np
import pytest
import torch

from model.kv_cache import PagedKVCache
from rl.train.losses import token_logprobs
from rl.train.trainer import pack
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.types import GenerationRequest, RolloutState

EOS = 2


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"max_batch_size": 8, "block_size": 4, "max_seq_len": 64, **kw}), eos_id=EOS)


def _group(prompt, n, max_new=16, first_seed=0, **kw):
    return [GenerationRequest(f"g-{j}", tuple(prompt), max_new, seed=first_seed + j, **kw) for j in range(n)]


PROMPT_A = (1, 11, 12, 13, 14, 15, 16, 17, 18, 19)  # 10 tokens: 2 full blocks of 4 before the last token, 1 partial
PROMPT_B = (1, 21, 22, 23, 24, 25, 26, 27, 28)  # 9 tokens: the last token starts a block (no partial block to copy)


def _run(eng, reqs, interrupt_at=None):
    eng.add(reqs)
    out, steps = [], 0
    while eng.has_work():
        out += eng.step()
        steps += 1
        if steps == interrupt_at:
            states = [RolloutState.from_bytes(s.to_bytes()) for s in eng.interrupt()]
            assert eng.cache.num_free_blocks == eng.cache.num_blocks  # shared blocks and the registry's hold freed
            eng.resume(states)
    return {g.sample_id: g for g in out}


def test_pool_blocks_are_reference_counted():
    pool = PagedKVCache(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)
    a = pool.allocate(2)
    pool.share(a)
    pool.free(a)
    assert pool.num_free_blocks == 2  # still held once
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(a[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.share(a[:1])


@pytest.mark.parametrize("prompt", [PROMPT_A, PROMPT_B])
@pytest.mark.parametrize("fixture", ["moe_model", "dense_model"])
def test_a_group_sharing_its_prompt_gives_the_tokens_of_unshared_prefills(prompt, fixture, request):
    model = request.getfixturevalue(fixture)
    reqs = _group(prompt, 6) + _group(PROMPT_B if prompt == PROMPT_A else PROMPT_A, 3, first_seed=50)
    reqs[6:] = [GenerationRequest(f"h-{j}", r.prompt_tokens, r.max_new_tokens, r.seed) for j, r in enumerate(reqs[6:])]
    shared_eng, plain_eng = _engine(model, max_batch_size=4), _engine(model, max_batch_size=4, share_prompt_kv=False)
    shared, plain = _run(shared_eng, reqs), _run(plain_eng, reqs)
    assert shared.keys() == plain.keys() == {r.sample_id for r in reqs}
    for sid, g in plain.items():
        h = shared[sid]
        assert h.response_tokens == g.response_tokens and h.finish_reason == g.finish_reason, sid
        assert np.allclose(h.logprobs, g.logprobs, atol=1e-4)
        if g.routing_trace is not None:
            assert np.array_equal(h.routing_trace, g.routing_trace)
    st, pt = shared_eng.stats, plain_eng.stats
    assert st.shared_prompt_seqs > 0 and pt.shared_prompt_seqs == 0
    # a shared sample skips P - 1 prompt tokens and feeds the last one as a decode row
    assert st.prefill_tokens == pt.prefill_tokens - st.shared_prompt_tokens - st.shared_prompt_seqs
    # 4 rows at a time: the group of 6 prefills once while one of its samples lives; every sample is either
    # prefilled or shared, never both
    assert st.prefill_seqs + st.shared_prompt_seqs == len(reqs) and st.shared_prompt_seqs >= 3
    assert shared_eng.cache.num_free_blocks == shared_eng.cache.num_blocks and not shared_eng._prompts


def test_sharing_survives_interrupt_and_resume(moe_model):
    reqs = _group(PROMPT_A, 5, max_new=20)
    reference = _run(_engine(moe_model, share_prompt_kv=False), reqs)
    for at in (1, 4):
        eng = _engine(moe_model)
        got = _run(eng, reqs, interrupt_at=at)
        assert eng.stats.shared_prompt_seqs == 4  # the five were admitted together: one prefill, four shares
        for sid, g in reference.items():
            assert got[sid].response_tokens == g.response_tokens
            assert np.array_equal(got[sid].routing_trace, g.routing_trace)


class _StopAfter:
    """Tool-call stop hook for the test: the turn closes a call once it has `n` tokens (the real one is
    rollout/tool_calls.StopMatcher, which decodes text)."""

    def __init__(self, n, vocab):
        self.n, self.trigger_ids = n, frozenset(range(vocab))

    def matches(self, turn_tokens):
        return len(turn_tokens) >= self.n


def _drive(eng, reqs, tool_output, interrupt_when=None):
    """Run to completion, answering every pause with `tool_output` at once; interrupt (to bytes and back)
    once, after the first step where `interrupt_when(eng)` holds."""
    eng.add(reqs)
    out, pauses, interrupted = [], 0, False
    while eng.has_work():
        out += eng.step()
        for p in eng.pop_paused():
            pauses += 1
            eng.append(p.sample_id, tool_output)
        if interrupt_when is not None and not interrupted and interrupt_when(eng):
            interrupted = True
            states = [RolloutState.from_bytes(s.to_bytes()) for s in eng.interrupt()]
            assert eng.cache.num_free_blocks == eng.cache.num_blocks
            eng.resume(states)
    assert interrupt_when is None or interrupted
    return {g.sample_id: g for g in out}, pauses


def test_tool_output_is_prefilled_over_the_cached_turns_exactly(moe_model):
    """After a pause and an append, the engine's logprobs of the tokens it samples equal a full teacher-forced
    forward over prompt + turns + tool output (so the extend attended to the right context), and the routing
    trace equals that forward's experts; appended tokens carry logprob 0 and are reported as spans."""
    vocab = moe_model.config.vocab_size
    eng = _engine(moe_model)
    eng.tool_stop = _StopAfter(4, vocab)
    tool = [30, 31, 32, 33, 34]
    reqs = _group(PROMPT_A, 3, max_new=24, temperature=0.8, tool_calls=True)
    gens, pauses = _drive(eng, reqs, tool)
    assert pauses >= 3 and eng.stats.appended_tokens == sum(e - s for g in gens.values() for s, e in g.appended_spans)
    b = pack([g.prompt_tokens for g in gens.values()], [g.response_tokens for g in gens.values()],
             routing_B=[g.routing_trace for g in gens.values()])
    with torch.no_grad():
        logits, routing = moe_model(b.input_ids)
    lp = token_logprobs(logits, b.targets, temperature=0.8)
    for i, g in enumerate(gens.values()):
        P, R = len(g.prompt_tokens), len(g.response_tokens)
        assert g.appended_spans and all(g.response_tokens[s:e] == tuple(tool[: e - s]) for s, e in g.appended_spans)
        sampled = [t for t in range(R) if not any(s <= t < e for s, e in g.appended_spans)]
        want = lp[i, P - 1 : P - 1 + R].numpy()
        assert np.allclose(np.asarray(g.logprobs)[sampled], want[sampled], atol=1e-4)
        assert all(g.logprobs[t] == 0.0 for s, e in g.appended_spans for t in range(s, e))
        # the trace covers every fed token; tool output that filled the budget ends the sample unfed
        s, e = g.appended_spans[-1]
        fed = P + R - 1 - (e - s if e == R else 0)
        assert g.routing_trace.shape[0] == fed
        assert torch.equal(routing[i, :fed], torch.from_numpy(g.routing_trace.astype(np.int64)))


def test_interrupt_while_paused_or_appended_resumes_exactly(dense_model):
    vocab = dense_model.config.vocab_size
    tool = [40, 41, 42]
    reqs = _group(PROMPT_B, 3, max_new=20, tool_calls=True)

    def fresh():
        e = _engine(dense_model)
        e.tool_stop = _StopAfter(3, vocab)
        return e

    reference, _ = _drive(fresh(), reqs, tool)
    # interrupt right after the first pauses were answered (appended, not yet fed) ...
    got, _ = _drive(fresh(), reqs, tool, interrupt_when=lambda e: bool(e._ready))
    assert {k: g.response_tokens for k, g in got.items()} == {k: g.response_tokens for k, g in reference.items()}
    # ... and while samples sit paused, their tool still running
    eng = fresh()
    eng.add(reqs)
    while not eng._paused:
        eng.step()
    paused = [p.sample_id for p in eng.pop_paused()]
    states = [RolloutState.from_bytes(s.to_bytes()) for s in eng.interrupt()]
    assert {s.request.sample_id for s in states if s.paused} == set(paused)
    assert eng.num_paused == 0 and not eng.has_work()  # handed out: the interrupted engine holds none of them
    eng.resume(states)
    out = eng.step()
    assert eng.num_paused == len(paused)  # resumed paused: they wait for their tool output again
    for sid in paused:
        eng.append(sid, tool)
    while eng.has_work():
        out += eng.step()
        for p in eng.pop_paused():
            eng.append(p.sample_id, tool)
    assert {g.sample_id: g.response_tokens for g in out} == {k: g.response_tokens for k, g in reference.items()}


def test_tool_output_past_the_budget_is_cut_and_finishes_the_sample(dense_model):
    eng = _engine(dense_model)
    eng.tool_stop = _StopAfter(3, dense_model.config.vocab_size)
    eng.add(_group(PROMPT_B, 1, max_new=8, tool_calls=True, ignore_eos=True))
    while not eng.num_paused:
        assert not eng.step()
    (p,) = eng.pop_paused()
    assert eng.append(p.sample_id, list(range(30, 40))) == 8 - len(p.response_tokens)
    (g,) = eng.step()
    assert g.finish_reason == "length" and len(g.response_tokens) == 8 and g.appended_spans == ((3, 8),)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and not eng.has_work()
    eng.add(_group(PROMPT_B, 1, max_new=8, tool_calls=True))
    while not eng.num_paused:
        eng.step()
    (p,) = eng.pop_paused()
    g = eng.finish_paused(p.sample_id, "max_turns")
    assert g.finish_reason == "max_turns" and eng.cache.num_free_blocks == eng.cache.num_blocks
