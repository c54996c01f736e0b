"""Asynchronous GRPO on colocated, time-shared PolicyWorkers (seed §5.2.1-§5.2.3).

The algorithm, per train step:
  ROLLOUT   every engine advances each of its sequences by `steps_per_call` tokens; finished samples
            go to the reward workers and the store; the dispatcher releases new prompts by its policy
            (`sample`: as soon as the samples finished since the last release reach the next prompt's
            group size), keeping `max_inflight` samples generating. With Ray workers the next call is
            queued before this one's results are read (`pipelined_calls`): the engines never wait for
            the controller's round trip.
  WAIT      until the dispatcher's train-batch condition holds: `prompts_per_step` complete groups
            within the off-policy bounds (exact definitions in rl/dispatch.py).
  INTERRUPT every engine stops at the current token boundary; in-flight `RolloutState`s (KV cache,
            routing trace, logprobs, versions) leave the pool (KV parked on the device or in host memory:
            `engine.park_kv`).
  TRAIN     one optimizer step, data-parallel over the workers (a group is never split; groups are dealt
            to workers by length so they finish together); the weights change in place; policy_version += 1.
  RESUME    the states go back into the KV pools and generation continues from the exact token with
            no prefill. New tokens carry the new version, so each sample's segments
            [(start, end, version)] and its concatenated routing trace record where it changed hands.

Checkpoints (rl/checkpoint/format.py) are taken at the top of the ROLLOUT loop, a token boundary: every
engine is interrupted, pending rewards are collected, the controller state (`state_dict`) and the
workers' states are written, and generation resumes (or, on SIGTERM, the job exits). A restored job
re-enters the loop at the same point, so it continues exactly as the uninterrupted one would.

Departures from the textbook: the behaviour logprob in the clipped ratio is recorded per token at
generation time, so a sample spanning several versions is corrected token by token; `sync` is this
same loop with no overlap between rollout and training (the baseline).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Sequence

from pydantic import ValidationError

from rewards.task import Problem
from rl import reconfigure
from rl.algo import repercussion
from rl.config import GRPOStage, OPDStage
from rl.dispatch import Dispatcher, FinishedMeta, Ticket
from rl.faults import fault_point
from rl.train.losses import group_advantages
from rl.metrics import RolloutClock, rollout_breakdown
from rl.train.parallel import deal_by_length
from rl.algo.streams import Cursor
from rl.algo.job import Job, StageResult
from rl.train.trainer import TrainBatch, timed_train_step
from rl.types import Prompt, Sample
from rollout.types import Generation, GenerationRequest


def _group_cost(group) -> int:
    """What a forward/backward processes for a group: its samples' prompt + response tokens."""
    return sum(len(s.prompt_tokens) + len(s.response_tokens) for s in group)


def mini_batch_groups(groups: list, count: int, n_workers: int) -> list[list[int]]:
    """Indices of `groups` in each of `count` mini-batches (`GRPOStage.mini_batches`): whole groups dealt so the
    mini-batches' tokens are about equal (rl/train/parallel.py `deal_by_length`), each with at least one group per
    worker (fewer mini-batches when the step has fewer groups), ordered by their smallest index."""
    count = max(1, min(count, len(groups) // max(n_workers, 1)))
    if count == 1:
        return [list(range(len(groups)))]
    return sorted(deal_by_length([_group_cost(g) for g in groups], count))


def prompt_id_of(sample_id: str) -> str:
    return sample_id.rsplit("-", 1)[0]


def uniform_groups(ready: dict[str, int], finished: dict[str, list[Sample]], on_failure: str | None) -> list[str]:
    """GRPOStage.dynamic_sampling: the ready groups (prompt id -> group size) whose rewards are all in and all equal
    within each effort group among the samples a train step would use (rl/algo/repercussion.py), so that every advantage
    would be 0. A group still waiting for a reward stays: its last reward may differ."""
    out = []
    for pid, size in ready.items():
        group = finished.get(pid, [])
        rewards: dict[str, set[float]] = defaultdict(set)
        for s in repercussion.trained(group, on_failure):
            rewards[s.group_id].add(s.reward)
        if len(group) == size and rewards and all(len(r) == 1 for r in rewards.values()):
            out.append(pid)
    return out


def tool_call_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """A step's tool calls (multi-turn samples; none: {}): calls a sample, and the mean and largest seconds from a
    call's parse to its output (rl/runtime/tool_turns.py; sandbox admission and exec): what holds samples off the
    engine while they wait."""
    walls = [t.wall_s for s in samples for t in s.turns if t.kind == "tool" and t.wall_s is not None]
    if not walls:
        return {}
    return {"rollout/tool_calls_per_sample": len(walls) / len(samples),
            "rollout/tool_call_s_mean": sum(walls) / len(walls), "rollout/tool_call_s_max": max(walls)}


def verified_group_ids(ready: dict[str, int], finished: dict[str, list[Sample]]) -> set[str]:
    """The ready groups (prompt id -> group size) that have every sample's reward in."""
    return {pid for pid, size in ready.items() if len(finished.get(pid, ())) >= size}


def verified_groups(ready: dict[str, int], finished: dict[str, list[Sample]]) -> int:
    """How many of the ready groups have every sample's reward in."""
    return len(verified_group_ids(ready, finished))


class AsyncGRPO:
    """One GRPO or OPD stage's controller state and loop, on the job's workers."""

    def __init__(self, job: Job, stage: GRPOStage, stage_idx: int):
        self.job, self.stage, self.stage_idx = job, stage, stage_idx
        recipe, tasks = job.recipe, job.stage_tasks(stage)
        self.tasks = tasks
        self.policy = job.policy
        self.n_workers = len(self.policy)
        self.disp = Dispatcher(stage.dispatch, datasets=list(tasks), group_size=stage.group_size,
                               prompts_per_step=stage.prompts_per_step, seed=recipe.run.seed + stage_idx,
                               id_prefix=f"s{stage_idx}-p")
        self.disp.version = job.state.global_step
        self.streams = {d: Cursor(task, seed_offset=2000 + stage_idx) for d, task in tasks.items()}
        self.prompts: dict[str, tuple[Prompt, Problem]] = {}
        self.finished: dict[str, list[Sample]] = defaultdict(list)  # prompt_id -> rewarded samples
        self.load = [0] * self.n_workers  # unfinished samples per worker
        self.pending_rewards: list[tuple[object, list[Generation]]] = []
        self.unverified: Counter[str] = Counter()  # prompt_id -> its samples with a verdict still out
        self.closed_unverified: set[str] = set()  # closed groups (filtered, stale, discarded) with verdicts still out
        self.effort_of: dict[str, int | None] = {}  # sample_id -> effort level, while in flight
        self.clock = RolloutClock()
        self._writer_seen = job.store.writer_s  # the store's writer seconds already in the clock
        self.pipelined = self.policy.remote and stage.pipelined_calls
        self._ahead: deque = deque()  # rollout calls queued on the workers, their results not read yet (oldest first)
        self._requests: dict[int, list[GenerationRequest]] = {}  # released, to ride on the next rollout call
        self.step = 0  # train steps of this stage so far
        opd = stage.teachers if isinstance(stage, OPDStage) else None
        self.live = reconfigure.LiveConfig(
            version=0, mixture=dict(stage.dispatch.mixture), caps=dict(stage.dispatch.dataset_max_inflight),
            assignment={d: opd.teacher_for(d) for d in tasks if opd and opd.teacher_for(d)},
            teachers={t.name: t for t in opd.teachers} if opd else {})
        self.teacher_of: dict[str, str | None] = {}  # prompt_id -> teacher assigned at dispatch
        self.prompts_too_long = 0  # problems skipped because their prompt exceeds engine.prompt_limit (since start/resume)
        self.on_failure = recipe.tools.on_failure if recipe.tools is not None else None
        self.skips_uniform = (stage.skip_uniform_groups and type(stage) is GRPOStage and stage.kl_ref_coef == 0
                              and stage.entropy_coef == 0 and not recipe.model.is_sparse)
        """Groups whose advantages are all 0 leave the trainer's step (GRPOStage.skip_uniform_groups)."""
        self.filters_uniform = stage.dynamic_sampling and type(stage) is GRPOStage
        """Groups whose rewards are all equal leave before a batch is taken (GRPOStage.dynamic_sampling)."""
        self.filtered_in_a_row = 0  # groups filtered since the last train step

    # -- checkpoint state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Controller state at a token boundary with pending rewards collected (see module docstring); the
        checkpoint stores it as records (rl/algo/records.py), and `load_state_dict` takes them parsed back."""
        assert not self.pending_rewards
        live = set(self.disp.unfinished_prompt_ids()) | set(self.finished)
        return {"dispatcher": self.disp.state_dict(), "streams": {d: c.drawn for d, c in self.streams.items()},
                "prompts": {pid: self.prompts[pid] for pid in live},
                "finished": {pid: [s.sample_id for s in ss] for pid, ss in self.finished.items()},
                "effort_of": dict(self.effort_of), "clock": self.clock, "step": self.step, "live": self.live,
                "teacher_of": {pid: self.teacher_of.get(pid) for pid in live}}

    def load_state_dict(self, state: dict, inflight_ids: list[list[str]]) -> None:
        self.disp.load_state_dict(state["dispatcher"])
        for d, n in state["streams"].items():
            self.streams[d].skip_to(n)
        self.prompts = dict(state["prompts"])
        self.finished = defaultdict(list, {pid: [self.job.store.get_sample(i) for i in ids]
                                           for pid, ids in state["finished"].items()})
        self.effort_of, self.clock, self.step = dict(state["effort_of"]), state["clock"], state["step"]
        self.load = [len(ids) for ids in inflight_ids]
        self.teacher_of = dict(state["teacher_of"])
        self.use_live(state["live"])
        # teachers added live before this checkpoint are not in the recipe the workers' pools came from
        original = {t.name for t in self.stage.teachers.teachers} if isinstance(self.stage, OPDStage) else set()
        added = [t for name, t in self.live.teachers.items() if name not in original]
        if added:
            self.policy.add_teachers(added)
        # patches applied after this checkpoint (answered, so out of the inbox) are applied again, in order
        for answer in sorted(reconfigure.answers(self.job.run_dir), key=lambda a: a.get("version") or 0):
            if answer.get("status") == "applied" and answer.get("stage") == self.stage_idx and answer["version"] > self.live.version:
                self.apply_patch(reconfigure.ReconfigPatch.model_validate(answer["patch"]), pid=None)

    # -- the phases ------------------------------------------------------------------------------------
    def release(self, tickets: list[Ticket]) -> None:
        job, effort, sampling = self.job, self.job.recipe.effort, self.job.recipe.engine.sampling
        per_worker: dict[int, list[GenerationRequest]] = defaultdict(list)
        prompts = []
        for t in tickets:
            # With effort conditioning the group is M_b samples at each level b (one group to the dispatcher).
            levels = [b for b in effort.levels for _ in range(effort.samples_per_level)] if effort else [None] * t.group_size
            problem, rendered, dropped = job.renderer.draw_fitting(self.streams[t.dataset], levels)
            self.prompts_too_long += dropped  # longer than the engine takes: skipped, counted, never generated
            plain = rendered[None] if None in rendered else job.renderer.render(problem)  # the prompt without effort
            prompt = Prompt(t.prompt_id, t.dataset, plain.text, plain.ids, problem.answer, t.group_size, t.version,
                            self.live.version)
            self.teacher_of[t.prompt_id] = self.live.teacher_for(t.dataset)
            self.prompts[t.prompt_id] = (prompt, problem)
            prompts.append(prompt)
            for j, b in enumerate(levels):  # engines split the in-flight samples, least-loaded first
                w = min(range(self.n_workers), key=self.load.__getitem__)
                self.load[w] += 1
                sid = f"{t.prompt_id}-{j}"
                self.effort_of[sid] = b
                toks = rendered[b].ids
                forced = job.tasks[t.dataset].response_budget(problem, j)
                # a forced length as the budget or, `forced_length == "eos"`, as an end the engine meets only when
                # it comes (rewards/longtail.py); either way the policy's own EOS is ignored: a random policy samples
                # one every ~vocabulary tokens, which would cut the drawn lengths short
                at_eos = forced is not None and getattr(job.tasks[t.dataset], "forced_length", "budget") == "eos"
                per_worker[w].append(GenerationRequest(
                    sid, toks, forced if forced is not None and not at_eos else job.recipe.max_response_tokens,
                    seed=job.renderer.sample_seed(sid), temperature=sampling.temperature, top_p=sampling.top_p,
                    ignore_eos=forced is not None, eos_at=forced if at_eos else None,
                    tool_calls=job.renderer.uses_tools(t.dataset)))
        t_store = time.perf_counter()
        job.store.add_prompts(prompts)  # one transaction a release (before any of their samples can be written)
        self.clock.store_s += time.perf_counter() - t_store
        if self.pipelined:  # they ride on the next rollout call (rollout_call), queued behind the one now running
            for w, reqs in per_worker.items():
                self._requests.setdefault(w, []).extend(reqs)
        else:
            self.policy.add_requests(dict(per_worker))

    def collect_rewards(self, block: bool) -> None:
        """Read the reward workers' verdicts into the store and the finished groups: all of them (`block`), or those
        ready now, in whatever order they came (a slow batch on one worker holds up none behind it on another)."""
        rewards, clock = self.job.rewards, self.clock
        while self.pending_rewards:
            if block:
                fut, gens = self.pending_rewards.pop(0)
            else:
                i = next((i for i, (f, _) in enumerate(self.pending_rewards) if rewards.ready(f)), None)
                if i is None:
                    break
                fut, gens = self.pending_rewards.pop(i)
            t0 = time.perf_counter()
            verdicts = rewards.get(fut)
            clock.verify_s += time.perf_counter() - t0
            self.unverified.subtract(prompt_id_of(g.sample_id) for g in gens)
            samples = [self.job.renderer.to_sample(*self.prompts[prompt_id_of(g.sample_id)], g, verdict,
                                          status="discarded" if self.disp.is_discarded(prompt_id_of(g.sample_id)) else "finished",
                                          effort=self.effort_of.pop(g.sample_id),
                                          teacher=self.teacher_of.get(prompt_id_of(g.sample_id)))
                       for g, verdict in zip(gens, verdicts)]
            if self.on_failure is not None:  # repercussion of sandbox failures (rl/algo/repercussion.py)
                samples = [repercussion.settle(s, self.on_failure) for s in samples]
            t0 = time.perf_counter()
            self.job.store.add_samples(samples)
            clock.store_s += time.perf_counter() - t0
            for s in samples:
                if s.status == "finished" and s.prompt_id not in self.closed_unverified:
                    self.finished[s.prompt_id].append(s)
            for pid in {s.prompt_id for s in samples}:
                if self.unverified[pid] <= 0:
                    del self.unverified[pid]
                    if pid in self.closed_unverified:
                        self.closed_unverified.discard(pid)
                        self.forget(pid)
        if self.filters_uniform:
            self.filter_uniform_groups()
        self.record_closed()

    def filter_uniform_groups(self) -> None:
        """GRPOStage.dynamic_sampling: drop the ready groups without a reward spread; say so when ten train steps'
        worth of groups in a row had none (verl's max_num_gen_batches stops the run there; this one goes on)."""
        uniform = uniform_groups(self.disp.ready_group_sizes(), self.finished, self.on_failure)
        before, self.filtered_in_a_row = self.filtered_in_a_row, self.filtered_in_a_row + len(uniform)
        self.disp.filter_ready(uniform)
        bound = 10 * self.stage.prompts_per_step
        if self.filtered_in_a_row // bound > before // bound:
            rewards = sorted({s.reward for pid in uniform for s in self.finished[pid]})
            self.job.say(f"dynamic_sampling: {self.filtered_in_a_row} groups in a row since train step {self.step} had "
                         f"equal rewards ({', '.join(f'{r:g}' for r in rewards[:4])}): the data may be too hard or too "
                         f"easy for the policy")

    VERDICT_BACKLOG = 2
    """Train steps' worth of complete groups whose verdicts may be out while the engines keep generating
    (`verdicts_backlogged`): past it the controller waits for them, as a bounded queue does."""

    def verdicts_backlogged(self) -> bool:
        """More complete groups wait for their verdicts than VERDICT_BACKLOG train steps take."""
        ready = self.disp.ready_group_sizes()
        unverified = len(ready) - verified_groups(ready, self.finished)
        return unverified >= self.VERDICT_BACKLOG * self.stage.prompts_per_step

    def batch_may_form(self, generating: bool = True) -> bool:
        """Enough complete groups for a train batch. While the engines generate, only the groups whose rewards are
        all in count: waiting for the verdicts of a group just finished (the reward workers are a call behind) would
        leave the GPU idle while the engines could run the next call, during which they arrive (issue #41: the
        SmolLM2 job spent 30% of its rollout time in that wait). With dynamic sampling a group still being verified may
        also yet be filtered out. The batch is then taken from those verified groups (rollout_until_batch), without a
        wait. With nothing generating there is nothing else to do: the controller waits for the verdicts."""
        if not generating:
            return self.disp.num_ready_groups >= self.stage.prompts_per_step
        return verified_groups(self.disp.ready_group_sizes(), self.finished) >= self.stage.prompts_per_step

    def store_writer_s(self) -> float:
        """RolloutClock.store_writer_s, brought up to the store's writer thread's seconds so far."""
        seen, self._writer_seen = self._writer_seen, self.job.store.writer_s
        self.clock.store_writer_s += self._writer_seen - seen
        return self.clock.store_writer_s

    def record_closed(self) -> None:
        """The outcomes of the groups that left without training; what the controller held for them goes (now, or
        when their last verdict comes in: a group can close before its verdicts do)."""
        by_outcome: dict[str, list[str]] = defaultdict(list)
        for pid, outcome in self.disp.drain_closed():
            by_outcome[outcome].append(pid)
            if self.unverified[pid] > 0:  # (collect_rewards keeps only positive counts)
                self.closed_unverified.add(pid)
                self.finished.pop(pid, None)
            else:
                self.forget(pid)
        for outcome, pids in by_outcome.items():
            self.job.store.set_outcome(pids, outcome)

    def forget(self, pid: str) -> None:
        """A group that is trained or closed: its prompt, teacher and rewarded samples are not needed again (a job
        that filters most groups, DAPO's dynamic sampling, kept every filtered prompt until it ended)."""
        self.prompts.pop(pid, None)
        self.teacher_of.pop(pid, None)
        self.finished.pop(pid, None)

    def tokens_of(self, pid: str) -> tuple[int, int]:
        ss = self.finished[pid]
        return sum(s.num_response_tokens for s in ss), sum(v < self.disp.version for s in ss for v in s.policy_versions_T)

    # -- live reconfiguration (rl/reconfigure.py) --------------------------------------------------------
    def use_live(self, live: reconfigure.LiveConfig) -> None:
        self.live = live
        self.disp.reconfigure(live.mixture, live.caps)

    def validated(self, patch: reconfigure.ReconfigPatch, step: int) -> reconfigure.LiveConfig:
        """The live config `patch` makes, once this job has checked it can run it (issue 40: what the CLI's checks let
        through used to kill the job): the stage's rules on a copy of the live config, the dispatcher's config
        validated as a recipe's, every added teacher loaded on every worker (all or none). ReconfigError (one line)
        with nothing changed otherwise."""
        new = reconfigure.apply_patch(self.live, patch, list(self.tasks), self.job.recipe.model.vocab_size, step,
                                      group_size=self.stage.group_size, opd=isinstance(self.stage, OPDStage))
        try:
            self.disp.reconfigured(new.mixture, new.caps)
        except ValidationError as e:
            raise reconfigure.ReconfigError(f"dispatch: {e.errors(include_url=False)[0]['msg']}") from None
        if patch.add_teachers:
            try:
                self.policy.add_teachers(list(patch.add_teachers))
            except ValueError as e:  # a worker's one line (through Ray: its traceback, then "ValueError: " and the line)
                self.policy.remove_teachers([t.name for t in patch.add_teachers])  # the workers that loaded them
                line = str(e).strip().splitlines()[-1].removeprefix("ValueError: ")
                raise reconfigure.ReconfigError(f"add_teachers: {line}") from None
        return new

    def apply_patch(self, patch: reconfigure.ReconfigPatch, pid: str | None) -> dict:
        """Apply (new config version) or refuse one patch; `pid`: the claimed inbox entry to answer (rl/reconfigure.py);
        None: a patch answered before a resume, applied again (through the same validation)."""
        job, step = self.job, self.job.state.global_step
        try:
            new = self.validated(patch, step)
        except reconfigure.ReconfigError as e:
            return self.refuse(pid, str(e), patch.model_dump(mode="json", exclude_defaults=True))
        self.use_live(new)
        result = {"status": "applied", "version": new.version, "train_step": step, "stage": self.stage_idx,
                  "patch": new.history[-1]["patch"]}
        job.store.add_config_version(new.version, "applied", result["patch"], step)
        job.say(f"reconfigure: config version {new.version} at train step {step}: {result['patch']}")
        job.logger.log({"config/version": new.version}, step=step)
        if pid is not None:
            reconfigure.answer(job.run_dir, pid, result)
        return result

    def refuse(self, pid: str | None, reason: str, patch: dict) -> dict:
        """A refused patch: answered (never re-applied by a resume), recorded in the store, said in the log."""
        step = self.job.state.global_step
        result = {"status": "refused", "reason": reason, "stage": self.stage_idx, "patch": patch}
        self.job.store.add_config_version(None, "refused", patch, step, reason=reason)
        self.job.say(f"reconfigure: refused at train step {step}: {reason}")
        if pid is not None:
            reconfigure.answer(self.job.run_dir, pid, result)
        return result

    def poll_control(self) -> None:
        for pid, _ in reconfigure.claimed(self.job.run_dir):  # claimed by a job that died validating it
            self.refuse(pid, "the job stopped while validating this patch (did loading a teacher kill a worker?); "
                        "not applied", {})
        for pid, path in reconfigure.pending(self.job.run_dir):
            try:
                patch = reconfigure.parse_patch(path.read_text(), source=path.name)
            except (reconfigure.ReconfigError, OSError, UnicodeDecodeError) as e:
                self.refuse(pid, str(e) if isinstance(e, reconfigure.ReconfigError) else f"{path.name}: unreadable "
                            f"({type(e).__name__})", {})
                continue
            try:
                reconfigure.claim(self.job.run_dir, pid)  # until answered: a resume refuses what this job died validating
            except FileNotFoundError:  # taken out of the inbox meanwhile (by hand): nothing to answer
                continue
            self.apply_patch(patch, pid)

    def checkpoint_point(self) -> None:
        """A token boundary where the job may checkpoint (periodically, or on SIGTERM: then exit)."""
        if self.job.checkpointer.wanted(self.job.state.global_step):
            t0 = time.perf_counter()
            self.drain()  # a queued call's finished samples belong in the checkpoint's controller state
            self.policy.interrupt()
            self.collect_rewards(block=True)
            self.job.checkpointer.save(self.job, self.stage_idx, self.state_dict())  # raises Preempted after a SIGTERM
            self.policy.resume()
            self.clock.checkpoint_s += time.perf_counter() - t0

    def rollout_until_batch(self, deadline: float | None = None) -> list[str] | None:
        """ROLLOUT until the dispatcher's train-batch condition holds; returns the batch's prompt ids, or None when
        the stage's time budget (`deadline`, time.monotonic()) ends first: at the token boundary of a rollout call,
        not after one more step (with dynamic sampling a batch can take long to fill, or never)."""
        disp, clock = self.disp, self.clock
        # released in the previous `calls_ahead` rounds: pipelined, maybe not yet seen in the results read
        before: deque[list[Ticket]] = deque(maxlen=self.stage.calls_ahead)
        idle = False  # the last call left nothing generating and nothing was released to generate next
        while True:
            self.poll_control()
            self.checkpoint_point()
            stop = False
            # this call's prompts, samples and outcomes: one transaction, written by the store's own thread while the
            # engines run the next call (rl/store/trajectories.py); the controller's reads and other writes wait for it
            with self.job.store.batch(background=True):
                t0, store0 = time.perf_counter(), clock.store_s
                tickets = disp.dispatch()
                if idle and not tickets:  # asked again after the idle call's completions (dynamic sampling drops groups)
                    raise RuntimeError(f"rollout stalled at step {self.step}: nothing in flight, the dispatcher releases nothing "
                                       f"and no batch fits the off-policy bounds ({disp.stats})")
                self.release(tickets)
                clock.dispatch_s += time.perf_counter() - t0 - (clock.store_s - store0)  # its store writes are in store_s
                results = self.rollout_call()
                self.absorb(results)
                batch = None
                # go on generating while verdicts are out, unless the complete groups waiting for theirs pass the bound
                # (reward workers that fall behind, or hang: the wait below is bounded by runtime.worker_timeout_s)
                generating = any(r.active or r.waiting for r in results) and not self.verdicts_backlogged()
                if self.batch_may_form(generating):
                    inflight_versions = [v for r in results for v in r.oldest_versions]
                    if generating:
                        # the batch from the groups whose verdicts are all in (with dynamic sampling the uniform ones
                        # among them filtered as they came): no wait for the verdicts still out (batch_may_form); they
                        # stay ready for a later batch
                        verified = verified_group_ids(disp.ready_group_sizes(), self.finished)
                        batch = disp.take_batch(inflight_versions, self.tokens_of, eligible=verified.__contains__)
                    else:
                        verify0 = clock.verify_s
                        self.collect_rewards(block=True)  # a ready group's rewards must be in before it trains
                        clock.reward_waits += 1
                        clock.reward_wait_s += clock.verify_s - verify0
                        batch = disp.take_batch(inflight_versions, self.tokens_of)
                    self.record_closed()
                if batch is not None:
                    # the batch became ready at the step that finished its last member in this call
                    chosen = set(batch)
                    ready_at = max((i for r in results for g, i in zip(r.finished, r.finish_step)
                                    if prompt_id_of(g.sample_id) in chosen), default=-1)
                    steps_run = max(r.steps for r in results)
                    late = self.drain()  # a call queued behind this one ran too: its samples wait for later batches
                    clock.interrupt_late_steps.append((max(0, steps_run - 1 - ready_at) if ready_at >= 0 else 0) + late)
                    self.filtered_in_a_row = 0
                elif deadline is not None and time.monotonic() >= deadline:
                    self.drain()  # a queued call's finished samples reach the dispatcher and the store
                    stop = True
            clock.store_s += self.job.store.last_commit_s
            if batch is not None or stop:
                return batch
            unseen = [t for r in before for t in r] if self.pipelined else []
            before.append(tickets)
            idle = not tickets and not unseen and not any(r.active or r.waiting for r in results)

    def rollout_call(self):
        """One rollout call's results. Pipelined (Ray workers, `pipelined_calls`): `calls_ahead` more calls are queued
        on the workers first, the newest carrying the new requests (queued at its start), so they run them while this
        controller reads and handles these results; the prompts released now join `calls_ahead` calls later than
        without pipelining."""
        steps = self.stage.steps_per_call
        if not self.pipelined:
            return self.policy.rollout(steps)
        requests, self._requests = self._requests, {}
        if not self._ahead:  # after a drain: the first call takes the requests, the queue fills behind it
            self._ahead.append(self.policy.submit_rollout(steps, requests))
            requests = {}
        while len(self._ahead) < self.stage.calls_ahead:
            self._ahead.append(self.policy.submit_rollout(steps, {}))
        self._ahead.append(self.policy.submit_rollout(steps, requests))
        self.clock.pipelined_calls += 1
        return self.policy.results(self._ahead.popleft())

    def drain(self) -> int:
        """Read and handle the rollout calls still queued on the workers (before an interrupt, a checkpoint or a
        train step: their finished samples must reach the dispatcher and the store); returns their engine steps."""
        if self._requests:  # released without a rollout call after them (none in the loop): queued now
            requests, self._requests = self._requests, {}
            self.policy.add_requests(requests)
        steps = 0
        while self._ahead:
            results = self.policy.results(self._ahead.popleft())
            self.absorb(results)
            steps += max((r.steps for r in results), default=0)
        return steps

    def absorb(self, results) -> None:
        """A rollout call's results: finished samples to the dispatcher and to the reward workers."""
        disp, clock = self.disp, self.clock
        gens = [g for r in results for g in r.finished]
        for w, r in enumerate(results):
            self.load[w] -= len(r.finished)
        if results:
            clock.add_concurrency(sum(r.generated / max(r.steps, 1) for r in results))
            clock.engine_s += max(r.seconds for r in results)
            clock.worker_gap_s += sum(r.gap_s for r in results) / len(results)
            clock.engine_steps += max(r.steps for r in results)
            clock.prefill_calls += sum(r.prefill_calls for r in results)
            clock.parks += sum(r.parks for r in results)
            clock.parked_bytes += sum(r.parked_bytes for r in results)
            clock.reprefill_tokens += sum(r.reprefill_tokens for r in results)
            clock.parked = sum(r.parked for r in results)
            clock.kv_used_sum += sum(r.kv_used_frac for r in results) / len(results)
            clock.kv_used_calls += 1
        clock.generated_tokens += sum(r.generated for r in results)
        self.job.progress.generated(sum(r.generated for r in results), self.job.state.global_step)
        for g in gens:
            disp.on_finished(FinishedMeta(g.sample_id, prompt_id_of(g.sample_id), len(g.response_tokens),
                                          min(g.policy_versions)))
        self.unverified.update(prompt_id_of(g.sample_id) for g in gens)
        if gens:
            items = [self.job.renderer.trajectory(self.prompts[prompt_id_of(g.sample_id)][1], g) for g in gens]
            t0 = time.perf_counter()
            self.pending_rewards.append((self.job.rewards.submit(items), gens))
            clock.verify_s += time.perf_counter() - t0
        self.collect_rewards(block=False)

    def train_step(self, batch: list[str], held: list[dict]) -> dict:
        """TRAIN one optimizer step (or `stage.mini_batches`) on whole groups, data-parallel across the workers."""
        job, stage, policy, disp, clock = self.job, self.stage, self.policy, self.disp, self.clock
        t_train = time.perf_counter()
        whole = [self.finished.pop(pid) for pid in batch]
        # repercussion: under tools.on_failure=leave_loss a sample a sandbox failure ended leaves the step, its
        # tokens and its group's baseline (rl/algo/repercussion.py); `whole` keeps it for the rollout metrics
        groups = [repercussion.trained(g, self.on_failure) for g in whole]
        samples = [s for g in groups for s in g]
        adv = dict(zip((s.sample_id for s in samples), group_advantages(
            [s.reward for s in samples], [s.group_id for s in samples], std_normalize=stage.std_normalize)))
        num_tokens = float(sum(s.num_trained_tokens for s in samples))  # tool-output tokens are not trained
        computed = groups  # the groups the forward and backward see; `samples` keeps every one: they are in the step
        if self.skips_uniform:  # every loss term is x advantage: these groups' gradient is exactly 0 (GRPOStage)
            uniform = [i for i, g in enumerate(groups) if g and all(adv[s.sample_id] == 0.0 for s in g)]
            left = set(uniform[max(0, self.n_workers - (len(groups) - len(uniform))):])  # each worker keeps >= 1 group
            computed = [g for i, g in enumerate(groups) if i not in left]
            self.clock.uniform_groups_skipped += len(left)
        teacher: dict[str, str] = {}
        if isinstance(stage, OPDStage):  # each sample's teacher; a removed teacher's samples go to the new one
            teacher = {s.sample_id: self.live.scoring_teacher(s.teacher, s.dataset) for s in samples}
            moved: dict[str, list[str]] = defaultdict(list)
            for s in samples:
                if teacher[s.sample_id] != s.teacher:
                    moved[teacher[s.sample_id]].append(s.sample_id)
            for name, ids in moved.items():
                job.store.set_teacher(ids, name)
        # whole groups to mini-batches, then each mini-batch's groups to ranks, balanced by tokens so the ranks
        # finish each optimizer step together (rl/train/parallel.py); a mini-batch's normaliser is its share of the step's
        mini = mini_batch_groups(computed, stage.mini_batches, self.n_workers)
        trained = [sum(s.num_trained_tokens for i in part for s in computed[i]) for part in mini]
        per_rank: list[list[TrainBatch]] = [[] for _ in range(self.n_workers)]
        for part, tokens in zip(mini, trained):
            groups_j = [computed[i] for i in part]
            norm = num_tokens * tokens / max(sum(trained), 1) if len(mini) > 1 else num_tokens
            for w, ranked in enumerate(deal_by_length([_group_cost(g) for g in groups_j], self.n_workers)):
                shard = [s for i in ranked for s in groups_j[i]]
                per_rank[w].append(TrainBatch.from_samples(shard, [adv[s.sample_id] for s in shard], norm,
                                                           [teacher[s.sample_id] for s in shard] if teacher else None))
        metrics = timed_train_step(policy, per_rank, stage)
        if isinstance(stage, OPDStage):
            metrics["opd/teachers_in_step"] = len(set(teacher.values()))  # across ranks, not rank 0's
        fault_point("train")
        t_update = time.perf_counter()
        version = job.advance_version()
        clock.weight_update_s += time.perf_counter() - t_update
        disp.on_train_step()
        job.store.mark_trained([s.sample_id for s in samples], version)
        job.store.set_outcome(batch, "trained")
        for pid in batch:
            self.forget(pid)
        clock.train_s += time.perf_counter() - t_train

        trained_version = version - 1  # the weights this step's gradient was taken at
        samples = [s for g in whole for s in g]  # the rollout metrics cover the batch, left-out samples included
        versions = [v for s in samples for v in s.policy_versions_T]
        metrics.update({
            "rollout/reward": sum(s.reward for s in samples) / len(samples),
            "rollout/accuracy": sum(s.correct for s in samples) / len(samples),
            "rollout/response_len": len(versions) / len(samples),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/tokens_per_s": clock.generated_tokens / max(clock.rollout_s, 1e-9),
            "rollout/concurrency_mean": clock.concurrency_mean,
            **tool_call_metrics(samples),
            "rollout/prompts_too_long": self.prompts_too_long,
            "async/max_version_lag": max(trained_version - v for v in versions) if versions else 0,
            "async/stale_token_frac": sum(v < trained_version for v in versions) / max(len(versions), 1),
            "async/interrupt_s": clock.interrupt_s[-1],
            "async/states_held": sum(h["states"] for h in held),
            "async/state_bytes_held": sum(h["bytes"] for h in held),
            "dispatch/inflight": disp.total_inflight,
            "dispatch/cap_skips": disp.stats.cap_skips,
            "dispatch/discarded_samples": disp.stats.discarded_samples,
            "dispatch/dropped_stale_groups": disp.stats.dropped_stale_groups,
            "dispatch/filtered_groups": disp.stats.filtered_groups,
            "dispatch/lag_waits": disp.stats.lag_waits,
            "dispatch/frac_waits": disp.stats.frac_waits,
            "dispatch/capacity_waits": disp.stats.capacity_waits,
            "train/policy_version": version,
            "config/version": self.live.version,
            "time/rollout_s": clock.rollout_s,
            "time/engine_s": clock.engine_s,  # of time/rollout_s: the workers' rollout calls; the rest the controller's
            "time/worker_gap_s": clock.worker_gap_s,  # of the rest: the workers waiting between consecutive calls
            "time/verify_s": clock.verify_s,  # of the controller's: submitting to and reading the reward workers
            "time/reward_wait_s": clock.reward_wait_s,  # of verify_s: blocked for verdicts before taking a batch
            "rollout/reward_waits_total": clock.reward_waits,
            "time/store_s": clock.store_s,  # and building the store's rows (a call's writes: on the store's thread)
            "time/store_writer_s": self.store_writer_s(),  # the store's thread running them (beside the controller)
            "time/dispatch_s": clock.dispatch_s,  # and drawing, rendering and tokenising new prompts into requests
            "rollout/engine_steps_total": clock.engine_steps,
            "rollout/prefill_calls_total": clock.prefill_calls,
            "rollout/kv_used_frac": clock.kv_used_sum / max(clock.kv_used_calls, 1),  # the stage's mean over calls
            "rollout/parked": clock.parked,  # samples whose KV is out of the pool, waiting for blocks
            "rollout/parks_total": clock.parks,
            "rollout/parked_bytes_total": clock.parked_bytes,
            "rollout/reprefill_tokens_total": clock.reprefill_tokens,
            "train/uniform_groups_skipped_total": clock.uniform_groups_skipped,
            "time/train_s": clock.train_s,
            "time/weight_update_s": clock.weight_update_s,  # of train_s: the engines take the new weights
            "time/checkpoint_s": clock.checkpoint_s,  # periodic checkpoints taken at token boundaries (not in rollout_s)
            # of the stage's wall time so far, the share in which neither the engines (their rollout calls, timed on the
            # workers) nor the trainer ran: the controller's own work, waits for verdicts, checkpoints
            "time/gpu_idle_share": 1.0 - (clock.engine_s + clock.train_s) / max(
                clock.rollout_s + clock.train_s + clock.checkpoint_s, 1e-9),
        })
        metrics.update(rollout_breakdown(samples))
        if self.on_failure is not None:
            metrics.update(repercussion.failure_counts(samples))
            metrics["rollout/left_out"] = float(len(samples) - sum(map(len, groups)))
        return metrics

    def run(self) -> StageResult:
        """The stage: ROLLOUT until a batch is ready -> INTERRUPT -> TRAIN -> RESUME, `max_steps` times (or
        until the time budget ends), then a stage-end checkpoint with the held-out evaluation."""
        job, stage, policy, clock = self.job, self.stage, self.policy, self.clock
        deadline = job.deadline(stage)
        for step in job.budget(stage, start=self.step):
            t_roll, ckpt0 = time.perf_counter(), clock.checkpoint_s
            batch = self.rollout_until_batch(deadline)
            clock.rollout_s += time.perf_counter() - t_roll - (clock.checkpoint_s - ckpt0)  # periodic checkpoints apart
            if batch is None:  # the time budget ended inside the rollout phase
                break

            # INTERRUPT at the token boundary; in-flight states leave the KV pool (`engine.park_kv`).
            t_sig = time.perf_counter()
            held = policy.interrupt()
            clock.interrupt_s.append(time.perf_counter() - t_sig)
            job.checkpointer.poll(job)  # a background checkpoint whose files are written is committed here

            metrics = self.train_step(batch, held)
            self.step = step + 1

            # RESUME: the engines continue every parked sample from its exact token, with no prefill.
            resumed = policy.resume()
            moved = sum(h["bytes"] for h in held) + sum(r["bytes"] for r in resumed)
            clock.bytes_moved += moved
            metrics["async/state_bytes_moved"] = moved
            job.record_train_step(stage, step, metrics)

        # Stage over: evaluate and checkpoint (a resume with a larger budget continues from here), then drop
        # what is still in flight; its prompts are recorded as dropped at the stage end.
        policy.interrupt()
        self.collect_rewards(block=True)
        metrics = job.stage_end_checkpoint(self.stage_idx, self.state_dict())
        policy.drop_inflight()
        self.collect_rewards(block=True)
        job.store.set_outcome(sorted(set(self.disp.unfinished_prompt_ids()) | set(self.finished)), "dropped_stage_end")
        return StageResult(metrics, clock)


def run_async_grpo(job: Job, stage: GRPOStage, stage_idx: int) -> StageResult:
    job.policy.begin_stage(stage)
    loop = AsyncGRPO(job, stage, stage_idx)
    restored = job.checkpointer.restore_stage(job)
    if restored is not None:  # the checkpoint's in-flight samples continue from their exact token
        loop.load_state_dict(restored, job.checkpointer.restore_inflight(job))
        job.policy.resume()
    return loop.run()
