"""Checkpoint records keep every live-config and loop field through a round trip (rl/algo/records.py): what a
live patch changed (per-dataset caps, mixture, the dataset -> teacher assignment, added teachers, the config
version and its history) and the in-flight bookkeeping (each prompt's teacher and each sample's effort level)
come back equal after `controller_to_record` -> JSON -> `controller_from_record`. A field dropped here resumes
silently under the recipe's original settings."""

import json

from rl.algo.records import controller_from_record, controller_to_record
from rl.config import DispatchConfig
from rl.dispatch import Dispatcher
from rl.metrics import RolloutClock
from rl.reconfigure import LiveConfig
from rl.store.trajectories import Watermark
from teachers.config import TeacherSpec


def _live() -> LiveConfig:
    return LiveConfig(version=3, mixture={"a": 0.25, "b": 0.75}, caps={"a": 8, "b": 12},
                      assignment={"a": "big", "b": "added"},
                      teachers={"big": TeacherSpec(name="big", checkpoint="/ckpt/big", datasets=["a"]),
                                "added": TeacherSpec(name="added", checkpoint="/ckpt/added", datasets=["b"])},
                      history=[{"version": 3, "patch": {"caps": {"b": 12}}, "status": "applied", "step": 5}])


def _round_trip(live: LiveConfig, effort_of: dict, teacher_of: dict) -> dict:
    disp = Dispatcher(DispatchConfig(policy="sample", max_inflight=8), datasets=["a", "b"], group_size=2,
                      prompts_per_step=2)
    state = {"dispatcher": disp.state_dict(), "streams": {"a": 4, "b": 1}, "prompts": {}, "finished": {},
             "effort_of": effort_of, "clock": RolloutClock(), "step": 5, "live": live, "teacher_of": teacher_of}
    driver = {"stage_idx": 1, "stage_type": "opd", "global_step": 9, "stage_minutes": 1.5, "summary": {},
              "recipe_yaml": "", "num_workers": 1, "watermark": Watermark(17, 9), "stage_end": None}
    text = json.dumps(controller_to_record(driver, state))
    return controller_from_record(json.loads(text))


def test_live_config_fields_survive_a_checkpoint_round_trip():
    back = _round_trip(_live(), {}, {})["stage_state"]["live"]
    assert back == _live()
    assert back.caps == {"a": 8, "b": 12} and back.version == 3
    assert back.teacher_for("b") == "added" and back.teachers["added"].checkpoint.name == "added"


def test_in_flight_teachers_and_effort_levels_survive_a_checkpoint_round_trip():
    effort_of = {"s1-p3-0": 25, "s1-p3-1": 75, "s1-p4-0": None}
    teacher_of = {"s1-p3": "big", "s1-p4": "added"}
    back = _round_trip(_live(), effort_of, teacher_of)
    assert back["stage_state"]["effort_of"] == effort_of
    assert back["stage_state"]["teacher_of"] == teacher_of
    assert back["watermark"] == Watermark(17, 9) and back["stage_state"]["streams"] == {"a": 4, "b": 1}
