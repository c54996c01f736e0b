"""The sandbox server's own files and its bound on received frames, without sandboxes: records in its state
directory written atomically and never through a symlink, damaged ones refused by the reader (the server
skips them), the work directory's caps as limits, and the byte budget all connections' partly received
frames share. tests/integration/test_sandbox_hostile.py runs the same through a real server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandbox_client.protocol import FrameBudget, ProtocolError, encode, read_frame
from sandbox_client.records import Limits
from sandbox_client.server import SandboxServer
from sandbox_client.statefiles import DamagedRecord, read_live_record, write_atomic

CGROUP_PARENT = "asyncrl-sandboxes-0000abcd"


@pytest.fixture
def state():
    """A state directory sandbox uids could traverse to (pytest's tmp_path is 0700; a root server checks)."""
    d = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-state-"))
    d.chmod(0o711)
    yield d / "state"
    shutil.rmtree(d, ignore_errors=True)


def test_limits_cap_the_work_directory_in_bytes_and_files():
    assert Limits().disk_mib == 128 and Limits().disk_inodes == 16384
    for bad in [{"disk_mib": 0}, {"disk_inodes": 1}, {"disk_inodes": 1 << 30}]:
        with pytest.raises(ValidationError):
            Limits(**bad)


def test_a_record_replaces_a_planted_symlink_and_leaves_no_temp_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("host file\n")
    (tmp_path / "live").mkdir()
    record = tmp_path / "live" / "sb-00000000000a.json"
    record.symlink_to(victim)
    write_atomic(record, b'{"id": 1}')
    assert victim.read_text() == "host file\n"
    assert not record.is_symlink() and record.read_bytes() == b'{"id": 1}'
    assert record.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in record.parent.iterdir()) == [record.name]


def test_state_dirs_never_write_through_planted_symlinks(state):
    victim = state.parent / "victim"
    victim.write_text("host file\n")
    (state / "etc").mkdir(parents=True)
    for name in ("passwd", "group"):
        (state / "etc" / name).symlink_to(victim)
    SandboxServer(state, state.parent / "s.sock")._make_state_dirs()
    assert victim.read_text() == "host file\n"
    assert (state / "etc" / "passwd").read_text().startswith("sandbox:x:65534:")


def _record(state: Path, name: str, body: bytes | dict) -> Path:
    (state / "live").mkdir(parents=True, exist_ok=True)
    path = state / "live" / name
    path.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    return path


def _read(state: Path, path: Path):
    return read_live_record(path, work_area=state / "work", cgroup_parent=CGROUP_PARENT)


def test_a_sound_record_reads_back(state):
    sid = "sb-0123456789ab"
    cgroup = f"/sys/fs/cgroup/job/{CGROUP_PARENT}/{sid}"
    rec = _read(state, _record(state, f"{sid}.json", {"id": sid, "uid": 2_000_005, "work": str(state / "work" / sid),
                                                    "cgroups": [cgroup]}))
    assert (rec.id, rec.uid, rec.work, rec.cgroups) == (sid, 2_000_005, state / "work" / sid, (Path(cgroup),))


SID = "sb-00000000000a"
GOOD = {"id": SID, "uid": 2_000_001, "cgroups": []}


@pytest.mark.parametrize("body, why", [
    (b'{"id": "sb-00000000000a", "uid": 20', "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "not a record"),
    ({**GOOD, "id": "sb-00000000000b"}, "id"),
    ({**GOOD, "uid": 0}, "uid"),
    ({**GOOD, "uid": "2000001"}, "uid"),
    ({**GOOD, "uid": True}, "uid"),
    ({**GOOD, "work": "/"}, "work"),
    ({**GOOD, "work": "WORK/.."}, "work"),
    ({**GOOD, "cgroups": ["/sys/fs/cgroup"]}, "cgroup"),
    ({**GOOD, "cgroups": [f"/sys/fs/cgroup/system.slice/{SID}"]}, "cgroup"),
    ({**GOOD, "cgroups": [f"/sys/fs/cgroup/{CGROUP_PARENT}/../{SID}"]}, "cgroup"),
    ({**GOOD, "cgroups": "/sys/fs/cgroup"}, "cgroup"),
    ({"id": SID}, "missing"),
])
def test_a_damaged_or_forged_record_is_refused(state, body, why):
    if isinstance(body, dict):
        body = {"work": str(state / "work" / SID), **body}
        if isinstance(body["work"], str) and body["work"].startswith("WORK"):
            body["work"] = str(state / "work") + body["work"][4:]
    with pytest.raises(DamagedRecord, match=why):
        _read(state, _record(state, f"{SID}.json", body))


def test_a_record_that_is_no_regular_file_is_refused_without_reading_it(state):
    (state / "live").mkdir(parents=True)
    fifo = state / "live" / "sb-00000000000a.json"
    os.mkfifo(fifo)  # opening it for reading would block forever
    with pytest.raises(DamagedRecord, match="not a regular file"):
        _read(state, fifo)
    link = state / "live" / "sb-00000000000b.json"
    link.symlink_to(state.parent)
    with pytest.raises(DamagedRecord, match="symlink"):
        _read(state, link)


def _partial_frame(size: int, sent: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", size) + b"\0" * sent)
    return reader


def test_partly_received_frames_share_one_budget():
    async def run():
        budget = FrameBudget(1000)
        first = asyncio.create_task(read_frame(_partial_frame(600, 10), budget=budget))
        await asyncio.sleep(0.01)
        assert budget.used == 600
        with pytest.raises(ProtocolError, match="budget"):
            await read_frame(_partial_frame(600, 10), budget=budget)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert budget.used == 0  # a connection that ends mid-frame gives its share back
        whole = asyncio.StreamReader()
        whole.feed_data(encode({"id": 1, "op": "info"}))
        assert await read_frame(whole, budget=budget) == {"id": 1, "op": "info"}
        assert budget.used == 0

    asyncio.run(run())


@pytest.mark.parametrize("plant", ["etc", "commands.jsonl", "state"])  # live/, server.lock: the same checks
def test_a_state_directory_with_planted_links_is_refused_in_one_line(state, plant):
    """Through the real `serve` command: a link (or a file) where the server keeps its own files stops the start
    with one line and exit 2, and the host file or directory it names is untouched."""
    victim_dir, victim = state.parent / "victim-dir", state.parent / "victim"
    victim_dir.mkdir(mode=0o700)
    victim.write_text("host file\n")
    if plant == "state":
        state.write_text("not a directory\n")
    else:
        state.mkdir()
        (state / plant).symlink_to(victim_dir if plant == "etc" else victim)
    proc = subprocess.run([sys.executable, "-m", "sandbox_client", "serve", "--socket", str(state.parent / "s.sock"),
                           "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "state directory" in proc.stderr or "is not a directory of uid" in proc.stderr
    assert victim.read_text() == "host file\n"
    assert list(victim_dir.iterdir()) == [] and victim_dir.stat().st_mode & 0o777 == 0o700
    assert not (state.parent / "s.sock").exists()
