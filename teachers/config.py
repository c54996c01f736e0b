"""Teacher registry and pool configuration for full-vocabulary OPD (seed §5.2.4). Pure pydantic.

Seed §5.2.4: the final OPD stage trains on all domains with over 40 teachers, each domain's best
teacher possibly from a different stage of development and of a different architecture; switching
among them must cost next to nothing. A `TeacherSpec` names one teacher checkpoint and the datasets it
scores; a `TeacherPoolConfig` lists the teachers and sets the device-memory budget of the
`teachers.pool.TeacherPool` that serves them. Imports neither torch nor ray (recipes validate instantly);
teacher shapes are read from each checkpoint's `config.json` with the pure `ModelConfig`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from configbase import StrictConfig
from model.config import ModelConfig, check_vocab, read_teacher_config


class TeacherSpec(StrictConfig):
    """One teacher: a checkpoint (asyncrl, Hugging Face or GGUF) and the datasets it scores."""

    name: str = Field(min_length=1)
    """Teacher name; pool calls and metrics refer to it."""
    checkpoint: Path
    """An asyncrl checkpoint directory (`config.json` + `model.safetensors`: a run's `checkpoints/<name>`),
    or anything `model.init` takes: a Hugging Face directory (a run's `export/<name>`), a GGUF file, or the
    name of a model `rl models fetch` got."""
    datasets: list[str] = Field(default_factory=list)
    """Dataset names whose samples this teacher scores (its domains); empty: none assigned yet."""

    def architecture(self) -> ModelConfig:
        """The teacher's architecture, read from its checkpoint's config.json."""
        return read_teacher_config(self.checkpoint)


class TeacherPoolConfig(StrictConfig):
    """Host store of every teacher plus a device-resident LRU set within a memory budget."""

    teachers: list[TeacherSpec] = Field(default_factory=list)
    """All teachers the pool can serve; their weights live in host memory, a few at a time on device."""
    device_memory_mib: float = Field(4096.0, gt=0)
    """Device memory for resident teacher weights, MiB; least-recently-used teachers are evicted
    beyond it. Must hold the largest teacher (twice that for prefetch to overlap a load)."""
    prefetch: bool = True
    """Copy the next teacher of a step to the device on a side stream (a thread on CPU) while the
    current one computes, so switching costs next to nothing."""
    pin_host_memory: bool = True
    """Keep host copies in page-locked memory when CUDA exists (asynchronous host-to-device copies)."""
    dtype: str | None = Field(None, pattern=r"^(float32|bfloat16|float16)$")
    """Dtype of device copies (float32 | bfloat16 | float16); None keeps the checkpoint's dtype."""

    @model_validator(mode="after")
    def validate_names(self) -> "TeacherPoolConfig":
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"teacher names must be unique, repeated: {dup}")
        served: dict[str, str] = {}
        for t in self.teachers:
            for d in t.datasets:
                if d in served:
                    raise ValueError(f"dataset {d!r} is assigned to two teachers: {served[d]!r} and {t.name!r}")
                served[d] = t.name
        return self

    def teacher_for(self, dataset: str) -> str | None:
        """Name of the teacher that scores `dataset`, or None when no teacher serves it."""
        for t in self.teachers:
            if dataset in t.datasets:
                return t.name
        return None

    def validate_vocab(self, student_vocab: int) -> None:
        """Raise ValueError listing every teacher whose vocabulary differs from the student's
        (full-vocabulary OPD compares distributions over one shared vocabulary)."""
        errors = [e for t in self.teachers if (e := check_vocab(student_vocab, t.architecture(), t.name))]
        if errors:
            raise ValueError("; ".join(errors))
