"""GGUF checkpoints (issue #14, item 1): dequantised on load, llama.cpp's q/k permutation undone.

Tiny GGUF files are written in the test after llama.cpp's convert_hf_to_gguf.py (tests/hf_tiny.py; its
permutation is llama.cpp's code, not asyncrl's) and loaded by asyncrl and by transformers' own GGUF
loader: the logits must agree to ATOL (both dequantise with gguf-py, so the gap is summation order).
Qwen3 / Qwen3-MoE GGUFs (which transformers' GGUF loader reads with the wrong head_dim / expert width)
are checked at F32 against the transformers model they were written from.

SmolLM2-135M-Instruct (the real Q4_1 + Q8_0 file): asyncrl vs transformers loading the same file, all
positions of 8 chat prompts rendered by the GGUF's chat template: max |Δlogit| <= 1e-3 (measured 0),
mean KL <= 1e-6 (measured 0), 32 greedy tokens through asyncrl's Engine identical on all 8 prompts.
The file is found through $ASYNCRL_SMOLLM2_GGUF or where `rl models fetch smollm2-135m-instruct` puts
it; missing, the test skips locally and fails under CI=true."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from model.formats import CheckpointFormatError  # noqa: E402
from model.gguf_file import GGUFFile  # noqa: E402
from model.pretrained import build_decoder, read_pretrained_config  # noqa: E402
from tests.hf_tiny import (FETCH_HINT, engine_greedy, hf_from_gguf, hf_greedy, logit_gap, make_hf, smollm2_gguf,  # noqa: E402
                           smollm2_parity, write_gguf)

ATOL = 1e-4
PROMPTS = [[1] + [(5 * i + 11 * j) % 150 + 3 for j in range(4 + 3 * i)] for i in range(8)]


def _gap(ours, theirs) -> tuple[float, float]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            out.append(logit_gap(ours(torch.tensor([p]))[0], theirs(torch.tensor([p])).logits))
    return max(g[0] for g in out), max(g[1] for g in out)


@pytest.fixture(scope="module")
def llama():
    return make_hf("llama", seed=3, rope_scaling=None)  # llama.cpp bakes Llama 3.1 scaling into a tensor: plain RoPE


@pytest.mark.parametrize("qtype", ["F32", *(pytest.param(q, marks=pytest.mark.slow) for q in ("F16", "BF16", "Q8_0", "Q4_0")), "Q4_1",
                                   *(pytest.param(q, marks=pytest.mark.slow) for q in ("Q5_0", "Q5_1"))])
def test_llama_gguf_matches_transformers(qtype, llama, tmp_path):
    path = write_gguf(llama, tmp_path / f"llama-{qtype}.gguf", qtype)
    assert {t.type_name for t in GGUFFile(path).tensors.values()} == {"F32", qtype}
    cfg = read_pretrained_config(path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (4, 2, 16, False)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)  # GGUF stores it as float32
    ours, theirs = build_decoder(cfg).eval(), hf_from_gguf(path)
    max_abs, kl = _gap(ours, theirs)
    assert max_abs <= ATOL and kl <= 1e-8, (max_abs, kl)
    if qtype == "Q4_1":  # the real file's type: greedy through the engine too
        assert engine_greedy(ours, PROMPTS, 12) == hf_greedy(theirs, PROMPTS, 12)
    if qtype == "F32":  # and against the model the file was written from: the permutation is undone exactly
        assert _gap(ours, llama)[0] <= ATOL


def test_k_quants_dequantise_like_transformers(tmp_path):
    """Q2_K..Q6_K (256-value super-blocks; gguf-py can only dequantise them, so the blocks are random)."""
    hf = make_hf("llama", seed=4, rope_scaling=None, hidden_size=256, intermediate_size=256, head_dim=64)
    for qtype in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        path = write_gguf(hf, tmp_path / f"{qtype}.gguf", qtype)
        ours, theirs = build_decoder(read_pretrained_config(path)).eval(), hf_from_gguf(path)
        with torch.no_grad():
            x = torch.tensor([PROMPTS[2]])
            a, b = ours(x)[0], theirs(x).logits
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-3 * a.abs().max(), qtype


def test_qwen2_gguf_with_bias(tmp_path):
    hf = make_hf("qwen2", seed=5)
    path = write_gguf(hf, tmp_path / "qwen2.gguf", "Q8_0")
    cfg = read_pretrained_config(path)
    assert cfg.attention_bias and not cfg.qk_norm
    assert _gap(build_decoder(cfg).eval(), hf_from_gguf(path))[0] <= ATOL


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_qwen3_gguf_against_the_source_model(kind, tmp_path):
    hf = make_hf(kind, seed=6)
    path = write_gguf(hf, tmp_path / f"{kind}.gguf", "F32")
    cfg = read_pretrained_config(path)
    assert cfg.qk_norm and cfg.is_moe == (kind == "qwen3_moe") and cfg.head_dim == (32 if kind == "qwen3" else 16)
    assert _gap(build_decoder(cfg).eval(), hf)[0] <= ATOL


def test_unsupported_quantisation_is_one_line(tmp_path, llama):
    path = write_gguf(make_hf("llama", seed=1, rope_scaling=None, hidden_size=256, intermediate_size=256, head_dim=64),
                      tmp_path / "iq.gguf", "IQ2_XXS")
    with pytest.raises(CheckpointFormatError) as e:
        read_pretrained_config(path)
    assert str(e.value).startswith(f"{path}: tensor ") and "has quantisation type IQ2_XXS; asyncrl dequantises F32, F16" in str(e.value)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(write_gguf(llama, tmp_path / "whole.gguf", "Q8_0").read_bytes()[:-1000])
    with pytest.raises(ValueError, match="runs past the end of the file") as e:
        build_decoder(read_pretrained_config(truncated))
    assert "\n" not in str(e.value)


# -- the real model -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the SmolLM2 GGUF file is missing: run `{FETCH_HINT}`")
        pytest.skip(f"SmolLM2 GGUF file not found: run `{FETCH_HINT}` (or set ASYNCRL_SMOLLM2_GGUF)")
    return path


@pytest.mark.slow
def test_smollm2_parity_with_transformers(smollm2):
    torch.set_num_threads(1)  # two OpenMP threads spin 5x slower whenever another process shares the 2 cores
    cfg = read_pretrained_config(smollm2)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn.intermediate_size,
            cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (576, 30, 9, 3, 64, 1536, 49152, 1e5, True)
    r = smollm2_parity(smollm2, new_tokens=32)
    assert r["max_abs_logit_diff"] <= 1e-3 and r["mean_kl"] <= 1e-6, r
    assert r["greedy_match"] == r["greedy_total"] == 8, [(a, b) for a, b in zip(r["ours_gen"], r["theirs_gen"]) if a != b]
    assert "Paris" in r["first_reply"]  # a real model, really loaded: it knows the capital of France


def test_model_path_follows_asyncrl_home_and_names_the_fetch_command(tmp_path, monkeypatch):
    """The one place `rl models fetch` writes to and the tests read from: $ASYNCRL_HOME/models/<name>/<file>."""
    from model.registry import model_path, resolve_model_source

    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path))
    assert model_path("smollm2-135m-instruct") == tmp_path / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ValueError, match="not fetched yet: run `rl models fetch smollm2-135m-instruct`"):
        resolve_model_source("smollm2-135m-instruct")  # a known name before `rl models fetch`: one line
    monkeypatch.delenv("ASYNCRL_HOME")
    assert str(model_path("smollm2-135m-instruct")).startswith(os.path.expanduser("~/.cache/asyncrl/models/"))
    with pytest.raises(KeyError, match="unknown model 'gpt5'"):
        model_path("gpt5")
