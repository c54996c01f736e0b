"""The rollout path (model/fused.py, issue #15): fused q/k/v and gate/up GEMMs and the decode_fused kernels give
the plain forward's logits (fp32) for Llama-, Qwen3- (qk-norm), Qwen2- (q/k/v bias) and MoE-shaped debug models,
through a whole forward, the engine and the captured decode forward; the fused weights follow every in-place
weight change (the optimizer, rl/runtime/worker.py's rollout copy and update, checkpoint loads); training is untouched.
`kernels=True` runs the Triton kernels (interpreted on CPU, TRITON_INTERPRET=1 from tests/conftest.py)."""

import copy

import pytest
import torch

from model import fused
from model.decoder import Decoder
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.types import GenerationRequest
from tests.conftest import debug_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ARCHS = {
    "llama": dict(moe=False, qk_norm=False),
    "qwen3": dict(moe=False, qk_norm=True),
    "qwen2": dict(moe=False, qk_norm=False, attention_bias=True),
    "qwen3_moe": dict(moe=True, qk_norm=True),
}


def _model(arch: str, **kw) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(debug_config(**ARCHS[arch], **kw)).to(DEV).eval()
    with torch.no_grad():  # biases start at zero; random ones so that a lost bias would show
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(params=[False, True], ids=["eager", "kernels"])
def kernels(request, monkeypatch):
    """Run the rollout path with the Triton kernels (True) or their eager references (False), on any device."""
    monkeypatch.setattr(fused, "use_kernels", lambda x: request.param)
    return request.param


def _plain(model: Decoder, *args, **kw):
    """The plain forward of the same module (the rollout path switched off), no grad."""
    fused.ENABLED = False
    try:
        with torch.no_grad():
            return model(*args, **kw)[0]
    finally:
        fused.ENABLED = True


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> bool:
    return bool((got - want).abs().max() <= tol * max(want.abs().max().item(), 1.0))


@pytest.mark.parametrize("share_storage", [False, True], ids=["copy", "views"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rollout_path_gives_the_plain_logits(arch, share_storage, kernels):
    model = _model(arch)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEV)
    want = _plain(model, ids)
    assert model.enable_rollout_fusion(share_storage=share_storage)
    with torch.no_grad():
        got = model(ids)[0]
    assert _close(got, want)
    assert torch.equal(_plain(model, ids), want)  # the plain path still reads the same parameters


@pytest.mark.parametrize("arch, kv", [("llama", "bf16"), *(pytest.param(a, k, marks=pytest.mark.slow)
                                                          for a, k in (("qwen3", "bf16"), ("qwen2", "bf16"), ("qwen3", "fp8")))])
def test_engine_on_the_rollout_path_gives_the_plain_engines_tokens(arch, kv, kernels):
    """Prefill (the cache written by the fused kernel for bf16, by PagedKVCache.write for fp8) and eager decode
    over the paged cache: greedy and sampled tokens equal, logprobs within 1e-4 (fp32)."""
    plain = _model(arch, kv_cache={"dtype": kv})
    fast = copy.deepcopy(plain)
    assert fast.enable_rollout_fusion()
    reqs = [GenerationRequest(f"s{i}", tuple([1] + [10 + (7 * i + j) % 60 for j in range(2 + i)]), 6, seed=i,
                              temperature=0.0 if i % 2 else 1.0) for i in range(3)]
    out = {}
    for name, model in (("plain", plain), ("fast", fast)):
        eng = Engine(model, EngineConfig(max_batch_size=4, block_size=4, max_seq_len=32, cuda_graphs=False),
                     eos_id=2, device=DEV)
        out[name] = {g.sample_id: g for g in eng.generate(reqs)}
    for sid, g in out["plain"].items():
        assert out["fast"][sid].response_tokens == g.response_tokens, sid
        assert max(abs(a - b) for a, b in zip(out["fast"][sid].logprobs, g.logprobs)) < 1e-4


@pytest.mark.parametrize("kv", ["bf16", pytest.param("fp4", marks=pytest.mark.slow)])
def test_captured_decode_forward_on_the_rollout_path_gives_the_plain_logits(kv, kernels, monkeypatch):
    """DecodeGraphs' captured computation (rollout/graphs.py `_forward`: slots from the input buffer, the paged
    decode kernel, padding rows) run directly, on the rollout path that DecodeGraphs turns on, against the
    same forward on the plain path, over an engine's live cache. head_dim 32: with the kernels an fp4 cache's
    rows are encoded by the qk-norm + RoPE kernel (`PagedKVCache.fp4_layer`), which must store what `write` does."""
    from model.kv_cache import PagedKVCache
    from rollout.graphs import _COLS, DecodeGraphs

    fused_fp4 = []
    fp4_layer = PagedKVCache.fp4_layer
    monkeypatch.setattr(PagedKVCache, "fp4_layer", lambda self, i: fused_fp4.append(i) or fp4_layer(self, i))
    model = _model("qwen3", kv_cache={"dtype": kv}, head_dim=32)
    eng = Engine(model, EngineConfig(max_batch_size=4, block_size=4, max_seq_len=32, cuda_graphs=False), eos_id=2,
                 device=DEV)
    eng.add([GenerationRequest(f"s{i}", (1, 5 + i, 6, 7 + i), 20, seed=i) for i in range(3)])
    for _ in range(3):
        eng.step()
    graphs = DecodeGraphs(model, eng.cache, max_batch_size=4, max_blocks=eng.cache.blocks_for(32))
    assert model._rollout is not None and model._rollout.share_storage is False  # a trainable module: copies
    buf = torch.zeros(4, _COLS + graphs.max_blocks, dtype=torch.long, device=DEV)  # row 3: padding
    for i, s in enumerate(eng._active):
        buf[i, 0], buf[i, 1], buf[i, 2] = s.tokens[-1], s.num_cached, 1
        buf[i, _COLS:_COLS + len(s.blocks)] = torch.tensor(s.blocks)
    with torch.no_grad():
        fused.ENABLED = False
        try:
            want, _, _ = graphs._forward(buf)
        finally:
            fused.ENABLED = True
        got, sampled, routing = graphs._forward(buf)  # writes the same K/V into the same slots again
    assert _close(got[:3], want[:3], 1e-4) and torch.isfinite(got[3]).all()
    assert len(fused_fp4) == (2 if kv == "fp4" and kernels else 0)  # both layers, on the kernel path only
    assert routing is None  # a dense model: no expert ids
    # the sampler inside the captured computation: temperature 0 (the buffer's zero bits) takes the argmax
    assert sampled.shape == (2, 4) and sampled[0, :3].long().tolist() == got[:3].argmax(-1).tolist()


def _adamw_step(model: Decoder) -> None:
    """One optimizer step on the module, as the trainer makes it (in place, autograd on)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2)).to(DEV)
    model(ids)[0].float().logsumexp(-1).mean().backward()
    opt.step()
    model.eval()


def test_copies_follow_an_optimizer_step_on_the_shared_module(kernels):
    """The trainer's own module (float32, shared with the engine): its fused copies are refreshed in place
    (same addresses, which captured graphs hold) once the optimizer has changed the weights."""
    model = _model("qwen2")
    model.enable_rollout_fusion()
    attn = model.model.layers[0].self_attn
    addr = (attn.rollout_weights.weight.data_ptr(), attn.rollout_weights.bias.data_ptr())
    assert not model.refresh_rollout_weights()  # fresh after building
    _adamw_step(model)
    assert model.refresh_rollout_weights() and not model.refresh_rollout_weights()
    assert (attn.rollout_weights.weight.data_ptr(), attn.rollout_weights.bias.data_ptr()) == addr
    assert torch.equal(attn.rollout_weights.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    ids = torch.tensor([[1, 4, 9, 16]], device=DEV)
    _adamw_step(model)  # and without the explicit refresh: the forward checks the version counters itself
    with torch.no_grad():
        got = model(ids)[0]
    assert _close(got, _plain(model, ids))


def test_the_rollout_copy_shares_storage_and_needs_no_refresh(kernels):
    """rl/runtime/worker.py's engine copy (run.dtype bfloat16 / FSDP2; float32 here for exact logits): its Linear weights
    are views of the fused buffers, so `refresh_rollout_copy` writes straight into them."""
    from rl.runtime.worker import refresh_rollout_copy, rollout_copy

    master = _model("qwen3")
    twin = rollout_copy(master, torch.float32)
    assert twin.enable_rollout_fusion(share_storage=True)
    mlp = twin.model.layers[1].mlp
    buf = mlp.rollout_weights.weight
    assert mlp.gate_proj.weight.data_ptr() == buf.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == buf.data_ptr() + mlp.gate_proj.weight.numel() * buf.element_size()
    _adamw_step(master)
    refresh_rollout_copy(twin, master)
    assert not twin.refresh_rollout_weights()  # nothing to copy: the update landed in the buffers
    ids = torch.tensor([[1, 4, 9, 16, 25]], device=DEV)
    with torch.no_grad():
        got = twin(ids)[0]
    assert _close(got, _plain(master, ids))
    assert twin.state_dict().keys() == master.state_dict().keys()


@pytest.mark.parametrize("share_storage", [False, True], ids=["copy", "views"])
def test_a_checkpoint_load_reaches_the_rollout_path(tmp_path, share_storage):
    from model.checkpoint import write_weights
    from model.pretrained import load_weights_into

    other = _model("qwen2")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    write_weights(other, tmp_path)
    model = _model("qwen2")
    model.enable_rollout_fusion(share_storage=share_storage)
    load_weights_into(model, tmp_path)
    ids = torch.tensor([[3, 1, 4, 1, 5]], device=DEV)
    with torch.no_grad():
        got = model(ids)[0]
    assert _close(got, _plain(other, ids))


def test_training_is_untouched_by_rollout_fusion():
    """With the rollout path on (copies), the module's parameters, state_dict and autograd forward are the
    plain ones: same tensors (no views), same loss and gradients as an identical module without it."""
    plain = _model("qwen2")
    model = copy.deepcopy(plain)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.enable_rollout_fusion()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    buffers = {g.weight.untyped_storage().data_ptr() for g in model._rollout.groups}
    assert not any(p.untyped_storage().data_ptr() in buffers for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3)).to(DEV)
    losses = []
    for m in (plain, model):
        m.train()
        loss = m(ids)[0].logsumexp(-1).mean()
        loss.backward()
        losses.append(loss)
    # bit for bit on CPU; on CUDA attention's backward may accumulate in a varying order, so to rounding there
    same = torch.equal if DEV == "cpu" else (lambda a, b: _close(a, b, 1e-6))
    assert same(losses[0], losses[1])
    assert all(same(a.grad, b.grad) for a, b in zip(plain.parameters(), model.parameters()))


def test_the_worker_refreshes_the_engines_fused_weights_at_the_weight_update():
    """PolicyWorker.update_weights (float32: the engine shares the trainer's module) leaves the fused copies
    level with the new weights, so the next decode step has nothing to copy."""
    from rl.config import Recipe
    from rl.train.trainer import TrainBatch
    from rl.runtime.worker import PolicyWorker
    from tests.unit.test_worker import RECIPE

    recipe = Recipe.model_validate({**RECIPE, "model": {**RECIPE["model"], "ffn": {"type": "dense", "intermediate_size": 128}}})
    w = PolicyWorker(recipe)
    assert w.rollout_model is w.model and w.rollout_model.enable_rollout_fusion()  # as DecodeGraphs does on CUDA
    w.begin_stage(recipe.stages[0])
    gens = w.generate([GenerationRequest(f"s{i}", (1, 20 + i, 30), 6, seed=i) for i in range(2)])
    batch = TrainBatch([g.prompt_tokens for g in gens], [g.response_tokens for g in gens],
                       float(sum(len(g.response_tokens) for g in gens)), [g.logprobs for g in gens],
                       [g.policy_versions for g in gens], None, [1.0, -1.0])
    w.train_step(batch, recipe.stages[0])
    w.update_weights(1)
    assert not w.rollout_model.refresh_rollout_weights()
    attn = w.model.model.layers[0].self_attn
    assert torch.equal(attn.rollout_weights.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_graphs_over_the_rollout_copy_see_each_weight_update():
    """The worker's engine copy (frozen: its Linears become views of the fused buffers) decoding through CUDA
    graphs, refreshed after an optimizer step as rl/runtime/worker.py does, gives the plain eager engine's tokens on the
    master weights (fp32), before and after the update, with no recapture."""
    from rl.runtime.worker import refresh_rollout_copy, rollout_copy

    master = _model("qwen3")
    twin = rollout_copy(master, torch.float32)
    cfg = dict(max_batch_size=8, block_size=4, max_seq_len=64)
    fast = Engine(twin, EngineConfig(**cfg), eos_id=2, device=DEV)
    plain = Engine(master, EngineConfig(**cfg, cuda_graphs=False), eos_id=2, device=DEV)
    assert twin._rollout is not None and twin._rollout.share_storage and master._rollout is None
    reqs = [GenerationRequest(f"s{i}", (1, 5 + i, 6, 7), 16, seed=i, temperature=1.0) for i in range(5)]
    for step in range(2):
        got = {g.sample_id: g for g in fast.generate(reqs)}
        want = {g.sample_id: g for g in plain.generate(reqs)}
        for sid, g in want.items():
            assert got[sid].response_tokens == g.response_tokens, (step, sid)
            assert max(abs(a - b) for a, b in zip(got[sid].logprobs, g.logprobs)) < 1e-4
        _adamw_step(master)
        refresh_rollout_copy(twin, master)
        assert not twin.refresh_rollout_weights()
    assert fast.graphs.disabled_reason is None and fast.stats.graph_steps > 0 and len(fast.graphs._graphs) >= 1
