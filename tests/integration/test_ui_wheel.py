"""The dashboard's page ships in the package (issue #45 item 6): a wheel built from this checkout holds the page, its
script and the vendored chart library, and `rl ui` run from the unpacked wheel (not the checkout) serves them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
import zipfile

import pytest

from tests.ui_run import make_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = ("rl/ui/static/index.html", "rl/ui/static/app.js", "rl/ui/static/app.css",
          "rl/ui/static/vendor/uPlot.iife.min.js", "rl/ui/static/vendor/uPlot.min.css")


def test_a_wheel_holds_the_page_and_serves_it_from_where_it_is_installed(tmp_path):
    import importlib.util

    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]  # offline when it can
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info beside the sources it builds
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "configbase", "model", "rollout", "rewards", "rl", "sandbox_client",
                 "teachers"):
        copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
        kw = {"ignore": shutil.ignore_patterns("__pycache__", "*.pyc")} if copy is shutil.copytree else {}
        copy(os.path.join(ROOT, name), src / name, **kw)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("asyncrl-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert set(ASSETS) <= names, sorted(set(ASSETS) - names)
        z.extractall(tmp_path / "site")
    run = make_run(tmp_path / "run", n=5)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}  # the wheel's rl, not the checkout's
    code = ("import rl.ui, sys; assert rl.ui.__file__.startswith(sys.argv[1]), rl.ui.__file__; "
            "from rl.cli import main; raise SystemExit(main(['ui', sys.argv[2], '--port', '0']))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "site"), str(run)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "rl ui: serving 1 run(s) at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() else "")
        url = line.split(" at ", 1)[1].strip()
        base = url.split("/?")[0]
        token = url.split("token=", 1)[1]
        for path, file in (("/", "index.html"), ("/app.js", "app.js"), ("/vendor/uPlot.iife.min.js", "vendor/uPlot.iife.min.js")):
            with urllib.request.urlopen(f"{base}{path}?token={token}", timeout=10) as r:
                body = r.read()
            with open(os.path.join(ROOT, "rl", "ui", "static", file), "rb") as f:
                assert r.status == 200 and body == f.read(), path
        with urllib.request.urlopen(f"{base}/api/runs?token={token}", timeout=10) as r:
            assert b'"steps": 300' in r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
