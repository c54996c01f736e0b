"""Decode steps replayed from CUDA graphs (rollout/graphs.py, issue #15) give the eager engine's tokens;
prefill computes logits at one position per sequence. The graph tests need CUDA (they run on the GPU
machine); the counters and buckets run everywhere."""

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.graphs import batch_buckets
from rollout.types import GenerationRequest, RolloutState, states_on_host

EOS = 2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


def _requests(n, max_new=24, temperature=0.0):
    return [GenerationRequest(f"s{i}", tuple([1] + [10 + (7 * i + j) % 60 for j in range(3 + i % 5)]), max_new,
                              seed=1000 + i, temperature=temperature) for i in range(n)]


def test_batch_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1] and batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(8) == [1, 2, 4, 8]
    for m in (1, 5, 64, 100):
        assert all(any(b >= n for b in batch_buckets(m)) for n in range(1, m + 1))


def test_context_buckets_cover_every_context_and_a_narrow_graph_computes_what_the_full_width_one_does(dense_model):
    """Decode graphs per context bucket (rollout/graphs.py): the widths start at 512 tokens and double up to
    max_seq_len's blocks; the computation a graph captures, run eagerly on CPU over the gathered context (the path
    without the paged kernel), gives the same logits at the narrow width that holds the rows' contexts as at the
    full width (masked padding only)."""
    from rollout.graphs import _COLS, DecodeGraphs, context_buckets

    assert context_buckets(1024, 16) == [32, 64, 128, 256, 512, 1024] and context_buckets(20, 16) == [20]
    assert context_buckets(100, 4) == [100]  # 512 tokens at blocks of 4: 128 blocks, more than the table
    eng = Engine(dense_model, EngineConfig(max_batch_size=4, block_size=4, max_seq_len=2048), eos_id=EOS)
    eng.generate(_requests(4, max_new=6))  # writes some KV into the pool
    graphs = DecodeGraphs(dense_model, eng.cache, 4, eng.cache.blocks_for(2048), paged_kernel=False)
    assert graphs.context_buckets == [128, 256, 512] and graphs.context_bucket(20) == 128
    assert graphs.context_bucket(513) == 128 + 128 and graphs.context_bucket(2048) == 512
    buf = torch.zeros(4, _COLS + graphs.max_blocks, dtype=torch.long)
    buf[:3, 0] = torch.tensor([11, 12, 13])
    buf[:3, 1] = torch.tensor([5, 9, 2])  # positions: contexts of 6, 10 and 3 tokens
    buf[:3, 2] = 1
    buf[:3, _COLS:_COLS + 3] = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    with torch.no_grad():
        full = graphs._forward(buf.clone())[0][:3]
        narrow = graphs._forward(buf.clone(), graphs.context_bucket(10))[0][:3]
    torch.testing.assert_close(narrow.float(), full.float(), rtol=1e-5, atol=1e-5)


def test_prefill_computes_logits_at_the_last_position_only(dense_model):
    eng = Engine(dense_model, EngineConfig(max_batch_size=4, block_size=4, max_seq_len=64), eos_id=EOS)
    assert eng.graphs is None  # CPU: eager
    eng.generate(_requests(6, max_new=5))
    assert eng.stats.prefill_logit_rows == eng.stats.prefill_seqs == 6 and eng.stats.prefill_tokens > 6
    assert eng.stats.kv_gather_bytes > 0 and eng.stats.graph_steps == 0


@cuda
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
def test_graph_decode_equals_eager_decode(kv):
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False, kv_cache={"dtype": kv})).cuda().eval()
    out = {}
    for graphs in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64, cuda_graphs=graphs), eos_id=EOS,
                     device="cuda")
        reqs = _requests(11, max_new=20) + [GenerationRequest(f"u{i}", (1, 9, 10 + i), 20, seed=50 + i, temperature=1.0)
                                             for i in range(4)] + [
            GenerationRequest("t", (1, 5, 6), 20, seed=7, temperature=0.7),
            GenerationRequest("np", (1, 5, 7), 6, seed=8, temperature=1.0, top_p=0.9)]  # nucleus: sampled after the graph
        out[graphs] = eng.generate(reqs)
        if graphs:
            assert eng.graphs.disabled_reason is None and eng.stats.graph_steps == eng.stats.decode_steps > 0
            # steps of decode rows at top_p = 1 sample inside the graph; those with a nucleus row or a prefill do not
            assert 0 < eng.stats.graph_sampled_steps < eng.stats.graph_steps
    for a, b in zip(out[False], out[True]):
        assert a.response_tokens == b.response_tokens, a.sample_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@cuda
def test_graph_decode_survives_interrupt_resume_and_weight_updates():
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).cuda().eval()
    eng = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64, park_kv="device"), eos_id=EOS,
                 device="cuda")
    ref = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64, cuda_graphs=False, park_kv="host"),
                 eos_id=EOS, device="cuda")
    for e in (eng, ref):
        e.add(_requests(5, max_new=30))
        for _ in range(6):
            e.step()
    with torch.no_grad():  # an in-place weight update, as the trainer's optimizer makes
        for p in model.parameters():
            p.mul_(1.01)
    parked = {id(e): e.interrupt() for e in (eng, ref)}  # park_kv: device and host, same bytes
    assert {s.k.device.type for s in parked[id(eng)]} == {"cuda"} and {s.k.device.type for s in parked[id(ref)]} == {"cpu"}
    on_host = {s.request.sample_id: s for s in states_on_host(parked[id(eng)])}  # as a checkpoint writes them
    for s in parked[id(ref)]:
        torch.testing.assert_close(RolloutState.from_bytes(on_host[s.request.sample_id].to_bytes()).k, s.k)
    got, want = [], []
    for e, sink in ((eng, got), (ref, want)):
        e.resume(parked[id(e)])
        while e.has_work():
            sink += e.step()
    key = lambda g: g.sample_id  # noqa: E731
    assert [g.response_tokens for g in sorted(got, key=key)] == [g.response_tokens for g in sorted(want, key=key)]
    assert eng.stats.graph_steps > 0


def test_paged_kernel_decode_equals_gather_decode():
    """The decode forward through the paged kernel (Triton; interpreted on CPU) gives the gather + SDPA
    forward's logits, padding rows (context 0, scratch slot) included, for every KV format (fp32 model)."""
    from model.decoder import Decoder
    from model.kv_cache import PagedBatch
    from tests.conftest import debug_config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for kv in ("bf16", "fp8", "fp4"):
        torch.manual_seed(0)
        model = Decoder(debug_config(moe=False, kv_cache={"dtype": kv})).to(dev).eval()
        eng = Engine(model, EngineConfig(max_batch_size=4, block_size=4, max_seq_len=32, cuda_graphs=False), eos_id=EOS,
                     device=dev)
        eng.add(_requests(3, max_new=20))
        for _ in range(5):
            eng.step()
        seqs, bs = eng._active, 4
        mb = eng.cache.blocks_for(32)
        tables = torch.tensor([s.blocks + [0] * (mb - len(s.blocks)) for s in seqs] + [[0] * mb], device=dev)  # + padding
        pos = torch.tensor([s.num_cached for s in seqs] + [0], device=dev)[:, None]
        valid = torch.tensor([1, 1, 1, 0], device=dev)[:, None]
        ids = torch.tensor([s.tokens[-1] for s in seqs] + [0], device=dev)[:, None]
        slot = torch.where(valid > 0, tables.gather(1, pos // bs) * bs + pos % bs, torch.full_like(pos, -1))
        ctx = (tables[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(4, mb * bs)
        mask = (torch.arange(mb * bs, device=dev)[None, :] <= pos)[:, None, None, :]
        with torch.no_grad():
            want, _ = model(ids, pos, batch=PagedBatch(eng.cache, False, slot, ctx, mask))
            lens = torch.where(valid > 0, pos + 1, torch.zeros_like(pos))[:, 0]
            got, _ = model(ids, pos, batch=PagedBatch(eng.cache, False, slot, block_table=tables, context_lens=lens))
        assert (got[:3] - want[:3]).abs().max() < 1e-4, kv
        assert torch.isfinite(got[3]).all()


@cuda
def test_graph_decode_steps_make_no_host_sync_but_the_token_read():
    """Decode steps (graphs, sampling, bookkeeping) under torch.cuda.set_sync_debug_mode('error'): the one read
    of sampled tokens waits on an event into pinned memory, which the debug mode does not count as a sync."""
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).cuda().eval()
    eng = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64), eos_id=EOS, device="cuda")
    eng.add([GenerationRequest(f"s{i}", (1, 5 + i, 6, 7), 30, seed=i, ignore_eos=True) for i in range(6)])
    eng.step()  # admission and prefill (host-built tensors) happen here
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert eng.overlap and eng.stats.graph_steps >= 10  # overlapped (the default on CUDA): one step still unread
    assert all(len(s.tokens) == 4 + 10 and s.inflight == 1 for s in eng._active)


@cuda
def test_shared_prompts_and_tool_turns_under_graphs_equal_the_eager_engine():
    """Samples sharing a prompt decode through the graphs from the shared blocks; a tool turn's extend runs
    eagerly between graph steps; tokens equal the eager, unshared engine's (fp32)."""
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).cuda().eval()

    class StopAfter:
        trigger_ids = frozenset(range(model.config.vocab_size))

        def matches(self, turn):
            return len(turn) >= 5

    out = {}
    for fast in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64, cuda_graphs=fast,
                                         share_prompt_kv=fast), eos_id=EOS, device="cuda")
        eng.tool_stop = StopAfter()
        prompt = tuple(range(1, 12))
        eng.add([GenerationRequest(f"g{j}", prompt, 24, seed=j, temperature=1.0, tool_calls=j % 2 == 0) for j in range(6)])
        got = []
        while eng.has_work():
            got += eng.step()
            for p in eng.pop_paused():
                eng.append(p.sample_id, [20, 21, 22])
        out[fast] = {g.sample_id: g for g in got}
        if fast:
            assert eng.stats.shared_prompt_seqs == 5 and eng.stats.graph_steps > 0 and eng.stats.appended_tokens > 0
    for sid, g in out[False].items():
        assert out[True][sid].response_tokens == g.response_tokens, sid
        assert max(abs(x - y) for x, y in zip(out[True][sid].logprobs, g.logprobs)) < 1e-4


@cuda
def test_moe_decode_under_graphs_equals_the_eager_engine_with_its_routing_read_with_the_tokens():
    """MoE through the grouped expert kernels has no host read, so its decode is captured too: tokens, logprobs and
    routing traces equal the eager engine's (fp32), also across an interrupt and resume, and graph decode steps
    make no host sync (sync debug mode): the expert ids reach the host with the tokens, in the step's one read."""
    from model import fused
    from model.decoder import Decoder
    from tests.conftest import debug_config

    assert fused.GROUPED_EXPERTS
    torch.manual_seed(0)
    model = Decoder(debug_config(moe=True)).cuda().eval()
    out = {}
    for graphs in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64, cuda_graphs=graphs), eos_id=EOS,
                     device="cuda")
        eng.add(_requests(9, max_new=20) + [GenerationRequest(f"u{i}", (1, 9, 10 + i), 20, seed=50 + i, temperature=1.0)
                                            for i in range(4)])
        got = []
        for _ in range(5):
            got += eng.step()
        eng.resume(eng.interrupt())
        eng.step()  # admission: the resumed KV restored
        if graphs:
            torch.cuda.set_sync_debug_mode("error")
            try:
                got += eng.step() + eng.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        while eng.has_work():
            got += eng.step()
        out[graphs] = sorted(got, key=lambda g: g.sample_id)
        if graphs:
            assert eng.graphs.disabled_reason is None and eng.stats.graph_steps == eng.stats.decode_steps > 0
    assert [g.sample_id for g in out[False]] == [g.sample_id for g in out[True]] and len(out[True]) == 13
    for a, b in zip(out[False], out[True]):
        assert a.response_tokens == b.response_tokens, a.sample_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        n = len(a.prompt_tokens) + len(a.response_tokens) - 1  # every fed position's experts
        assert a.routing_trace.shape[0] == b.routing_trace.shape[0] == n, a.sample_id
        assert (a.routing_trace == b.routing_trace).all(), a.sample_id


@cuda
def test_chunked_prefill_with_shared_prompts_under_graphs_equals_the_unchunked_eager_engine():
    """prefill_chunk_tokens on the GPU: long prompts fed in chunks between graph decode steps, a group's siblings
    waiting on the owner's last chunk, give the unchunked eager engine's tokens (fp32)."""
    from model.decoder import Decoder
    from tests.conftest import debug_config

    torch.manual_seed(0)
    model = Decoder(debug_config(moe=False)).cuda().eval()
    out = {}
    for fast in (False, True):
        eng = Engine(model, EngineConfig(max_batch_size=8, block_size=4, max_seq_len=64, cuda_graphs=fast,
                                         share_prompt_kv=fast, prefill_chunk_tokens=8 if fast else None),
                     eos_id=EOS, device="cuda")
        long_prompt = tuple(1 + (5 * j) % 70 for j in range(27))
        reqs = _requests(3, max_new=16, temperature=1.0) + [
            GenerationRequest(f"g{j}", long_prompt, 16, seed=90 + j, temperature=1.0) for j in range(4)]
        eng.add(reqs[:3])
        got = eng.step() + eng.step()
        eng.add(reqs[3:])  # the long group arrives while the short ones decode
        while eng.has_work():
            got += eng.step()
        out[fast] = {g.sample_id: g for g in got}
        if fast:
            assert eng.stats.graph_steps > 0 and eng.stats.shared_prompt_seqs == 3 and eng.stats.prefill_chunks > 0
    assert set(out[False]) == set(out[True]) and len(out[True]) == 7
    for sid, g in out[False].items():
        assert out[True][sid].response_tokens == g.response_tokens, sid
        assert max(abs(x - y) for x, y in zip(out[True][sid].logprobs, g.logprobs)) < 1e-4
