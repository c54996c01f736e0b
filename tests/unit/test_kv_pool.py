"""Block bookkeeping of the paged KV pool and the engine's admission: every block handed out once and taken
back, a request that exactly fits is admitted, the batch bound holds, and parked samples count for the
version-lag bound while they wait to be readmitted. The real engine on the tiny dense model."""

import pytest

from model.kv_cache import CacheFullError, PagedKVCache
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.types import GenerationRequest

EOS = 2


def _pool(num_blocks=4, block_size=4) -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=8)


def test_the_pool_hands_out_every_block_once_and_takes_them_back():
    pool = _pool()
    assert [pool.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    a = pool.allocate(3)
    b = pool.allocate(1)  # the last free block
    assert sorted(a + b) == [0, 1, 2, 3] and pool.num_free_blocks == 0
    with pytest.raises(CacheFullError):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 3 and sorted(pool.allocate(3)) == sorted(a)


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"max_batch_size": 4, "block_size": 4, "max_seq_len": 32, **kw}), eos_id=EOS)


def _request(i: int, max_new: int = 4) -> GenerationRequest:
    return GenerationRequest(f"s{i}", (1, 10 + i, 20, 30), max_new, seed=i, ignore_eos=True)


def test_a_request_that_exactly_fits_the_free_blocks_is_admitted(dense_model):
    eng = _engine(dense_model, num_blocks=2, max_seq_len=8)  # 4 prompt + 4 new tokens = 2 blocks of 4: the whole pool
    (g,) = eng.generate([_request(0)])
    assert len(g.response_tokens) == 4 and eng.cache.num_free_blocks == 2


def test_no_more_than_max_batch_size_sequences_run_at_once(dense_model):
    eng = _engine(dense_model, max_batch_size=2)
    eng.add([_request(i) for i in range(5)])
    done, most = [], 0
    while eng.has_work():
        done += eng.step()
        most = max(most, eng.num_active)
    assert most == 2 and sorted(g.sample_id for g in done) == [f"s{i}" for i in range(5)]
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_parked_samples_count_for_the_lag_bound_while_they_wait_to_be_readmitted(dense_model):
    eng = _engine(dense_model)
    eng.add([_request(i, max_new=8) for i in range(2)])
    eng.step()
    eng.step()
    eng.resume(eng.interrupt())
    eng.policy_version = 3
    assert eng.num_active == 0 and eng.oldest_versions() == [0, 0]  # waiting, with tokens of version 0
    eng.step()
    assert eng.num_active == 2 and eng.oldest_versions() == [0, 0]


def test_kv_memory_fraction_sizes_the_pool_from_free_memory(dense_model, monkeypatch):
    """engine.kv_memory_fraction: the pool takes that share of the memory free when the engine starts (here the
    host's available RAM, read for real, then a fixed figure), and refuses one that cannot hold a sequence."""
    import rollout.engine as engine_mod

    free = engine_mod.free_memory(engine_mod.torch.device("cpu"))
    eng = _engine(dense_model, kv_memory_fraction=1e-4)
    pool = sum(t.numel() * t.element_size() for t in eng.cache._tensors().values())  # noqa: SLF001
    assert 0.9e-4 * free < pool <= 1.1e-4 * free
    per_block = pool / (eng.cache.num_blocks + 1 / eng.cache.block_size)  # the scratch slot aside
    monkeypatch.setattr(engine_mod, "free_memory", lambda device: 64 * per_block)
    assert _engine(dense_model, kv_memory_fraction=0.5).cache.num_blocks == 32
    assert _engine(dense_model, kv_memory_fraction=0.25).generate([_request(0)])[0].response_tokens
    with pytest.raises(ValueError, match="kv_memory_fraction=0.05 .* fewer than one sequence of max_seq_len=32"):
        _engine(dense_model, kv_memory_fraction=0.05)  # 3 blocks of 4 tokens
    with pytest.raises(ValueError, match="not num_blocks and kv_memory_fraction"):
        EngineConfig(num_blocks=64, kv_memory_fraction=0.5)
