"""KV-cache storage formats (bf16 | fp8 | fp4, seed §2.4.4) and QAT: the pool stores real packed bytes,
reports its size by formula, the training forward with QAT is the sampled policy, STE gradient, exact
interrupt/resume."""

import pytest
import torch

from model.decoder import Decoder
from model.kv_cache import PagedBatch, PagedKVCache, fake_quant, kv_format
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.types import GenerationRequest, RolloutState
from tests.conftest import debug_config

TOKENS = [1, 20, 31, 5, 9, 44, 17, 3, 60, 2, 11, 12, 13]  # crosses several 4-token blocks
ATOL_SAME = 1e-4  # paths that see bit-identical K/V: float32 summation order only
# Unquantised full forward vs decode through a quantised cache on the debug MoE model (init_std 0.15:
# peaked attention, logits std ~1.1, max ~3.8; routing may flip). Stated tolerances (max |Δ logit|,
# max |Δ next-token probability|); measured 0.76 / 0.015 for fp8 (K/V rel. error 2.7%) and 1.10 / 0.027
# for fp4 (rel. error 10%).
ATOL_FORMAT = {"bf16": (1e-4, 1e-5), "fp8": (1.0, 0.05), "fp4": (2.0, 0.1)}


def _model(kv_dtype="bf16", qat=False, moe=True):
    torch.manual_seed(0)
    return Decoder(debug_config(moe=moe, kv_cache={"dtype": kv_dtype, "qat": qat})).eval()


def _cache(model, num_blocks=16, block_size=4):
    c = model.config
    return PagedKVCache(num_layers=c.num_layers, num_blocks=num_blocks, block_size=block_size,
                        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, kv_dtype=c.kv_cache.dtype)


def _incremental_logits(model, tokens, P=3):
    """Prefill the first P tokens, then decode the rest one by one through the paged cache."""
    cache = _cache(model)
    blocks = cache.allocate(cache.blocks_for(len(tokens)))
    slots = torch.tensor([cache.slots(blocks, 0, P)])
    out = [model(torch.tensor([tokens[:P]]), batch=PagedBatch(cache, True, slots))[0][0]]
    for pos in range(P, len(tokens)):
        ctx = torch.tensor([cache.slots(blocks, 0, pos + 1)])
        mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
        b = PagedBatch(cache, False, ctx[:, -1:], ctx, mask)
        out.append(model(torch.tensor([[tokens[pos]]]), torch.tensor([[pos]]), batch=b)[0][0])
    return torch.cat(out)


def _formula(kv_dtype, kvh, d, elem):
    """seed §2.4.4: K+V of KVH heads x D dims; fp4 = 4 bits + one 8-bit scale per 16 values."""
    return {"bf16": 2 * kvh * d * elem, "fp8": 2 * kvh * (d + 1), "fp4": 2 * kvh * d * 4.5 / 8}[kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp4"])
def test_bytes_per_token_match_formula_and_pool(kv_dtype):
    m = _model(kv_dtype)
    c = m.config
    eng = Engine(m, EngineConfig(max_batch_size=2, block_size=4, max_seq_len=32), eos_id=2)
    want = _formula(kv_dtype, c.num_kv_heads, c.head_dim, elem=4)  # float32 debug model
    assert eng.kv_bytes_per_token_per_layer == want == eng.cache.pool_bytes_per_slot_per_layer
    # the pool holds the packed format itself, not a dequantised copy
    D = c.head_dim
    data_d, scale = {"bf16": (D, None), "fp8": (D, ()), "fp4": (D // 2, (D // 16,))}[kv_dtype]
    assert eng.cache.k.shape[-1] == data_d and eng.cache.k.dtype == (torch.float32 if kv_dtype == "bf16" else torch.uint8)
    assert (eng.cache.k_scale is None) == (scale is None)
    if scale is not None:
        assert eng.cache.k_scale.shape[3:] == scale and eng.cache.k_scale.dtype == torch.uint8
    # a real bf16 pool: 2 bytes per element
    bf = PagedKVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert bf.bytes_per_token_per_layer == _formula("bf16", 2, 64, 2) == bf.pool_bytes_per_slot_per_layer


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_fake_quant_is_bit_identical_to_cache_round_trip(kv_dtype):
    torch.manual_seed(1)
    cache = PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=32, kv_dtype=kv_dtype)
    k, v = torch.randn(2, 5, 2, 32) * 3, torch.randn(2, 5, 2, 32)
    slots = torch.tensor([cache.slots([0, 1], 0, 5), cache.slots([2, 3], 0, 5)])
    k_w, v_w = cache.write(1, slots, k, v)
    k_r, v_r = cache.gather(1, slots)
    fmt = kv_format(kv_dtype)
    assert torch.equal(fake_quant(k, fmt), k_r) and torch.equal(fake_quant(v, fmt), v_r)
    assert torch.equal(k_w, k_r) and torch.equal(v_w, v_r)
    assert not torch.equal(k_r, k)  # it does quantise
    if torch.cuda.is_available():  # the decode write without a read back (fp4 on CUDA: encoded into the pool)
        cuda = PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=32, kv_dtype=kv_dtype,
                            device="cuda")
        assert cuda.write(1, slots.cuda(), k.cuda(), v.cuda(), read_back=False) is None
        k_c, v_c = cuda.gather(1, slots.cuda())
        assert torch.equal(k_c.cpu(), k_r) and torch.equal(v_c.cpu(), v_r)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8", "fp4"])
def test_decode_through_cache_matches_full_forward(kv_dtype):
    """Unquantised training forward vs decode through the cache: exact-ish for bf16, within the format's
    stated tolerance for fp8 / fp4; with QAT the training forward *is* the decode (float tolerance)."""
    plain, qat = _model(kv_dtype, qat=False), _model(kv_dtype, qat=True)
    with torch.no_grad():
        inc = _incremental_logits(plain, TOKENS)
        full_plain = plain(torch.tensor([TOKENS]))[0][0]
        full_qat = qat(torch.tensor([TOKENS]))[0][0]
        assert torch.equal(_incremental_logits(qat, TOKENS), inc)  # qat changes nothing in the engine
    gap = (full_plain - inc).abs().max()
    prob_gap = (full_plain.softmax(-1) - inc.softmax(-1)).abs().max()
    assert gap <= ATOL_FORMAT[kv_dtype][0] and prob_gap <= ATOL_FORMAT[kv_dtype][1], (gap, prob_gap)
    assert torch.allclose(full_qat, inc, atol=ATOL_SAME), (full_qat - inc).abs().max()
    if kv_dtype != "bf16":
        assert gap > 10 * ATOL_SAME  # without QAT the trained and the sampled policy differ


@pytest.mark.parametrize("kv_dtype", [pytest.param("fp8", marks=pytest.mark.slow), "fp4"])
def test_qat_training_logprobs_equal_engine_logprobs(kv_dtype):
    """The trained policy is the sampled policy: teacher-forced QAT logprobs of the engine's own samples
    equal the behaviour logprobs it recorded (batched, padded, continuous batching)."""
    from rl.train.losses import token_logprobs
    from rl.train.trainer import pack

    m = _model(kv_dtype, qat=True)
    reqs = [GenerationRequest(f"s{i}", (1, 10 + i, 20 + 3 * i, 30), 12, seed=i, temperature=0.8) for i in range(5)]
    gens = Engine(m, EngineConfig(max_batch_size=3, block_size=4, max_seq_len=32), eos_id=2).generate(reqs)
    b = pack([g.prompt_tokens for g in gens], [g.response_tokens for g in gens], [g.logprobs for g in gens],
             routing_B=[g.routing_trace for g in gens])
    with torch.no_grad():
        logits, _ = m(b.input_ids, routing_replay=b.routing)
    lp = token_logprobs(logits, b.targets, temperature=0.8)
    mask = b.mask.bool()
    assert torch.allclose(lp[mask], b.behavior_logprobs[mask], atol=ATOL_SAME)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_ste_gradient_is_identity_at_the_dequantised_point(kv_dtype):
    """d loss / d k through fake_quant == d loss / d k_hat with k_hat the dequantised value as a leaf."""
    torch.manual_seed(2)
    fmt = kv_format(kv_dtype)
    q, k, v = (torch.randn(2, 4, 6, 32, dtype=torch.float32) for _ in range(3))
    k.requires_grad_(True)
    v.requires_grad_(True)
    loss_fn = lambda kk, vv: torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True).square().sum()  # noqa: E731
    loss_fn(fake_quant(k, fmt), fake_quant(v, fmt)).backward()
    k_hat = fmt.round_trip(k.detach()).requires_grad_(True)
    v_hat = fmt.round_trip(v.detach()).requires_grad_(True)
    loss_fn(k_hat, v_hat).backward()
    assert torch.equal(k.grad, k_hat.grad) and torch.equal(v.grad, v_hat.grad)
    # and through the model: QAT training still reaches k_proj / v_proj
    m = _model(kv_dtype, qat=True).train()
    m(torch.tensor([TOKENS]))[0].square().mean().backward()
    attn = m.model.layers[0].self_attn
    assert attn.k_proj.weight.grad.abs().sum() > 0 and attn.v_proj.weight.grad.abs().sum() > 0


def test_fp4_interrupt_resume_equals_uninterrupted():
    m = _model("fp4", qat=True)
    cfg = EngineConfig(max_batch_size=4, block_size=4, max_seq_len=48)
    reqs = [GenerationRequest(f"s{i}", (1, 11 + i, 21, 31 + 2 * i), 12, seed=100 + i) for i in range(5)]
    reference = {g.sample_id: g for g in Engine(m, cfg, eos_id=2).generate(reqs)}
    eng = Engine(m, cfg, eos_id=2)
    eng.add(reqs)
    done = []
    for _ in range(4):
        done += eng.step()
    prefills = eng.stats.prefill_calls
    states = [RolloutState.from_bytes(s.to_bytes()) for s in eng.interrupt()]
    admitted = [s for s in states if s.k is not None]
    c = m.config
    for s in admitted:  # carried in the storage format: packed E2M1 + E4M3 scales, bytes by formula
        n = len(s.tokens) - 1
        assert s.kv_format == "fp4" and s.k.dtype == s.k_scale.dtype == torch.uint8
        assert s.k.shape == (c.num_layers, n, c.num_kv_heads, c.head_dim // 2)
        assert s.v_scale.shape == (c.num_layers, n, c.num_kv_heads, c.head_dim // 16)
        assert sum(t.nbytes for t in s.kv_tensors().values()) == n * c.num_layers * eng.kv_bytes_per_token_per_layer
    eng.resume(states)
    while eng.has_work():
        done += eng.step()
    assert {g.sample_id: (g.response_tokens, g.logprobs) for g in done} == {
        sid: (g.response_tokens, g.logprobs) for sid, g in reference.items()}
    never_admitted = len(states) - len(admitted)
    assert eng.stats.prefill_calls - prefills <= (1 if never_admitted else 0)
    # a state in another format is refused instead of being misread
    with pytest.raises(ValueError, match="holds a fp4 paged KV cache; this engine stores fp8 paged"):
        Engine(_model("fp8"), cfg, eos_id=2).resume(admitted[:1])


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_a_quantised_kv_cache_on_a_gpu_older_than_8_9_is_one_line(kv_dtype, monkeypatch):
    """The FP8/FP4 attention kernels convert E4M3 with Triton's float8e4nv (compute capability 8.9+): on an older GPU the cache is
    refused before anything is allocated, in one line naming the field, the device's capability and the way out
    (the capability is faked: this is the check's logic, not a GPU's)."""
    from model.kv_cache import KVFormatDeviceError, quantised_kv_refusal

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(KVFormatDeviceError) as e:
        PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=32, kv_dtype=kv_dtype,
                     device="cuda")
    assert str(e.value) == (f"model.kv_cache.dtype={kv_dtype} needs a GPU of compute capability 8.9 or newer (E4M3 "
                            "conversions in its attention kernels); cuda is 8.0: use kv_cache.dtype bf16")
    assert quantised_kv_refusal("bf16", "cuda") is None  # bf16 runs anywhere
    assert quantised_kv_refusal(kv_dtype, "cpu") is None  # the CPU path runs the PyTorch code
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert quantised_kv_refusal(kv_dtype, "cuda:0") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert quantised_kv_refusal(kv_dtype, "cuda:0") is None
