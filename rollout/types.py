"""Records crossing the engine's seam: requests in, finished generations and rollout states out."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import msgpack
import numpy as np
import torch


@dataclass(frozen=True)
class GenerationRequest:
    sample_id: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    seed: int
    """Sampler seed of this sample; with the token index it fixes every random draw (counter-based)."""
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    """Keep generating past EOS until max_new_tokens (forced-length benchmarks)."""
    eos_at: int | None = None
    """Forced-length benchmarks (rewards/longtail.py `mode: eos`): the response ends after this many tokens as if the
    policy had sampled its end-of-sequence token there (finish reason 'eos'), with max_new_tokens the cap. Only the
    completion check reads it: admission and KV allocation never do, so the engine knows a sample's length no more
    than it knows a policy's. None: the policy's own EOS."""
    tool_calls: bool = False
    """Multi-turn: the engine pauses this sample when its response closes a tool call (`Engine.tool_stop`);
    the worker appends the tool's output (`Engine.append`) and generation continues from the cached KV."""


@dataclass(frozen=True)
class Generation:
    """A finished sequence."""

    sample_id: str
    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Behaviour log-probability of each response token (under the request's temperature)."""
    policy_versions: tuple[int, ...]
    """Policy version that produced each response token."""
    finish_reason: str
    """'eos', 'length', or what `Engine.finish_paused` was told (e.g. 'max_turns')."""
    routing_trace: np.ndarray | None
    """MoE: int16 [len(prompt) + len(response) - 1, num_layers, top_k] expert ids of every fed token."""
    generate_s: float = 0.0
    appended_spans: tuple[tuple[int, int], ...] = ()
    """Response offsets [start, end) of tokens the engine did not sample (tool output appended with
    `Engine.append`): trained with loss mask 0; their logprobs are 0.0 placeholders."""
    tool_turns: tuple[dict, ...] = ()
    """What the worker said about each append (`Engine.append(..., info=)`: tool, call, status, output...),
    plus its "start" and "end" response offsets; plain values only (they travel in RolloutStates)."""
    """Wall-clock seconds from admission to finish (time interrupted excluded)."""


@dataclass(frozen=True)
class ToolCallPause:
    """A sample that stopped because its response closes a tool call (`Engine.pop_paused`)."""

    sample_id: str
    response_tokens: tuple[int, ...]
    """The response so far, the call included."""
    turn_start: int
    """Response offset where the model's current turn began (after the last tool output)."""
    tool_turns: int = 0
    """Tool outputs appended to this sample so far."""


@dataclass
class RolloutState:
    """Everything the engine needs to continue a sample exactly where it stopped (seed §5.2.3).

    `tokens` holds prompt + response so far; the KV of the first `num_cached` tokens is in `k`/`v`: all
    but the last (the last sampled token is fed at the next step), or fewer when tokens were appended
    to a paused sample (tool output, fed at the next step by a prefill of only them). The sampler's RNG
    state is the request seed plus the response index, so nothing else is kept. A request that was never admitted has `k is None`.
    """

    request: GenerationRequest
    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    k: torch.Tensor | None = None
    """[num_layers, len(tokens) - 1, kv_heads, ...] in the cache's storage format: the model dtype
    [.., head_dim] for bf16, uint8 E4M3 bits [.., head_dim] for fp8, uint8 E2M1 pairs [.., head_dim/2]
    for fp4 (`model.kv_cache`)."""
    v: torch.Tensor | None = None
    routing: np.ndarray | None = None
    """int16 [len(tokens) - 1, num_layers, top_k]."""
    generate_s: float = 0.0
    kv_format: str = "bf16"
    """Storage format of k/v (`ModelConfig.kv_cache.dtype`); resume checks it matches the engine's."""
    k_scale: torch.Tensor | None = None
    """Quantised formats: uint8 scales [num_layers, len(tokens) - 1, kv_heads(, head_dim/16 for fp4)]."""
    v_scale: torch.Tensor | None = None
    csa2: dict[str, torch.Tensor] | None = None
    """CSA2 models: the sequence's `CSA2Cache` as named tensors (`model.sparse_attention.cache_tensors`),
    in place of k/v; a CSA2 model keeps no paged KV."""
    paused: bool = False
    """Stopped at a tool call, waiting for `Engine.append` (multi-turn); resumes paused."""
    appended_spans: list[tuple[int, int]] = field(default_factory=list)
    """As `Generation.appended_spans`."""
    tool_turns: list[dict] = field(default_factory=list)
    """As `Generation.tool_turns`."""
    num_cached: int | None = None
    """Tokens whose KV `k`/`v` (or csa2) hold; None: len(tokens) - 1 when there is KV, else 0."""
    workdir: dict | None = None
    """Multi-turn, in checkpoints only: the sample's sandbox work directory as it was before its pending tool call
    (or now, between calls), so that after a resume the call runs again on the same files (seed §5.1.3). The
    worker's record, opaque to the engine (rl/runtime/tool_turns.py): {"archive": gzip'd tar bytes} or {"lost": why};
    None: no files."""

    @property
    def cached(self) -> int:
        if not self.has_kv:
            return 0
        return len(self.tokens) - 1 if self.num_cached is None else self.num_cached

    @property
    def has_kv(self) -> bool:
        """Was admitted: the engine holds KV (paged or CSA2) for all tokens but the last."""
        return self.k is not None or self.csa2 is not None

    def kv_tensors(self) -> dict[str, torch.Tensor]:
        """The paged KV in its storage format, as `PagedKVCache.export` gave it."""
        t = {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}
        return {n: x for n, x in t.items() if x is not None}

    def _tensors(self) -> dict[str, torch.Tensor]:
        t = self.kv_tensors()
        for n, x in (self.csa2 or {}).items():
            t["csa2." + n] = x
        return t

    @property
    def num_response_tokens(self) -> int:
        return len(self.tokens) - len(self.request.prompt_tokens)

    @property
    def nbytes(self) -> int:
        n = sum(t.nbytes for t in self._tensors().values())
        return n + (0 if self.routing is None else self.routing.nbytes)

    # -- serialisation: msgpack header + raw tensor bytes (seed §5.2.3) ------------------------------
    # Layout, version ROLLOUT_STATE_FORMAT: 8-byte little-endian header length, a msgpack map (plain
    # types only: no extension types, so decoding cannot build objects or run code), then the raw bytes
    # of each tensor in header order and of the routing trace (int16 little-endian).
    def to_bytes(self) -> bytes:
        return b"".join(self.byte_parts())

    def byte_parts(self) -> list[bytes | memoryview]:
        """`to_bytes` as the pieces it joins: the header, then each tensor's bytes as views of its memory where it is
        contiguous, or of each of its contiguous sub-tensors (a layer of a KV view into a gather exported for many
        sequences is one: [L, rows of this sequence, ...] of [L, all rows, ...]), copied only otherwise. Writing them
        one by one (`states_file_parts`) copies no tensor byte in Python (issue #41: a checkpoint's pause)."""
        tensors = self._tensors()
        header = {
            "format": ROLLOUT_STATE_FORMAT,
            "request": {f.name: getattr(self.request, f.name) for f in fields(GenerationRequest)},
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "policy_versions": self.policy_versions,
            "generate_s": self.generate_s,
            "kv_format": self.kv_format,
            "csa2": self.csa2 is not None,
            "paused": self.paused,
            "appended_spans": [list(x) for x in self.appended_spans],
            "tool_turns": list(self.tool_turns),
            "num_cached": self.num_cached,
            "workdir": self.workdir,
            "tensors": {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()},
            "routing": None if self.routing is None else list(self.routing.shape),
        }
        head = msgpack.packb(header)
        parts: list[bytes | memoryview] = [len(head).to_bytes(8, "little") + head]
        for t in tensors.values():
            parts += _tensor_bytes(t.detach().cpu())
        if self.routing is not None:
            parts.append(self.routing.astype("<i2").tobytes())
        return parts

    @classmethod
    def from_bytes(cls, data: bytes) -> "RolloutState":
        """Inverse of `to_bytes`; ValueError (one line) on anything that is not a well-formed state of
        this format (the bytes come from a checkpoint directory: untrusted)."""
        data = bytes(data)
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n > len(data) - 8:
            raise ValueError(f"rollout state: truncated ({len(data)} bytes)")
        header = unpack_plain(data[8 : 8 + n])
        if not isinstance(header, dict) or header.get("format") != ROLLOUT_STATE_FORMAT:
            found = header.get("format") if isinstance(header, dict) else None
            raise ValueError(f"rollout state: format {found!r}, this asyncrl reads {ROLLOUT_STATE_FORMAT}")
        try:
            req = dict(header["request"])
            req["prompt_tokens"] = tuple(_ints(req["prompt_tokens"]))
            request = GenerationRequest(**req)
            offset, tensors = 8 + n, {}
            for name, (dtype, shape) in header["tensors"].items():
                dt, shape = _DTYPES[dtype], _ints(shape)
                size = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
                if offset + size > len(data):
                    raise ValueError(f"tensor {name} runs past the end")
                if size == 0:  # torch.frombuffer refuses an empty buffer
                    tensors[name] = torch.empty(shape, dtype=dt)
                else:
                    buf = bytearray(data[offset : offset + size])
                    tensors[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)
                offset += size
            routing = None
            if header["routing"] is not None:
                shape = _ints(header["routing"])
                size = int(np.prod(shape)) * 2
                if offset + size > len(data):
                    raise ValueError("the routing trace runs past the end")
                routing = np.frombuffer(data[offset : offset + size], dtype="<i2").reshape(shape).astype(np.int16)
            csa2 = {n.removeprefix("csa2."): t for n, t in tensors.items() if n.startswith("csa2.")}
            return cls(
                request=request,
                tokens=_ints(header["tokens"]),
                logprobs=[float(x) for x in header["logprobs"]],
                policy_versions=_ints(header["policy_versions"]),
                k=tensors.get("k"),
                v=tensors.get("v"),
                routing=routing,
                generate_s=float(header["generate_s"]),
                kv_format=str(header["kv_format"]),
                k_scale=tensors.get("k_scale"),
                v_scale=tensors.get("v_scale"),
                csa2=csa2 if header["csa2"] else None,
                paused=bool(header.get("paused", False)),
                appended_spans=[tuple(_ints(x)) for x in header.get("appended_spans", [])],
                tool_turns=_dicts(header.get("tool_turns", [])),
                num_cached=None if header.get("num_cached") is None else _ints([header["num_cached"]])[0],
                workdir=_workdir(header.get("workdir")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"rollout state: malformed header ({type(e).__name__}: {e})") from None


ROLLOUT_STATE_FORMAT = 1
"""Version of the `RolloutState.to_bytes` layout; resumable checkpoints record it in their manifest."""

_DTYPES = {name: getattr(torch, name) for name in
           ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")}
"""Tensor dtypes a serialised state may name (an allow-list: a name is never looked up on torch)."""


def _tensor_bytes(t: torch.Tensor) -> list[memoryview]:
    """The bytes of `t` in row-major order as views of its memory: one when it is contiguous, else one per
    sub-tensor along its first dimension when each is contiguous; else of one contiguous copy."""
    if not t.numel():
        return []
    subs = t.unbind(0) if not t.is_contiguous() and t.dim() > 1 else (t if t.is_contiguous() else t.contiguous(),)
    if not all(x.is_contiguous() for x in subs):
        subs = (t.contiguous(),)
    return [memoryview(x.reshape(-1).view(torch.uint8).numpy()) for x in subs]


def _bin_header(n: int) -> bytes:
    """msgpack's header of a byte string of `n` bytes (the smallest of bin 8/16/32, as `msgpack.packb` writes it)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def parts_nbytes(parts: list[bytes | memoryview]) -> int:
    """The bytes that `byte_parts` or `states_file_parts` pieces hold in all."""
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)


def states_file_parts(states: list[RolloutState]) -> list[bytes | memoryview]:
    """The bytes of `msgpack.packb([s.to_bytes() for s in states])` (an in-flight checkpoint file,
    rl/checkpoint/format.py) as pieces to write in order, the tensors' bytes not copied (`byte_parts`): building
    them is cheap where the join and the packing copied every KV byte twice, in the checkpoint's pause."""
    out: list[bytes | memoryview] = [msgpack.Packer().pack_array_header(len(states))]
    for s in states:
        parts = s.byte_parts()
        out.append(_bin_header(parts_nbytes(parts)))
        out += parts
    return out


def states_on_host(states: list[RolloutState]) -> list[RolloutState]:
    """The states with their paged KV in host memory, for serialising: those parked on the device
    (`engine.park_kv: device`) come over in one copy per tensor name, each state then a view of it."""
    dev = [s for s in states if s.k is not None and s.k.device.type != "cpu"]
    if not dev:
        return states
    names = list(dev[0].kv_tensors())
    host = {n: torch.cat([s.kv_tensors()[n] for s in dev], dim=1).cpu() for n in names}
    moved, start = {}, 0
    for s in dev:
        rows = s.k.shape[1]
        moved[id(s)] = replace(s, **{n: host[n][:, start:start + rows] for n in names})
        start += rows
    return [moved.get(id(s), s) for s in states]


def unpack_plain(data: bytes):
    """msgpack → plain Python values only (str keys, no extension types, no raw bytes as str)."""

    def no_ext(code, _data):
        raise ValueError(f"msgpack extension type {code} is not allowed")

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=no_ext, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise ValueError(f"not valid msgpack ({type(e).__name__}: {e})") from None


def _dicts(xs) -> list[dict]:
    if not isinstance(xs, list) or not all(isinstance(x, dict) for x in xs):
        raise ValueError(f"expected a list of maps, got {type(xs).__name__}")
    return xs


def _workdir(x) -> dict | None:
    ok = x is None or (isinstance(x, dict) and len(x) == 1 and (isinstance(x.get("archive"), bytes)
                                                                 or isinstance(x.get("lost"), str)))
    if not ok:
        raise ValueError("workdir is neither null, {archive: bytes} nor {lost: str}")
    return x


def _ints(xs) -> list[int]:
    if not isinstance(xs, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs):
        raise ValueError(f"expected a list of non-negative ints, got {type(xs).__name__}")
    return xs
