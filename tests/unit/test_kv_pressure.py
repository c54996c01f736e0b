"""KV blocks on demand and samples parked under memory pressure (rollout/engine.py `_grow`, `_park`; issue #42).

The engine admits a sample for the blocks its next step writes into, not for prompt + max_new_tokens, and gives
each running sample a block when it needs one. When the pool runs dry, the most recently admitted samples are
parked (their KV to host memory) and resume ahead of new prompts as blocks free. A pressured run must generate what
a roomy one does: the same tokens, finish reasons, versions and MoE routing, and log-probs within float noise (the
batch's composition changes which rows share a forward: tests/unit/test_overlap_steps.py's bound)."""

import pytest

from rollout.types import GenerationRequest
from tests.unit.test_engine_sharing_and_turns import PROMPT_A, _StopAfter
from tests.unit.test_overlap_steps import _common_token, _drive, _engine, _requests, _same, _same_routing

TIGHT = 20  # blocks: one sample of max_seq_len (64 tokens, blocks of 4) and a little more; six would need 96


@pytest.mark.parametrize(("moe", "overlap", "interrupt_at"), [(False, False, ()), (False, True, (3, 11)),
                                                              (True, False, (3, 11)), (True, True, ())])
def test_a_pool_too_small_for_every_sample_parks_some_and_generates_what_a_roomy_one_does(
        dense_model, moe_model, moe, overlap, interrupt_at):
    """Groups sharing a prompt, sampled and greedy rows, EOS, more requests than the batch holds; overlapped steps
    (a parked row's token in the launched step is dropped, as an interrupt drops it) and interrupts that take
    parked samples' states along (train steps in a job). No deadlock: every sample finishes."""
    model = moe_model if moe else dense_model
    eos = _common_token(model)
    roomy = _engine(model, False, eos)
    plain = _drive(roomy, _requests())
    assert roomy.stats.parks == 0
    eng = _engine(model, overlap, eos, num_blocks=TIGHT)
    got = _drive(eng, _requests(), interrupt_at=interrupt_at)
    _same(plain, got)
    if moe:
        _same_routing(plain, got)
    assert eng.stats.parks > 0 and eng.stats.parked_bytes > 0 and eng.stats.max_parks >= 1
    assert eng.stats.reprefill_tokens == 0 and eng.stats.resumed_tokens > 0  # parked KV came back, nothing recomputed
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and not eng.has_work()


def test_admission_counts_the_blocks_a_sample_uses_not_its_worst_case(dense_model):
    """Six requests that may each grow to 12 blocks: reserving the worst case, a pool of 40 admits three; on demand
    all six start, and they are parked only as they grow."""
    eng = _engine(dense_model, False, num_blocks=40)
    eng.add([GenerationRequest(f"r{i}", PROMPT_A, 40, seed=i, temperature=1.0, ignore_eos=True) for i in range(6)])
    eng.step()
    assert eng.num_active == 6 and eng.num_waiting == 0
    blocks = sorted(len(s.blocks) for s in eng._active)  # noqa: SLF001 - what each holds: its prompt's, not 12
    assert blocks[-1] <= eng.cache.blocks_for(len(PROMPT_A) + 1)
    out = {}
    while eng.has_work():
        out.update((g.sample_id, g) for g in eng.step())
    assert len(out) == 6 and all(len(g.response_tokens) == 40 for g in out.values())
    assert eng.stats.parks > 0  # 6 x 13 blocks at the end do not fit in 40


def test_a_sample_whose_blocks_exactly_fill_the_pool_is_admitted(dense_model):
    """The pool's last free block is usable: a sample that needs exactly the free blocks (prompt and response in one
    block of 4 slots) is admitted and generated, not refused as a pool too small."""
    eng = _engine(dense_model, False, num_blocks=1, max_seq_len=4, max_new_tokens=1)
    (g,) = eng.generate([GenerationRequest("r", (1, 5, 9), 1, seed=0, ignore_eos=True)])
    assert len(g.response_tokens) == 1 and eng.cache.num_free_blocks == 1


def test_the_oldest_sample_is_never_parked_and_parked_ones_resume_before_new_prompts(dense_model):
    """Youngest first: the first admitted sample runs to the end without a park; a parked sample waits at the head of
    the queue, so new prompts are not admitted past it."""
    eng = _engine(dense_model, False, num_blocks=TIGHT, max_batch_size=6)
    reqs = [GenerationRequest(f"r{i}", PROMPT_A, 40, seed=i, temperature=1.0, ignore_eos=True) for i in range(8)]
    eng.add(reqs)
    parked_ever, order = set(), []
    while eng.has_work():
        for g in eng.step():
            order.append(g.sample_id)
        waiting = eng._waiting  # noqa: SLF001
        parked = [st.request.sample_id for st in waiting if st.has_kv]
        parked_ever.update(parked)
        fresh_at = [i for i, st in enumerate(waiting) if not st.has_kv]
        assert not parked or not fresh_at or max(i for i, st in enumerate(waiting) if st.has_kv) < min(fresh_at)
    assert "r0" not in parked_ever and parked_ever and order[0] == "r0"


def test_tool_call_pauses_and_appends_under_pressure(dense_model):
    """Samples paused at a tool call hold their blocks; an appended tool output grows a sample by several tokens at
    once (blocks on demand for all of them)."""
    def run(num_blocks=None):
        eng = _engine(dense_model, False, **({"num_blocks": num_blocks} if num_blocks else {}))
        eng.tool_stop = _StopAfter(3, dense_model.config.vocab_size)
        reqs = [GenerationRequest(f"t{j}", PROMPT_A, 30, seed=j, temperature=1.0, tool_calls=True) for j in range(5)]
        return _drive(eng, reqs, tool_output=[40, 41, 42, 43, 44, 45]), eng

    plain, _ = run()
    got, eng = run(TIGHT)
    _same(plain, got)
    assert eng.stats.parks > 0 and all(g.appended_spans for g in got.values())


def test_a_forced_end_finishes_a_sample_as_its_eos_would_and_survives_a_park(dense_model):
    """`GenerationRequest.eos_at` (the long-tail benchmark's forced lengths, rewards/longtail.py `mode: eos`): the
    response ends there with finish reason 'eos', under the cap; parked and resumed (the request travels with the
    state), it still ends there."""
    reqs = [GenerationRequest(f"e{i}", PROMPT_A, 40, seed=i, temperature=1.0, eos_at=3 + 5 * i) for i in range(6)]
    for num_blocks in (None, TIGHT):
        eng = _engine(dense_model, False, eos=10**6, **({"num_blocks": num_blocks} if num_blocks else {}))
        out = _drive(eng, reqs, interrupt_at=(4,))
        assert {k: (len(g.response_tokens), g.finish_reason) for k, g in out.items()} == \
               {f"e{i}": (3 + 5 * i, "eos") for i in range(6)}
    assert eng.stats.parks > 0


@pytest.mark.parametrize("moe", [True])  # MoE: the re-prefill's expert ids checked too
def test_past_the_host_budget_a_parked_sample_is_prefilled_again_with_the_same_tokens(dense_model, moe_model, moe):
    """`engine.park_host_gib`: a park that would hold more host memory drops the sample's KV; it resumes by prefilling
    its prompt and response so far (counted in reprefill_tokens) and continues with the tokens a roomy run samples."""
    model = moe_model if moe else dense_model
    eos = _common_token(model)
    plain = _drive(_engine(model, False, eos), _requests())
    eng = _engine(model, False, eos, num_blocks=TIGHT, park_host_gib=1e-9)  # a few bytes: every park drops its KV
    got = _drive(eng, _requests())
    _same(plain, got)
    if moe:  # the prefill recomputes the expert ids of every fed position: under the same weights, the same ones
        _same_routing(plain, got)
    assert eng.stats.parks > 0 and eng.stats.parked_bytes == 0 and eng.stats.reprefill_tokens > 0
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and not eng.has_work()


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_quantised_kv_formats_park_their_stored_bytes(kv):
    """FP8/FP4 caches (seed §2.4.4): a parked sample's KV leaves the pool in its storage format, scales included, and
    comes back bit for bit, so the pressured run generates the roomy run's tokens."""
    import torch

    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False, kv_cache={"dtype": kv})).float().eval()
    plain = _drive(_engine(model, False), _requests())
    eng = _engine(model, True, num_blocks=TIGHT)
    got = _drive(eng, _requests(), interrupt_at=(5,))
    _same(plain, got, logprob_tol=1e-2)  # the roomy run quantises K/V computed in other batch shapes (_same)
    assert eng.stats.parks > 0 and eng.cache.num_free_blocks == eng.cache.num_blocks
