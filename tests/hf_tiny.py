"""Tiny Hugging Face models built by transformers in the test (no hub), the parity measures, and a GGUF
writer that follows llama.cpp's convert_hf_to_gguf.py on its own (not asyncrl's conversion), for
tests/unit/test_pretrained*.py and bench/parity.py. Everything runs on CPU in float32."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_config(kind: str, **kw):
    """A small transformers config of `kind` (fields of COMMON and `kw` on top): llama (Llama 3.1 RoPE
    scaling unless rope_scaling=None), qwen2, qwen3 (head_dim 32 != hidden/heads), qwen3_moe."""
    import transformers as tf

    if kind == "llama":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        return tf.LlamaConfig(**{**COMMON, "rope_theta": 500000.0, **kw})
    if kind == "qwen2":
        return tf.Qwen2Config(**{**COMMON, "rope_theta": 1e6, **kw})
    if kind == "qwen3":
        return tf.Qwen3Config(**{**COMMON, "head_dim": 32, **kw})
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "norm_topk_prob": True, **kw})
    raise ValueError(kind)


def make_hf(kind: str, directory: Path | None = None, seed: int = 0, max_shard_size=None, **kw):
    """A randomly initialised transformers model of `kind` with every parameter drawn afresh (biases and
    norm weights included, so that no mapping hides behind zeros or ones); saved to `directory` if given."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **kw), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
    if directory is not None:
        extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(directory, **extra)
    return model


def logit_gap(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """(max |Δlogit|, mean KL(theirs || ours)) over all positions; logits [..., V]."""
    lp, lq = torch.log_softmax(theirs.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return (ours - theirs).abs().max().item(), kl.mean().item()


def engine_greedy(model, prompts: list[list[int]], n: int, eos_id: int = 2) -> list[list[int]]:
    """n greedy tokens per prompt through asyncrl's Engine (continuous batching, paged KV cache)."""
    from rollout.config import EngineConfig
    from rollout.engine import Engine
    from rollout.types import GenerationRequest

    longest = max(len(p) for p in prompts) + n
    engine = Engine(model, EngineConfig(max_batch_size=len(prompts), block_size=16, max_seq_len=longest, max_new_tokens=n),
                    eos_id=eos_id)
    reqs = [GenerationRequest(f"p{i}", tuple(p), n, seed=i, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]
    return [list(g.response_tokens) for g in engine.generate(reqs)]


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy generate of n tokens per prompt, the prompts left-padded into one batch, EOS
    not stopping generation (as the engine's ignore_eos; min_new_tokens would instead forbid EOS)."""
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    saved = model.generation_config.eos_token_id, model.config.eos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id, model.config.eos_token_id = saved
    return out[:, T:].tolist()


# -- a GGUF writer after llama.cpp's convert_hf_to_gguf.py ------------------------------------------------------
def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


RANDOM_BYTES_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS")
"""Types gguf-py cannot quantise to: `write_gguf` fills their blocks with random bytes instead."""


def _random_blocks(shape: tuple[int, ...], qt) -> np.ndarray:
    """Random blocks of type `qt` for a tensor of `shape`. Every byte is below 0x3C, so every float16 field
    of a block (scales d, dmin) has exponent < 15: finite and below 1 in magnitude, never inf or NaN."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(sum(shape))
    return rng.integers(0, 0x3C, size=(*shape[:-1], shape[-1] // block * block_bytes), dtype=np.uint8)


def write_gguf(hf_model, path: Path, qtype: str = "F32", arch: str | None = None) -> Path:
    """Write `hf_model` (Llama / Qwen2 / Qwen3 / Qwen3-MoE) as a GGUF file: llama.cpp's tensor names, q/k
    rows permuted for llama, 2-D weights in `qtype` (1-D tensors stay F32, as llama.cpp keeps them; the
    types of RANDOM_BYTES_TYPES get random blocks: a file to compare two dequantising loaders on)."""
    import gguf

    c = hf_model.config
    arch = arch or {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    else:
        w.add_feed_forward_length(c.intermediate_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
                 "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
                 "mlp.gate.weight": "ffn_gate_inp.weight"}
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for k in list(state):  # transformers 5 holds experts fused: [E, 2I, H] gate|up and [E, H, I]
        if k.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(state.pop(k), 2, axis=1)
            state[k.replace("gate_up_proj", "gate_proj")], state[k.replace("gate_up_proj", "up_proj")] = gate, up
    qt = gguf.GGMLQuantizationType[qtype]
    for k, v in state.items():
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers."):].split(".", 1)
            if rest.startswith("mlp.experts."):
                gguf_name = f"blk.{i}.ffn_{rest.split('.')[2].removesuffix('_proj')}_exps.weight"
            else:
                gguf_name = f"blk.{i}.{per_layer[rest]}"
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                v = _llama_cpp_permute(v, c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads)
        else:
            gguf_name = names[k]
        if v.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.ascontiguousarray(v, dtype=np.float32))
        elif qtype in RANDOM_BYTES_TYPES:
            w.add_tensor(gguf_name, _random_blocks(v.shape, qt), raw_dtype=qt)
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(v, dtype=np.float32), qt)
            w.add_tensor(gguf_name, q, raw_dtype=qt)  # the writer reads the element shape off the bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@functools.cache
def _speed_up_transformers_gguf() -> None:
    """transformers' GGUF loader parses the file's header twice (config, weights; three times with the
    tokenizer) and rebuilds gguf-py's tensor-name map once per tensor: ~10 s for SmolLM2 on this machine.
    Memoise both (same objects, same results: speed only, the math is untouched)."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *a, **k):
        key = (str(path), a, tuple(sorted(k.items())))
        if key not in readers:
            readers[key] = original(path, *a, **k)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(None)(gguf.get_tensor_name_map)


def hf_from_gguf(path: Path):
    """transformers' own GGUF loading of `path` (float32, dequantised by transformers)."""
    from transformers import AutoModelForCausalLM

    _speed_up_transformers_gguf()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


# -- SmolLM2-135M-Instruct (the GGUF file `rl models fetch smollm2-135m-instruct` writes) -------------------------
SMOLLM2 = "smollm2-135m-instruct"
FETCH_HINT = f"rl models fetch {SMOLLM2}"

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Explain recursion."}],
    [{"role": "user", "content": "What is 17 times 23? Think step by step."}],
    [{"role": "user", "content": "Give me three tips for learning a new language."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]
"""The 8 chat prompts of the SmolLM2 parity check (rendered with the GGUF's own chat template)."""


def smollm2_gguf() -> Path | None:
    """$ASYNCRL_SMOLLM2_GGUF, else where `rl models fetch` puts the file; None when it is not there."""
    import os

    from model.registry import model_path

    path = Path(os.environ.get("ASYNCRL_SMOLLM2_GGUF") or model_path(SMOLLM2))
    return path if path.is_file() else None


def smollm2_parity(path: Path, new_tokens: int = 32, export_dir: Path | None = None) -> dict:
    """asyncrl vs transformers on SmolLM2 GGUF `path`, both loading the same file in float32: logits at all
    positions of the 8 chat prompts (max |Δlogit|, mean KL), `new_tokens` greedy tokens per prompt (asyncrl
    through its Engine, transformers through generate), and with `export_dir` the export round trip
    (asyncrl -> HF directory -> transformers: loading report and max |Δlogit| against asyncrl)."""
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model.pretrained import build_decoder, export_hf, read_pretrained_config

    _speed_up_transformers_gguf()
    times, t0 = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        times[name] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()

    ours = build_decoder(read_pretrained_config(path)).eval()
    lap("asyncrl_load")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = hf_from_gguf(path)
    lap("transformers_load")
    prompts = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids
               for m in CHAT_PROMPTS]
    gaps, ours_logits = [], []
    with torch.no_grad():
        for p in prompts:
            a, b = ours(torch.tensor([p]))[0], theirs(torch.tensor([p])).logits
            gaps.append(logit_gap(a, b) + (a.shape[1],))
            ours_logits.append(a)
    lap("logits")
    max_abs = max(g[0] for g in gaps)
    mean_kl = sum(g[1] * g[2] for g in gaps) / sum(g[2] for g in gaps)  # per position, over all prompts
    ours_gen = engine_greedy(ours, prompts, new_tokens, tok.eos_token_id)
    lap("asyncrl_greedy")
    theirs_gen = hf_greedy(theirs, prompts, new_tokens)
    lap("transformers_greedy")
    out = {"max_abs_logit_diff": max_abs, "mean_kl": mean_kl, "positions": sum(g[2] for g in gaps),
           "greedy_match": sum(a == b for a, b in zip(ours_gen, theirs_gen)), "greedy_total": len(prompts),
           "first_reply": tok.decode(ours_gen[0]), "seconds": times, "ours_gen": ours_gen, "theirs_gen": theirs_gen}
    if export_dir is not None:
        export_hf(ours, export_dir, tokenizer_from=tok.save_pretrained, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
        back, info = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32, output_loading_info=True)
        with torch.no_grad():
            out["export_max_abs_logit_diff"] = max((a - back.eval()(torch.tensor([p])).logits).abs().max().item()
                                                   for a, p in zip(ours_logits, prompts))
        out["export_loading_info"] = {k: sorted(v) for k, v in info.items() if v}
        lap("export_round_trip")
    return out
