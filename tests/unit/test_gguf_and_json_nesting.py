"""Deeply nested values in untrusted model files (issue 40, class 7): GGUF arrays of arrays and JSON documents
(config.json, tokenizer_config.json, a safetensors header) nested 100,000 deep are one line, never RecursionError;
the nesting real files use still loads."""

import json
import struct

import pytest

from configbase.jsonfile import MAX_DEPTH, loads
from model.formats import CheckpointFormatError, check_safetensors_header, checkpoint_fields
from model.gguf_file import MAX_ARRAY_DEPTH, GGUFFile
from model.gguf_metadata import read_gguf_metadata
from model.hf_tokenizer import load_hf_tokenizer
from tests.tiny_tokenizer import write_hf_dir

DEEP = "[" * 100_000 + "]" * 100_000


def _nested_gguf(path, depth: int):
    """One key whose value is `depth` arrays, each holding the next, around an empty array of u8."""
    kv = struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 0, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    return path


@pytest.mark.parametrize("read", [read_gguf_metadata, lambda p: GGUFFile(p).metadata], ids=["metadata", "gguf_file"])
def test_gguf_arrays_nested_too_deep_are_one_line(tmp_path, read):
    with pytest.raises(ValueError, match=f"GGUF metadata arrays nested deeper than {MAX_ARRAY_DEPTH} levels"):
        read(_nested_gguf(tmp_path / "deep.gguf", 100_000))
    value = read(_nested_gguf(tmp_path / "ok.gguf", MAX_ARRAY_DEPTH))["key"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        (value,) = value
    assert value == []


def test_json_nesting_is_bounded_without_recursion():
    for text in (DEEP, "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), '{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1)):
        with pytest.raises(ValueError, match=f"JSON nested deeper than {MAX_DEPTH} levels"):
            loads(text)
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None and loads('{"a": [1, {"b": []}]}') == {"a": [1, {"b": []}]}
    with pytest.raises(ValueError):
        loads("{")


def test_nested_model_and_tokenizer_files_are_one_line(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"model_type": "llama", "x": ' + DEEP + "}")
    (m / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointFormatError, match="config.json: unreadable .JSON nested deeper than"):
        checkpoint_fields(m)
    header = ('{"x": ' + DEEP + "}").encode()
    (tmp_path / "deep.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointFormatError, match="not a safetensors file .JSON nested deeper than"):
        check_safetensors_header(tmp_path / "deep.safetensors")
    tok = write_hf_dir(tmp_path / "tok")
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"})[:-1] + ', "x": ' + DEEP + "}")
    with pytest.raises(ValueError, match="tokenizer_config.json: not readable JSON .JSON nested deeper than"):
        load_hf_tokenizer(tok)
