"""Hugging Face checkpoints in and out (issue #14, items 1 and 4): tiny random Llama (Llama 3.1 RoPE
scaling), Qwen2 (q/k/v bias), Qwen3 (qk-norm, head_dim != hidden/heads) and Qwen3-MoE models, created and
saved by transformers in the test, loaded by asyncrl, compared with transformers on CPU in float32:

    logits     every position of 8 prompts: max |Δlogit| <= ATOL (1e-4), mean KL <= KL_TOL (1e-8)
    greedy     16 tokens per prompt through asyncrl's Engine == transformers' generate, token for token
    export     asyncrl -> HF directory -> transformers: no missing / unexpected keys, the same logits

Every parameter of the transformers model is drawn afresh (biases and norm weights too), so a mapping
that dropped one would show. Expected gaps are ~1e-6 (summation order only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from model.config import ModelConfig  # noqa: E402
from model.conversion import PermuteRoPE, hf_conversion  # noqa: E402
from model.decoder import Decoder  # noqa: E402
from model.formats import CheckpointFormatError  # noqa: E402
from model.pretrained import build_decoder, export_hf, load_pretrained_into, read_pretrained_config  # noqa: E402
from tests.hf_tiny import engine_greedy, hf_greedy, logit_gap, make_hf  # noqa: E402

ATOL, KL_TOL = 1e-4, 1e-8
KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe")
PROMPTS = [[1] + [(7 * i + 13 * j) % 150 + 3 for j in range(5 + 3 * i)] for i in range(8)]  # 6 .. 27 tokens
REPO = Path(__file__).resolve().parents[2]


def _logits(model, prompt):
    with torch.no_grad():
        out = model(torch.tensor([prompt]))
    return out[0] if isinstance(out, tuple) else out.logits


def _gap(ours, theirs) -> tuple[float, float]:
    gaps = [logit_gap(_logits(ours, p), _logits(theirs, p)) for p in PROMPTS]
    return max(g[0] for g in gaps), sum(g[1] for g in gaps) / len(gaps)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (directory, transformers model) for each architecture, saved once for the module."""
    root = tmp_path_factory.mktemp("hf")
    return {kind: (root / kind, make_hf(kind, root / kind, seed=i)) for i, kind in enumerate(KINDS)}


# -- config derivation --------------------------------------------------------------------------------------
def test_config_is_derived_from_the_checkpoint(saved):
    llama, qwen2, qwen3, moe = (read_pretrained_config(saved[k][0]) for k in KINDS)
    assert (llama.qk_norm, llama.attention_bias, llama.rope_theta, llama.rope_scaling.type) == (False, False, 5e5, "llama3")
    assert llama.rope_scaling.original_max_position_embeddings == 32 and llama.ffn.intermediate_size == 96
    assert (qwen2.qk_norm, qwen2.attention_bias, qwen2.rope_scaling) == (False, True, None)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.num_kv_heads, qwen3.vocab_size) == (True, 32, 2, 160)
    assert moe.is_moe and (moe.ffn.num_experts, moe.ffn.num_experts_per_tok, moe.ffn.moe_intermediate_size) == (4, 2, 32)
    assert moe.ffn.num_shared_experts == 0 and moe.ffn.norm_topk_prob and moe.rms_norm_eps == 1e-5
    assert all(c.init == str(saved[k][0]) for c, k in zip((llama, qwen2, qwen3, moe), KINDS))


def test_recipe_fields_must_agree_with_the_checkpoint(saved):
    path = str(saved["qwen3"][0])
    cfg = ModelConfig.model_validate({"init": path, "num_heads": 4, "kv_cache": {"dtype": "fp8"}, "max_position_embeddings": 64})
    assert cfg.num_heads == 4 and cfg.kv_cache.dtype == "fp8" and cfg.max_position_embeddings == 64 and cfg.head_dim == 32
    for given, needle in [({"num_heads": 8}, "has num_heads=4 but the recipe says num_heads=8"),
                          ({"ffn": {"type": "dense", "intermediate_size": 95}}, "ffn.intermediate_size=96 but the recipe says ffn.intermediate_size=95"),
                          ({"ffn": {"type": "moe"}}, "has ffn="),
                          ({"qk_norm": False}, "qk_norm=True but the recipe says qk_norm=False"),
                          ({"max_position_embeddings": 4096}, "exceeds the 128"),
                          ({"sparse_attention": {}}, "sparse_attention=None")]:
        with pytest.raises(ValueError, match=needle) as e:
            ModelConfig.model_validate({"init": path, **given})
        assert "\n" not in str(e.value).split("\n  Value error, ")[-1].split("[type=")[0].strip()
    # A validated config round-trips (the resolved recipe of a run directory reloads unchanged).
    assert ModelConfig.model_validate(cfg.model_dump()) == cfg


def test_unsupported_configs_are_refused_in_one_line(tmp_path, saved):
    base = json.loads((saved["llama"][0] / "config.json").read_text())
    cases = [({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
             ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
             ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling type 'yarn'"),
             ({"attention_bias": True}, "attention_bias=True is not supported")]
    for i, (change, needle) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **change}))
        (d / "model.safetensors").write_bytes((saved["llama"][0] / "model.safetensors").read_bytes())
        with pytest.raises(CheckpointFormatError, match=needle) as e:
            read_pretrained_config(d)
        assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_old_transformers_spelling_is_read_the_same(tmp_path, saved):
    """transformers 4.x: rope_theta + rope_scaling {type: ...}, num_experts, torch_dtype."""
    new = json.loads((saved["qwen3_moe"][0] / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "num_local_experts", "dtype")}
    old.update(rope_theta=new["rope_parameters"]["rope_theta"], rope_scaling={"type": "linear", "factor": 2.0},
               num_experts=4, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "model.safetensors").symlink_to(saved["qwen3_moe"][0] / "model.safetensors")
    cfg = read_pretrained_config(tmp_path)
    assert cfg.ffn.num_experts == 4 and cfg.rope_scaling.type == "linear" and cfg.rope_scaling.factor == 2.0


# -- parity ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_greedy_match_transformers(kind, saved):
    directory, hf = saved[kind]
    ours = build_decoder(read_pretrained_config(directory)).eval()
    max_abs, mean_kl = _gap(ours, hf)
    assert max_abs <= ATOL and mean_kl <= KL_TOL, (kind, max_abs, mean_kl)
    assert engine_greedy(ours, PROMPTS, 16) == hf_greedy(hf, PROMPTS, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip(kind, saved, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    directory, hf = saved[kind]
    ours = build_decoder(read_pretrained_config(directory)).eval()
    out = export_hf(ours, tmp_path / "export", tokenizer_from=directory)
    back, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert type(back) is type(hf) and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert max(logit_gap(_logits(ours, p), _logits(back.eval(), p))[0] for p in PROMPTS) <= 1e-5
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        with safe_open(str(directory / "model.safetensors"), "pt") as g:  # the same tensors, bit for bit
            assert names == set(g.keys()) and all(torch.equal(f.get_tensor(n), g.get_tensor(n)) for n in names)
    if kind == "qwen3_moe":  # experts on disk per expert, as save_pretrained writes them
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in names


def test_sharded_checkpoint(tmp_path, saved):
    hf = saved["llama"][1]
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    ours = build_decoder(read_pretrained_config(tmp_path)).eval()
    assert _gap(ours, hf)[0] <= ATOL
    out = export_hf(ours, tmp_path / "export", max_shard_bytes=40_000)  # and sharded on the way out
    from transformers import AutoModelForCausalLM

    back, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()) and (out / "model.safetensors.index.json").is_file()
    assert _gap(ours, back.eval())[0] <= 1e-5


def test_moe_fused_expert_layout(tmp_path, saved):
    """The other expert layout, built by hand from the per-expert file: gate_up_proj [E, 2I, H] (gate rows
    first) and down_proj [E, H, I] per layer. Both asyncrl and transformers load it to the same logits, and
    asyncrl's export with expert_layout="fused" writes exactly these tensors."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    directory, hf = saved["qwen3_moe"]
    per_expert = load_file(str(directory / "model.safetensors"))
    fused = {k: v for k, v in per_expert.items() if ".mlp.experts." not in k}
    for i in range(2):
        e = [[per_expert[f"model.layers.{i}.mlp.experts.{j}.{n}.weight"] for j in range(4)] for n in ("gate_proj", "up_proj", "down_proj")]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(e[0]), torch.stack(e[1])], dim=1)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(e[2])
    src = tmp_path / "fused"
    src.mkdir()
    save_file(fused, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text((directory / "config.json").read_text())
    ours = build_decoder(read_pretrained_config(src)).eval()
    assert _gap(ours, hf)[0] <= ATOL
    theirs, info = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()) and _gap(ours, theirs.eval())[0] <= ATOL
    out = export_hf(ours, tmp_path / "export", expert_layout="fused")
    written = load_file(str(out / "model.safetensors"))
    assert written.keys() == fused.keys() and all(torch.equal(written[k], fused[k]) for k in fused)


def test_steps_invert_each_other():
    """Each declared step: from_ours(to_ours(t)) == t. And the llama.cpp permutation on a 2-head, D=4
    example: HF rows (0, 1 | 2, 3) of a head become GGUF rows (0, 2, 1, 3)."""
    step = PermuteRoPE("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight", heads=2)
    gguf_rows = torch.arange(8.0)[:, None]
    (piece,) = step.to_ours({"i": 0}, gguf_rows)
    assert piece.tensor[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # an involution for D = 4
    t = torch.randn(2 * 16, 5)
    (piece,) = step.to_ours({"i": 0}, t)
    assert torch.equal(step.from_ours({"i": 0}, lambda n: piece.tensor), t) and not torch.equal(piece.tensor, t)
    torch.manual_seed(0)
    for kind in KINDS:
        for layout in ("per_expert", "fused") if kind == "qwen3_moe" else ("per_expert",):
            model = Decoder(_small_config(kind))
            state = model.state_dict()
            conv = hf_conversion(model.config, layout)
            for name, tensor in conv.export(state.__getitem__):
                for p in conv.to_ours(name, tensor):
                    target = state[p.name][p.index] if p.index else state[p.name]
                    assert torch.equal(target, p.tensor), (kind, name)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_sharded_rank_reads_only_the_rows_it_keeps(ranks):
    """`to_ours_rows` (what an FSDP2 rank loads, model/pretrained.py): for every declared conversion, each of
    `ranks` ranks keeping chunk r of every parameter's rows gets exactly those rows, and reads only them (a
    whole expert only where it keeps that expert), so the ranks together read each file row once; GGUF's
    permuted q/k rows mix within a head and are read whole, then cut."""
    from model.conversion import gguf_conversion

    torch.manual_seed(0)
    cases = [(k, hf_conversion, layout) for k in KINDS for layout in (("per_expert", "fused") if k == "qwen3_moe" else ("per_expert",))]
    for kind, make, layout in cases + [("llama", gguf_conversion, "llama")]:
        cfg, conv = _small_config(kind), make(_small_config(kind), layout)
        model = Decoder(cfg)
        state, params = model.state_dict(), dict(model.named_parameters())  # buffers: none in these formats
        chunk = {n: -(-t.shape[0] // ranks) for n, t in state.items()}
        source = dict(conv.export(state.__getitem__))
        read_by_rank = []
        for r in range(ranks):
            def rows(n, r=r):
                return range(min(r * chunk[n], len(state[n])), min((r + 1) * chunk[n], len(state[n])))
            local = {n: torch.full_like(t[rows(n).start : rows(n).stop], float("nan")) for n, t in state.items()}
            nbytes = 0
            for name, tensor in source.items():
                def read(want, tensor=tensor):
                    nonlocal nbytes
                    out = tensor if want is None else tensor[want.start : want.stop]
                    nbytes += out.numel() * out.element_size()
                    return out
                for p in conv.to_ours_rows(name, read, rows):
                    (local[p.name][p.index] if p.index else local[p.name]).copy_(p.tensor)
            for n, t in params.items():
                assert torch.equal(local[n], t.detach()[rows(n).start : rows(n).stop]), (kind, layout, n, r)
            read_by_rank.append(nbytes)
        total = sum(t.numel() * t.element_size() for t in source.values())
        if make is hf_conversion:  # every row read once, by the rank that keeps it
            assert sum(read_by_rank) == total, (kind, layout)
        else:  # the permuted q/k weights whole on every rank, the rest once
            assert total < sum(read_by_rank) < ranks * total


def _small_config(kind: str) -> ModelConfig:
    """The debug model flavour with the features of `kind`."""
    from tests.conftest import debug_config

    feats = {"llama": dict(qk_norm=False), "qwen2": dict(qk_norm=False, attention_bias=True), "qwen3": {},
             "qwen3_moe": dict(ffn={"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "num_shared_experts": 0})}[kind]
    return debug_config(moe=False, **feats)


# -- loading: dtype, device, failures ------------------------------------------------------------------------
def test_bf16_load_allocates_no_float32_model(saved, monkeypatch):
    """build_decoder(dtype=bf16) builds on the meta device (the random init touches no memory) and loads
    each tensor straight into its bf16 parameter."""
    devices = []
    original = Decoder.reset_parameters
    monkeypatch.setattr(Decoder, "reset_parameters", lambda self: (devices.append(self.lm_head.weight.device.type), original(self)))
    directory, hf = saved["qwen3_moe"]
    ours = build_decoder(read_pretrained_config(directory), dtype=torch.bfloat16)
    assert devices == ["meta"] and {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    want = {k: v for k, v in hf.state_dict().items() if ".experts." not in k}
    got = ours.state_dict()
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in want.items())
    assert torch.equal(got["model.layers.1.mlp.experts.up_proj"],
                       hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][:, 32:].to(torch.bfloat16))


def test_bad_checkpoints_fail_in_one_line(tmp_path, saved):
    import shutil

    from safetensors.torch import load_file, save_file

    src = saved["qwen2"][0]
    cases = {}
    d = cases["missing"] = tmp_path / "missing"
    saved["qwen2"][1].save_pretrained(d, max_shard_size="40KB")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    for name, change in [("extra", lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})),
                         ("shape", lambda s: s.update({"model.layers.1.self_attn.k_proj.bias": torch.zeros(31)})),
                         ("lacking", lambda s: s.pop("model.layers.1.self_attn.v_proj.bias"))]:
        d = cases[name] = tmp_path / name
        shutil.copytree(src, d)
        state = load_file(str(d / "model.safetensors"))
        change(state)
        save_file(state, str(d / "model.safetensors"))
    expected = {"missing": f"{shard}: missing shard", "extra": "unexpected tensor model.layers.0.mlp.extra.weight",
                "shape": "tensor model.layers.1.self_attn.k_proj.bias has shape (31,); the config gives",
                "lacking": "no tensor model.layers.1.self_attn.v_proj.bias"}
    for name, needle in expected.items():
        with pytest.raises(CheckpointFormatError) as e:
            build_decoder(read_pretrained_config(cases[name]))
        assert needle in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


def test_load_into_an_existing_model_keeps_device_and_tying(saved):
    directory, hf = saved["llama"]
    model = Decoder(read_pretrained_config(directory).model_copy(update={"init": None}))
    load_pretrained_into(model, directory)
    assert _gap(model.eval(), hf)[0] <= ATOL


def test_loads_and_generates_with_transformers_blocked(saved, tmp_path):
    """The runtime path never imports transformers: a subprocess whose import system refuses it still
    reads the config, loads the weights (an HF directory and a Q4_1 GGUF file), tokenizes (the
    `tokenizers` library on a tokenizer.json) and generates through the Engine."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.hf_tiny import write_gguf

    directory = saved["qwen2"][0]
    gguf_path = write_gguf(make_hf("llama", rope_scaling=None), tmp_path / "tiny.gguf", "Q4_1")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(157)])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "accelerate"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
try:
    import transformers  # noqa: F401
    raise SystemExit("the blocker let transformers in")
except ImportError:
    pass
from tokenizers import Tokenizer
from model.pretrained import build_decoder, read_pretrained_config
from tests.hf_tiny import engine_greedy
ids = Tokenizer.from_file({str(tmp_path / 'tokenizer.json')!r}).encode("w5 w17 w3 w99").ids
model = build_decoder(read_pretrained_config({str(directory)!r})).eval()
out = engine_greedy(model, [[1] + ids], 8)
gguf_out = engine_greedy(build_decoder(read_pretrained_config({str(gguf_path)!r})).eval(), [[1] + ids], 8)
assert "transformers" not in sys.modules and len(out[0]) == len(gguf_out[0]) == 8
print("ids", [1] + ids, "out", out[0])
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids, out = proc.stdout.split("out")
    prompt = json.loads(ids.split("ids")[1])
    assert json.loads(out) == hf_greedy(saved["qwen2"][1], [prompt], 8)[0]


def test_init_from_an_asyncrl_checkpoint(tmp_path, moe_model):
    """model.init may name an asyncrl checkpoint directory too: its ModelConfig is the derived config, the
    KV-cache format may differ, and the weights (the router's selection bias included) stream in."""
    from model.checkpoint import load_config, save_checkpoint

    with torch.no_grad():
        moe_model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))
    path = save_checkpoint(moe_model, tmp_path / "ckpt")
    assert load_config(path).init is None  # a checkpoint holds its weights: no pointer back to where they came from
    cfg = ModelConfig.model_validate({"init": str(path), "kv_cache": {"dtype": "fp8"}})
    free = {"init": None, "kv_cache": moe_model.config.kv_cache, "init_std": moe_model.config.init_std}  # init_std: unused
    assert cfg.model_copy(update=free) == moe_model.config
    loaded = build_decoder(cfg.model_copy(update={"kv_cache": moe_model.config.kv_cache})).eval()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), moe_model.state_dict().values()))
    with pytest.raises(ValueError, match="num_layers=3 exceeds the 2 of init"):
        ModelConfig.model_validate({"init": str(path), "num_layers": 3})
    first = build_decoder(ModelConfig.model_validate({"init": str(path), "num_layers": 1,
                                                      "kv_cache": moe_model.config.kv_cache}))
    full = moe_model.state_dict()
    assert all(torch.equal(t, full[k]) for k, t in first.state_dict().items()) and "model.layers.1.mlp.gate.weight" in full


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_lower_num_layers_keeps_the_first_layers_of_the_checkpoint(kind, saved):
    """Layer dropping (issue #43's teacher of another architecture): `num_layers` below the checkpoint's builds the
    model of its first layers, the same model transformers computes with the later layers removed."""
    import copy

    path, hf = saved[kind]
    full = read_pretrained_config(path).num_layers
    ours = build_decoder(ModelConfig.model_validate({"init": str(path), "num_layers": full - 1})).eval()
    assert ours.config.num_layers == full - 1
    cut = copy.deepcopy(hf)
    cut.model.layers = cut.model.layers[: full - 1]
    cut.config.num_hidden_layers = full - 1
    max_gap, mean_kl = _gap(ours, cut.eval())
    assert max_gap < ATOL and mean_kl < KL_TOL
    assert _gap(ours, hf)[0] > 100 * ATOL  # not the whole model
