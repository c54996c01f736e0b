"""What a background checkpoint does in the rollouts' pause (issue #41): the trainer's tensors into host buffers
reused from one checkpoint to the next (rl/checkpoint/host_copies.py), the in-flight states' file as views of
their tensors, written without copying them (rollout/types.py `states_file_parts`)."""

import msgpack
import numpy as np
import pytest
import torch

from rl.checkpoint.host_copies import HostCopies
from rollout.types import GenerationRequest, RolloutState, states_file_parts


def _states() -> tuple[list[RolloutState], torch.Tensor]:
    """States as an export gives them: views [L, rows, H, D] of one gather of every sequence's rows (not
    contiguous), fp8-style scales beside them, a routing trace, one never admitted, one paused with tool turns."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 40, 2, 8, generator=g).to(torch.bfloat16)
    v = torch.randn(3, 40, 2, 8, generator=g).to(torch.bfloat16)
    scale = torch.randint(0, 255, (3, 40, 2), generator=g, dtype=torch.uint8)
    states, start = [], 0
    for i, rows in enumerate([5, 1, 17, 300 // 20]):
        req = GenerationRequest(f"p{i}-0", tuple(range(3)), 64, seed=i)
        tokens = list(range(rows + 1))
        states.append(RolloutState(req, tokens, [0.5] * (rows - 2), [1] * (rows - 2), k[:, start:start + rows],
                                   v[:, start:start + rows], np.arange(rows * 3 * 2, dtype=np.int16).reshape(rows, 3, 2),
                                   kv_format="fp8", k_scale=scale[:, start:start + rows], v_scale=scale[:, start:start + rows],
                                   paused=i == 2, tool_turns=[{"call": "x"}] if i == 2 else []))
        start += rows
    states.append(RolloutState(GenerationRequest("waiting-0", (1, 2), 8, seed=9), [1, 2]))
    return states, k


def _reference_bytes(s: RolloutState) -> bytes:
    """`to_bytes` as it was written before the parts (header, then each tensor copied whole, then the routing)."""
    tensors = s._tensors()
    head = s.byte_parts()[0]
    body = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    return head + body + (b"" if s.routing is None else s.routing.astype("<i2").tobytes())


def test_the_in_flight_file_is_msgpack_of_each_state_and_its_kv_bytes_are_not_copied():
    states, k = _states()
    parts = states_file_parts(states)
    data = b"".join(bytes(p) for p in parts)
    assert data == msgpack.packb([_reference_bytes(s) for s in states])
    back = [RolloutState.from_bytes(b) for b in msgpack.unpackb(data)]
    for a, b in zip(states, back):
        assert b.tokens == a.tokens and b.paused == a.paused and b.tool_turns == a.tool_turns
        for name, t in a.kv_tensors().items():
            assert torch.equal(b.kv_tensors()[name], t), name
    # a KV view's bytes are views of the gather's memory, one a layer: nothing copied in the pause
    lo, hi = k.data_ptr(), k.data_ptr() + k.nbytes
    in_k = [p for p in parts if isinstance(p, memoryview) and lo <= np.frombuffer(p, np.uint8).ctypes.data < hi]
    assert len(in_k) == sum(3 for s in states if s.k is not None)


def test_a_state_too_large_for_bin16_takes_msgpacks_bin32_header():
    big = torch.zeros(1, 70_000, 1, 1, dtype=torch.uint8)
    s = RolloutState(GenerationRequest("a-0", (1,), 4, seed=0), list(range(70_001)), k=big, v=big, kv_format="fp8")
    data = b"".join(bytes(p) for p in states_file_parts([s]))
    assert data == msgpack.packb([_reference_bytes(s)])


def test_host_copies_reuse_their_buffers_and_hold_the_values_of_the_copy():
    host = HostCopies()
    w = {"a": torch.arange(6.0).reshape(2, 3), "b": [torch.ones(4), 7, "x"]}
    first = host.tree(w, ("t",))
    host.end()
    ptrs = (first["a"].data_ptr(), first["b"][0].data_ptr())
    w["a"].add_(10)  # training goes on: the copy keeps the values it had
    assert torch.equal(first["a"], torch.arange(6.0).reshape(2, 3)) and first["b"][1:] == [7, "x"]
    assert first["a"].data_ptr() != w["a"].data_ptr()
    second = host.tree(w, ("t",))
    host.end()
    assert (second["a"].data_ptr(), second["b"][0].data_ptr()) == ptrs  # the same memory, new values
    assert torch.equal(second["a"], w["a"])
    # a changed shape or dtype gets a new buffer; a tensor no copy used any more is released
    third = host.tree({"a": w["a"].double()}, ("t",))
    host.end()
    assert third["a"].dtype == torch.float64 and torch.equal(third["a"], w["a"].double())
    assert host.nbytes == third["a"].nbytes


def test_host_copies_larger_than_the_keep_limit_are_not_held_between_checkpoints():
    host = HostCopies(keep_limit_bytes=1000)
    small = host.tree({"a": torch.ones(10)})  # 40 bytes: kept for the next copy
    host.end()
    assert host.nbytes == 40
    big = host.tree({"a": torch.ones(10), "b": torch.full((300,), 2.0)})  # 1,240 bytes: past the limit
    host.end()
    assert host.nbytes == 0 and torch.equal(big["b"], torch.full((300,), 2.0))  # the copy itself is intact
    assert big["a"].data_ptr() == small["a"].data_ptr()  # (the kept buffer was reused before the limit let it go)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned buffers and queued copies need a CUDA device")
def test_host_copies_from_a_gpu_are_pinned_up_to_the_limit_and_complete_after_end():
    host = HostCopies(pin_limit_bytes=3 << 20)
    src = {f"t{i}": torch.randn(1 << 18, device="cuda") for i in range(4)}  # 1 MiB each
    src["odd"] = torch.randn(3 << 16, device="cuda")  # 0.75 MiB, a 1 MiB block: past the limit
    out = host.tree(src)
    host.end()
    assert all(torch.equal(out[n], src[n].cpu()) for n in src)
    assert host.pinned_bytes == 3 << 20 and [n for n, t in out.items() if t.is_pinned()] == ["t0", "t1", "t2"]
