"""Bad checkpoints named by `model.init` are one line and exit 2 through the CLI (`rl validate`, which
`rl train` runs first): a Hugging Face directory with a missing shard, a GGUF file of a quantisation type
asyncrl does not dequantise. (The tokenizer that does not fit the model: tests/unit/test_hf_tokenizer.py;
a dataset row without its answer field: tests/integration/test_file_dataset_cli.py.)"""

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.hf_tiny import make_hf, write_gguf  # noqa: E402

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def _validate_with_init(init) -> str:
    proc = subprocess.run([*CLI, "validate", "configs/quickstart.yaml", "--set", f"model.init={init}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_missing_shard_is_one_line_exit_2(tmp_path):
    d = tmp_path / "sharded"
    make_hf("qwen2", seed=0).save_pretrained(d, max_shard_size="40KB")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert f"{shard}: missing shard" in _validate_with_init(d)


@pytest.mark.parametrize("header, message", [
    ((1 << 40).to_bytes(8, "little") + b"{}", "not a safetensors file (header length 1099511627776)"),  # before allocating
    ((8).to_bytes(8, "little") + b"[1, 2]  ", "not a safetensors file (header is not a JSON object)"),
    (b"c__builtin__\nopen\n(S'x'\ntR.", "not a safetensors file (header length"),  # a pickle: never unpickled
])
def test_a_weight_file_that_is_not_safetensors_is_one_line_exit_2(tmp_path, header, message):
    d = tmp_path / "hf"
    make_hf("qwen2", seed=0).save_pretrained(d)
    (d / "model.safetensors").write_bytes(header)
    assert f"{d / 'model.safetensors'}: {message}" in _validate_with_init(d)


def test_an_unsupported_quantisation_is_one_line_exit_2(tmp_path):
    path = write_gguf(make_hf("llama", seed=1, rope_scaling=None, hidden_size=256, intermediate_size=256, head_dim=64),
                      tmp_path / "iq.gguf", "IQ2_XXS")
    assert "has quantisation type IQ2_XXS; asyncrl dequantises F32, F16" in _validate_with_init(path)
