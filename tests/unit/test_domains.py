"""Procedural domains: exact formats, worked lines that imply the answer, seeds, splits, verifier, vocabulary."""

from __future__ import annotations

import itertools
import random

import pytest
from pydantic import TypeAdapter, ValidationError

from model.tokenizer import CharTokenizer
from rewards.arithmetic import ArithmeticTask
from rewards.config import (
    PROCEDURAL_DOMAIN_CONFIGS,
    ArithmeticConfig,
    BaseConversionConfig,
    CountCharConfig,
    DatasetConfig,
    MaxListConfig,
    ModuloConfig,
    MultiplyDigitConfig,
    ReverseConfig,
    SubtractionConfig,
)
from rewards.config import DEFAULT_DOMAIN_CONFIGS
from rewards.domains import DOMAIN_CLASSES
from rewards.procedural import ProceduralTask, in_heldout_split
from tests.conftest import parsed, verify_text

DOMAINS = [pytest.param(cfg, id=cfg.type) for cfg in DEFAULT_DOMAIN_CONFIGS]


def _train(task, n: int, offset: int = 0):
    return list(itertools.islice(task.train_stream(offset), n))


# ---- registry and configs -------------------------------------------------------------------------


def test_registry_covers_every_config_type():
    assert len(DOMAIN_CLASSES) >= 8
    assert {c.model_fields["type"].default for c in PROCEDURAL_DOMAIN_CONFIGS} == set(DOMAIN_CLASSES)
    assert len({c.name for c in DEFAULT_DOMAIN_CONFIGS}) == len(DEFAULT_DOMAIN_CONFIGS)  # one recipe can hold all
    assert isinstance(ArithmeticConfig().build(), ArithmeticTask)
    for cfg in DEFAULT_DOMAIN_CONFIGS:
        task = cfg.build()
        assert type(task) is DOMAIN_CLASSES[cfg.type] and task.name == cfg.name


def test_union_discriminates_on_type_and_rejects_unknown_keys():
    adapter = TypeAdapter(list[DatasetConfig])
    cfgs = adapter.validate_python([{"type": "arithmetic"}, {"type": "modulo", "name": "par", "moduli": [2]},
                                    {"type": "reverse", "max_len": 5}])
    assert [type(c) for c in cfgs] == [ArithmeticConfig, ModuloConfig, ReverseConfig]
    assert cfgs[1].moduli == [2] and cfgs[2].max_len == 5
    with pytest.raises(ValidationError):
        adapter.validate_python([{"type": "reverse", "max_digits": 3}])  # a field of another domain
    with pytest.raises(ValidationError):
        adapter.validate_python([{"type": "no_such_domain"}])


@pytest.mark.parametrize("bad", [
    lambda: ReverseConfig(min_len=5, max_len=4),
    lambda: ModuloConfig(moduli=[1, 3]),
    lambda: BaseConversionConfig(bases=[10]),
    lambda: MaxListConfig(min_items=4, max_items=3),
    lambda: CountCharConfig(max_len=10),  # running count must stay one digit per character
    lambda: CountCharConfig(alphabet="aB"),
])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValidationError):
        bad()


def test_task_refuses_a_config_of_another_type():
    with pytest.raises(ValueError, match="reverse"):
        DOMAIN_CLASSES["reverse"](ModuloConfig())


# ---- exact formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, instance, prompt, solution", [
    (ReverseConfig(), "abc", "rev abc=", "cba"),
    (CountCharConfig(), ("a", "abca"), "cnt a:abca=", "1112\n2"),
    (SubtractionConfig(), (523, 187), "523-187=", "3-7=6b\n2-8-1=3b\n5-1-1=3\n336"),
    (SubtractionConfig(), (1000, 1), "1000-1=", "0-1=9b\n0-0-1=9b\n0-0-1=9b\n1-0-1=0\n999"),
    (SubtractionConfig(), (7, 7), "7-7=", "7-7=0\n0"),
    (MultiplyDigitConfig(), (47, 6), "47*6=", "7*6=42\n4*6+4=28\n282"),
    (MultiplyDigitConfig(), (25, 0), "25*0=", "5*0=0\n2*0=0\n0"),
    (ModuloConfig(), (123, 7), "123%7=", "1%7=1\n12%7=5\n53%7=4\n4"),
    (MaxListConfig(), (37, 92, 41), "max 37,92,41=", "37 92 92\n92"),
    (BaseConversionConfig(), (13, 2), "13>b2=", "13:1\n6:0\n3:1\n1:1\n1101"),
    (BaseConversionConfig(), (0, 3), "0>b3=", "0"),
    (DEFAULT_DOMAIN_CONFIGS[-1], 4721, "dsum 4721=", "4 11 13 14\n14"),
])
def test_worked_solutions_by_hand(cfg, instance, prompt, solution):
    p = cfg.build().make_problem(instance)
    assert (p.prompt, p.metadata["solution"], p.answer) == (prompt, solution, solution.splitlines()[-1])
    assert p.problem_id == f"{cfg.name}:{prompt[:-1]}" and p.dataset == cfg.name


def _implied_answer(kind: str, p) -> str:
    """The answer the worked lines imply, read back independently of the generator's own arithmetic."""
    lines = p.metadata["solution"].splitlines()[:-1]
    if kind == "subtraction":
        return "".join(line.split("=")[1].rstrip("b") for line in reversed(lines)).lstrip("0") or "0"
    if kind == "multiply_digit":
        sums = [int(line.split("=")[1]) for line in lines]
        digits = (str(sums[-1] // 10) if sums[-1] >= 10 else "") + "".join(str(s % 10) for s in reversed(sums))
        return digits.lstrip("0") or "0"
    if kind == "modulo":
        return lines[-1].split("=")[1]
    if kind == "count_char":
        return lines[0][-1] if lines else "0"
    if kind in ("max_list", "digit_sum"):
        return lines[0].split(" ")[-1]
    if kind == "base_conversion":
        return "".join(line.split(":")[1] for line in reversed(lines)) or "0"
    return p.answer  # answer-only domains


def _reference(kind: str, prompt: str) -> str:
    body = prompt[:-1]
    if kind == "reverse":
        return body[4:][::-1]
    if kind == "uppercase":
        return body[3:].upper()
    if kind == "sort_digits":
        return "".join(sorted(body[5:]))
    if kind == "count_char":
        c, s = body[4:].split(":")
        return str(s.count(c))
    if kind == "subtraction":
        a, b = map(int, body.split("-"))
        return str(a - b)
    if kind == "multiply_digit":
        a, d = map(int, body.split("*"))
        return str(a * d)
    if kind == "modulo":
        n, m = map(int, body.split("%"))
        return str(n % m)
    if kind == "max_list":
        return str(max(map(int, body[4:].split(","))))
    if kind == "base_conversion":
        n, k = body.split(">b")
        n, k, out = int(n), int(k), ""
        while n:
            n, out = n // k, str(n % k) + out
        return out or "0"
    if kind == "digit_sum":
        return str(sum(map(int, body[5:])))
    raise AssertionError(kind)


@pytest.mark.parametrize("cfg", DOMAINS)
def test_answers_are_right_and_worked_lines_imply_them(cfg):
    task = cfg.build()
    for p in _train(task, 300) + task.heldout():
        assert p.answer == _reference(cfg.type, p.prompt), p
        assert _implied_answer(cfg.type, p) == p.answer, p


@pytest.mark.parametrize("cfg", DOMAINS)
def test_every_character_is_in_the_vocab_and_problems_are_short(cfg):
    tok = CharTokenizer()
    task = cfg.build()
    for p in _train(task, 500) + task.heldout():
        text = p.prompt + p.metadata["solution"]
        assert tok.decode(tok.encode(text)) == text
        assert len(text) <= 60, text
        assert p.prompt.endswith("=") and not p.metadata["solution"].endswith("\n")


# ---- seeds and splits -----------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", DOMAINS)
def test_streams_are_deterministic_by_seed_and_offset(cfg):
    task = cfg.build()
    first = [p.prompt for p in _train(task, 50)]
    assert first == [p.prompt for p in _train(cfg.build(), 50)]  # same seed, fresh object
    assert first != [p.prompt for p in _train(task, 50, offset=1)]
    reseeded = cfg.model_copy(update={"seed": 1}).build()
    assert first != [p.prompt for p in _train(reseeded, 50)]
    assert [p.prompt for p in task.heldout()] == [p.prompt for p in cfg.build().heldout()]
    assert [p.prompt for p in task.heldout()] != [p.prompt for p in reseeded.heldout()]


@pytest.mark.parametrize("cfg", DOMAINS)
def test_heldout_is_disjoint_from_train_whatever_the_seeds(cfg):
    task = cfg.build()
    heldout = {p.prompt for p in task.heldout()}
    assert len(heldout) == cfg.num_heldout and all(in_heldout_split(f"{cfg.type}:{prompt}") for prompt in heldout)
    other_seed = cfg.model_copy(update={"seed": 7}).build()
    for t in (task, other_seed):
        train = {p.prompt for p in _train(t, 2000)}
        assert not train & heldout
        assert not any(in_heldout_split(f"{cfg.type}:{prompt}") for prompt in train)


def test_too_small_instance_space_for_heldout_is_a_clear_error():
    task = BaseConversionConfig(bases=[2], max_value=20, num_heldout=10).build()
    with pytest.raises(ValueError, match="too small; lower num_heldout"):
        task.heldout()


# ---- verifier and demonstrations ------------------------------------------------------------------


def _corrupt(answer: str) -> str:
    last = answer[-1]
    swap = {"9": "8", "Z": "Y", "z": "y"}.get(last, chr(ord(last) + 1))
    return answer[:-1] + swap


@pytest.mark.parametrize("cfg", DOMAINS)
def test_verify_accepts_demonstrations_and_rejects_wrong_answers(cfg):
    task = cfg.build()
    rng = random.Random(0)
    for p in _train(task, 100):
        demo = task.demonstration(p, rng)
        assert demo == p.metadata["solution"] and verify_text(task, p, demo).correct and verify_text(task, p, demo).reward == 1.0
        assert verify_text(task, p, demo + "\n\n  ").correct  # trailing blank lines are not the answer line
        direct = task.demonstration(p, rng, direct_answer_rate=1.0)
        assert direct == p.answer and verify_text(task, p, direct).correct
        assert task.reasoning(direct) == ""
        assert len(task.reasoning(demo)) == len(demo) - len(p.answer)
        wrong = _corrupt(p.answer)
        v = verify_text(task, p, p.metadata["solution"][: len(p.metadata["solution"]) - len(p.answer)] + wrong)
        assert (v.correct, v.reward, parsed(v)) == (False, 0.0, wrong)
        assert not verify_text(task, p, p.answer + "0").correct  # a prefix match is not enough
        assert not verify_text(task, p, p.answer + "\nx").correct  # the last line counts, not any line
        assert parsed(verify_text(task, p, "")) is None and not verify_text(task, p, "  \n").correct
        assert task.response_budget(p, 0) is None


def test_direct_answer_rate_mixes_demonstrations():
    task = ModuloConfig(direct_answer_rate=0.5).build()
    p = next(task.train_stream())
    rng = random.Random(0)
    kinds = {task.demonstration(p, rng) == p.answer for _ in range(200)}
    assert kinds == {True, False}


def test_procedural_task_is_the_base_of_every_domain():
    assert all(issubclass(cls, ProceduralTask) for cls in DOMAIN_CLASSES.values())
