"""Rollout engine speed (issue #15): asyncrl's engine with CUDA-graphed decode, the same engine eager, and
HF transformers `generate`, in one run on the same weights.

    python bench/engine.py --quick              # CPU, a tiny shape: the plumbing and the counters
    python bench/engine.py                      # CUDA: SmolLM2-135M and Qwen3-0.6B shapes, bf16 (+ fp4 KV)

Random weights (bf16 on CUDA, fp32 on CPU), 128-token prompts (16 with --quick), a fixed number of new
tokens with EOS ignored. ms per step = wall time of the decode phase of a whole generate call (every step
after the first, which prefills) divided by its decode steps, host work included; tokens/s = batch / that.
HF runs `generate` greedily with its default dynamic cache; its decode time is the whole call minus a
1-token call's. Counters from the engine: logit rows computed per prefilled sequence, and bytes of K/V that
decode gathered into temporary context tensors per generated token.
Last line: RESULT ms_per_step_b1=.. ms_per_step_b16=.. speedup_vs_hf_b16=.. prefill_logit_rows_per_seq=..
kv_gather_bytes=.. (per generated token) [CUDA: ms_per_step_b64=.. ms_per_step_b256=.. and, side by side at
batch 64, unfused_graphs_ms_per_step_b64 (graphs over the unfused forward with a gathered context) and
eager_ms_per_step_b64 (no graphs, no fused kernels: the engine before issue #15), speedup_vs_eager_b64,
fp4_over_bf16_b64; the same for the 0.6B shape with a qwen3_ prefix]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from model.kernels import gemv
from model.config import ModelConfig
from model.decoder import Decoder
from rollout.config import EngineConfig
from rollout import sampling
from rollout.engine import Engine
from model.shapes import SHAPES  # name -> ModelConfig fields (random weights of published shapes)
from rollout.types import GenerationRequest


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


VARIANTS = {  # name -> (cuda_graphs, paged decode kernel, fused RMSNorm/RoPE, the fused rollout path of model/fused.py)
    "graphs": (True, True, True, True),                # this engine
    "graphs_layer_unfused": (True, True, True, False),  # the third step (e18e6a2): separate q/k/v, gate/up, adds
    "graphs_gather": (True, False, False, False),      # graphs over the unfused forward (the first step, c2e4c99)
    "eager": (False, False, False, False),             # the engine before issue #15
}


def engine_ms_per_step(model: Decoder, batch: int, prompt: int, new: int, device: str, *,
                       variant: str = "graphs", overlap: bool | None = None, sample_in_graph: bool = True,
                       cap: int | None = None) -> tuple[float, Engine]:
    """ms per decode step of `batch` samples of `prompt` + `new` tokens. `cap`: the engine's max_seq_len when larger
    than they need (a run's response cap: the same contexts, a longer possible one)."""
    from model import fused as rollout_path
    from model.kernels import norm_rope

    graphs, paged, fused_norm, fused_layers = VARIANTS[variant]
    norm_rope.ENABLED, rollout_path.ENABLED = fused_norm, fused_layers
    # blocks on demand: a pool for the contexts the run has, not batch x cap (which would not fit at a 16K cap)
    blocks = None if cap is None else batch * (-(-(prompt + new + 16) // 16) + 1) + 64
    cfg = EngineConfig(max_batch_size=batch, block_size=16, max_seq_len=max(prompt + new + 16, cap or 0), max_new_tokens=new,
                       num_blocks=blocks, cuda_graphs=graphs, paged_decode_kernel=paged, overlap_steps=overlap, sample_in_graph=sample_in_graph)
    eng = Engine(model, cfg, eos_id=0, device=device)
    vocab = model.config.vocab_size

    def requests(tag: str, n: int):
        g = torch.Generator().manual_seed(batch)
        return [GenerationRequest(f"{tag}{i}", tuple(torch.randint(1, vocab, (prompt,), generator=g).tolist()), n,
                                  seed=i, temperature=1.0, ignore_eos=True) for i in range(batch)]
    eng.generate(requests("warm", 4))  # captures the graph of this bucket, warms the allocator
    before = eng.stats.decode_steps
    eng.add(requests("r", new))
    eng.step()  # prefill + first token
    _sync(device)
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    _sync(device)
    steps = eng.stats.decode_steps - before
    norm_rope.ENABLED = rollout_path.ENABLED = True
    return 1000 * (time.perf_counter() - t0) / steps, eng


def group_rollout(model: Decoder, groups: int, group_size: int, prompt: int, new: int, device: str, *,
                  share: bool) -> tuple[float, Engine]:
    """GRPO-shaped rollout: `groups` prompts x `group_size` samples, all admitted at once, short responses
    (where prefill weighs most). Returns (wall seconds of the whole generate, the engine)."""
    B = groups * group_size
    cfg = EngineConfig(max_batch_size=B, block_size=16, max_seq_len=prompt + new + 16, max_new_tokens=new,
                       share_prompt_kv=share)
    eng = Engine(model, cfg, eos_id=0, device=device)
    g = torch.Generator().manual_seed(7)
    prompts = [tuple(torch.randint(1, model.config.vocab_size, (prompt,), generator=g).tolist()) for _ in range(groups)]
    reqs = [GenerationRequest(f"p{i}-{j}", prompts[i], new, seed=i * group_size + j, ignore_eos=True)
            for i in range(groups) for j in range(group_size)]
    eng.generate(reqs[:group_size])  # warm-up: graphs of the buckets, allocator
    eng.stats = type(eng.stats)()
    _sync(device)
    t0 = time.perf_counter()
    eng.generate(reqs)
    _sync(device)
    return time.perf_counter() - t0, eng


def logprob_mismatch(shape: str, device: str, fused: bool, batch: int = 32, prompt: int = 64, new: int = 64,
                     cudnn_attention: bool = False) -> float:
    """Mean |engine logprob - trainer logprob| over sampled tokens under run.dtype bfloat16: the engine decodes a
    bf16 copy (graphs; `fused`: the fused rollout path of model/fused.py), the trainer recomputes with the float32
    master weights under bf16 autocast in the trainer's forward context (rl/train/trainer.py `forward_context`: flash
    attention on CUDA, or cuDNN's with `cudnn_attention`)."""
    from model import fused as rollout_path
    from rl.train.losses import token_logprobs
    from rl.train.trainer import forward_context, pack
    from rl.runtime.worker import rollout_copy

    torch.manual_seed(0)
    master = Decoder(ModelConfig(**SHAPES[shape], max_position_embeddings=4096)).to(device)
    twin = rollout_copy(master, torch.bfloat16 if device == "cuda" else torch.float32)
    rollout_path.ENABLED = fused
    eng = Engine(twin, EngineConfig(max_batch_size=batch, block_size=16, max_seq_len=prompt + new + 16, max_new_tokens=new),
                 eos_id=0, device=device)
    g = torch.Generator().manual_seed(1)
    gens = eng.generate([GenerationRequest(f"m{i}", tuple(torch.randint(1, master.config.vocab_size, (prompt,), generator=g).tolist()),
                                           new, seed=i, ignore_eos=True) for i in range(batch)])
    rollout_path.ENABLED = True
    b = pack([x.prompt_tokens for x in gens], [x.response_tokens for x in gens], [x.logprobs for x in gens], device=device)
    with torch.no_grad(), forward_context(device, torch.bfloat16 if device == "cuda" else None, cudnn_attention):
        out = master.forward_hidden(b.input_ids)
        lp = token_logprobs(master.logits(out.hidden), b.targets)
    m = b.mask.bool()
    return float((lp[m] - b.behavior_logprobs[m]).abs().mean())


def long_context_ms_per_step(shape: str, device: str, batch: int, context: int, new: int, kv: str) -> float:
    """Decode ms/step at a long context (the prompt fills it: prefill runs in chunks of requests)."""
    model = build(shape, device, kv, max_pos=context + new + 64)
    ms = engine_ms_per_step(model, batch, context, new, device)[0]
    del model
    torch.cuda.empty_cache()
    return ms


def hf_ms_per_step(model: Decoder, batch: int, prompt: int, new: int, device: str) -> float:
    from transformers import AutoModelForCausalLM

    from model.pretrained import export_hf

    with tempfile.TemporaryDirectory() as d:
        export_hf(model, f"{d}/hf")
        hf = AutoModelForCausalLM.from_pretrained(f"{d}/hf", dtype=next(model.parameters()).dtype).to(device).eval()
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)

    def run(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t0
    run(2)
    return 1000 * (run(new) - run(1)) / (new - 1)


def build(shape: str, device: str, kv: str = "bf16", max_pos: int = 4096) -> Decoder:
    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[shape], max_position_embeddings=max_pos, kv_cache={"dtype": kv})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return Decoder(cfg).to(device=device, dtype=dtype).eval()


def overlap_side_by_side(shapes: list[str], device: str, result: dict[str, float],
                         batches: tuple[int, ...] = (1, 64, 256)) -> None:
    """ms/step of the engine as configured by default (steps overlapped on CUDA, tokens sampled inside the decode
    graph, by the sampling kernels on CUDA), next to the same engine with the sampler's eager ops, sampling after the replay (`sample_in_graph: false`) and to plain steps (each
    read before the next is launched), in turn per batch in one run; tokens dropped per generated token; FP4 KV
    against bf16 at every batch (the same weights), and FP4 with its rows encoded by their own kernel
    (ASYNCRL_FP4_FUSED_WRITE=0) rather than by the RoPE kernel."""
    prompt, new = (128, 256) if device == "cuda" else (16, 32)
    for shape in shapes:
        for kv in ("bf16", "fp4"):
            model = build(shape, device, kv)
            for b in batches if device == "cuda" else (1, 16):
                ms_on, eng = engine_ms_per_step(model, b, prompt, new, device, overlap=True)
                key = f"{shape}_{'' if kv == 'bf16' else 'fp4_'}"
                result[f"{key}ms_per_step_b{b}"] = ms_on
                if kv == "fp4":  # and with the rows encoded by their own kernel (not the RoPE kernel's write)
                    os.environ["ASYNCRL_FP4_FUSED_WRITE"] = "0"
                    try:
                        ms_sep = engine_ms_per_step(model, b, prompt, new, device, overlap=True)[0]
                    finally:
                        del os.environ["ASYNCRL_FP4_FUSED_WRITE"]
                    result[f"{shape}_fp4_separate_write_ms_per_step_b{b}"] = ms_sep
                    result[f"{shape}_fp4_over_bf16_b{b}"] = ms_on / result[f"{shape}_ms_per_step_b{b}"]
                    print(f"{shape:<9}fp4   batch {b:>4}: {ms_on:.3f} ms/step ({result[f'{shape}_fp4_over_bf16_b{b}']:.3f}"
                          f" of bf16; {ms_sep:.3f} with the rows encoded by their own kernel)", flush=True)
                    continue
                ms_after = engine_ms_per_step(model, b, prompt, new, device, overlap=True, sample_in_graph=False)[0]
                ms_off = engine_ms_per_step(model, b, prompt, new, device, overlap=False)[0]
                sampling.SAMPLE_KERNEL = False  # the sampler's eager ops (~40 kernels) in place of its three
                try:
                    ms_eager_sampler = engine_ms_per_step(model, b, prompt, new, device, overlap=True)[0]
                finally:
                    sampling.SAMPLE_KERNEL = True
                gemv.GEMV_KERNEL = False  # every linear through cuBLAS (F.linear), none through the skinny kernel
                try:
                    ms_cublas = engine_ms_per_step(model, b, prompt, new, device, overlap=True)[0]
                finally:
                    gemv.GEMV_KERNEL = True
                result[f"{shape}_cublas_linear_ms_per_step_b{b}"] = ms_cublas
                print(f"{shape:<9}bf16  batch {b:>4}: {ms_on:.3f} ms/step; cuBLAS linears {ms_cublas:.3f}; "
                      f"eager sampler ops {ms_eager_sampler:.3f}; "
                      f"sampling after the replay {ms_after:.3f}; plain steps {ms_off:.3f} ({ms_off / ms_on:.2f}x); "
                      f"graph-sampled steps {eng.stats.graph_sampled_steps}/{eng.stats.decode_steps}", flush=True)
                result[f"{shape}_eager_sampler_ms_per_step_b{b}"] = ms_eager_sampler
                result[f"{shape}_sample_after_ms_per_step_b{b}"] = ms_after
                result[f"{shape}_plain_ms_per_step_b{b}"] = ms_off
                result[f"{shape}_discarded_per_token_b{b}"] = eng.stats.discarded_tokens / max(eng.stats.generated_tokens, 1)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    for (m, n, k, dtype, bias), (chosen, ours, theirs, tile) in sorted(gemv.decisions.items(), key=str):
        print(f"linear {m}x{k} -> {n} {str(dtype).removeprefix('torch.')}{' +bias' if bias else ''}: skinny kernel "
              f"{ours:.2f} us (tile {tile}), cuBLAS {theirs:.2f} us in graph replay: {'kernel' if chosen else 'cuBLAS'}",
              flush=True)


def mismatches(shape: str, device: str, result: dict[str, float]) -> None:
    """The engine-vs-trainer logprob mismatch under bf16 mixed precision, with and without the fused rollout path,
    and on CUDA also with the trainer's attention on cuDNN's kernels instead of flash (Trainer.cudnn_attention)."""
    for fused in (False, True):
        key = f"logprob_mismatch_{'fused' if fused else 'unfused'}"
        result[key] = logprob_mismatch(shape, device, fused)
        print(f"{shape} engine-vs-trainer |delta logprob| mean ({'fused' if fused else 'unfused'} rollout path): "
              f"{result[key]:.5f}", flush=True)
    if device == "cuda":
        result["logprob_mismatch_fused_cudnn"] = logprob_mismatch(shape, device, True, cudnn_attention=True)
        print(f"{shape} ... with the trainer's attention on cuDNN: {result['logprob_mismatch_fused_cudnn']:.5f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default="smollm2,qwen3")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--long", action="store_true", help="CUDA: also 2K context at batch 64 and 16K at batch 16, bf16 and fp4")
    ap.add_argument("--long-only", action="store_true", help="CUDA: only the long contexts of --long")
    ap.add_argument("--overlap-only", action="store_true",
                    help="only the engine's default against sampling after the replay and plain steps, side by side, for each "
                         "shape at batch 1, 64, 256, and FP4 against bf16 KV at batch 64")
    ap.add_argument("--batches", default="1,64,256", help="--overlap-only on CUDA: the batches (bf16, then FP4)")
    ap.add_argument("--fp4-kernels", default=None,
                    help="CUDA: only bf16 against FP4 KV with each of these FP4 attention kernels (e.g. triton,gluon), "
                         "in turn per point (--batches at 128+256 tokens, then 2K and 16K contexts), --rounds times")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--caps", help="only: decode ms/step of the same ~330-token contexts at each engine max_seq_len given "
                    "(comma-separated, e.g. 2048,8192,16384), bf16 and fp4 KV, at the first of --batches (CUDA)")
    ap.add_argument("--mismatch-only", action="store_true", help="only the engine-vs-trainer logprob mismatch")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    torch.set_num_threads(2 if device == "cpu" else torch.get_num_threads())
    result: dict[str, float] = {}
    if args.fp4_kernels:
        fp4_kernels_side_by_side(args.shapes.split(",")[-1], device, result, args.fp4_kernels.split(","),
                                 tuple(int(b) for b in args.batches.split(",")), args.rounds)
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)
        return
    if args.mismatch_only:
        mismatches(args.shapes.split(",")[0] if device == "cuda" else "tiny", device, result)
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)
        return
    if args.caps:
        cap_sweep(args.shapes.split(",")[-1] if device == "cuda" else "tiny", device, result,
                  [int(c) for c in args.caps.split(",")], int(args.batches.split(",")[0]) if device == "cuda" else 8)
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)
        return
    if args.long_only:
        long_contexts(args.shapes.split(",")[-1] if device == "cuda" else None, device, result)
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)
        return
    if args.overlap_only:
        overlap_side_by_side(args.shapes.split(",") if device == "cuda" else ["tiny"], device, result,
                             tuple(int(b) for b in args.batches.split(",")))
        print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)
        return
    if device == "cpu":
        shapes, batches, prompt, new = ["tiny"], [1, 16], 16, 32
    else:
        shapes, batches, prompt, new = args.shapes.split(","), [1, 16, 64, 256], 128, 256
    print(f"{'shape':<9}{'kv':<6}{'batch':>6}{'graphs ms/step':>16}{'unfused graphs':>16}{'eager ms/step':>15}"
          f"{'HF ms/step':>12}{'tok/s':>10}")
    for n, shape in enumerate(shapes):
        prefix = "" if n == 0 else f"{shape}_"
        model = build(shape, device)
        for b in batches:
            ms, eng = engine_ms_per_step(model, b, prompt, new, device)
            side = device == "cuda" and b == 64  # the three variants side by side
            unfused = engine_ms_per_step(model, b, prompt, new, device, variant="graphs_gather")[0] if side else float("nan")
            if device == "cuda" and b in (1, 64):  # this step's fusion alone, side by side
                result[f"{prefix}layer_unfused_ms_per_step_b{b}"] = engine_ms_per_step(
                    model, b, prompt, new, device, variant="graphs_layer_unfused")[0]
                print(f"{shape:<9}{'bf16':<6}{b:>6} layer-unfused graphs: {result[f'{prefix}layer_unfused_ms_per_step_b{b}']:.2f}")
            eager = engine_ms_per_step(model, b, prompt, new, device, variant="eager")[0] if side else float("nan")
            hf = hf_ms_per_step(model, b, prompt, new, device) if b == 16 and not args.no_hf else float("nan")
            print(f"{shape:<9}{'bf16':<6}{b:>6}{ms:>16.2f}{unfused:>16.2f}{eager:>15.2f}{hf:>12.2f}{1000 * b / ms:>10.0f}",
                  flush=True)
            result[f"{prefix}ms_per_step_b{b}"] = ms
            if side:
                result[f"{prefix}unfused_graphs_ms_per_step_b{b}"] = unfused
                result[f"{prefix}eager_ms_per_step_b{b}"] = eager
                result[f"{prefix}speedup_vs_eager_b{b}"] = eager / ms
            if b == 16:
                result[f"{prefix}speedup_vs_hf_b16"] = hf / ms
            if n == 0 and b == batches[-1]:
                st = eng.stats
                result["prefill_logit_rows_per_seq"] = st.prefill_logit_rows / max(st.prefill_seqs, 1)
                result["kv_gather_bytes"] = st.kv_gather_bytes / max(st.generated_tokens, 1)
                if eng.graphs is not None and eng.graphs.disabled_reason:
                    print(f"graphs disabled: {eng.graphs.disabled_reason}")
        if device == "cuda":
            del model
            fp4 = build(shape, device, "fp4")
            ms4 = engine_ms_per_step(fp4, 64, prompt, new, device)[0]
            print(f"{shape:<9}{'fp4':<6}{64:>6}{ms4:>16.2f}", flush=True)
            result[f"{prefix}fp4_over_bf16_b64"] = ms4 / result[f"{prefix}ms_per_step_b64"]
            del fp4
            torch.cuda.empty_cache()
    mismatches(shapes[0], device, result)
    # GRPO groups: the prompt prefilled once per group (shared KV blocks) vs once per sample, side by side
    gshape = shapes[0]
    groups, gsize, gprompt, gnew = (4, 4, 40, 8) if device == "cpu" else (32, 8, 256, 32)
    model = build(gshape, device)
    for share in (False, True):
        wall, eng = group_rollout(model, groups, gsize, gprompt, gnew, device, share=share)
        tag = "shared" if share else "unshared"
        st = eng.stats
        print(f"{gshape} groups {groups}x{gsize}, prompt {gprompt}, {gnew} new: {tag:9s} wall {wall:.3f} s, "
              f"prefill tokens/group {st.prefill_tokens / groups:.0f}, shared prompt tokens {st.shared_prompt_tokens}",
              flush=True)
        result[f"group_prefill_tokens_per_group_{tag}"] = st.prefill_tokens / groups
        result[f"group_wall_s_{tag}"] = wall
    result["group_speedup_shared"] = result["group_wall_s_unshared"] / result["group_wall_s_shared"]
    del model
    long_contexts(args.shapes.split(",")[-1] if device == "cuda" and args.long else None, device, result)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)


def fp4_kernels_side_by_side(shape: str, device: str, result: dict, kernels: list[str], batches: tuple[int, ...],
                             rounds: int) -> None:
    """bf16 KV against FP4 KV read by each FP4 attention kernel, in turn at every point and `rounds` times (the
    median kept): batches at 128-token prompts + 256 new tokens, then batch 64 at 2K and batch 16 at 16K context
    (64 new tokens). The same weights for every arm (one model per KV format, built once)."""
    from model.kernels import decode_attention as attention

    if device != "cuda":  # the FP4 kernels' timings mean nothing on the CPU: the tiny shape's plumbing only
        shape, batches, kernels = "tiny", (1,), ["triton"]
    models = {kv: build(shape, device, kv, max_pos=16384 + 128) for kv in ("bf16", "fp4")}
    points = [(b, 128, 256) for b in batches] + ([(64, 2048, 64), (16, 16384, 64)] if device == "cuda" else [])
    arms = ["bf16"] + [f"fp4_{k}" for k in kernels]
    default = attention.FP4_KERNEL
    for b, prompt, new in points:
        times: dict[str, list[float]] = {a: [] for a in arms}
        for _ in range(rounds):
            for arm in arms:
                attention.FP4_KERNEL = arm.removeprefix("fp4_") if arm != "bf16" else default
                try:
                    times[arm].append(engine_ms_per_step(models[arm.split("_")[0]], b, prompt, new, device)[0])
                finally:
                    attention.FP4_KERNEL = default
                if device == "cuda":
                    torch.cuda.empty_cache()
        tag = f"b{b}" + (f"_{prompt // 1024}k" if prompt >= 1024 else "")
        ms = {a: sorted(t)[len(t) // 2] for a, t in times.items()}
        for a in arms:
            result[f"{a}_ms_per_step_{tag}"] = ms[a]
            if a != "bf16":
                result[f"{a}_over_bf16_{tag}"] = ms[a] / ms["bf16"]
        print(f"{shape} {tag}: " + "; ".join(f"{a} {ms[a]:.3f} ms/step {[round(x, 3) for x in times[a]]}" for a in arms),
              flush=True)


def cap_sweep(shape: str, device: str, result: dict, caps: list[int], batch: int) -> None:
    """Issue 42: the decode step of the same contexts (256-token prompts, 74 new tokens: ~330 at the end) at each
    response cap (engine.max_seq_len). The engine allocates blocks on demand and replays the decode graph of the
    narrowest context bucket, so the cap should cost nothing; RESULT <kv>_step_ms_<cap> and
    <kv>_step_ms_<last>_over_<first>."""
    prompt, new = (256, 74) if device == "cuda" else (16, 8)
    for kv in ("bf16", "fp4") if device == "cuda" else ("bf16",):
        model = build(shape, device, kv, max_pos=max(caps) + 64)
        for cap in caps:
            ms = engine_ms_per_step(model, batch, prompt, new, device, cap=cap)[0]
            result[f"{kv}_step_ms_{cap}"] = ms
            print(f"{shape} {kv} batch {batch}, contexts {prompt}..{prompt + new}, cap {cap}: {ms:.2f} ms/step", flush=True)
        result[f"{kv}_step_ms_{caps[-1]}_over_{caps[0]}"] = result[f"{kv}_step_ms_{caps[-1]}"] / result[f"{kv}_step_ms_{caps[0]}"]
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def long_contexts(shape: str | None, device: str, result: dict) -> None:
    """--long: decode ms/step at 2K (batch 64) and 16K (batch 16), bf16 and FP4 KV, and FP4 / bf16."""
    if shape is None:
        return
    for b, ctx in ((64, 2048), (16, 16384)):
        for kv in ("bf16", "fp4"):
            ms = long_context_ms_per_step(shape, device, b, ctx, 64, kv)
            print(f"{shape:<9}{kv:<6}{b:>6} context {ctx}: {ms:.2f} ms/step", flush=True)
            result[f"{kv}_ms_per_step_b{b}_{ctx // 1024}k"] = ms
        k = f"b{b}_{ctx // 1024}k"
        result[f"fp4_over_bf16_{k}"] = result[f"fp4_ms_per_step_{k}"] / result[f"bf16_ms_per_step_{k}"]


if __name__ == "__main__":
    main()
