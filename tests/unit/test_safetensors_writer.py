"""model/checkpoint.py `write_safetensors`: files that safetensors' own loaders read back tensor for tensor (every
dtype the checkpoints hold, scalars, empty tensors, non-contiguous views, metadata), and a clear error for a dtype
the format has no name for."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model.checkpoint import write_safetensors


def test_safetensors_loaders_read_back_every_tensor(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(5, 7, generator=g),
        "half": torch.randn(3, 3, generator=g).half(),
        "bf16": torch.randn(2, 9, generator=g).bfloat16(),
        "f64": torch.randn(4, generator=g).double(),
        "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "step": torch.tensor(17.0),  # a scalar (AdamW's step)
        "rng": torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),  # odd length: the next offset unaligned
        "ids": torch.arange(-3, 9, dtype=torch.int64),
        "i16": torch.arange(5, dtype=torch.int16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "view": torch.arange(24.0).reshape(4, 6).t(),  # not contiguous
    }
    path = tmp_path / "t.safetensors"
    write_safetensors(tensors, path, metadata={"format": "2"})
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(back[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else back[k],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "2"}
        assert torch.equal(f.get_slice("w")[1:3], tensors["w"][1:3])  # sliced reads (FSDP2 loads rows this way)


def test_a_dtype_without_a_safetensors_name_is_refused_with_its_name(tmp_path):
    with pytest.raises(ValueError, match=r"tensor 'z': dtype torch.complex64 has no safetensors type"):
        write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")
