"""Overlapped engine steps (rollout/engine.py, `EngineConfig.overlap_steps`, issue #15): each step is launched
before the previous one's tokens are read. On CPU nothing runs ahead, but every bookkeeping path does: rows
whose last token is still "on the device", rows that finish or pause while launched once more (their token
dropped), interrupts that drop the launched step. The generations must be exactly the plain engine's."""

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.types import GenerationRequest, RolloutState
from tests.unit.test_engine_sharing_and_turns import PROMPT_A, PROMPT_B, _StopAfter

EOS = 2


def _engine(model, overlap, eos=EOS, **kw):
    cfg = EngineConfig(**{"max_batch_size": 6, "block_size": 4, "max_seq_len": 64, "overlap_steps": overlap, **kw})
    return Engine(model, cfg, eos_id=eos)


def _common_token(model) -> int:
    """A token the tiny model emits early in several responses: as EOS, some samples stop mid-way."""
    gens = _engine(model, False).generate(_requests())
    counts = {}
    for g in gens:
        for t in g.response_tokens[2:8]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def _requests():
    """Groups sharing a prompt (with and without a partial block), singles of several lengths, greedy and
    sampled rows, EOS reachable, more requests than the batch holds (admissions while others decode)."""
    reqs = [GenerationRequest(f"a{j}", PROMPT_A, 12 + 3 * j, seed=j, temperature=1.0) for j in range(4)]
    reqs += [GenerationRequest(f"b{j}", PROMPT_B, 20, seed=10 + j, temperature=1.2) for j in range(3)]
    reqs += [GenerationRequest(f"c{i}", tuple([1] + [30 + (5 * i + j) % 40 for j in range(2 + i)]), 6 + 4 * i, seed=20 + i,
                               temperature=0.0 if i % 2 else 0.9, top_p=0.8 if i == 2 else 1.0) for i in range(5)]
    return reqs


def _drive(eng, reqs, tool_output=None, interrupt_at=()):
    eng.add(reqs)
    out, steps = {}, 0
    while eng.has_work():
        for g in eng.step():
            out[g.sample_id] = g
        steps += 1
        for p in eng.pop_paused():
            eng.append(p.sample_id, tool_output)
        if steps in interrupt_at:
            states = [RolloutState.from_bytes(s.to_bytes()) for s in eng.interrupt()]
            assert eng.cache.num_free_blocks == eng.cache.num_blocks
            eng.resume(states)
    return out


def _same(a, b, logprob_tol: float = 1e-5):
    """The same generations; log-probs within `logprob_tol`: batch shapes differ, so float noise (~3e-6 on CPU). A
    quantised KV cache rounds that noise to whole quantisation steps where a value sits near a boundary (FP8 on an AMD
    EPYC: 6e-4), so its callers pass a bound of such a step."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert (x.response_tokens, x.finish_reason, x.appended_spans, x.policy_versions) == \
               (y.response_tokens, y.finish_reason, y.appended_spans, y.policy_versions), k
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0) < logprob_tol, k


def test_overlap_is_off_on_cpu_by_default_and_for_moe_unless_asked(dense_model, moe_model):
    assert not _engine(dense_model, None).overlap and _engine(dense_model, True).overlap
    assert not _engine(moe_model, None).overlap and _engine(moe_model, True).overlap  # None: on CUDA only


def _same_routing(a, b):
    for k in a:
        x, y = a[k], b[k]
        if not x.appended_spans:  # every fed position (a tool output that fills the budget is never fed)
            assert x.routing_trace.shape[0] == len(x.prompt_tokens) + len(x.response_tokens) - 1, k
        assert x.routing_trace.shape == y.routing_trace.shape and (x.routing_trace == y.routing_trace).all(), k


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("interrupt_at", [(), (1,), (2, 9), (5, 6, 17)])
def test_overlapped_steps_give_the_plain_engines_generations(dense_model, moe_model, moe, interrupt_at):
    """MoE too (on request): each routing part carries its first position, so a trace comes out in feed order whatever
    order its parts arrived in; an interrupt that drops a launched prefill leaves its last prompt position to be fed
    again at resume, and the trace then holds it once."""
    model = moe_model if moe else dense_model
    eos = _common_token(model)
    plain = _drive(_engine(model, False, eos), _requests())
    eng = _engine(model, True, eos)
    got = _drive(eng, _requests(), interrupt_at=interrupt_at)
    _same(plain, got)
    if moe:
        _same_routing(plain, got)
    assert {g.finish_reason for g in got.values()} == {"eos", "length"}  # both stops ran one step late
    assert eng.stats.discarded_tokens > 0  # rows launched once more after their last token
    assert eng.stats.generated_tokens == sum(len(g.response_tokens) for g in got.values())
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and not eng.has_work()


def _tool_run(model, overlap, interrupt_at=()):
    eng = _engine(model, overlap)
    eng.tool_stop = _StopAfter(3, model.config.vocab_size)
    reqs = [GenerationRequest(f"t{j}", PROMPT_A if j < 3 else PROMPT_B, 18, seed=j, temperature=1.0, tool_calls=True)
            for j in range(5)]
    return _drive(eng, reqs, tool_output=[40, 41, 42, 43], interrupt_at=interrupt_at)


def test_overlapped_moe_steps_pause_at_tool_calls_with_exact_routing(moe_model):
    plain = _tool_run(moe_model, False)
    for got in (_tool_run(moe_model, True), _tool_run(moe_model, True, interrupt_at=(3, 4, 8))):
        _same(plain, got)
        _same_routing(plain, got)


def test_overlapped_steps_pause_at_tool_calls_exactly(dense_model):
    """A row that pauses was launched once more: that token is dropped, and the append feeds the call's last
    token again with the tool output, as the plain engine does."""
    plain = _tool_run(dense_model, False)
    assert all(g.appended_spans for g in plain.values())
    eng = _engine(dense_model, True)  # a paused sample holds the KV of its context before the call's last token
    eng.tool_stop = _StopAfter(3, dense_model.config.vocab_size)
    eng.add([GenerationRequest("p", PROMPT_A, 18, seed=0, temperature=1.0, tool_calls=True)])
    while not eng.num_paused:
        eng.step()
    (st,) = eng.interrupt()
    assert st.paused and st.cached == len(st.tokens) - 1 and len(st.tokens) == len(PROMPT_A) + 3
    _same(plain, _tool_run(dense_model, True))
    _same(plain, _tool_run(dense_model, True, interrupt_at=(3, 4, 8)))


def test_a_weight_update_between_steps_labels_tokens_with_the_launching_version(dense_model):
    """Without an interrupt, the step launched before `policy_version` changed keeps its version: the label
    says which weights sampled the token."""
    eng = _engine(dense_model, True)
    eng.add([GenerationRequest("v", PROMPT_B, 6, seed=3, temperature=1.0, ignore_eos=True)])
    eng.step()  # launches the prefill; nothing read yet
    eng.policy_version = 1
    out = []
    while eng.has_work():
        out += eng.step()
    assert out[0].policy_versions == (0, 1, 1, 1, 1, 1)


def test_graph_decode_takes_its_tokens_on_the_device():
    """Decode rows whose last token is unread take it from the launched step's output in the input buffer
    (rollout/graphs.py run(ids=...)); CUDA only."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).cuda().eval()
    out = {}
    for overlap in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=6, block_size=4, max_seq_len=64, overlap_steps=overlap), eos_id=EOS,
                     device="cuda")
        out[overlap] = _drive(eng, _requests(), interrupt_at=(4, 11))
        assert eng.stats.graph_steps > 0
    _same(out[False], out[True])
