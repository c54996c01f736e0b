"""Prefills replayed from CUDA graphs (rollout/graphs.py PrefillGraphs, issue #15): prompts right-padded to a
(rows, tokens) bucket give the eager prefill's tokens, logprobs and routing traces. On CPU the padded computation runs
eagerly (`capture=False`); the captured graphs run on the GPU machine."""

import numpy as np
import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.graphs import PrefillGraphs, token_buckets
from rollout.types import GenerationRequest

EOS = 2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


def _requests() -> list[GenerationRequest]:
    """GRPO-like: three prompts of three samples each (their prompt prefilled once), five single prompts of 3-19
    tokens, and a 70-token prompt longer than the graphs' 64-token buckets (prefilled eagerly)."""
    groups = [GenerationRequest(f"g{p}_{k}", tuple([1] + [10 + (3 * p + j) % 50 for j in range(5 + 4 * p)]), 12,
                                seed=100 + 10 * p + k, temperature=1.0) for p in range(3) for k in range(3)]
    singles = [GenerationRequest(f"s{i}", tuple([1] + [20 + (7 * i + j) % 40 for j in range(2 + 4 * i)]), 9 + i,
                                 seed=300 + i, temperature=1.0) for i in range(5)]
    long = [GenerationRequest("long", tuple([1] + [11 + j % 45 for j in range(69)]), 8, seed=7, temperature=1.0)]
    return groups + singles + long


def test_token_and_prefill_buckets():
    assert token_buckets(64) == [16, 32, 64] and token_buckets(100) == [16, 32, 64, 100] and token_buckets(8) == [8]
    g = PrefillGraphs.__new__(PrefillGraphs)
    g.row_buckets, g.token_buckets, g.max_graph_tokens = [1, 2, 4, 8], [16, 32, 64], 128
    assert g.bucket(3, 10) == (4, 16) and g.bucket(1, 17) == (1, 32) and g.bucket(8, 16) == (8, 16)
    assert g.bucket(9, 5) is None and g.bucket(1, 65) is None  # larger than every bucket
    assert g.bucket(4, 33) is None  # 4 x 64 tokens > max_graph_tokens


@pytest.mark.parametrize("moe", [False, True])
def test_padded_prefill_equals_the_eager_prefill(moe, moe_model, dense_model):
    model = moe_model if moe else dense_model
    reqs = _requests()
    out, engines = {}, {}
    for padded in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=6, block_size=4, max_seq_len=128, prefill_interval=2), eos_id=EOS)
        if padded:
            eng.prefill_graphs = PrefillGraphs(model, eng.cache, max_rows=8, max_tokens=64, capture=False)
        out[padded], engines[padded] = sorted(eng.generate(reqs), key=lambda g: g.sample_id), eng
    g = engines[True]
    assert 0 < g.prefill_graphs.replays < g.stats.prefill_calls == engines[False].stats.prefill_calls  # the long one: eager
    assert g.stats.shared_prompt_seqs == 6 and g.stats.prefill_logit_rows == g.stats.prefill_seqs
    for a, b in zip(out[False], out[True]):
        assert (a.sample_id, a.response_tokens, a.finish_reason) == (b.sample_id, b.response_tokens, b.finish_reason)
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5), a.sample_id
        if moe:
            n = len(a.prompt_tokens) + len(a.response_tokens) - 1  # every fed position's experts
            assert a.routing_trace.shape[0] == b.routing_trace.shape[0] == n
            assert np.array_equal(a.routing_trace, b.routing_trace), a.sample_id
        else:
            assert a.routing_trace is None and b.routing_trace is None


@cuda
@pytest.mark.parametrize("moe", [False, True])
def test_graph_prefill_equals_the_eager_prefill_on_the_gpu(moe):
    from model import fused
    from model.decoder import Decoder
    from tests.conftest import debug_config

    assert fused.GROUPED_EXPERTS
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=moe)).cuda().eval()
    out = {}
    for graphs in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=6, block_size=4, max_seq_len=128, prefill_interval=2,
                                         prefill_graphs=graphs), eos_id=EOS, device="cuda")
        if graphs:  # the engine builds them (buckets up to max_seq_len); 64-token buckets send the long prompt eager
            assert isinstance(eng.prefill_graphs, PrefillGraphs) and eng.prefill_graphs.token_buckets[-1] == 128
            eng.prefill_graphs = PrefillGraphs(model, eng.cache, max_rows=8, max_tokens=64)
        else:
            assert eng.prefill_graphs is None
        out[graphs] = sorted(eng.generate(_requests()), key=lambda g: g.sample_id)
        if graphs:
            assert eng.prefill_graphs.disabled_reason is None and 0 < eng.prefill_graphs.replays < eng.stats.prefill_calls
    for a, b in zip(out[False], out[True]):
        assert a.response_tokens == b.response_tokens, a.sample_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        if moe:
            assert np.array_equal(a.routing_trace, b.routing_trace), a.sample_id
