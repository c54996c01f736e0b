"""Rollout engine: continuous batching, interrupt/resume without prefill, sampling."""


import numpy as np
import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.sampling import counter_uniform, sample_tokens
from rollout.types import GenerationRequest, RolloutState

EOS = 2


def _requests(n, max_new=24, temperature=1.0, top_p=1.0):
    return [GenerationRequest(f"s{i}", tuple([1] + [10 + (7 * i + j) % 60 for j in range(3 + i % 5)]), max_new,
                              seed=1000 + i, temperature=temperature, top_p=top_p) for i in range(n)]


def _engine(model, **kw):
    cfg = dict(max_batch_size=4, block_size=4, max_seq_len=64)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), eos_id=EOS)


def _key(g):
    return (g.response_tokens, g.finish_reason)


def test_continuous_batching_equals_one_at_a_time(moe_model):
    reqs = _requests(10)
    batched = _engine(moe_model, max_batch_size=4).generate(reqs)  # 10 requests through 4 slots
    single = [_engine(moe_model, max_batch_size=1).generate([r])[0] for r in reqs]
    assert [_key(g) for g in batched] == [_key(g) for g in single]
    for a, b in zip(batched, single):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert np.array_equal(a.routing_trace, b.routing_trace)
    lengths = {len(g.response_tokens) for g in batched}
    assert len(lengths) > 1  # sequences finish at different times, so others joined mid-flight


def test_a_prefill_interval_gathers_admissions_and_keeps_every_token(moe_model):
    reqs = [GenerationRequest(r.sample_id, r.prompt_tokens, 4 + 3 * i, seed=r.seed) for i, r in enumerate(_requests(12))]
    plain, gathered = _engine(moe_model, max_batch_size=6), _engine(moe_model, max_batch_size=6, prefill_interval=4)
    a, b = plain.generate(reqs), gathered.generate(reqs)
    assert [_key(g) for g in a] == [_key(g) for g in b]  # counter-based sampling: when a sample starts changes nothing
    for x, y in zip(a, b):
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-4)
        assert np.array_equal(x.routing_trace, y.routing_trace)
    # 12 requests through 6 slots: each finish admits the next at once, or at most every 4th step, in bigger prefills
    assert gathered.stats.prefill_calls < plain.stats.prefill_calls
    assert gathered.stats.prefill_seqs == plain.stats.prefill_seqs == 12


def test_chunked_prefill_feeds_long_prompts_in_bounded_steps_and_keeps_every_token(moe_model):
    """prefill_chunk_tokens: prompts longer than the chunk are fed 8 tokens a step (the first chunk as a prefill, the
    rest over the cached context) while the others decode, also after an interrupt in the middle of a prompt; the
    tokens, logprobs and routing traces equal the unchunked engine's (a group sharing a long prompt included)."""
    long = [GenerationRequest(f"l{i}", tuple([1] + [10 + (5 * i + j) % 60 for j in range(n)]), 10, seed=70 + i)
            for i, n in enumerate((22, 36, 17))]
    group = [GenerationRequest(f"g{i}", tuple([1] + [20 + j % 40 for j in range(25)]), 10, seed=90 + i) for i in range(3)]
    reqs = _requests(5, max_new=10) + long + group
    want = {g.sample_id: g for g in _engine(moe_model, max_batch_size=6).generate(reqs)}
    eng = _engine(moe_model, max_batch_size=6, prefill_chunk_tokens=8)
    fed, forward = [], moe_model.forward_hidden

    def recording(ids, *a, **k):
        fed.append(ids.shape[1])
        return forward(ids, *a, **k)
    eng.model.forward_hidden = recording
    eng.add(reqs)
    got = eng.step() + eng.step()  # the first 6 admitted; the long prompts are mid-way
    states = eng.interrupt()
    mid = [s for s in states if s.has_kv and s.cached < len(s.tokens) - 1]
    assert mid and all(len(s.tokens) == len(s.request.prompt_tokens) for s in mid)  # interrupted inside a prompt
    eng.resume(states)
    while eng.has_work():
        got += eng.step()
    del eng.model.forward_hidden
    assert sorted(g.sample_id for g in got) == sorted(want)
    for g in got:
        w = want[g.sample_id]
        assert _key(g) == _key(w), g.sample_id
        assert np.allclose(g.logprobs, w.logprobs, atol=1e-5) and np.array_equal(g.routing_trace, w.routing_trace)
    assert max(fed) == 8 and eng.stats.prefill_chunks >= 2 + 4 + 2 + 3  # every forward fed at most one chunk a row


def test_a_chunked_prompt_is_shared_by_its_group_once_its_last_chunk_ran(moe_model):
    """A group's samples share a prompt fed in chunks: the siblings hold its blocks but decode only once the owner's
    last chunk has run (they take the prompt's expert ids then); interrupted before that, they come back as fresh
    requests (their shared KV did not exist yet) and the owner with the chunks it has. Tokens, logprobs and routing
    equal the unchunked, unshared engine's."""
    prompt = tuple([1] + [20 + j % 40 for j in range(29)])  # 30 tokens: chunks of 8, 8, 8, then 6 with the sampling
    group = [GenerationRequest(f"g{i}", prompt, 10, seed=90 + i) for i in range(4)]
    want = {g.sample_id: g for g in _engine(moe_model, share_prompt_kv=False).generate(group)}
    eng = _engine(moe_model, prefill_chunk_tokens=8)
    eng.add(group)
    got = eng.step() + eng.step()  # the owner has two chunks cached; three siblings wait
    assert eng.stats.shared_prompt_seqs == 3 and eng.stats.decode_steps == 0
    states = eng.interrupt()
    assert sorted((s.request.sample_id, s.cached) for s in states if s.has_kv) == [("g0", 16)]
    assert sum(not s.has_kv for s in states) == 3
    eng.resume(states)
    while eng.has_work():
        got += eng.step()
    assert eng.stats.shared_prompt_seqs == 3 + 2  # after the resume g1 owns the prompt again, g2 and g3 share it
    assert sorted(g.sample_id for g in got) == sorted(want)
    for g in got:
        w = want[g.sample_id]
        assert _key(g) == _key(w), g.sample_id
        assert np.allclose(g.logprobs, w.logprobs, atol=1e-5) and np.array_equal(g.routing_trace, w.routing_trace)


def test_stops_on_eos_or_length(moe_model):
    gens = _engine(moe_model, max_batch_size=8).generate(_requests(16, max_new=24))
    reasons = {g.finish_reason for g in gens}
    assert reasons == {"eos", "length"}  # the fixture model produces both
    for g in gens:
        if g.finish_reason == "eos":
            assert g.response_tokens[-1] == EOS and EOS not in g.response_tokens[:-1]
        else:
            assert len(g.response_tokens) == 24 and EOS not in g.response_tokens
        P, R = len(g.prompt_tokens), len(g.response_tokens)
        assert g.routing_trace.shape == (P + R - 1, 2, 2)
        assert len(g.logprobs) == len(g.policy_versions) == R


@pytest.mark.parametrize("interrupt_after", [1, 3, 7])
def test_interrupt_resume_equals_uninterrupted(moe_model, interrupt_after):
    reqs = _requests(6, max_new=20)
    reference = {g.sample_id: g for g in _engine(moe_model).generate(reqs)}

    eng = _engine(moe_model)
    eng.add(reqs)
    done = []
    for _ in range(interrupt_after):
        done += eng.step()
    prefills_before = eng.stats.prefill_calls
    states = eng.interrupt()
    assert eng.num_active == 0 and eng.cache.num_free_blocks == eng.cache.num_blocks  # all blocks freed
    # States survive a msgpack round trip (the spill-to-disk path).
    states = [RolloutState.from_bytes(s.to_bytes()) for s in states]
    admitted = [s for s in states if s.k is not None]
    assert admitted and all(s.k.shape[1] == len(s.tokens) - 1 for s in admitted)
    eng.resume(states)
    while eng.has_work():
        done += eng.step()
    got = {g.sample_id: g for g in done}
    assert got.keys() == reference.keys()
    for sid, g in got.items():
        assert _key(g) == _key(reference[sid])
        assert np.array_equal(g.routing_trace, reference[sid].routing_trace)
    # Only never-admitted requests were prefilled after the interrupt; resumed ones were not.
    never_admitted = len(states) - len(admitted)
    assert eng.stats.prefill_calls - prefills_before <= (1 if never_admitted else 0)
    assert eng.stats.resumed_tokens == sum(s.k.shape[1] for s in admitted)


def test_resume_makes_no_prefill_call(moe_model):
    eng = _engine(moe_model, max_batch_size=8)
    eng.add(_requests(4, max_new=30))
    eng.step()
    eng.step()
    states = eng.interrupt()
    calls = eng.stats.prefill_calls
    eng.resume(states)
    eng.step()
    assert eng.stats.prefill_calls == calls
    assert eng.num_active == len([s for s in states if s.num_response_tokens < 30])


def test_versions_stamped_per_token(moe_model):
    eng = _engine(moe_model, max_batch_size=8)
    eng.add(_requests(2, max_new=30))
    for _ in range(3):
        eng.step()
    states = eng.interrupt()
    eng.policy_version = 5
    eng.resume(states)
    gens = []
    while eng.has_work():
        gens += eng.step()
    for g in gens:
        v = list(g.policy_versions)
        assert v[:3] == [0, 0, 0] and set(v[3:]) <= {5} and v == sorted(v)


def test_greedy_is_argmax_and_top_p_restricts_support():
    torch.manual_seed(0)
    logits = torch.randn(64, 10) * 2
    n = logits.shape[0]
    seeds, ctr = torch.arange(n), torch.zeros(n, dtype=torch.long)
    greedy, _ = sample_tokens(logits, torch.zeros(n), torch.ones(n), seeds, ctr)
    assert torch.equal(greedy, logits.argmax(-1))
    # top_p tiny -> always the most likely token even at temperature 1
    tok, lp = sample_tokens(logits, torch.ones(n), torch.full((n,), 1e-6), seeds, ctr)
    assert torch.equal(tok, logits.argmax(-1))
    # logprob is under the temperature-scaled softmax, before top-p truncation
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_sampling_matches_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    n = logits.shape[0]
    tok, _ = sample_tokens(logits, torch.ones(n), torch.ones(n), torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tok, minlength=4).float() / n
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)
    # top_p=0.8 keeps the smallest prefix reaching 0.8 mass: tokens {0, 1} (0.64 + 0.24)
    tok, _ = sample_tokens(logits, torch.ones(n), torch.full((n,), 0.8), torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tok, minlength=4).float() / n
    p = logits[0].softmax(-1)[:2]
    assert freq[2:].sum() == 0 and torch.allclose(freq[:2], p / p.sum(), atol=0.015)


def test_counter_uniform_is_uniform_and_seed_dependent():
    u = counter_uniform(torch.full((50000,), 7), torch.arange(50000))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    v = counter_uniform(torch.full((50000,), 8), torch.arange(50000))
    assert (u != v).float().mean() > 0.99


def test_rollout_state_round_trip_preserves_everything(moe_model):
    eng = _engine(moe_model)
    eng.add(_requests(1, max_new=10))
    eng.step(); eng.step()
    (s,) = eng.interrupt()
    r = RolloutState.from_bytes(s.to_bytes())
    assert r.request == s.request and r.tokens == s.tokens and r.policy_versions == s.policy_versions
    assert r.logprobs == pytest.approx(s.logprobs)
    assert torch.equal(r.k, s.k) and torch.equal(r.v, s.v) and np.array_equal(r.routing, s.routing)
    assert r.nbytes == s.nbytes > 0


def test_replaying_recorded_routing_reproduces_recorded_logprobs(moe_model):
    """The training forward with the engine's routing trace gives the engine's logprobs and experts."""
    from rl.train.losses import token_logprobs
    from rl.train.trainer import pack

    gens = _engine(moe_model, max_batch_size=8).generate(_requests(6, max_new=20, temperature=0.7))
    b = pack([g.prompt_tokens for g in gens], [g.response_tokens for g in gens], [g.logprobs for g in gens],
             routing_B=[g.routing_trace for g in gens])
    with torch.no_grad():
        logits, routing = moe_model(b.input_ids, routing_replay=b.routing)
    lp = token_logprobs(logits, b.targets, temperature=0.7)
    m = b.mask.bool()
    assert torch.allclose(lp[m], b.behavior_logprobs[m], atol=1e-4)
    real = torch.zeros_like(m)
    for i, g in enumerate(gens):
        real[i, : len(g.prompt_tokens) + len(g.response_tokens) - 1] = True
    assert torch.equal(routing[real], b.routing[real])


def test_a_rows_token_does_not_depend_on_its_batch_mates_top_p():
    """Rows with top_p = 1 draw without a sort; a batch that also holds a top_p < 1 row (which sorts) gives
    them the same tokens as a batch of top_p = 1 rows alone, and the nucleus row stays in its nucleus."""
    torch.manual_seed(1)
    logits = torch.randn(33, 50) * 3
    n = logits.shape[0]
    seeds, ctr = torch.arange(n) * 7919, torch.arange(n)
    alone, _ = sample_tokens(logits, torch.ones(n), torch.ones(n), seeds, ctr, nucleus=False)
    top_p = torch.ones(n)
    top_p[5] = 0.3
    mixed, _ = sample_tokens(logits, torch.ones(n), top_p, seeds, ctr, nucleus=True)
    keep = torch.arange(n) != 5
    assert torch.equal(mixed[keep], alone[keep])
    probs = logits[5].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.3).sum()) + 1]
    assert mixed[5] in nucleus


def test_two_level_inverse_cdf_equals_the_plain_one():
    """The blocked inverse CDF picks the id a float64 scan over the whole vocabulary picks (vocabularies not a
    multiple of the block, draws at block edges, zero-probability ids never chosen)."""
    from rollout.sampling import inverse_cdf

    torch.manual_seed(2)
    for V in (7, 1024, 3000, 49152):
        probs = torch.randn(16, V).mul(3).softmax(-1)
        probs[:, ::5] = 0.0
        u = torch.rand(16, dtype=torch.float64)
        cum = probs.double().cumsum(-1)
        want = torch.searchsorted(cum, (u * cum[:, -1])[:, None]).squeeze(-1)
        got = inverse_cdf(probs, u)
        assert torch.equal(got, want), V
        assert (probs.gather(1, got[:, None]) > 0).all()
