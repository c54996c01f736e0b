"""The controller's checkpoint records: live objects <-> plain JSON records (layout: rl/checkpoint/format.py).

Every record type has a `*_to_record` / `*_from_record` pair here (the dispatcher's own record is in
rl/dispatch.py). Records hold field values only, never class or module names, so renaming a Python class
cannot break a resume; a record with missing or unexpected fields is refused with one line instead of
being half-read. `controller_to_record` / `controller_from_record` assemble the whole `controller.json`.
"""

from __future__ import annotations

from dataclasses import fields

from rewards.task import Problem
from rl.metrics import RolloutClock
from rl.checkpoint.format import CheckpointError, check_plain
from rl.dispatch import parse_state as parse_dispatcher_state
from rl.reconfigure import LiveConfig
from rl.store.trajectories import Watermark
from rl.types import Prompt
from teachers.config import TeacherSpec

ASYNC_STAGES = ("grpo", "opd")
"""Stage types whose loop is rl/algo/async_grpo.py (AsyncLoop record); `sft` has the SFTLoop record."""


def fields_record(obj) -> dict:
    """A dataclass's fields by name (values must already be plain)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def from_fields(cls, record: dict, what: str):
    """`cls(**record)`, refusing unexpected fields (a missing one without a default fails in `cls`)."""
    if not isinstance(record, dict):
        raise ValueError(f"{what}: expected a record, got {type(record).__name__}")
    unexpected = set(record) - {f.name for f in fields(cls)}
    if unexpected:
        raise ValueError(f"{what}: unexpected fields {sorted(unexpected)}")
    return cls(**record)


def _exact(record: dict, keys: tuple[str, ...], what: str) -> dict:
    if not isinstance(record, dict) or set(record) != set(keys):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{what}: expected fields {sorted(keys)}, got {got}")
    return record


# -- small records ------------------------------------------------------------------------------------------
def random_state_to_record(state: tuple) -> list:
    """`random.Random.getstate()` -> [version, [625 ints], gauss_next]."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def random_state_from_record(record: list) -> tuple:
    version, internal, gauss = record
    return version, tuple(int(x) for x in internal), gauss


def problem_to_record(p: Problem) -> dict:
    """A task's Problem as its own JSON record (rewards.task.Problem.to_record)."""
    return p.to_record()


def problem_from_record(d: dict) -> Problem:
    d = _exact(d, ("problem_id", "dataset", "prompt", "answer", "metadata"), "problem")
    return Problem.from_record(d)


def prompt_to_record(p: Prompt) -> dict:
    return dict(fields_record(p), tokens=list(p.tokens))


def prompt_from_record(d: dict) -> Prompt:
    prompt = from_fields(Prompt, d, "prompt")
    return Prompt(**dict(fields_record(prompt), tokens=tuple(int(t) for t in prompt.tokens)))


def clock_to_record(c: RolloutClock) -> dict:
    return {f.name: list(v) if isinstance(v := getattr(c, f.name), list) else v for f in fields(c)}


def clock_from_record(d: dict) -> RolloutClock:
    clock = from_fields(RolloutClock, d, "clock")
    if "concurrency_calls" not in d:  # written before the window (RolloutClock.concurrency): it holds every call
        clock.concurrency_sum, clock.concurrency_calls = float(sum(clock.concurrency)), len(clock.concurrency)
    return clock


def live_config_to_record(live: LiveConfig) -> dict:
    return {"version": live.version, "mixture": dict(live.mixture), "caps": dict(live.caps),
            "assignment": dict(live.assignment),
            "teachers": {name: spec.model_dump(mode="json") for name, spec in live.teachers.items()},
            "history": [dict(h) for h in live.history]}


def live_config_from_record(d: dict) -> LiveConfig:
    d = _exact(d, ("version", "mixture", "caps", "assignment", "teachers", "history"), "live config")
    return LiveConfig(version=int(d["version"]), mixture=dict(d["mixture"]), caps=dict(d["caps"]),
                      assignment=dict(d["assignment"]),
                      teachers={name: TeacherSpec.model_validate(spec) for name, spec in d["teachers"].items()},
                      history=[dict(h) for h in d["history"]])


def watermark_to_record(wm: Watermark) -> dict:
    return {"seq": wm.seq, "train_step": wm.train_step}


def watermark_from_record(d: dict) -> Watermark:
    d = _exact(d, ("seq", "train_step"), "watermark")
    return Watermark(int(d["seq"]), int(d["train_step"]))


# -- stage loops ---------------------------------------------------------------------------------------------
SFT_KEYS = ("step", "drawn", "rng")
ASYNC_KEYS = ("dispatcher", "streams", "prompts", "finished", "effort_of", "clock", "step", "live", "teacher_of")


def sft_state_to_record(state: dict) -> dict:
    """run_sft's loop state {step, drawn, rng (random.Random state)}."""
    return {"step": state["step"], "drawn": state["drawn"], "rng": random_state_to_record(state["rng"])}


def sft_state_from_record(rec: dict) -> dict:
    rec = _exact(rec, SFT_KEYS, "sft loop")
    return {"step": int(rec["step"]), "drawn": int(rec["drawn"]), "rng": random_state_from_record(rec["rng"])}


def async_state_to_record(state: dict) -> dict:
    """AsyncGRPO.state_dict() (live objects; its dispatcher part is already a record) -> AsyncLoop record."""
    return {"dispatcher": state["dispatcher"], "streams": dict(state["streams"]),
            "prompts": {pid: {"prompt": prompt_to_record(prompt), "problem": problem_to_record(problem)}
                        for pid, (prompt, problem) in state["prompts"].items()},
            "finished": {pid: list(ids) for pid, ids in state["finished"].items()},
            "effort_of": dict(state["effort_of"]), "clock": clock_to_record(state["clock"]), "step": state["step"],
            "live": live_config_to_record(state["live"]), "teacher_of": dict(state["teacher_of"])}


def async_state_from_record(rec: dict) -> dict:
    """AsyncLoop record -> what AsyncGRPO.load_state_dict takes (the dispatcher part stays a record, checked here)."""
    rec = _exact(rec, ASYNC_KEYS, "async loop")
    parse_dispatcher_state(rec["dispatcher"])
    prompts = {}
    for pid, pair in rec["prompts"].items():
        pair = _exact(pair, ("prompt", "problem"), f"prompt {pid}")
        prompts[pid] = (prompt_from_record(pair["prompt"]), problem_from_record(pair["problem"]))
    return {"dispatcher": rec["dispatcher"], "streams": {d: int(n) for d, n in rec["streams"].items()},
            "prompts": prompts, "finished": {pid: [str(i) for i in ids] for pid, ids in rec["finished"].items()},
            "effort_of": dict(rec["effort_of"]), "clock": clock_from_record(rec["clock"]), "step": int(rec["step"]),
            "live": live_config_from_record(rec["live"]), "teacher_of": dict(rec["teacher_of"])}


# -- controller.json -----------------------------------------------------------------------------------------
DRIVER_KEYS = ("stage_idx", "stage_type", "global_step", "stage_minutes", "summary", "recipe_yaml", "num_workers",
               "watermark", "stage_end")


def controller_to_record(driver: dict, stage_state: dict) -> dict:
    """{driver: Driver, stage: SFTLoop | AsyncLoop}. `driver` has DRIVER_KEYS with a Watermark as
    `watermark`; `stage_state` is the loop's state as run_sft / AsyncGRPO.state_dict give it."""
    kind = driver["stage_type"]
    stage = async_state_to_record(stage_state) if kind in ASYNC_STAGES else sft_state_to_record(stage_state)
    record = {"driver": dict(_exact(driver, DRIVER_KEYS, "driver"), watermark=watermark_to_record(driver["watermark"]),
                             summary=dict(driver["summary"])),
              "stage": stage}
    check_plain(record, "controller")
    return record


def controller_from_record(doc: dict) -> dict:
    """controller.json (without its format number) -> the driver fields, `watermark` as a Watermark and
    `stage_state` as the stage loop takes it; CheckpointError (one line) when any record is malformed."""
    try:
        doc = _exact(doc, ("driver", "stage"), "controller")
        driver = dict(_exact(doc["driver"], DRIVER_KEYS, "driver"))
        kind = driver["stage_type"]
        if kind not in ASYNC_STAGES + ("sft",):
            raise ValueError(f"unknown stage type {kind!r}")
        driver["watermark"] = watermark_from_record(driver["watermark"])
        driver["stage_state"] = (async_state_from_record(doc["stage"]) if kind in ASYNC_STAGES
                                 else sft_state_from_record(doc["stage"]))
        return driver
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"controller.json: malformed record ({type(e).__name__}: {e})") from None
