"""Records crossing the engine's seam: requests in, finished generations and rollout states out."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """'eos' or 'length'."""
    routing_trace: np.ndarray | None
    """MoE: int16 [len(prompt) + len(response) - 1, num_layers, top_k] expert ids of every fed token."""
    generate_s: float = 0.0
    """Wall-clock seconds from admission to finish (time interrupted excluded)."""


@dataclass
class RolloutState:
    """Everything the engine needs to continue a sample exactly where it stopped (seed §5.2.3).

    `tokens` holds prompt + response so far; the KV of all tokens but the last is in `k`/`v`
    (the last sampled token is fed at the next step). The sampler's RNG state is the request seed plus
    the response index, so nothing else is kept. A request that was never admitted has `k is None`.
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

    # -- serialisation: msgpack header + raw tensor bytes --------------------------------------------
    def to_bytes(self) -> bytes:
        tensors = self._tensors()
        header = {
            "request": self.request.__dict__,
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "policy_versions": self.policy_versions,
            "generate_s": self.generate_s,
            "kv_format": self.kv_format,
            "csa2": self.csa2 is not None,
            "tensors": {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()},
            "routing": None if self.routing is None else list(self.routing.shape),
        }
        parts = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values()]
        if self.routing is not None:
            parts.append(self.routing.astype("<i2").tobytes())
        head = msgpack.packb(header)
        return len(head).to_bytes(8, "little") + head + b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> "RolloutState":
        n = int.from_bytes(data[:8], "little")
        header = msgpack.unpackb(data[8 : 8 + n])
        req = header["request"]
        req["prompt_tokens"] = tuple(req["prompt_tokens"])
        offset, tensors = 8 + n, {}
        for name, (dtype, shape) in header["tensors"].items():
            dt = getattr(torch, dtype)
            size = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
            if size == 0:  # torch.frombuffer refuses an empty buffer
                tensors[name] = torch.empty(shape, dtype=dt)
            else:
                buf = bytearray(data[offset : offset + size])
                tensors[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)
            offset += size
        routing = None
        if header["routing"] is not None:
            shape = header["routing"]
            size = int(np.prod(shape)) * 2
            routing = np.frombuffer(data[offset : offset + size], dtype="<i2").reshape(shape).astype(np.int16)
        csa2 = {n.removeprefix("csa2."): t for n, t in tensors.items() if n.startswith("csa2.")}
        return cls(
            request=GenerationRequest(**req),
            tokens=list(header["tokens"]),
            logprobs=list(header["logprobs"]),
            policy_versions=list(header["policy_versions"]),
            k=tensors.get("k"),
            v=tensors.get("v"),
            routing=routing,
            generate_s=header["generate_s"],
            kv_format=header.get("kv_format", "bf16"),
            k_scale=tensors.get("k_scale"),
            v_scale=tensors.get("v_scale"),
            csa2=csa2 if header.get("csa2") else None,
        )
