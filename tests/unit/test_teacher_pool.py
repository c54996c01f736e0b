"""TeacherPool: exact outputs for heterogeneous teachers, LRU within a byte budget, grouped runs that load each
teacher once, prefetch, counters, config validation; the teacher-zoo builder at debug size."""

from __future__ import annotations

import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from model.checkpoint import save_checkpoint
from model.pretrained import load_checkpoint
from model.config import DenseFFNConfig, ModelConfig, MoEFFNConfig
from model.decoder import Decoder
from model.tokenizer import CharTokenizer
from rewards.config import UppercaseConfig
from model.config import check_vocab
from teachers.config import TeacherPoolConfig, TeacherSpec
from teachers.pool import TeacherPool
from teachers.architectures import ARCHITECTURES, tiny
from rl.algo.train_teachers import build_teachers, heldout_accuracy, sft

_SAME = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn=DenseFFNConfig(intermediate_size=64))
_HETERO = {
    "deep": ModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                        ffn=DenseFFNConfig(intermediate_size=64)),
    "moe": ModelConfig(hidden_size=48, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=24, init_std=0.1,
                       ffn=MoEFFNConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "tied-mqa": ModelConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=False,
                            tie_word_embeddings=True, ffn=DenseFFNConfig(intermediate_size=96)),
}


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    # Debug-size models: intra-op parallelism does not pay, and on shared cores 2 threads stall badly.
    torch.set_num_threads(1)


def _save(root: Path, name: str, cfg: ModelConfig, seed: int) -> TeacherSpec:
    torch.manual_seed(seed)
    save_checkpoint(Decoder(cfg), root / name)
    return TeacherSpec(name=name, checkpoint=root / name, datasets=[f"d-{name}"])


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    same = [_save(root, n, _SAME, i) for i, n in enumerate("ABC")]
    hetero = [_save(root, n, cfg, 10 + i) for i, (n, cfg) in enumerate(_HETERO.items())]
    return {"same": same, "hetero": hetero}


def _ids(seed: int = 0, b: int = 3, t: int = 12) -> torch.Tensor:
    return torch.randint(3, 99, (b, t), generator=torch.Generator().manual_seed(seed))


def _budget_mib(nbytes: int, k: float) -> float:
    """A budget of k teachers of nbytes each, in MiB."""
    return nbytes * k / 2**20


def _one_size(zoo) -> int:
    return TeacherPool(zoo["same"][:1], 1024, prefetch=False).nbytes("A")


def _held_bytes(pool: TeacherPool, name: str) -> int:
    """Device bytes a teacher's buffers hold now: its nbytes while resident, 0 once evicted."""
    flat = pool._host[name].device_flat
    return 0 if flat is None else sum(b.untyped_storage().nbytes() for b in flat.values())


def _one_at_a_time_mib(zoo) -> float:
    """A budget that holds the biggest heterogeneous teacher but never two (the two smallest need 1.34
    times the biggest): every use is a switch."""
    return max(TeacherPool([s], 1024, prefetch=False).nbytes(s.name) for s in zoo["hetero"]) * 1.2 / 2**20


# ---- outputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [False, True])
def test_outputs_equal_a_direct_forward_of_each_heterogeneous_teacher(zoo, prefetch):
    ids = _ids()
    budget = max(TeacherPool([s], 1024, prefetch=False).nbytes(s.name) for s in zoo["hetero"]) * 1.5 / 2**20
    pool = TeacherPool(zoo["hetero"], budget, prefetch=prefetch)  # fits one at a time: every use is a switch
    for _ in range(2):
        outs = pool.hidden_states({s.name: ids for s in zoo["hetero"]})
        for spec in zoo["hetero"]:
            ref = load_checkpoint(spec.checkpoint).eval()
            with torch.no_grad():
                want = ref.forward_hidden(ids)
            got = outs[spec.name]
            assert got.hidden.shape == (3, 12, _HETERO[spec.name].hidden_size)
            assert torch.equal(got.hidden, want.hidden)
            assert torch.equal(got.head_weight, ref.lm_head.weight)
            assert (got.routing is None) == (spec.name != "moe")
            if got.routing is not None:
                assert torch.equal(got.routing, want.routing)
    # outputs taken before a teacher was evicted stay valid: hidden_states clones the head weight
    assert torch.equal(outs["deep"].head_weight, load_checkpoint(zoo["hetero"][0].checkpoint).lm_head.weight)
    tied = pool.forward("tied-mqa", ids)
    assert torch.equal(tied.head_weight, load_checkpoint(zoo["hetero"][2].checkpoint).model.embed_tokens.weight)
    pool.close()


def test_forward_accepts_positions_and_matches_the_decoder(zoo):
    spec = zoo["hetero"][0]
    ids, pos = _ids(1, 2, 6), torch.arange(5, 11).expand(2, 6)
    pool = TeacherPool(zoo["hetero"][:1], 64)
    got = pool.forward(spec.name, ids, pos).hidden
    pool.close()
    with torch.no_grad():
        assert torch.equal(got, load_checkpoint(spec.checkpoint).forward_hidden(ids, pos).hidden)


@pytest.mark.parametrize("prefetch", [False, True])
def test_reloads_after_eviction_reuse_the_binding_and_match_the_decoder(zoo, prefetch):
    """`run`'s hot path (a consuming fn, no clone): teacher by teacher, load after eviction after load, the
    logits equal a direct Decoder forward's; a reload only refills the storage the first load bound."""
    ids = _ids(2)
    refs = {s.name: load_checkpoint(s.checkpoint).eval() for s in zoo["hetero"]}
    with torch.no_grad():
        outs = {n: ref.forward_hidden(ids) for n, ref in refs.items()}
        want = {n: (out, refs[n].logits(out.hidden)) for n, out in outs.items()}
    pool = TeacherPool(zoo["hetero"], _one_at_a_time_mib(zoo), prefetch=prefetch)
    seen = {}

    def score(name, out):
        hidden, logits = want[name]
        assert torch.equal((out.hidden @ out.head_weight.t()).float(), logits)
        assert (out.routing is None) == (hidden.routing is None)
        if out.routing is not None:
            assert torch.equal(out.routing, hidden.routing)
        module = pool._host[name].module
        if name == "tied-mqa":
            assert module.lm_head.weight is module.model.embed_tokens.weight
        seen.setdefault(name, weakref.ref(module.lm_head.weight))  # (a reference would pin the buffer)
        assert module.lm_head.weight is seen[name]()  # bound once: later loads refill it in place
        assert _held_bytes(pool, name) == pool.nbytes(name)
        return out.hidden.shape[-1]

    for r in range(3):
        assert pool.run({n: ids for n in refs}, score) == {n: c.hidden_size for n, c in _HETERO.items()}
        s = pool.stats()  # after the first call, the one teacher still resident goes first
        assert (s.loads + s.hits, s.teachers) == (3, 3) and s.loads >= (3 if r == 0 else 2) and s.evictions >= 1
        for name in refs:
            assert _held_bytes(pool, name) == (pool.nbytes(name) if name in pool.resident else 0)
    pool.close()


def test_buffers_of_each_dtype_are_freed_and_refilled(zoo):
    """bfloat16 teachers keep the MoE selection bias in float32: two buffers, both freed and refilled."""
    ids = _ids(3)
    pool = TeacherPool(zoo["hetero"], _one_at_a_time_mib(zoo) / 2, dtype=torch.bfloat16, prefetch=False)
    assert set(pool._host["moe"].flat) == {torch.bfloat16, torch.float32}
    first = {s.name: pool.forward(s.name, ids) for s in zoo["hetero"]}
    assert _held_bytes(pool, "moe") == 0 and pool.resident == ["tied-mqa"]
    again = pool.forward("moe", ids)
    assert _held_bytes(pool, "moe") == pool.nbytes("moe") and _held_bytes(pool, "tied-mqa") == 0
    assert torch.equal(again.hidden, first["moe"].hidden) and torch.equal(again.routing, first["moe"].routing)
    assert torch.equal(again.head_weight, first["moe"].head_weight)


def test_a_load_is_a_real_copy_of_the_host_store(zoo):
    """Each load copies the host store into device storage of its own: a change to the store after a
    load leaves the resident copy alone, and the next load (after eviction) picks it up."""
    ids = _ids(4)
    pool = TeacherPool(zoo["same"][:2], _budget_mib(_one_size(zoo), 1.5), prefetch=False)
    ref = load_checkpoint(zoo["same"][0].checkpoint).eval()
    pool.forward("A", ids)
    host = pool._host["A"]
    device_buf, host_buf = host.device_flat[torch.float32], host.flat[torch.float32]
    assert device_buf.data_ptr() != host_buf.data_ptr()
    host_buf.mul_(2)
    assert torch.equal(pool.forward("A", ids).head_weight, ref.lm_head.weight)
    pool.forward("B", ids)  # evicts A
    assert _held_bytes(pool, "A") == 0
    assert torch.equal(pool.forward("A", ids).head_weight, 2 * ref.lm_head.weight)


def test_forward_returns_a_head_weight_that_outlives_eviction(zoo):
    """`forward` and `hidden_states` clone the head weight: eviction frees the teacher's own in place,
    which a view would then read through (PyTorch does not check), and the clone pins nothing."""
    ids = _ids(5)
    pool = TeacherPool(zoo["hetero"], _one_at_a_time_mib(zoo), prefetch=False)
    out = pool.forward("tied-mqa", ids)
    outs = pool.hidden_states({"deep": ids})
    assert pool.resident == ["deep"] and _held_bytes(pool, "tied-mqa") == 0  # freed in place, not pinned
    assert pool._host["tied-mqa"].device_flat is not None
    assert torch.equal(out.head_weight, load_checkpoint(zoo["hetero"][2].checkpoint).model.embed_tokens.weight)
    pool.forward("moe", ids)
    assert torch.equal(outs["deep"].head_weight, load_checkpoint(zoo["hetero"][0].checkpoint).lm_head.weight)


def test_a_head_weight_kept_past_fn_makes_eviction_let_go_instead_of_freeing(zoo):
    """A view of a teacher's weights kept past `run`'s fn (here: saved by autograd for a backward run
    after the teacher is evicted) stays valid: the pool gives that teacher's buffers up to their holders
    instead of freeing them; the teacher reloads into fresh buffers, and once nothing holds a view,
    eviction frees in place again."""
    ids = _ids(6)
    ref = load_checkpoint(zoo["hetero"][0].checkpoint).eval()
    pool = TeacherPool(zoo["hetero"], _one_at_a_time_mib(zoo), prefetch=False)
    student = torch.randn(3, 32, requires_grad=True)
    loss = pool.run({"deep": ids}, lambda n, out: (student @ out.head_weight.t()).logsumexp(-1).sum())["deep"]
    pool.forward("moe", ids)  # evicts deep
    host = pool._host["deep"]
    assert pool.resident == ["moe"] and host.device_flat is None
    assert host.module.lm_head.weight.device.type == "meta"
    loss.backward()
    want = torch.autograd.grad((student @ ref.lm_head.weight.t()).logsumexp(-1).sum(), student)[0]
    assert torch.equal(student.grad, want)
    kept = pool.run({"deep": ids}, lambda n, out: out.head_weight)["deep"]  # reloads into fresh buffers
    with torch.no_grad():
        assert torch.equal(pool.forward("deep", ids).hidden, ref.forward_hidden(ids).hidden)
    pool.forward("moe", ids)
    assert torch.equal(kept, ref.lm_head.weight)
    del kept, loss
    pool.forward("deep", ids)
    pool.forward("moe", ids)
    assert host.device_flat is not None and _held_bytes(pool, "deep") == 0  # freed in place again
    s = pool.stats()
    assert s.loads == s.evictions + 1 and pool.peak_resident_bytes <= pool.budget_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
def test_cuda_switching_frees_in_place_and_orders_streams(zoo, prefetch):
    """On the GPU: prefetches allocate and copy on the side stream; eviction frees in place, after the
    compute stream's queued reads (record_stream): a compute stream held back by a sleep kernel still
    reads each teacher's own weights while the next teachers' loads land, possibly in the same memory."""
    ids = _ids(7).cuda()
    refs = {s.name: load_checkpoint(s.checkpoint).eval().cuda() for s in zoo["hetero"]}
    with torch.no_grad():
        want = {n: ref.logits(ref.forward_hidden(ids).hidden) for n, ref in refs.items()}
    base = torch.cuda.memory_allocated()
    pool = TeacherPool(zoo["hetero"], _one_at_a_time_mib(zoo) * 1.75, prefetch=prefetch, device="cuda")  # two fit
    got = []

    def score(name, out):
        torch.cuda._sleep(2_000_000)  # the compute stream lags the host by ~1 ms per teacher
        got.append((name, (out.hidden @ out.head_weight.t()).float()))

    order = [list(_HETERO), ["tied-mqa", "deep"], ["moe", "tied-mqa", "deep"], ["deep", "moe"]] * 3
    for i, names in enumerate(order):
        pool.run({n: ids for n in names}, score, next_teachers=order[i + 1] if i + 1 < len(order) else ())
    torch.cuda.synchronize()
    for name, logits in got:
        torch.testing.assert_close(logits, want[name], rtol=1e-5, atol=1e-5)
    s = pool.stats()
    assert s.evictions > 0 and (s.prefetched > 0) == prefetch
    for name in refs:
        assert _held_bytes(pool, name) == (pool.nbytes(name) if name in pool.resident else 0)
    assert torch.cuda.memory_allocated() - base <= pool.resident_bytes + 2**20
    pool.set_budget(_one_at_a_time_mib(zoo))  # evicts down to one
    assert len(pool.resident) == 1 and sum(_held_bytes(pool, n) for n in refs) == pool.resident_bytes
    pool.close()


# ---- LRU within the budget -------------------------------------------------------------------------


def test_lru_budget_of_two_teachers_counts_loads_and_evicts_least_recent(zoo):
    size = _one_size(zoo)
    pool = TeacherPool(zoo["same"], _budget_mib(size, 2.5), prefetch=False)
    ids = _ids()
    loads = []
    for name in "ABACA":
        pool.forward(name, ids)
        loads.append(pool.stats(reset=False).loads)
    assert loads == [1, 2, 2, 3, 3]  # A, B load; A hits; C evicts B (least recent), not A; A hits
    assert pool.resident == ["C", "A"]
    pool.forward("B", ids)  # evicts C, the least recent now
    s = pool.stats()
    assert (s.loads, s.hits, s.evictions, s.teachers, s.prefetched) == (4, 2, 2, 6, 0)
    assert pool.resident == ["A", "B"] and pool.resident_bytes == 2 * size
    assert pool.peak_resident_bytes <= pool.budget_bytes
    assert pool.stats().loads == 0  # reset
    # an evicted teacher's device memory is freed in place; a resident one holds exactly its bytes
    assert _held_bytes(pool, "C") == 0 and _held_bytes(pool, "A") == _held_bytes(pool, "B") == size


@pytest.mark.parametrize("prefetch", [False, True])
def test_run_loads_each_teacher_once_and_stays_within_budget(zoo, prefetch):
    size = _one_size(zoo)
    pool = TeacherPool(zoo["same"], _budget_mib(size, 2.5), prefetch=prefetch)
    seen = []
    out = pool.run({n: _ids(i) for i, n in enumerate("ABC")}, lambda name, o: seen.append(name) or o.hidden.sum().item())
    s = pool.stats()
    assert sorted(seen) == ["A", "B", "C"] and set(out) == {"A", "B", "C"}
    assert (s.loads, s.hits, s.teachers) == (3, 0, 3)
    assert s.prefetched == (2 if prefetch else 0)  # the first load of a cold step cannot be hidden
    assert pool.peak_resident_bytes <= pool.budget_bytes
    assert s.compute_s > 0 and s.load_s > 0 and s.overhead == pytest.approx(s.load_wait_s / s.compute_s)
    pool.close()


def test_run_serves_resident_teachers_first_so_none_is_loaded_twice(zoo):
    pool = TeacherPool(zoo["same"], _budget_mib(_one_size(zoo), 2.5), prefetch=False)
    pool.forward("A", _ids())
    pool.forward("B", _ids())  # resident, least recent first: A, B
    pool.stats()
    # C first would evict A and then reload it; serving A first lets C evict B instead.
    pool.run({"C": _ids(), "A": _ids()}, lambda n, o: None)
    s = pool.stats()
    assert (s.loads, s.hits, s.evictions) == (1, 1, 1)
    assert pool.resident == ["A", "C"]


def test_prefetch_needs_room_for_two_and_never_evicts_a_teacher_still_needed(zoo):
    size = _one_size(zoo)
    ids = {n: _ids() for n in "ABC"}
    one = TeacherPool(zoo["same"], _budget_mib(size, 1.5), prefetch=True)
    one.run(ids, lambda n, o: None)
    s = one.stats()
    assert (s.loads, s.prefetched, s.evictions) == (3, 0, 2)  # no room to overlap: synchronous switches
    assert one.peak_resident_bytes <= one.budget_bytes
    two = TeacherPool(zoo["same"], _budget_mib(size, 2.5), prefetch=True)
    two.run({"A": ids["A"], "B": ids["B"]}, lambda n, o: None)
    two.stats()
    # A, B resident and both needed: C cannot be prefetched until A is done, then evicts A (not B).
    two.run(ids, lambda n, o: None)
    s = two.stats()
    assert (s.loads, s.prefetched, s.hits, s.evictions) == (1, 1, 2, 1)
    assert two.resident == ["B", "C"]
    assert two.prefetch("A") and two.stats().loads == 0  # a hint for the next step, settled on use
    two.forward("A", ids["A"])
    s = two.stats()
    assert (s.loads, s.prefetched, s.hits) == (1, 1, 0)
    one.close()
    two.close()


def test_next_teachers_prefetch_the_next_calls_first_load(zoo):
    size = _one_size(zoo)
    ids = {n: _ids() for n in "ABC"}
    pool = TeacherPool(zoo["same"], _budget_mib(size, 3.5), prefetch=True)
    pool.run({"A": ids["A"]}, lambda n, o: None)
    pool.stats()
    # A resident; this call needs B (a cold load: nothing else to overlap it with), the next one A and C:
    # once B is in, C is prefetched while B computes.
    out = pool.run({"B": ids["B"]}, lambda n, o: o.hidden.shape, next_teachers=["A", "C"])
    assert set(out) == {"B"}
    s = pool.stats()
    assert (s.loads, s.prefetched, s.evictions) == (1, 0, 0)
    assert pool._inflight is not None and pool._inflight[0] == "C"  # in flight, settled on use
    pool.run({"C": ids["C"], "A": ids["A"]}, lambda n, o: None)
    s = pool.stats()
    assert (s.loads, s.prefetched, s.hits) == (1, 1, 1)  # C landed from the lookahead, A hit
    pool.close()

    # Two fit: the lookahead evicts neither a teacher this call needs nor a resident one the next needs.
    two = TeacherPool(zoo["same"], _budget_mib(size, 2.5), prefetch=True)
    two.run({"A": ids["A"]}, lambda n, o: None)
    two.run({"A": ids["A"]}, lambda n, o: None, next_teachers=["B", "nope"])  # unknown names are ignored
    assert two._inflight[0] == "B"
    two.stats()
    two.run({"B": ids["B"], "A": ids["A"]}, lambda n, o: None, next_teachers=["A", "C"])
    s = two.stats()
    assert (s.loads, s.prefetched, s.hits) == (1, 1, 1)
    assert two._inflight is None  # C would have to evict A (needed next) or B (needed now)
    two.run({"B": ids["B"]}, lambda n, o: None, next_teachers=["C"])  # now A may go
    assert two._inflight[0] == "C"
    two.run({"C": ids["C"]}, lambda n, o: None)
    s = two.stats()
    assert (s.loads, s.prefetched, s.evictions) == (1, 1, 1) and two.peak_resident_bytes <= two.budget_bytes
    two.set_prefetch(False)
    two.run({"C": ids["C"]}, lambda n, o: None, next_teachers=["A"])
    assert two._inflight is None
    two.close()


def test_add_and_remove_teachers_live(zoo):
    size = _one_size(zoo)
    pool = TeacherPool(zoo["same"][:2], _budget_mib(size, 3.5), prefetch=False)
    pool.forward("A", _ids())
    pool.remove("A")
    assert pool.names == ["B"] and pool.resident == [] and pool.resident_bytes == 0
    with pytest.raises(KeyError, match="unknown teacher"):
        pool.forward("A", _ids())
    pool.add(zoo["same"][2])
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add(zoo["same"][2])
    assert pool.run({"C": _ids(), "B": _ids()}, lambda n, o: o.hidden.shape[-1]) == {"C": 32, "B": 32}


def test_set_budget_live_evicts_least_recent_and_refuses_a_budget_below_one_teacher(zoo):
    size = _one_size(zoo)
    pool = TeacherPool(zoo["same"], _budget_mib(size, 3.5), prefetch=False)
    for name in "BAC":
        pool.forward(name, _ids())
    pool.set_budget(_budget_mib(size, 1.5))
    assert pool.resident == ["C"] and pool.stats().evictions == 2
    with pytest.raises(ValueError, match="cannot hold teachers"):
        pool.set_budget(_budget_mib(size, 0.5))
    assert pool.resident == ["C"]
    with pytest.raises(KeyError, match="unknown teachers"):
        pool.run({"Z": _ids()}, lambda n, o: None)


# ---- errors and config -----------------------------------------------------------------------------


def test_errors_surface_when_a_teacher_is_added(zoo, tmp_path):
    size = _one_size(zoo)
    with pytest.raises(ValueError, match=r"needs .* MiB on device but the pool's device_memory_mib"):
        TeacherPool(zoo["same"][:1], _budget_mib(size, 0.5))
    bad = ModelConfig(vocab_size=128, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=16,
                      ffn=DenseFFNConfig(intermediate_size=32))
    spec = _save(tmp_path, "wide-vocab", bad, 0)
    with pytest.raises(ValueError, match="vocab_size=128 but the student has vocab_size=99"):
        TeacherPool([spec], 64, student_vocab=CharTokenizer().vocab_size)
    with pytest.raises(ValueError, match="missing: no such file or directory"):
        TeacherPool([TeacherSpec(name="x", checkpoint=tmp_path / "missing")], 64)
    # a checkpoint whose weights do not match its config.json
    (tmp_path / "wide-vocab" / "config.json").write_text(_SAME.model_dump_json())
    with pytest.raises(ValueError, match=r"does not match its config: .*embed_tokens.weight is \(128, 16\) not \(99, 32\)"):
        TeacherPool([spec], 64)


def test_a_teacher_may_be_a_hugging_face_directory_or_a_gguf_file(tmp_path):
    """A real model teaches as it is (seed §5.2.4: teachers from different stages of development): an HF
    directory (a run's export) and a GGUF file load through the declared conversions, and the pool's
    logits are the transformers model's own."""
    pytest.importorskip("transformers")
    from tests.hf_tiny import logit_gap, make_hf, write_gguf

    hf = make_hf("llama", tmp_path / "hf", seed=3, rope_scaling=None)  # GGUF: plain RoPE (test_pretrained_gguf.py)
    gguf = write_gguf(hf, tmp_path / "t.gguf", qtype="F32")
    pool = TeacherPool([TeacherSpec(name="hf", checkpoint=tmp_path / "hf"), TeacherSpec(name="gguf", checkpoint=gguf)],
                       64, student_vocab=160, prefetch=False)
    ids = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
    for name in ("hf", "gguf"):
        assert pool.config(name).init is not None and pool.config(name).num_layers == 2
        out = pool.forward(name, ids)
        got = out.hidden @ out.head_weight.T
        assert logit_gap(got, want)[0] < 1e-4, name
    with pytest.raises(ValueError, match="vocab_size=160 but the student has vocab_size=99"):
        TeacherPool([TeacherSpec(name="hf", checkpoint=tmp_path / "hf")], 64, student_vocab=99)


def test_check_vocab_names_both_sizes_on_one_line():
    assert check_vocab(99, ModelConfig()) is None
    msg = check_vocab(99, ModelConfig(vocab_size=151936), "qwen")
    assert "\n" not in msg and "151936" in msg and "99" in msg and msg.startswith("qwen")


def test_pool_config_validates_and_builds(zoo):
    specs = zoo["hetero"]
    cfg = TeacherPoolConfig(teachers=specs, device_memory_mib=8, prefetch=False)
    assert cfg.teacher_for("d-moe") == "moe" and cfg.teacher_for("nope") is None
    cfg.validate_vocab(99)
    with pytest.raises(ValueError, match="vocab_size=99 but the student has vocab_size=100"):
        cfg.validate_vocab(100)
    with pytest.raises(ValidationError, match="unique"):
        TeacherPoolConfig(teachers=[specs[0], specs[0]])
    with pytest.raises(ValidationError, match="assigned to two teachers"):
        TeacherPoolConfig(teachers=[specs[0], specs[1].model_copy(update={"datasets": ["d-deep"]})])
    with pytest.raises(ValidationError):
        TeacherPoolConfig(device_memory_mib=0)
    with pytest.raises(ValidationError):
        TeacherPoolConfig(dtype="int8")
    pool = TeacherPool.from_config(cfg)
    assert pool.names == ["deep", "moe", "tied-mqa"] and not pool.prefetch_enabled
    half = TeacherPool.from_config(TeacherPoolConfig(teachers=specs[:1], dtype="bfloat16"))
    assert half.nbytes("deep") * 2 == pool.nbytes("deep")
    assert half.forward("deep", _ids()).hidden.dtype == torch.bfloat16


def test_config_module_imports_neither_torch_nor_ray():
    code = "import sys, teachers.config; bad = {'torch', 'ray'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ---- teacher zoo -----------------------------------------------------------------------------------


def test_sft_learns_and_greedy_evaluation_stops_at_eos():
    torch.manual_seed(0)
    model = Decoder(tiny(ARCHITECTURES["mqa"]))
    task = UppercaseConfig(max_len=4, num_heldout=8).build()
    losses = sft(model, task, steps=60, batch_size=16, lr=1e-2)
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5  # 4.3 -> 2.7 at this seed
    assert 0.0 <= heldout_accuracy(model, task, max_new_tokens=8) <= 1.0


def test_build_teachers_saves_a_loadable_heterogeneous_zoo(tmp_path):
    archs = {k: tiny(v) for k, v in ARCHITECTURES.items()}
    cfg, reports = build_teachers(tmp_path, num_teachers=3, num_trained=1, steps=3, batch_size=8,
                                  architectures=archs, eval_problems=4, log=lambda _s: None)
    assert [r.architecture for r in reports] == list(archs)[:3]
    assert reports[0].heldout_accuracy is not None and reports[0].dataset == "reverse"
    assert reports[1].heldout_accuracy is None and cfg.teachers[1].datasets == []
    assert TeacherPoolConfig.model_validate_json((tmp_path / "teachers.json").read_text()) == cfg
    assert len({load_checkpoint(s.checkpoint).config for s in cfg.teachers}) == 3
    pool = TeacherPool.from_config(cfg)
    outs = pool.hidden_states({s.name: _ids() for s in cfg.teachers})
    assert len(outs) == 3 and pool.stats().loads == 3
    with pytest.raises(ValueError, match="each trained teacher serves its own dataset"):
        build_teachers(tmp_path / "x", num_teachers=2, num_trained=3, steps=1)
