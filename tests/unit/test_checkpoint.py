"""Resume building blocks without a model: checkpoint directories, dispatcher and stream state, store
rollback, recipe compatibility, the signal guard."""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from rewards.arithmetic import ArithmeticTask
from rewards.config import ArithmeticConfig
from rl.checkpoint.format import CheckpointError, CheckpointManager, save_tree
from rl.dispatch import DispatchConfig, Dispatcher, FinishedMeta
from rl.algo.resume import check_resumable
from rl.checkpoint.preempt import PreemptionGuard
from rl.recipe_io import recipe_from_yaml, recipe_to_yaml
from rl.store.trajectories import TrajectoryStore, Watermark
from rl.algo.streams import Cursor
from rl.types import Prompt
from tests.unit.test_store import make_sample


def _write(mgr: CheckpointManager, step: int, payload: bytes = b"weights", stage_end: dict | None = None) -> object:
    """A checkpoint with stand-in contents (what the manager itself reads: manifest, headers, records)."""
    tmp = mgr.begin(step)
    save_file({"w": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text("{}")
    save_tree({"torch_rng": torch.get_rng_state()}, tmp)
    return mgr.commit(tmp, step, {"global_step": step}, stage_end=stage_end)


def test_commit_renames_into_place_and_keeps_the_last_k(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, warn=lambda m: None)
    paths = [_write(mgr, s) for s in (4, 8, 12)]
    assert mgr.complete() == paths[1:] and not list(tmp_path.glob(".tmp-*"))
    assert mgr.latest() == paths[2] and mgr.controller_state(paths[2]) == {"global_step": 12}
    again = _write(mgr, 12)  # same step twice (e.g. a SIGTERM right after a periodic one): never overwritten
    assert again != paths[2] and mgr.latest() == again
    third = _write(mgr, 12)  # the oldest of the step-12 ones was pruned: the next name must still be new
    assert mgr.complete() == [again, third]


def test_pruned_checkpoints_leave_their_weights_when_asked(tmp_path):
    """`checkpoint.keep_weights: N`: a pruned checkpoint's config.json and model.safetensors move (whole, byte for
    byte) to weights/<its name>/, a model directory teachers read, the newest N of them stay; the checkpoints
    themselves are pruned as before and stage-end ones are kept where they are."""
    weights = tmp_path / "weights"
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=1, warn=lambda m: None, keep_weights=weights,
                            weights_kept=2)
    marker = {"stage": 0, "type": "sft", "eval": {}}
    paths = [_write(mgr, 2, b"two"), _write(mgr, 4, b"four"), _write(mgr, 8, b"eight", stage_end=marker),
             _write(mgr, 12, b"twelve"), _write(mgr, 16, b"sixteen")]
    assert mgr.complete() == [paths[2], paths[4]]
    assert sorted(p.name for p in weights.iterdir()) == [paths[1].name, paths[3].name]  # the newest 2 of 3 pruned
    for path, payload in ((paths[1], b"four"), (paths[3], b"twelve")):
        kept = weights / path.name
        assert sorted(p.name for p in kept.iterdir()) == ["config.json", "model.safetensors"]
        assert bytes(load_file(str(kept / "model.safetensors"))["w"].numpy()) == payload
    target, warnings = tmp_path / "elsewhere", []  # a planted link at weights/: nothing is written through it
    target.mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "weights").symlink_to(target)
    linked = CheckpointManager(tmp_path / "linked" / "checkpoints", keep_last=1, warn=warnings.append,
                               keep_weights=tmp_path / "linked" / "weights", weights_kept=2)
    _write(linked, 4), _write(linked, 8)
    assert not list(target.iterdir()) and len(linked.complete()) == 1 and "are not kept" in warnings[0]
    plain = CheckpointManager(tmp_path / "other", keep_last=1, warn=lambda m: None)
    _write(plain, 4), _write(plain, 8)
    assert not (tmp_path / "other" / "weights").exists() and len(plain.complete()) == 1


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "drop_manifest", "drop_file"])
def test_a_damaged_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    warnings = []
    mgr = CheckpointManager(tmp_path, keep_last=3, warn=warnings.append)
    good, bad = _write(mgr, 4, b"a" * 100), _write(mgr, 8, b"b" * 100)
    f = bad / "model.safetensors"
    if damage == "flip_byte":
        f.write_bytes(b"b" * 99 + b"c")
    elif damage == "truncate":
        f.write_bytes(b"b" * 50)
    elif damage == "drop_manifest":
        (bad / "MANIFEST.json").unlink()
    else:
        f.unlink()
    assert mgr.latest() == good
    assert len(warnings) == 1 and str(bad) in warnings[0]


def test_an_interrupted_write_is_not_a_checkpoint_and_is_cleaned_up(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3, warn=lambda m: None)
    good = _write(mgr, 4)
    tmp = mgr.begin(8)  # killed before commit
    (tmp / "model.safetensors").write_bytes(b"half")
    assert mgr.latest() == good
    _write(mgr, 8)
    assert not tmp.exists()


def _drive(d: Dispatcher, events: int) -> list:
    """A fixed script of dispatch / finish / train events; returns what the dispatcher decided."""
    log, open_samples = [], []
    for i in range(events):
        for t in d.dispatch():
            log.append(("release", t))
            open_samples += [(t, j) for j in range(t.group_size)]
        if open_samples:
            t, j = open_samples.pop((7 * i) % len(open_samples))
            d.on_finished(FinishedMeta(f"{t.prompt_id}-{j}", t.prompt_id, 5 + i % 3, t.version))
        batch = d.take_batch([], lambda pid: (10, 0))
        if batch:
            log.append(("batch", batch))
            d.on_train_step()
    return log


def test_dispatcher_state_round_trip_continues_identically():
    cfg = DispatchConfig(policy="sample", max_inflight=12, mixture={"a": 1.0, "b": 3.0}, dataset_max_inflight={"a": 8},
                         warmup_discard={"steps": 1, "min_response_tokens": 6})
    make = lambda: Dispatcher(cfg, datasets=["a", "b"], group_size=4, prompts_per_step=2, seed=7)
    original = make()
    _drive(original, 30)
    snapshot = original.state_dict()
    restored = make()
    restored.load_state_dict(snapshot)
    expected = _drive(original, 40)
    assert _drive(restored, 40) == expected
    fresh = make()  # without the snapshot the continuation differs (the script would catch a no-op restore)
    assert _drive(fresh, 40) != expected


def test_dispatcher_snapshot_is_a_copy():
    d = Dispatcher(DispatchConfig(max_inflight=8), datasets=["a"], group_size=4, prompts_per_step=1)
    snap = d.state_dict()
    d.dispatch()
    assert snap["inflight"] == {} and d.total_inflight == 8


def test_cursor_skip_reproduces_the_stream():
    task = ArithmeticTask(ArithmeticConfig(name="arith", max_digits=3, num_heldout=8))
    a = Cursor(task, seed_offset=5)
    drawn = [next(a) for _ in range(9)]
    b = Cursor(task, seed_offset=5)
    b.skip_to(4)
    assert [next(b) for _ in range(5)] == drawn[4:] and b.drawn == a.drawn == 9
    with pytest.raises(ValueError, match="rewind"):
        b.skip_to(3)


def test_store_rollback_undoes_work_after_the_watermark(tmp_path):
    store = TrajectoryStore.for_run_dir(tmp_path / "run")
    store.add_prompts([Prompt("p0", "arith", "q", (1,), "a", 2, 0)])
    store.add_samples([make_sample("s0", prompt_id="p0"), make_sample("s1", prompt_id="p0")])
    store.mark_trained(["s0"], 1)
    store.set_outcome(["p0"], "trained")
    store.add_train_step(1, {"rl/loss": 0.5})
    wm = store.watermark(1)
    # after the checkpoint: a new prompt and sample, a train step consuming s1, an outcome change
    store.add_prompts([Prompt("p1", "arith", "q", (1,), "a", 2, 1)])
    store.add_samples([make_sample("s2", prompt_id="p1")])
    store.mark_trained(["s1"], 2)
    store.add_train_step(2, {"rl/loss": 0.25})
    store.set_outcome(["p0"], "dropped_stage_end")
    counts = store.rollback_to(wm, checkpoint="ckpt")
    assert counts == {"samples_regenerated": 1, "prompts_redispatched": 1, "samples_untrained": 1,
                      "train_steps_rolled_back": 1}
    assert store.get_sample("s2") is None and store.sample_train_step("s1") is None and store.sample_train_step("s0") == 1
    assert store.train_step_metrics(2) is None and store.train_step_metrics(1) == {"rl/loss": 0.5}
    assert store.restarts()[0]["train_step"] == 1
    audit = store.audit()
    assert audit == {"trained_twice": 0, "trained": 1, "link_mismatch": 0, "prompts": 1, "prompts_open": 0}
    # the redone work reuses the same ids, and s1 can now be trained (once) again
    store.add_prompts([Prompt("p1", "arith", "q", (1,), "a", 2, 1)])
    store.add_samples([make_sample("s2", prompt_id="p1")])
    store.mark_trained(["s1"], 2)
    assert store.audit()["trained_twice"] == 0
    store.close()


def test_store_audit_sees_a_sample_trained_by_two_steps(tmp_path):
    store = TrajectoryStore.for_run_dir(tmp_path / "run")
    store.add_samples([make_sample("s0")])
    store.mark_trained(["s0"], 1)
    store.rollback_to(Watermark(store.watermark(1).seq, 0), checkpoint="")  # forgets step 1 ...
    store.mark_trained(["s0"], 1)
    with store._engine.begin() as c:  # ... then a bug re-links it without a rollback
        from sqlalchemy import text
        c.execute(text("INSERT INTO trained (run_id, sample_id, step) VALUES (:run, 's0', 3)"), {"run": store.run_id})
    assert store.audit()["trained_twice"] == 1
    store.close()


def minimal_recipe_dict() -> dict:
    return {"datasets": [{"type": "arithmetic", "name": "arith", "num_heldout": 8}],
            "stages": [{"type": "sft", "max_steps": 10}], "model": {}}


def test_resume_compatibility():
    base = recipe_from_yaml(recipe_to_yaml(recipe_from_yaml(_yaml(minimal_recipe_dict()))))
    changed = minimal_recipe_dict()
    changed["stages"][0]["max_steps"] = 999  # budget: compatible
    changed["logging"] = {"wandb": False}
    check_resumable(base, recipe_from_yaml(_yaml(changed)))
    changed["stages"][0]["datasets"] = ["arith"]  # the same datasets, named: compatible
    changed["eval"] = {"datasets": ["arith"]}
    check_resumable(base, recipe_from_yaml(_yaml(changed)))
    two = minimal_recipe_dict()
    two["datasets"].append({"type": "arithmetic", "name": "big", "max_digits": 5, "num_heldout": 8})
    saved, narrowed = recipe_from_yaml(_yaml(two)), dict(two, stages=[{"type": "sft", "max_steps": 10, "datasets": ["big"]}])
    with pytest.raises(CheckpointError, match=re.escape("stages.0.datasets (['arith', 'big'] -> ['big'])")):
        check_resumable(saved, recipe_from_yaml(_yaml(narrowed)))
    changed["model"] = dict(changed.get("model", {}), hidden_size=32, head_dim=8)
    with pytest.raises(CheckpointError, match=r"model\.(head_dim|hidden_size)"):
        check_resumable(base, recipe_from_yaml(_yaml(changed)))


def _yaml(d: dict) -> str:
    import yaml

    return yaml.safe_dump(d)


def test_first_signal_requests_a_checkpoint_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.signal_time is not None
    assert signal.getsignal(signal.SIGTERM) == before
