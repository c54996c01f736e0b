"""Checkpoint format 2 without a training run: every controller record round-trips through JSON, the
tensor tree and the trainer state round-trip through safetensors, old formats are refused (not skipped),
damaged or crafted files are skipped, stage-end checkpoints survive pruning, serialised rollout states
are decoded without running anything."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from rewards.arithmetic import ArithmeticTask
from rewards.config import ArithmeticConfig, ReverseConfig
from rewards.longtail import LongTailConfig
from rl.algo import records as rec
from rl import metrics, reconfigure
from rl.metrics import RolloutClock
from rl.checkpoint.format import CheckpointError, CheckpointManager, flatten_tree, load_tree, save_tree, unflatten_tree
from rl.config import Recipe
from rl.dispatch import DispatchConfig, Dispatcher
from rl.algo.resume import find_resume_point
from rl.recipe_io import recipe_from_yaml
from rl.store.trajectories import TrajectoryStore, Watermark
from rl.types import Prompt
from rl.runtime.worker import PolicyWorker
from rl.train.trainer import TrainBatch, merge_step_metrics
from rollout.types import GenerationRequest, RolloutState
from teachers.config import TeacherSpec
from tests.unit.test_checkpoint import _drive, _write, _yaml, minimal_recipe_dict
from tests.unit.test_store import make_sample

ROOT = Path(__file__).resolve().parents[2]


def _json(x):
    """What a record becomes after a trip through controller.json."""
    return json.loads(json.dumps(x))


def _problems():
    tasks = [ArithmeticTask(ArithmeticConfig(name="arith", max_digits=3, num_heldout=8)),
             ReverseConfig(name="rev", num_heldout=8, max_len=4).build(),
             LongTailConfig(name="tail").build()]
    return [next(iter(t.train_stream(seed_offset=3))) for t in tasks]


def _live() -> reconfigure.LiveConfig:
    live = reconfigure.LiveConfig(version=0, mixture={"a": 1.0}, caps={"b": 8}, assignment={"a": "t1"},
                                  teachers={"t1": TeacherSpec(name="t1", checkpoint=Path("/ckpts/t1"), datasets=["a"])})
    return reconfigure.apply_patch(live, reconfigure.ReconfigPatch(mixture={"b": 2.5}, dataset_max_inflight={"b": None}),
                                   ["a", "b"], None, train_step=7)


def _dispatcher() -> Dispatcher:
    cfg = DispatchConfig(policy="sample", max_inflight=12, mixture={"a": 1.0, "b": 3.0}, dataset_max_inflight={"a": 8},
                         warmup_discard={"steps": 1, "min_response_tokens": 6})
    return Dispatcher(cfg, datasets=["a", "b"], group_size=4, prompts_per_step=2, seed=7)


def _async_state() -> dict:
    disp = _dispatcher()
    _drive(disp, 30)
    problem = _problems()[0]
    prompt = Prompt("s1-p0000003", "a", problem.prompt, (1, 5, 9), problem.answer, 4, 2, config_version=1)
    clock = RolloutClock(concurrency=[1.5, 2.25], interrupt_s=[0.01], interrupt_late_steps=[0, 2], rollout_s=1.25,
                         train_s=0.5, generated_tokens=10, bytes_moved=1024)
    return {"dispatcher": disp.state_dict(), "streams": {"a": 5, "b": 2}, "prompts": {prompt.prompt_id: (prompt, problem)},
            "finished": {prompt.prompt_id: [f"{prompt.prompt_id}-0"]}, "effort_of": {"x-0": 25, "x-1": None},
            "clock": clock, "step": 3, "live": _live(), "teacher_of": {prompt.prompt_id: "t1"}}


# -- records ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(3))
def test_problem_record_round_trip(i):
    problem = _problems()[i]
    assert rec.problem_from_record(_json(rec.problem_to_record(problem))) == problem


def test_small_records_round_trip():
    prompt = Prompt("p1", "arith", "1+2=", (1, 2, 3), "3", 4, 5, config_version=2)
    back = rec.prompt_from_record(_json(rec.prompt_to_record(prompt)))
    assert back == prompt and isinstance(back.tokens, tuple)
    clock = _async_state()["clock"]
    assert rec.clock_from_record(_json(rec.clock_to_record(clock))) == clock
    live = _live()
    assert live.history and rec.live_config_from_record(_json(rec.live_config_to_record(live))) == live
    assert rec.watermark_from_record(_json(rec.watermark_to_record(Watermark(41, 7)))) == Watermark(41, 7)
    rng = random.Random(3)
    rng.random()
    restored = random.Random(0)
    restored.setstate(rec.random_state_from_record(_json(rec.random_state_to_record(rng.getstate()))))
    assert [restored.random() for _ in range(5)] == [rng.random() for _ in range(5)]


def test_clock_keeps_a_window_of_calls_and_the_whole_stage_mean(monkeypatch):
    """RolloutClock.concurrency keeps the last CONCURRENCY_WINDOW calls (it grew by one a call for the whole stage,
    into every checkpoint); concurrency_mean still covers every call, also after a checkpoint's round trip. A clock
    written before the window (no concurrency_sum / concurrency_calls) takes them from its whole list."""
    monkeypatch.setattr(metrics, "CONCURRENCY_WINDOW", 4)
    clock = RolloutClock()
    for x in range(1, 12):
        clock.add_concurrency(float(x))
    assert 4 <= len(clock.concurrency) < 8 and clock.concurrency[-1] == 11.0
    assert clock.concurrency_mean == 6.0 and clock.concurrency_calls == 11
    back = rec.clock_from_record(_json(rec.clock_to_record(clock)))
    assert back == clock and back.concurrency_mean == 6.0
    old = {k: v for k, v in rec.clock_to_record(_async_state()["clock"]).items()
           if k not in ("concurrency_sum", "concurrency_calls")}
    restored = rec.clock_from_record(_json(old))
    assert (restored.concurrency_sum, restored.concurrency_calls, restored.concurrency_mean) == (3.75, 2, 1.875)


def test_record_with_an_unexpected_or_missing_field_is_refused():
    record = rec.prompt_to_record(Prompt("p1", "arith", "1+2=", (1,), "3", 4, 5))
    with pytest.raises(ValueError, match="unexpected fields"):
        rec.prompt_from_record(dict(record, colour="red"))
    with pytest.raises(TypeError):
        rec.prompt_from_record({k: v for k, v in record.items() if k != "answer"})


def test_dispatcher_record_through_json_continues_identically():
    original = _dispatcher()
    _drive(original, 30)
    restored = _dispatcher()
    restored.load_state_dict(_json(original.state_dict()))
    expected = _drive(original, 40)
    assert _drive(restored, 40) == expected


def test_sft_and_async_loop_records_round_trip():
    rng = random.Random("sft")
    rng.random()
    sft = {"step": 3, "drawn": 48, "rng": rng.getstate()}
    assert rec.sft_state_from_record(_json(rec.sft_state_to_record(sft))) == sft
    state = _async_state()
    assert rec.async_state_from_record(_json(rec.async_state_to_record(state))) == state


def _driver(stage_type: str = "grpo") -> dict:
    return {"stage_idx": 1, "stage_type": stage_type, "global_step": 12, "stage_minutes": 0.75,
            "summary": {"sft_acc": 0.5}, "recipe_yaml": "run: {}\n", "num_workers": 2, "watermark": Watermark(99, 12),
            "stage_end": {"stage": 1, "type": stage_type, "eval": {"eval/accuracy": 0.25}}}


def test_controller_record_round_trips_and_names_no_class():
    state = _async_state()
    text = json.dumps(rec.controller_to_record(_driver(), state))
    parsed = rec.controller_from_record(json.loads(text))
    assert parsed == dict(_driver(), stage_state=state)
    # nothing in the file names a class or a module: renaming either cannot break a resume
    for name in ("Ticket", "FinishedMeta", "_Group", "DispatchStats", "RolloutClock", "LiveConfig", "TeacherSpec",
                 "Prompt", "Problem", "Watermark", "Dispatcher", "rl.", "rewards.", "teachers."):
        assert name not in text


def test_malformed_controller_record_is_one_line():
    record = rec.controller_to_record(_driver(), _async_state())
    record["stage"]["dispatcher"]["open"] = [{"ticket": {"prompt_id": "x"}}]
    with pytest.raises(CheckpointError, match="^controller.json: malformed record") as e:
        rec.controller_from_record(record)
    assert "\n" not in str(e.value)


def test_a_controller_record_must_be_plain(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match="tuple"):
        mgr.commit(mgr.begin(1), 1, {"rng": (1, 2)})


# -- tensor trees and the trainer state -----------------------------------------------------------------------
def test_tensor_tree_round_trip_keeps_int_keys_tuples_and_dtypes(tmp_path):
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}, 7: {"m": torch.zeros(0)}},
            "groups": [{"betas": (0.9, 0.99), "params": [0, 7], "fused": None, "name": "g", "flag": True}],
            "rng": torch.get_rng_state(), "half": torch.ones(3, dtype=torch.bfloat16)}
    save_tree(tree, tmp_path)
    back = load_tree(tmp_path)
    assert list(back["state"]) == [0, 7] and back["groups"] == tree["groups"]
    assert isinstance(back["groups"][0]["betas"], tuple)
    for a, b in ((back["state"][0]["step"], tree["state"][0]["step"]), (back["rng"], tree["rng"]), (back["half"], tree["half"])):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(TypeError, match="cannot store"):
        flatten_tree({"x": object()})
    with pytest.raises(ValueError, match="no tensor"):
        unflatten_tree({"tensor": "t9"}, {})


def test_trainer_state_round_trip(tmp_path):
    """AdamW moments, the LR schedule (warm-up) and the torch RNG come back exactly: the next step and
    the next random draw equal those of the run that never stopped."""
    recipe = Recipe.model_validate({
        "run": {"name": "t", "seed": 0},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
        "datasets": [{"type": "arithmetic"}], "engine": {"max_batch_size": 8, "max_seq_len": 64, "max_new_tokens": 8},
        "runtime": {"ray": False}, "stages": [{"type": "sft", "optim": {"lr": 1e-2, "warmup_steps": 5}}]})
    batch = TrainBatch([[1, 20, 30], [1, 21, 31, 41]], [[5, 6, 2], [7, 2]], 5.0)
    stage = recipe.stages[0]

    def sft_loss(worker) -> float:
        return merge_step_metrics([worker.train_step(batch, stage)])["sft/loss"]

    w = PolicyWorker(recipe)
    w.begin_stage(recipe.stages[0])
    for _ in range(3):
        sft_loss(w)
    w.save(str(tmp_path))
    saved = {i: {k: v.clone() for k, v in s.items()} for i, s in w.trainer.opt.state_dict()["state"].items()}
    expected_draw = torch.rand(4)
    expected_loss = sft_loss(w)
    expected_lr = w.trainer.sched.get_last_lr()
    expected_weights = [t.detach().clone() for t in w.model.parameters()]  # after an update that uses the moments

    w2 = PolicyWorker(recipe)  # reseeds torch: the RNG must come from the checkpoint
    w2.begin_stage(recipe.stages[0])
    w2.load(str(tmp_path))
    state = w2.trainer.opt.state_dict()["state"]
    assert state.keys() == saved.keys() and all(torch.equal(state[i][k], saved[i][k]) for i in saved for k in saved[i])
    assert w2.trainer.sched.last_epoch == 3
    assert torch.equal(torch.rand(4), expected_draw)
    assert sft_loss(w2) == expected_loss
    assert w2.trainer.sched.get_last_lr() == expected_lr
    assert all(torch.equal(a, b) for a, b in zip(w2.model.parameters(), expected_weights))


# -- the manager: formats, damage, pruning, the finder ----------------------------------------------------------
def _old_format(path: Path, manifest: bool = True) -> None:
    """A checkpoint as the format-1 code wrote it: controller.pkl (content never read) and a format-1 manifest."""
    path.mkdir(parents=True)
    (path / "controller.pkl").write_bytes(b"\x80\x05N.")
    (path / "model.safetensors").write_bytes(b"w")
    if manifest:
        (path / "MANIFEST.json").write_text(json.dumps({"format": 1, "global_step": 12, "files": {}}))


@pytest.mark.parametrize("manifest", [True, False])
def test_a_format_1_checkpoint_is_refused_with_one_line_not_skipped(tmp_path, manifest):
    mgr = CheckpointManager(tmp_path, warn=lambda m: None)
    _write(mgr, 4)  # an older, valid checkpoint must not be fallen back to
    old = tmp_path / "step-00000012-000"
    _old_format(old, manifest)
    with pytest.raises(CheckpointError) as e:
        mgr.latest()
    assert str(e.value) == (f"checkpoint {old} has format 1 (pickled controller state, written before format 2); "
                            f"this asyncrl reads format 2: start a new run directory")


def test_a_newer_format_is_refused(tmp_path):
    path = _write(CheckpointManager(tmp_path), 4)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    (path / "MANIFEST.json").write_text(json.dumps(dict(manifest, format=3)))
    with pytest.raises(CheckpointError, match="has format 3 .written by a newer asyncrl.; this asyncrl reads format 2"):
        CheckpointManager(tmp_path).latest()


@pytest.mark.parametrize("name", ["controller.json", "trainer.json", "trainer.safetensors", "config.json"])
def test_damage_to_a_file_other_than_the_weights_skips_the_checkpoint(tmp_path, name):
    warnings = []
    mgr = CheckpointManager(tmp_path, warn=warnings.append)
    good, bad = _write(mgr, 4), _write(mgr, 8)
    data = bytearray((bad / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / name).write_bytes(bytes(data))
    assert mgr.latest() == good
    assert warnings == [f"warning: skipping checkpoint {bad}: {name} does not match its digest"]


def test_a_crafted_file_under_a_rewritten_manifest_is_skipped(tmp_path):
    """An attacker who also rewrites the digests gets a checkpoint that is skipped, never loaded."""
    warnings = []
    mgr = CheckpointManager(tmp_path, warn=warnings.append)
    good, bad = _write(mgr, 4), _write(mgr, 8)
    (bad / "trainer.safetensors").write_bytes(b"\x80\x05 not a safetensors file")
    manifest = json.loads((bad / "MANIFEST.json").read_text())
    from model.checkpoint import file_digest

    p = bad / "trainer.safetensors"
    manifest["files"][p.name] = {"bytes": p.stat().st_size, "blake2b": file_digest(p)}
    (bad / "MANIFEST.json").write_text(json.dumps(manifest))
    assert mgr.latest() == good and "unreadable" in warnings[0]


@pytest.mark.parametrize("entry", ["link", "../escape", ".hidden"])
def test_a_manifest_entry_that_is_a_link_or_leaves_the_directory_skips_the_checkpoint(tmp_path, entry):
    """Files are read only from inside the checkpoint: a symbolic link (even with matching digests) or a name
    with a path is refused, so nothing outside the run directory is ever read as part of a checkpoint."""
    warnings = []
    mgr = CheckpointManager(tmp_path, warn=warnings.append)
    good, bad = _write(mgr, 4), _write(mgr, 8)
    manifest = json.loads((bad / "MANIFEST.json").read_text())
    if entry == "link":
        outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
        outside.write_bytes((bad / "controller.json").read_bytes())
        (bad / "controller.json").unlink()
        (bad / "controller.json").symlink_to(outside)
    else:
        manifest["files"][entry] = manifest["files"]["controller.json"]
    (bad / "MANIFEST.json").write_text(json.dumps(manifest))
    assert mgr.latest() == good
    assert warnings[0].endswith("controller.json is a symbolic link" if entry == "link" else f"bad entry {entry!r}")


def test_stage_end_checkpoints_survive_pruning(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, warn=lambda m: None)
    marker = lambda i: {"stage": i, "type": "sft", "eval": {"eval/accuracy": 0.5}}
    paths = {4: _write(mgr, 4, stage_end=marker(0)), 8: _write(mgr, 8), 12: _write(mgr, 12, stage_end=marker(1))}
    paths.update({s: _write(mgr, s) for s in (16, 20, 24)})
    assert mgr.complete() == [paths[4], paths[12], paths[20], paths[24]]
    assert mgr.latest() == paths[24] and mgr.latest(stage_end_only=True) == paths[12]
    assert mgr.stage_end(paths[12]) == marker(1) and mgr.stage_end(paths[24]) is None
    assert not list(tmp_path.glob(".tmp-*"))


def test_only_listed_inflight_files_are_read(tmp_path):
    mgr = CheckpointManager(tmp_path)
    tmp = mgr.begin(4)
    for rank in (0, 1):
        (tmp / f"inflight-w{rank}.msgpack").write_bytes(msgpack.packb([]))
    save_file({"w": torch.zeros(1)}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text("{}")
    save_tree({}, tmp)
    path = mgr.commit(tmp, 4, {})
    (path / "inflight-w2.msgpack").write_bytes(b"planted")
    assert mgr.latest() == path and mgr.inflight_files(path) == [path / "inflight-w0.msgpack", path / "inflight-w1.msgpack"]


def test_resume_refuses_to_start_over_when_no_checkpoint_is_usable(tmp_path):
    run = tmp_path / "run"
    store = TrajectoryStore.for_run_dir(run)
    store.add_samples([make_sample("s0"), make_sample("s1")])
    mgr = CheckpointManager(run / "checkpoints", warn=lambda m: None)
    bad = _write(mgr, 4)
    (bad / "controller.json").write_text("{}")
    recipe = recipe_from_yaml(_yaml(minimal_recipe_dict()))
    with pytest.raises(CheckpointError, match=r"^none of the 1 checkpoints under .* is usable"):
        find_resume_point(recipe, store, mgr, say=lambda m: None)
    assert store.get_sample("s0") is not None and store.restarts() == []  # the store was not rolled back
    empty = CheckpointManager(tmp_path / "never", warn=lambda m: None)  # no checkpoint ever written: start over
    assert find_resume_point(recipe, store, empty, say=lambda m: None) is None
    store.close()


# -- serialised rollout states (seed §5.2.3) -------------------------------------------------------------------
def _state_bytes() -> bytes:
    return RolloutState(GenerationRequest("s0", (1, 2), 4, seed=3), tokens=[1, 2, 5], logprobs=[-0.5], policy_versions=[0],
                        k=torch.randn(2, 2, 1, 4), v=torch.randn(2, 2, 1, 4)).to_bytes()


def _with_header(data: bytes, change) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = msgpack.unpackb(data[8 : 8 + n])
    change(header)
    head = msgpack.packb(header)
    return len(head).to_bytes(8, "little") + head + data[8 + n :]


@pytest.mark.parametrize("change, error", [
    (lambda h: h["tensors"]["k"].__setitem__(0, "load"), "KeyError"),  # a dtype name is never looked up on torch
    (lambda h: h.__setitem__("tokens", msgpack.ExtType(1, b"x")), "extension type"),
    (lambda h: h.__setitem__("format", 99), "format 99"),
    (lambda h: h["tensors"]["k"].__setitem__(1, [2, 2000, 1, 4]), "runs past the end"),
    (lambda h: h["request"].__setitem__("callback", "os.system"), "unexpected keyword"),
    (lambda h: h.__setitem__("workdir", {"archive": "not bytes"}), "workdir is neither"),
    (lambda h: h.__setitem__("workdir", {"archive": b"", "lost": "both"}), "workdir is neither"),
])
def test_rollout_state_decoding_refuses_anything_but_its_own_layout(change, error):
    data = _state_bytes()
    assert RolloutState.from_bytes(data).tokens == [1, 2, 5]
    with pytest.raises(ValueError, match=error):
        RolloutState.from_bytes(_with_header(data, change))
    with pytest.raises(ValueError, match="truncated"):
        RolloutState.from_bytes(data[:5])


@pytest.mark.parametrize("workdir", [None, {"archive": b"\x1f\x8b tar.gz bytes"}, {"lost": "snapshot: too big"}])
def test_a_samples_sandbox_work_directory_travels_in_its_state(workdir):
    """Multi-turn samples keep their sandbox files across a preemption in the state itself (rl/runtime/tool_turns.py)."""
    st = RolloutState.from_bytes(_state_bytes())
    st.workdir = workdir
    assert RolloutState.from_bytes(st.to_bytes()).workdir == workdir


def test_deeply_nested_msgpack_is_refused_before_it_is_built():
    from rollout.types import unpack_plain

    with pytest.raises(ValueError, match="StackError"):  # 200,000 nested arrays: msgpack's own depth limit
        unpack_plain(b"\x91" * 200_000 + b"\xc0")
    data = b"\x91" * 200_000 + b"\xc0"
    with pytest.raises(ValueError, match="StackError"):
        RolloutState.from_bytes(len(data).to_bytes(8, "little") + data)


def test_no_pickle_or_torch_load_in_the_code_base():
    """Loading never unpickles (issue #12): no pickle, torch.load or torch.distributed.checkpoint anywhere
    but in the tests that plant a poisoned pickle on purpose, and in rewards/supervised.py, whose child process
    unpickles only what its own parent (the job) sent it over a private pipe, as multiprocessing does; its replies
    to the job are JSON, checked and never unpickled."""
    trusted_pipe = ROOT / "rewards" / "supervised.py"
    pattern = re.compile(r"\bimport pickle\b|\bpickle\.load|torch\.load\(|distributed\.checkpoint|weights_only=False")
    offenders = [str(p.relative_to(ROOT)) for d in ("model", "rollout", "rewards", "teachers", "rl", "bench", "tests")
                 for p in (ROOT / d).rglob("*.py") if p.name != "test_resume.py" and p not in (Path(__file__), trusted_pipe)
                 and pattern.search(p.read_text())]
    assert offenders == []
