"""Mutation testing of the control code (issue #12, item 11): does the test suite catch the bugs a developer
plausibly writes in dispatch, the store's rollback, checkpoints, resume, engine bookkeeping, the async loop,
the SFT stream, the trainer's micro-batch loop and live reconfiguration?

Each mutation below is one hand-made edit: an exact snippet of a control module (it must occur exactly once)
and its replacement, the bug it models in one line, and the tests that cover that code. For each one the
script copies the working tree (git-tracked and untracked-but-not-ignored files; the real tree is never
touched) to a scratch directory, applies the edit, checks that it applied and still compiles, and runs
`python -m pytest -x -q -p no:cacheprovider <tests>` there with a timeout. The mutant is *killed* when the
tests fail (or time out), *survives* when they pass. Before any mutant, the union of the covering tests runs
once on the unmutated copy; if it fails the script stops (a mutant is killed only by a real failure).

    python bench/mutants.py --quick            # the mutations with fast covering tests (a few minutes on CPU)
    python bench/mutants.py                    # all of them (adds ones covered only by slow integration tests)
    python bench/mutants.py --new              # only the mutations of the newer modules (issue #40, class 8)
    python bench/mutants.py --only disp-cap-ignores-group-size     # one (repeatable)
    python bench/mutants.py --list             # the table of mutations, nothing run

Mutants run one after another (on 2 cores, parallel torch processes only slow each other down). The child
processes import the scratch copy (PYTHONPATH), write no bytecode (a stale .pyc of the same size and second
could hide a mutation) and use OMP_WAIT_POLICY=PASSIVE (spinning OpenMP threads made torch tests up to 50x
slower while other jobs shared the two cores). Last line (`_new`: the mutations of the modules written since
this bench's first version, issue #40 class 8: loop normalisers, staleness masks, checkpoint records, explicit
checkpoint steps, loaders, verifiers, effort, tool turns, sandbox limits; `--new` runs only those):
RESULT mutants=<n> kill_rate=<r> mutants_new=<m> kill_rate_new=<q> killed=<k> survived=<ids> minutes=<t>
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DISPATCH, DISPATCH_RULES = "tests/unit/test_dispatch.py", "tests/unit/test_dispatch_rules.py"
STORE, ROLLBACK = "tests/unit/test_store.py", "tests/unit/test_store_rollback.py"
CKPT, CKPT_FORMAT, CKPT_RULES = "tests/unit/test_checkpoint.py", "tests/unit/test_checkpoint_format.py", "tests/unit/test_checkpoint_rules.py"
ENGINE, KV_POOL, WORKER = "tests/unit/test_engine.py", "tests/unit/test_kv_pool.py", "tests/unit/test_worker.py"
LOOP = "tests/integration/test_async_loop.py"
SFT, TRAINER, RECONF = "tests/unit/test_sft.py", "tests/unit/test_trainer.py", "tests/unit/test_reconfigure.py"
E2E, RAY_RUNTIME = "tests/integration/test_train_e2e.py", "tests/integration/test_async_runtime.py"


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    """Exact text; must occur exactly once in `file`."""
    replacement: str
    bug: str
    """The developer's mistake this models, in one line."""
    tests: tuple[str, ...]
    """Test files or node ids that cover the mutated code (run in the scratch copy)."""
    quick: bool = True
    """Part of `--quick` (its covering tests are fast)."""
    new: bool = False
    """Of the modules written since this bench's first version (issue #40, class 8): reported apart."""


M = Mutant


def N(*args, **kwargs) -> Mutant:
    """A mutant of the newer modules (`Mutant.new`)."""
    return Mutant(*args, **kwargs, new=True)


MUTANTS: list[Mutant] = [
    # -- rl/dispatch.py: policies, caps, off-policy bounds, warm-up discard, its checkpoint record ------------
    M("disp-sample-credit-off-by-one", "rl/dispatch.py",
      "return self.credit >= group_size and total_inflight", "return self.credit > group_size and total_inflight",
      "sample policy waits for one credit more than the group size", (DISPATCH,)),
    M("disp-sample-credit-never-returned", "rl/dispatch.py",
      "def on_sample_finished(self) -> None:\n        self.credit += 1",
      "def on_sample_done(self) -> None:\n        self.credit += 1",
      "the credit hook is misnamed, so finished samples never give credit back", (DISPATCH,)),
    M("disp-prompt-credit-per-sample", "rl/dispatch.py",
      "def on_group_complete(self) -> None:\n        self.credit += 1",
      "def on_sample_finished(self) -> None:\n        self.credit += 1",
      "prompt policy refills on every finished sample instead of every whole group", (DISPATCH,)),
    M("disp-batch-remainder-floor", "rl/dispatch.py",
      "self.batches_owed += -(-(budget - released) // self.prompts_per_step)",
      "self.batches_owed += (budget - released) // self.prompts_per_step",
      "batch policy rounds the unreleased part of a capped batch down: the rest is never released", (DISPATCH, DISPATCH_RULES)),
    M("disp-sync-overlaps-ready-batch", "rl/dispatch.py",
      "d.total_inflight or d.num_open_groups or d.num_ready_groups else", "d.total_inflight or d.num_open_groups else",
      "sync policy releases the next batch while the last one is still untrained", (DISPATCH,)),
    M("disp-cap-skip-counted-always", "rl/dispatch.py",
      "        if capped:\n            self.stats.cap_skips += 1\n", "        self.stats.cap_skips += 1\n",
      "every draw is counted as a cap skip, capped or not", (DISPATCH, DISPATCH_RULES)),
    M("disp-cap-off-by-one", "rl/dispatch.py",
      "self.inflight[d] + self._group_size(d) <= cap", "self.inflight[d] + self._group_size(d) < cap",
      "a dataset may never reach its cap exactly", (DISPATCH, DISPATCH_RULES)),
    M("disp-cap-ignores-group-size", "rl/dispatch.py",
      "self.inflight[d] + self._group_size(d) <= cap", "self.inflight[d] < cap",
      "the cap checks in-flight samples before adding the new group: a cap not a multiple of G is exceeded",
      (DISPATCH, DISPATCH_RULES)),
    M("disp-blocked-draw-forgotten", "rl/dispatch.py",
      "                self._pending_draw = d\n                break", "                break",
      "a drawn but not admitted prompt is redrawn, so large groups starve behind small ones", (DISPATCH, DISPATCH_RULES)),
    M("disp-lag-wait-bound", "rl/dispatch.py",
      "any(v - mv > K - 1 for mv in inflight_min_versions)", "any(v - mv > K for mv in inflight_min_versions)",
      "the step does not wait for in-flight samples that would end up at lag K + 1", (DISPATCH,)),
    M("disp-stale-group-drop-bound", "rl/dispatch.py",
      "v - min(m.min_version for m in g.done) > K]", "v - min(m.min_version for m in g.done) >= K]",
      "groups exactly at the version-lag bound are dropped", (DISPATCH,)),
    M("disp-stale-frac-boundary", "rl/dispatch.py",
      "(stale + s) / (total + n) > f:", "(stale + s) / (total + n) >= f:",
      "a batch exactly at max_stale_token_frac is refused", (DISPATCH, DISPATCH_RULES)),
    M("disp-warmup-length-boundary", "rl/dispatch.py",
      "meta.num_tokens < self.cfg.warmup_discard.min_response_tokens", "meta.num_tokens <= self.cfg.warmup_discard.min_response_tokens",
      "warm-up discards samples of exactly min_response_tokens", (DISPATCH, DISPATCH_RULES)),
    M("disp-warmup-one-step-too-long", "rl/dispatch.py",
      "return self.train_steps < self.cfg.warmup_discard.steps", "return self.train_steps <= self.cfg.warmup_discard.steps",
      "warm-up discard lasts one train step too long", (DISPATCH, DISPATCH_RULES)),
    M("disp-open-discarded-group-not-reported", "rl/dispatch.py",
      "return prompt_id in self._discarded or (g is not None and g.discarded)", "return prompt_id in self._discarded",
      "samples of a group discarded while still generating are stored as finished", (DISPATCH,)),
    M("disp-restore-forgets-discarded", "rl/dispatch.py",
      'self._discarded, self._closed = s["discarded"], s["closed"]', 'self._closed = s["closed"]',
      "a restored dispatcher forgets which groups warm-up discarded", (CKPT, CKPT_FORMAT, DISPATCH_RULES)),
    M("disp-restore-forgets-pending-draw", "rl/dispatch.py",
      'self._groups, self._ready, self._pending_draw = s["open"], s["ready"], s["pending_draw"]',
      'self._groups, self._ready = s["open"], s["ready"]',
      "a restored dispatcher forgets the prompt it drew but could not release", (CKPT, CKPT_FORMAT, DISPATCH_RULES)),
    M("disp-reconfigure-drops-caps", "rl/dispatch.py",
      '"dataset_max_inflight": dict(caps)})', "})",
      "live reconfiguration changes the mixture but not the caps", (DISPATCH, DISPATCH_RULES)),

    # -- rl/store/trajectories.py: rollback, mark_trained, set_outcome, config versions, audit ----------------------------
    M("store-rollback-other-runs-samples", "rl/store/trajectories.py",
      "samples_regenerated=s.execute(delete(S).where(S.run_id == self.run_id, S.seq > wm.seq))",
      "samples_regenerated=s.execute(delete(S).where(S.seq > wm.seq))",
      "rollback deletes late samples of every run sharing the database", (STORE, CKPT, ROLLBACK)),
    M("store-rollback-keeps-config-versions", "rl/store/trajectories.py",
      "            s.execute(delete(ConfigVersionTable).where(ConfigVersionTable.run_id == self.run_id, "
      "ConfigVersionTable.seq > wm.seq,\n", "            s.execute(select(ConfigVersionTable).where(ConfigVersionTable.run_id == self.run_id, "
      "ConfigVersionTable.seq > wm.seq,\n",
      "rollback forgets the config-versions table: a re-applied patch shows twice", (STORE, CKPT, ROLLBACK)),
    M("store-rollback-drops-refused-patches", "rl/store/trajectories.py",
      'ConfigVersionTable.seq > wm.seq,\n                                                       ConfigVersionTable.status == "applied"))',
      "ConfigVersionTable.seq > wm.seq))",
      "rollback also deletes patches refused after the watermark, which are never retried", (STORE, ROLLBACK, LOOP)),
    M("store-rollback-trained-bound", "rl/store/trajectories.py",
      "TrainedTable.step > wm.train_step", "TrainedTable.step >= wm.train_step",
      "rollback also forgets the audit rows of the checkpoint's own train step", (STORE, CKPT, ROLLBACK)),
    M("store-rollback-keeps-late-outcomes", "rl/store/trajectories.py",
      "            s.execute(update(P).where(P.run_id == self.run_id, P.outcome_seq > wm.seq).values(outcome=None, "
      "outcome_seq=None))\n", "",
      "rollback keeps outcomes recorded after the watermark (a redone group cannot get its real one)",
      (STORE, CKPT, ROLLBACK)),
    M("store-mark-trained-twice", "rl/store/trajectories.py",
      "SampleTable.sample_id.in_(chunk),\n                           SampleTable.train_step.is_(None))",
      "SampleTable.sample_id.in_(chunk))",
      "mark_trained accepts a sample that is already trained", (STORE, CKPT)),
    M("store-outcome-overwritten", "rl/store/trajectories.py",
      "PromptTable.prompt_id.in_(list(prompt_ids[i : i + 500])),\n                                                    "
      "PromptTable.outcome.is_(None))",
      "PromptTable.prompt_id.in_(list(prompt_ids[i : i + 500])))",
      "a group's outcome is overwritten by a later one (trained becomes dropped_stage_end)", (STORE, CKPT, ROLLBACK)),
    M("store-outcome-other-runs", "rl/store/trajectories.py",
      "update(PromptTable).where(PromptTable.run_id == self.run_id,\n                                                    "
      "PromptTable.prompt_id.in_", "update(PromptTable).where(PromptTable.prompt_id.in_",
      "set_outcome updates the same prompt id of every run in a shared database", (STORE, CKPT, ROLLBACK)),
    M("store-config-version-no-seq", "rl/store/trajectories.py",
      "        self._seq += 1\n        with self._begin() as s:\n            s.add(ConfigVersionTable(",
      "        with self._begin() as s:\n            s.add(ConfigVersionTable(",
      "a config version does not take the next seq, so a rollback cannot tell it is late", (STORE, ROLLBACK)),
    M("store-reopen-ignores-config-seq", "rl/store/trajectories.py",
      "(S.seq, S), (C.seq, C)))", "(S.seq, S)))",
      "a reopened store continues its seq below its last config version", (STORE, ROLLBACK)),
    M("store-audit-counts-once-as-twice", "rl/store/trajectories.py",
      "having(func.count() > 1)", "having(func.count() >= 1)",
      "the audit counts every trained sample as trained twice", (STORE, CKPT)),

    # -- rl/checkpoint/format.py, model/checkpoint.py: naming, pruning, finder, format checks, atomic write ---------
    M("ckpt-name-counts-survivors", "rl/checkpoint/format.py",
      "{max(taken, default=-1) + 1:03d}", "{len(taken):03d}",
      "the n of step-<s>-<n> counts surviving checkpoints, so a name is reused after pruning",
      (CKPT, CKPT_FORMAT, CKPT_RULES)),
    M("ckpt-prune-keeps-one-more", "rl/checkpoint/format.py",
      "self.complete()[: -self.keep_last]", "self.complete()[: -self.keep_last - 1]",
      "pruning keeps keep_last + 1 checkpoints", (CKPT, CKPT_FORMAT)),
    M("ckpt-prune-stage-end", "rl/checkpoint/format.py",
      "            if self.stage_end(old) is None:\n                trash", "            if True:\n                trash",
      "pruning deletes stage-end checkpoints too", (CKPT, CKPT_FORMAT)),
    M("ckpt-latest-is-oldest", "rl/checkpoint/format.py",
      "for path in reversed(self.complete()):", "for path in self.complete():",
      "the finder returns the oldest valid checkpoint", (CKPT, CKPT_FORMAT)),
    M("ckpt-layout-unchecked", "rl/checkpoint/format.py",
      'if manifest.get("rollout_state_format") != ROLLOUT_STATE_FORMAT:', 'if manifest.get("rollout_state_format") is None:',
      "only the presence of the in-flight state layout is checked: a checkpoint of another layout is loaded", (CKPT, CKPT_FORMAT, CKPT_RULES)),
    M("ckpt-trainer-tree-unchecked", "rl/checkpoint/format.py",
      '        unflatten_tree(tree.get("tree"), dict.fromkeys(keys))', "        pass",
      "a trainer.json naming tensors its safetensors file lacks passes verification", (CKPT, CKPT_FORMAT, CKPT_RULES)),
    M("ckpt-inflight-from-directory", "rl/checkpoint/format.py",
      'listed = read_manifest(path)["files"]', "listed = [p.name for p in Path(path).iterdir()]",
      "in-flight files are read from the directory, not the manifest (a planted file is loaded)", (CKPT, CKPT_FORMAT)),
    M("ckpt-stale-tmp-kept", "rl/checkpoint/format.py",
      '        for stale in self.root.glob(".tmp-*"):  # a write or a prune a kill interrupted\n'
      "            shutil.rmtree(stale, ignore_errors=True)\n", "",
      "the half-written directory of a killed write is never cleaned up", (CKPT, CKPT_FORMAT)),
    M("ckpt-rename-before-manifest", "model/checkpoint.py",
      "    if before_manifest is not None:\n        before_manifest()\n    with (tmp / MANIFEST).open(\"w\") as f:\n"
      "        json.dump(body, f, indent=1)\n        f.flush()\n        os.fsync(f.fileno())\n    os.replace(tmp, final)\n",
      "    os.replace(tmp, final)\n    if before_manifest is not None:\n        before_manifest()\n"
      "    with (final / MANIFEST).open(\"w\") as f:\n        json.dump(body, f, indent=1)\n        f.flush()\n"
      "        os.fsync(f.fileno())\n",
      "the directory is renamed into place before its manifest is written", (CKPT, CKPT_RULES)),
    M("ckpt-no-parent-fsync", "model/checkpoint.py",
      "    os.replace(tmp, final)\n    fsync_dir(final.parent)\n", "    os.replace(tmp, final)\n",
      "the rename is not fsynced (lost on power failure, not on a process kill)", (CKPT, CKPT_RULES)),

    # -- rl/algo/records.py, rl/runtime/worker.py: records and the trainer state ----------------------------------
    M("rec-watermark-swapped", "rl/algo/records.py",
      'return {"seq": wm.seq, "train_step": wm.train_step}', 'return {"seq": wm.train_step, "train_step": wm.seq}',
      "the watermark record swaps its two fields", (CKPT_FORMAT,)),
    M("rec-live-history-dropped", "rl/algo/records.py",
      'history=[dict(h) for h in d["history"]])', "history=[])",
      "the live config's history is not restored", (CKPT_FORMAT,)),
    M("worker-lr-schedule-not-restored", "rl/runtime/worker.py",
      '                self.trainer.sched.load_state_dict(read_tree(state["scheduler"]))\n', "",
      "a resumed trainer restarts its LR schedule (warm-up again)", (CKPT_FORMAT,)),

    # -- rl/algo/resume.py, rl/algo/job.py: when to checkpoint, how a job resumes --------------------------------------
    M("resume-checkpoint-repeated-in-a-step", "rl/algo/resume.py",
      "\n               and global_step != self.last_step)", ")",
      "a due checkpoint is written again at every token boundary of the same step", (CKPT_RULES, LOOP)),
    M("resume-checkpoint-at-step-0", "rl/algo/resume.py",
      "self.every_steps > 0 and global_step > 0 and", "self.every_steps > 0 and",
      "a periodic checkpoint is written before the first train step", (CKPT_RULES, LOOP)),
    M("resume-rewrites-its-own-checkpoint", "rl/algo/resume.py",
      "self.last_step = resume_from.global_step if resume_from else -1", "self.last_step = -1",
      "a resumed job writes the checkpoint it was resumed from again", (CKPT_RULES, LOOP)),
    M("resume-datasets-may-change", "rl/algo/resume.py",
      'INCOMPATIBLE = ("model", "tokenizer", "datasets", "effort")', 'INCOMPATIBLE = ("model", "tokenizer", "effort")',
      "a resume may change the datasets the checkpoint's streams depend on", (CKPT, CKPT_RULES)),
    M("resume-stage-kinds-may-change", "rl/algo/resume.py",
      "    if kinds[0] != kinds[1]:\n", "    if len(kinds[0]) != len(kinds[1]):\n",
      "a resume may replace a stage by one of another type", (CKPT, CKPT_RULES)),
    M("resume-rollback-before-check", "rl/algo/resume.py",
      '    check_resumable(recipe_from_yaml(state["recipe_yaml"]), recipe)\n'
      '    if new_identity:\n        _fork(run_dir, store, state["watermark"], say)\n'
      '    undone = store.rollback_to(state["watermark"], checkpoint=str(path))\n',
      '    if new_identity:\n        _fork(run_dir, store, state["watermark"], say)\n'
      '    undone = store.rollback_to(state["watermark"], checkpoint=str(path))\n'
      '    check_resumable(recipe_from_yaml(state["recipe_yaml"]), recipe)\n',
      "the store is rolled back before the recipe is checked: a refused resume has already changed it",
      (CKPT, CKPT_FORMAT, CKPT_RULES)),
    M("resume-fresh-start-keeps-store", "rl/algo/resume.py",
      '        store.rollback_to(Watermark(0, 0), checkpoint="")\n', "",
      "a run that restarts from nothing keeps the rows of its first attempt", (CKPT_FORMAT, CKPT_RULES)),
    M("resume-inflight-not-resumed", "rl/algo/async_grpo.py",
      "        loop.load_state_dict(restored, job.checkpointer.restore_inflight(job))\n        job.policy.resume()\n",
      "        loop.load_state_dict(restored, job.checkpointer.restore_inflight(job))\n",
      "the checkpoint's in-flight samples stay parked after a resume", (LOOP,)),
    M("resume-version-not-restored", "rl/algo/resume.py",
      "        job.policy.update_weights(job.state.global_step)\n", "",
      "after a resume new tokens carry policy version 0 instead of the checkpoint's", (LOOP,)),
    M("job-version-stamped-before-advance", "rl/algo/job.py",
      "        self.state.global_step += 1\n        self.policy.update_weights(self.state.global_step)\n",
      "        self.policy.update_weights(self.state.global_step)\n        self.state.global_step += 1\n",
      "the engines get the old version after a step, so new tokens are stamped one version too old", (LOOP,)),

    # -- rl/algo/async_grpo.py: the loop ------------------------------------------------------------------------
    M("loop-step-not-advanced", "rl/algo/async_grpo.py",
      "            self.step = step + 1\n", "            self.step = step\n",
      "the loop's step counter lags, so a resumed stage redoes a step", (LOOP,)),
    M("loop-trained-outcome-missing", "rl/algo/async_grpo.py",
      '        job.store.set_outcome(batch, "trained")\n', "",
      "trained groups get no outcome (the stage end then calls them dropped)", (LOOP,)),
    M("loop-trained-at-wrong-step", "rl/algo/async_grpo.py",
      "job.store.mark_trained([s.sample_id for s in samples], version)",
      "job.store.mark_trained([s.sample_id for s in samples], version - 1)",
      "samples are stamped with the version they were trained at, not the step that consumed them", (LOOP,)),
    M("loop-stage-end-outcome-missing", "rl/algo/async_grpo.py",
      '        job.store.set_outcome(sorted(set(self.disp.unfinished_prompt_ids()) | set(self.finished)), '
      '"dropped_stage_end")\n', "",
      "groups still open at the stage end are left without an outcome", (LOOP,)),
    M("loop-streams-not-restored", "rl/algo/async_grpo.py",
      "            self.streams[d].skip_to(n)\n", "            pass\n",
      "a resumed stage draws its problems from the start of each dataset stream again", (LOOP,)),
    M("loop-reapplies-checkpointed-patch", "rl/algo/async_grpo.py",
      'answer["version"] > self.live.version', 'answer["version"] >= self.live.version',
      "on resume a patch the checkpoint already holds is applied a second time", (LOOP,)),

    # -- rollout/engine.py, model/kv_cache.py: admission, blocks, interrupt/resume, finish -----------------
    M("engine-finish-leaks-blocks", "rollout/engine.py",
      "        self.cache.free(s.blocks)\n        e = s.prompt\n", "        e = s.prompt\n",
      "a finished sequence keeps its KV blocks", (ENGINE, WORKER)),
    M("engine-interrupt-keeps-paused", "rollout/engine.py",
      "        states += self._waiting\n        self._active, self._waiting, self._ready, self._paused = [], [], [], {}",
      "        states += self._waiting\n        self._active, self._waiting, self._ready = [], [], []",
      "interrupt hands out the samples paused at a tool call but keeps holding them",
      (ENGINE, WORKER, "tests/unit/test_engine_sharing_and_turns.py")),
    M("engine-interrupt-drops-waiting", "rollout/engine.py",
      "        states += self._waiting\n", "",
      "interrupt forgets requests not yet admitted", (ENGINE, WORKER)),
    M("engine-admit-exact-fit-refused", "rollout/engine.py",
      "if need - full + (self.watermark if running and not self.sparse else 0) > self.cache.num_free_blocks:",
      "if need - full + (self.watermark if running and not self.sparse else 0) >= self.cache.num_free_blocks:",
      "a request that exactly fits the free blocks is not admitted", (ENGINE, KV_POOL, "tests/unit/test_kv_pressure.py")),
    M("engine-batch-bound-off-by-one", "rollout/engine.py",
      "self._waiting[0].paused or len(self._active) < self.cfg.max_batch_size",
      "self._waiting[0].paused or len(self._active) <= self.cfg.max_batch_size",
      "one sequence more than max_batch_size runs at once", (ENGINE, KV_POOL)),
    M("engine-oldest-ignores-parked", "rollout/engine.py",
      "return [s.versions[0] for s in held if s.versions] + [\n"
      "            s.policy_versions[0] for s in self._waiting if s.policy_versions\n        ]",
      "return [s.versions[0] for s in held if s.versions]",
      "the lag bound does not see resumed samples waiting to be readmitted", (ENGINE, KV_POOL)),
    M("engine-parks-the-oldest", "rollout/engine.py",
      "for v in sorted(self._active, key=lambda s: -s.admitted)[:-1]:",
      "for v in sorted(self._active, key=lambda s: -s.admitted):",
      "under memory pressure the oldest sample may be parked too: no sample is sure to progress",
      ("tests/unit/test_kv_pressure.py",)),
    M("engine-max-new-off-by-one", "rollout/engine.py",
      "or s.num_response >= self._max_new(s.request)", "or s.num_response > self._max_new(s.request)",
      "a sequence generates one token past max_new_tokens", (ENGINE,)),
    M("engine-resume-format-unchecked", "rollout/engine.py",
      "if st.has_kv and theirs != mine:", "if st.has_kv and st.kv_format is None:",
      "an engine resumes a state whose KV is stored in another format or layout", (ENGINE, "tests/unit/test_kv_formats.py")),
    M("kv-allocate-all-refused", "model/kv_cache.py",
      "if n > len(self._free):", "if n >= len(self._free):",
      "the pool refuses to hand out its last free block", (KV_POOL, ENGINE)),
    M("kv-blocks-for-wrong-ceil", "model/kv_cache.py",
      "return -(-num_tokens // self.block_size)", "return num_tokens // self.block_size + 1",
      "block count rounds up a length that is already a multiple of the block size", (KV_POOL, ENGINE)),

    # -- rl/algo/sft.py: the demonstration stream and its restore ---------------------------------------------
    M("sft-restore-floor", "rl/algo/sft.py",
      "c.skip_to(max(0, -(-(self.drawn - i) // n)))", "c.skip_to(max(0, (self.drawn - i) // n))",
      "a restored stream skips each task's cursor to floor instead of ceil of its share", (SFT,)),
    M("sft-round-robin-index", "rl/algo/sft.py",
      "self.cursors[(self.drawn - 1) % len(self.cursors)]", "self.cursors[self.drawn % len(self.cursors)]",
      "round robin starts at the second task", (SFT,)),
    M("sft-rng-not-restored", "rl/algo/sft.py",
      '        self.rng.setstate(state["rng"])\n', "",
      "a restored stream forgets the demonstration RNG", (SFT,)),

    # -- rl/train/trainer.py: micro-batch loop and metric merge ------------------------------------------------
    M("trainer-merge-unweighted-means", "rl/train/trainer.py",
      "sum(p.means.get(k, 0.0) * p.tokens for p in parts) / max(total, 1e-12)",
      "sum(p.means.get(k, 0.0) for p in parts) / len(parts)",
      "ranks' means are averaged instead of weighted by their tokens", (TRAINER,)),
    M("trainer-merge-shared-last-rank", "rl/train/trainer.py",
      "out = dict(parts[0].shared)", "out = dict(parts[-1].shared)",
      "the shared values (equal on every rank) are read from the last rank", (TRAINER,)),
    M("trainer-micro-batch-drops-a-row", "rl/train/trainer.py",
      "return [order[lo : lo + size] for lo in range(0, len(order), size)]",
      "return [order[lo : lo + size - 1] for lo in range(0, len(order), size)]",
      "each micro-batch leaves out its last row", (TRAINER,)),
    M("trainer-running-mean-unweighted", "rl/train/trainer.py",
      "(self.means.get(k, 0.0) * self.tokens + v * tokens) / max(total, 1e-12)",
      "(self.means.get(k, 0.0) + v) / (2 if k in self.means else 1)",
      "micro-batch means are averaged instead of weighted by their tokens", (TRAINER,)),
    M("trainer-grads-not-cleared", "rl/train/trainer.py",
      "        self.sched.step()\n        self.opt.zero_grad(set_to_none=True)\n", "        self.sched.step()\n",
      "gradients are not cleared after a step and leak into the next one", (TRAINER,)),

    # -- rl/reconfigure.py: live patches -----------------------------------------------------------------
    M("reconf-null-cap-kept", "rl/reconfigure.py",
      "        if v is None:\n            caps.pop(k, None)\n        else:\n            caps[k] = v\n",
      "        caps[k] = v\n",
      "a null cap in a patch is stored instead of removing the dataset's cap", (RECONF,)),
    M("reconf-history-aliased", "rl/reconfigure.py",
      "history=list(live.history),", "history=live.history,",
      "a new config version appends to the previous version's history list", (RECONF,)),
    M("reconf-zero-cap-accepted", "rl/reconfigure.py",
      "if v is not None and v <= 0:", "if v is not None and v < 0:",
      "a patch may set a cap of 0, which stalls the dataset for good", (RECONF,)),
    M("reconf-version-not-bumped", "rl/reconfigure.py",
      "version=live.version + 1,", "version=live.version,",
      "an applied patch keeps the old config version", (RECONF,)),

    # -- full set only: mutations whose covering tests are the slow CLI/Ray integration tests ------------
    M("sft-version-not-advanced", "rl/algo/driver.py",
      "        job.advance_version()\n        job.record_train_step(stage, step, metrics)\n",
      "        job.record_train_step(stage, step, metrics)\n",
      "SFT steps do not advance the policy version", (E2E,), quick=False),
    M("loop-trains-before-rewards-are-in", "rl/algo/async_grpo.py",
      "                        self.collect_rewards(block=True)  # a ready group's rewards must be in before it trains\n",
      "                        pass\n",
      "a batch is taken before its rewards are collected (Ray rewards are asynchronous)", (RAY_RUNTIME,), quick=False),
    M("loop-least-loaded-worker", "rl/algo/async_grpo.py",
      "w = min(range(self.n_workers), key=self.load.__getitem__)",
      "w = max(range(self.n_workers), key=self.load.__getitem__)",
      "requests go to the most loaded engine", (RAY_RUNTIME,), quick=False),
]


# -- issue #40 class 8: the modules written since the first version (reported apart: `Mutant.new`) ----------------
NORMS, LOSSES, OBJECTIVES = "tests/unit/test_normalisers.py", "tests/unit/test_losses.py", "tests/unit/test_objectives.py"
MASKS = "tests/unit/test_staleness_masks.py"
RECORDS, RUN_SPECS = "tests/unit/test_records_roundtrip.py", "tests/unit/test_run_specs.py"
HF_DEFAULTS, FUSED_EXPERTS = "tests/unit/test_hf_config_defaults.py", "tests/unit/test_fused_experts.py"
MATH_LITERALS, EFFORT, EFFORT_LEVELS = ("tests/unit/test_math_literals.py", "tests/unit/test_effort.py",
                                        "tests/unit/test_effort_levels.py")
TOOL_TIMEOUTS, EXEC_LIMITS = "tests/unit/test_tool_turn_limits.py", "tests/unit/test_exec_limits.py"

MUTANTS += [
    # -- rl/algo/async_grpo.py: the per-step normaliser the loop builds (tool turns, PPO mini-batches) ------------
    N("norm-counts-tool-output", "rl/algo/async_grpo.py",
      "num_tokens = float(sum(s.num_trained_tokens for s in samples))",
      "num_tokens = float(sum(s.num_response_tokens for s in samples))",
      "the step's normaliser counts tool-output tokens, which are never trained", (NORMS,)),
    N("norm-mini-batch-whole-step", "rl/algo/async_grpo.py",
      "norm = num_tokens * tokens / max(sum(trained), 1) if len(mini) > 1 else num_tokens", "norm = num_tokens",
      "every mini-batch is divided by the whole step's tokens (each PPO update shrinks by the mini-batch count)",
      (NORMS,)),
    N("norm-mini-batch-share-counts-tool-output", "rl/algo/async_grpo.py",
      "trained = [sum(s.num_trained_tokens for i in part for s in computed[i]) for part in mini]",
      "trained = [sum(s.num_response_tokens for i in part for s in computed[i]) for part in mini]",
      "a mini-batch's share of the normaliser counts its tool-output tokens", (NORMS,)),
    N("norm-mini-batch-own-tokens", "rl/algo/async_grpo.py",
      "norm = num_tokens * tokens / max(sum(trained), 1) if len(mini) > 1 else num_tokens",
      "norm = tokens if len(mini) > 1 else num_tokens",
      "a mini-batch is divided by its own tokens: the uniform groups the step skipped leave the normaliser", (NORMS,)),

    N("opd-remap-moves-active-teachers", "rl/reconfigure.py",
      "return dispatched if dispatched in self.active_teachers else self.teacher_for(dataset)",
      "return self.teacher_for(dataset)",
      "after a remap, in-flight samples of a teacher still in use move to their dataset's new teacher too", (NORMS,)),
    N("opd-remap-keeps-removed-teacher", "rl/reconfigure.py",
      "return dispatched if dispatched in self.active_teachers else self.teacher_for(dataset)", "return dispatched",
      "in-flight samples of a teacher a patch removed are still scored by it", (NORMS,)),
    N("opd-remap-not-stored", "rl/algo/async_grpo.py",
      "                job.store.set_teacher(ids, name)\n", "                pass\n",
      "the store keeps the removed teacher for samples another teacher scored", (NORMS,)),

    # -- rl/train/losses.py, rl/train/objectives.py: staleness masks (GRPO, OPD's KL, KL to the reference) --------
    N("mask-staleness-bound", "rl/train/losses.py",
      "keep = ((current_version - versions) <= max_staleness).to(mask.dtype)",
      "keep = ((current_version - versions) < max_staleness).to(mask.dtype)",
      "tokens exactly max_staleness versions old are masked", (MASKS, LOSSES)),
    N("mask-sample-frac-boundary", "rl/train/losses.py",
      "keep = keep * (stale <= max_sample_stale_frac).to(mask.dtype)[:, None]",
      "keep = keep * (stale < max_sample_stale_frac).to(mask.dtype)[:, None]",
      "a sample whose stale share is exactly max_sample_stale_frac is dropped", (MASKS, LOSSES)),
    N("mask-sample-frac-over-padding", "rl/train/losses.py",
      "stale = ((1 - keep) * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)", "stale = ((1 - keep) * mask).sum(-1) / mask.shape[-1]",
      "a sample's stale share is taken over the padded row, not its response tokens", (MASKS, LOSSES)),
    N("mask-sample-frac-counts-prompt", "rl/train/losses.py",
      "stale = ((1 - keep) * mask).sum(-1)", "stale = (1 - keep).sum(-1)",
      "a sample's stale share counts positions off the response (prompt, padding, tool output)", (MASKS, LOSSES)),
    N("mask-normaliser-kept-only", "rl/train/losses.py",
      "loss = (per_token * keep).sum() / x.num_tokens", "loss = (per_token * keep).sum() / keep.sum().clamp_min(1.0)",
      "the GRPO loss is divided by the kept tokens, so masking rescales the others' gradient", (MASKS, LOSSES)),
    N("mask-frac-not-passed", "rl/train/objectives.py",
      "s.max_staleness, s.max_sample_stale_frac)", "s.max_staleness)",
      "the objective never applies max_sample_stale_frac", (MASKS, OBJECTIVES)),
    N("mask-opd-kl-unmasked", "rl/train/objectives.py",
      "        weights = b.mask * keep\n", "        weights = b.mask\n",
      "OPD's KL term trains on stale tokens the GRPO term masks", (MASKS, OBJECTIVES)),
    N("mask-kl-ref-unmasked", "rl/train/objectives.py",
      "loss = loss + s.kl_ref_coef * (k3 * keep).sum() / rows.num_tokens",
      "loss = loss + s.kl_ref_coef * k3.sum() / rows.num_tokens",
      "the KL-to-reference term trains on stale tokens", (MASKS, OBJECTIVES)),
    N("mask-entropy-bonus-unmasked", "rl/train/objectives.py",
      "kept, coef = b.mask * keep, s.entropy_coef", "kept, coef = b.mask, s.entropy_coef",
      "the entropy bonus counts stale tokens", (MASKS, OBJECTIVES)),

    # -- rl/algo/records.py: live-config and loop fields through a checkpoint round trip ---------------------------
    N("rec-caps-not-saved", "rl/algo/records.py",
      '"caps": dict(live.caps),', '"caps": {},',
      "per-dataset caps a patch set are not written to the checkpoint", (RECORDS, CKPT_FORMAT)),
    N("rec-caps-not-restored", "rl/algo/records.py",
      'caps=dict(d["caps"]),', "caps={},",
      "per-dataset caps are not restored from the checkpoint", (RECORDS, CKPT_FORMAT)),
    N("rec-assignment-not-restored", "rl/algo/records.py",
      'assignment=dict(d["assignment"]),', "assignment={},",
      "the dataset -> teacher assignment a patch changed is not restored", (RECORDS, CKPT_FORMAT)),
    N("rec-teachers-not-restored", "rl/algo/records.py",
      'teachers={name: TeacherSpec.model_validate(spec) for name, spec in d["teachers"].items()},', "teachers={},",
      "teachers a patch added are not restored", (RECORDS, CKPT_FORMAT)),
    N("rec-live-version-reset", "rl/algo/records.py",
      'LiveConfig(version=int(d["version"]),', "LiveConfig(version=0,",
      "the live config's version restarts at 0 (a patch already held is applied again)", (RECORDS, CKPT_FORMAT)),
    N("rec-teacher-of-dropped", "rl/algo/records.py",
      '"teacher_of": dict(rec["teacher_of"])}', '"teacher_of": {}}',
      "in-flight prompts forget the teacher they were dispatched under", (RECORDS, CKPT_FORMAT)),
    N("rec-effort-of-dropped", "rl/algo/records.py",
      '"effort_of": dict(rec["effort_of"]), "clock"', '"effort_of": {}, "clock"',
      "in-flight samples forget their effort level", (RECORDS, CKPT_FORMAT)),

    # -- rl/checkpoint/format.py, rl/checkpoint/run_specs.py: explicit --step / RUN:STEP checkpoints -------------
    N("spec-step-unverified", "rl/checkpoint/format.py",
      'p.name.startswith(f"step-{global_step:08d}-") and self.problem(p) is None), None)',
      'p.name.startswith(f"step-{global_step:08d}-")), None)',
      "an explicit --step / RUN:STEP checkpoint is not verified like the newest one", (RUN_SPECS,)),
    N("spec-step-oldest", "rl/checkpoint/format.py",
      "        return next((p for p in reversed(self.complete())\n", "        return next((p for p in self.complete()\n",
      "of several checkpoints of one step, the oldest is taken", (RUN_SPECS,)),
    N("spec-step-kept-in-path", "rl/checkpoint/run_specs.py",
      "        text, step = head, int(tail)\n", "        step = int(tail)\n",
      "RUN:STEP keeps ':STEP' in the directory it looks for", (RUN_SPECS,)),
    N("spec-run-json-ignored", "rl/checkpoint/run_specs.py",
      'if (path / "checkpoints").is_dir() or (path / "run.json").is_file():', 'if (path / "checkpoints").is_dir():',
      "a run directory with no checkpoints yet is taken for a model path (no one-line 'no verified checkpoint')",
      (RUN_SPECS,)),

    # -- model/formats.py, model/conversion.py: Hugging Face config.json defaults and tensors -------------------------
    N("hf-default-rms-eps", "model/formats.py",
      '"rms_norm_eps": cfg.get("rms_norm_eps", 1e-6)', '"rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)',
      "a config.json without rms_norm_eps gets 1e-5, not transformers' 1e-6", (HF_DEFAULTS,)),
    N("hf-default-tied", "model/formats.py",
      'bool(cfg.get("tie_word_embeddings", False))', 'bool(cfg.get("tie_word_embeddings", True))',
      "a config.json without tie_word_embeddings is taken as tied", (HF_DEFAULTS,)),
    N("hf-default-rope-theta", "model/formats.py",
      "float(theta if theta is not None else 10000.0)", "float(theta if theta is not None else 500000.0)",
      "a config.json without rope_theta gets Llama 3's 500000, not transformers' 10000", (HF_DEFAULTS,)),
    N("hf-default-norm-topk", "model/formats.py",
      'bool(cfg.get("norm_topk_prob", False))', 'bool(cfg.get("norm_topk_prob", True))',
      "a Qwen3-MoE config.json without norm_topk_prob renormalises the top-k weights", (HF_DEFAULTS,)),
    N("hf-head-dim-ignored", "model/formats.py",
      '"head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,', '"head_dim": cfg["hidden_size"] // heads,',
      "an explicit head_dim (Qwen3: not hidden / heads) is ignored", (HF_DEFAULTS,)),
    N("hf-fused-gate-up-swapped", "model/conversion.py",
      "return [Piece(self.ours.format(**f), (), t[:, :inter]), Piece(self.up.format(**f), (), t[:, inter:])]",
      "return [Piece(self.ours.format(**f), (), t[:, inter:]), Piece(self.up.format(**f), (), t[:, :inter])]",
      "transformers 5's fused gate_up_proj is split up-first", (FUSED_EXPERTS,)),

    # -- rewards/verifiers.py: the math verifier's literal-number rule ------------------------------------------------
    N("math-fraction-for-integer", "rewards/verifiers.py",
      "return not all(g.is_integer for g in numbers) and bool(_FRACTION.fullmatch(text))",
      "return bool(_FRACTION.fullmatch(text))",
      "a fraction ('84/2') is accepted for an integer reference", (MATH_LITERALS,)),
    N("math-decimal-refused", "rewards/verifiers.py",
      r'_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")',
      r'_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)")',
      "a decimal answer ('0.75') is refused as an expression", (MATH_LITERALS,)),
    N("math-decimal-reference-unchecked", "rewards/verifiers.py",
      'numbers = [g for g in gold if getattr(g, "is_Float", False) or (getattr(g, "is_number", False) and g.is_rational)]',
      'numbers = [g for g in gold if getattr(g, "is_number", False) and g.is_rational]',
      "a decimal reference (a sympy Float) is not seen as a number: any expression equal to it scores", (MATH_LITERALS,)),
    N("math-spaced-fraction-refused", "rewards/verifiers.py",
      r"\d+\s*/\s*\d+", r"\d+/\d+",
      "a fraction written with spaces ('3 / 4') is refused for a fractional reference", (MATH_LITERALS,)),
    N("math-trailing-period-refused", "rewards/verifiers.py",
      '.strip("*$").strip().rstrip(".").strip()', '.strip("*$").strip()',
      "'The answer is 42.' is refused: the sentence's period is read as part of the number", (MATH_LITERALS,)),
    N("math-thousands-refused", "rewards/verifiers.py",
      r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", r"\d+(?:\.\d+)?",
      "'1,000' is refused as an expression", (MATH_LITERALS,)),

    # -- rewards/effort.py: effort levels ----------------------------------------------------------------------------
    N("effort-two-levels-no-decay", "rewards/effort.py",
      "        if len(self.levels) < 2:\n", "        if len(self.levels) <= 2:\n",
      "with exactly two levels the penalty does not decay with effort", (EFFORT_LEVELS, EFFORT)),
    N("effort-spacing-divides-by-count", "rewards/effort.py",
      "(self.levels[-1] - self.levels[0]) / (len(self.levels) - 1)", "(self.levels[-1] - self.levels[0]) / len(self.levels)",
      "the mean spacing divides the span by the level count, not the gaps", (EFFORT_LEVELS, EFFORT)),
    N("effort-levels-unsorted", "rewards/effort.py",
      "        return sorted(v)\n", "        return v\n",
      "levels are kept in the recipe's order, so b_min is the first one written", (EFFORT_LEVELS, EFFORT)),
    N("effort-lambda-ignored", "rewards/effort.py",
      "return self.lam * (self.levels[-1]", "return (self.levels[-1]",
      "τ ignores λ", (EFFORT_LEVELS, EFFORT)),
    N("effort-cap-is-floor", "rewards/effort.py",
      "return -min(self.c_max,", "return -max(self.c_max,",
      "C_max is the smallest deduction instead of the largest", (EFFORT_LEVELS, EFFORT)),

    # -- rl/runtime/tool_turns.py: tool turns ---------------------------------------------------------------------------
    N("tools-timeout-larger-wins", "rl/runtime/tool_turns.py",
      "timeout = min(self.timeout_s, self.limits.timeout_s)", "timeout = max(self.timeout_s, self.limits.timeout_s)",
      "of tools.timeout_s and the sandbox's timeout_s the larger wins", (TOOL_TIMEOUTS,)),
    N("tools-timeout-sandbox-ignored", "rl/runtime/tool_turns.py",
      "timeout = min(self.timeout_s, self.limits.timeout_s)", "timeout = self.timeout_s",
      "the sandbox's own timeout_s is ignored when tools.timeout_s is larger", (TOOL_TIMEOUTS,)),
    N("tools-turn-limit-off-by-one", "rl/runtime/tool_turns.py",
      "if p.tool_turns >= self.max_turns:", "if p.tool_turns > self.max_turns:",
      "a sample makes one tool call more than max_turns", (TOOL_TIMEOUTS,)),
    N("tools-killed-call-not-a-failure", "rl/runtime/tool_turns.py",
      '"failure": None if r.reason == "ok" else r.reason}', '"failure": None}',
      "a call the sandbox killed (timeout, memory) is appended as output instead of failing its sample",
      (TOOL_TIMEOUTS,)),

    # -- sandbox_client/: the limits of one exec and of a work directory ----------------------------------------------
    N("sandbox-exec-timeout-ignored", "sandbox_client/server.py",
      "float(timeout or sb.limits.timeout_s))", "float(sb.limits.timeout_s))",
      "an exec's own timeout is ignored: the sandbox's (30 s by default) always applies", (EXEC_LIMITS,)),
    N("sandbox-output-at-cap-truncated", "sandbox_client/runner.py",
      "            if len(chunk) > room:\n", "            if len(chunk) >= room:\n",
      "output of exactly output_bytes is reported truncated and its exec killed", (EXEC_LIMITS,)),
    N("sandbox-file-limit-in-kib", "sandbox_client/backends.py",
      'f"--fsize={limits.file_mib * MIB}"', 'f"--fsize={limits.file_mib << 10}"',
      "RLIMIT_FSIZE is set in KiB where file_mib is MiB: every file over a few KiB fails", (EXEC_LIMITS,)),
    N("sandbox-disk-cap-is-memory", "sandbox_client/server.py",
      "mount_capped(work, limits.disk_mib * MIB,", "mount_capped(work, limits.memory_mib * MIB,",
      "the work directory is sized by memory_mib instead of disk_mib", (EXEC_LIMITS,)),
]


# -- running ------------------------------------------------------------------------------------------------
def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def copy_tree(files: list[str], dest: Path) -> Path:
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    return dest


def apply(m: Mutant, tree: Path) -> None:
    """Edit `tree` in place; raises if the snippet is not there exactly once or the result does not compile."""
    path = tree / m.file
    text = path.read_text()
    count = text.count(m.original)
    if count != 1:
        raise SystemExit(f"mutant {m.id}: the snippet occurs {count} times in {m.file} (must be once)")
    mutated = text.replace(m.original, m.replacement)
    compile(mutated, str(path), "exec")
    path.write_text(mutated)
    if mutated == text or path.read_text() != mutated:
        raise SystemExit(f"mutant {m.id}: the edit did not apply")


def child_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """('pass' | 'fail' | 'timeout', seconds, last lines of output)."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    proc = subprocess.Popen(cmd, cwd=tree, env=child_env(tree), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        verdict = "pass" if proc.returncode == 0 else "fail"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the test process and anything it started (Ray, CLI children)
        out, _ = proc.communicate()
        verdict = "timeout"
    tail = "\n".join(out.strip().splitlines()[-3:])
    return verdict, time.monotonic() - t0, tail


def check_imports_copy(tree: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import rl.dispatch; print(rl.dispatch.__file__)"], cwd=tree,
                           env=child_env(tree), capture_output=True, text=True)
    if not probe.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"the scratch copy does not shadow the installed package: {probe.stdout}{probe.stderr}")


def run_all(chosen: list[Mutant], files: list[str], scratch: Path, timeout: float, keep: bool) -> list[dict]:
    """Check every edit, run the baseline, then each mutant in its own copy; one row per mutant."""
    for m in chosen:  # every edit applies to a pristine copy before anything runs
        apply(m, copy_tree([m.file], scratch / "probe"))
    shutil.rmtree(scratch / "probe")
    base = copy_tree(files, scratch / "base")
    check_imports_copy(base)
    all_tests = sorted({t for m in chosen for t in m.tests})
    verdict, secs, tail = run_tests(base, all_tests, timeout=max(timeout, 900.0))
    print(f"baseline: {len(all_tests)} test paths on the unmutated copy: {verdict} in {secs:.1f} s")
    if verdict != "pass":
        raise SystemExit(f"the covering tests fail without any mutation:\n{tail}")

    rows = []
    print(f"{'id':40s} {'file':22s} {'killed':8s} {'seconds':>7s}  (new: issue #40's modules)")
    for m in chosen:
        tree = scratch / m.id
        shutil.copytree(base, tree)
        apply(m, tree)
        verdict, secs, tail = run_tests(tree, list(m.tests), timeout)
        killed = verdict != "pass"
        rows.append({"id": m.id, "file": m.file, "bug": m.bug, "tests": list(m.tests), "quick": m.quick, "new": m.new,
                     "verdict": verdict, "killed": killed, "seconds": round(secs, 1), "tail": tail})
        label = "timeout" if verdict == "timeout" else ("yes" if killed else "SURVIVED")
        print(f"{m.id:40s} {m.file:22s} {label:8s} {secs:7.1f}{'  new' if m.new else ''}", flush=True)
        if not keep:
            shutil.rmtree(tree, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the mutations with fast covering tests")
    ap.add_argument("--only", action="append", default=[], help="run this mutation id (repeatable)")
    ap.add_argument("--new", action="store_true", help="only the mutations of the newer modules (Mutant.new)")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run (a timeout counts as killed)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "mutants.json"), help="JSON results")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directories")
    args = ap.parse_args()

    ids = [m.id for m in MUTANTS]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise SystemExit(f"duplicate mutation ids: {sorted(dup)}")
    unknown = set(args.only) - set(ids)
    if unknown:
        raise SystemExit(f"unknown mutation ids: {sorted(unknown)}")
    if args.only:
        chosen = [m for m in MUTANTS if m.id in args.only]
    else:
        chosen = [m for m in MUTANTS if (m.quick or not args.quick) and (m.new or not args.new)]
    if args.list:
        for m in chosen:
            print(f"{m.id:40s} {m.file:22s} {'quick' if m.quick else 'full':5s} {'new' if m.new else 'old':3s}  {m.bug}")
        print(f"{len(chosen)} mutations ({sum(m.new for m in chosen)} new)")
        return

    t_start = time.monotonic()
    files = tracked_files()
    missing = sorted({t.split("::")[0] for m in chosen for t in m.tests} - set(files))
    if missing:
        raise SystemExit(f"covering tests not in the tree: {missing}")
    scratch = Path(tempfile.mkdtemp(prefix="mutants-"))
    try:
        rows = run_all(chosen, files, scratch, args.timeout, args.keep)
    finally:
        if args.keep:
            print(f"scratch copies kept under {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    n, k = len(rows), sum(r["killed"] for r in rows)
    fresh = [r for r in rows if r["new"]]
    n_new, k_new = len(fresh), sum(r["killed"] for r in fresh)
    survived = [r["id"] for r in rows if not r["killed"]]
    by_file: dict[str, list[int]] = {}
    for r in rows:
        by_file.setdefault(r["file"], [0, 0])
        by_file[r["file"]][0] += 1
        by_file[r["file"]][1] += r["killed"]
    print("\nper module: " + ", ".join(f"{f} {kk}/{nn}" for f, (nn, kk) in sorted(by_file.items())))
    if n_new:
        print(f"old modules: {k - k_new}/{n - n_new} killed; new modules (issue #40): {k_new}/{n_new} killed")
    minutes = (time.monotonic() - t_start) / 60
    result = {"mutants": n, "killed": k, "kill_rate": round(k / n, 3) if n else 0.0, "mutants_new": n_new,
              "killed_new": k_new, "kill_rate_new": round(k_new / n_new, 3) if n_new else 0.0, "survived": survived,
              "minutes": round(minutes, 2), "quick": args.quick, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"RESULT mutants={n} kill_rate={result['kill_rate']:.3f} mutants_new={n_new} "
          f"kill_rate_new={result['kill_rate_new']:.3f} killed={k} survived={','.join(survived) or '-'} "
          f"minutes={minutes:.1f}")


if __name__ == "__main__":
    main()
