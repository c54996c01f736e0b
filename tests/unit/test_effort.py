"""Effort conditioning (seed §5.1.4): prefix text, length penalty values, subgroups."""

import math
import random

import pytest

from rewards.arithmetic import ArithmeticTask
from rewards.config import ArithmeticConfig
from rewards.effort import EffortConfig, effort_prefix
from rl.train.losses import group_advantages
from tests.conftest import len_reasoning


def test_exact_prefix_text():
    assert effort_prefix(75) == "Reasoning Effort: 75 (range 1--100; higher values request more thorough reasoning)"


def test_length_penalty_hand_computed():
    cfg = EffortConfig(levels=[100, 25, 50, 75], k0=2.0, lam=0.5, c_max=1.0, l_norm=40)
    assert cfg.levels == [25, 50, 75, 100]
    assert cfg.tau == pytest.approx(12.5)  # λ · mean spacing 25
    assert cfg.coefficient(25) == pytest.approx(2.0)
    assert cfg.coefficient(50) == pytest.approx(2.0 * math.exp(-2))
    # b = 50, ℓ = 20: k = 2e^-2 = 0.2707 → 0.2707 · 20 / 40 = 0.1353
    assert cfg.length_penalty(50, 20) == pytest.approx(-2.0 * math.exp(-2) * 0.5)
    # b = 25, ℓ = 40: 2 · 1 = 2 > C_max → capped at -1
    assert cfg.length_penalty(25, 40) == -1.0
    assert cfg.length_penalty(100, 0) == 0.0
    # a level never trained on interpolates: k(60) lies between k(50) and k(75)
    assert cfg.coefficient(75) < cfg.coefficient(60) < cfg.coefficient(50)
    assert cfg.group_size == 4 * cfg.samples_per_level


def test_single_level_has_no_decay_and_bad_levels_are_refused():
    assert EffortConfig(levels=[50], k0=1.0).coefficient(90) == 1.0
    with pytest.raises(ValueError, match="1..100"):
        EffortConfig(levels=[0, 50])
    with pytest.raises(ValueError, match="distinct"):
        EffortConfig(levels=[50, 50])


def test_subgroup_advantages_never_mix_efforts():
    # one prompt, two efforts: rewards differ a lot between efforts but each subgroup is centred alone
    rewards = [1.0, 0.0, 0.2, 0.2, 0.7]
    groups = ["p@25", "p@25", "p@100", "p@100", "p@50"]
    adv = group_advantages(rewards, groups, std_normalize=False)
    assert adv[:2] == pytest.approx([0.5, -0.5])
    assert adv[2:4] == pytest.approx([0.0, 0.0])  # not 0.2 - mean(all)
    assert adv[4] == 0.0  # a singleton subgroup gets 0, not its raw reward


def test_reasoning_tokens_of_the_arithmetic_task():
    task = ArithmeticTask(ArithmeticConfig())
    solution = task.make_problem((372, 589)).metadata["solution"]
    assert len_reasoning(task, solution) == len(solution) - len("961")
    assert len_reasoning(task, "961") == 0
    assert len_reasoning(task, "") == 0


def test_direct_answer_demonstrations():
    import random

    task = ArithmeticTask(ArithmeticConfig(direct_answer_rate=0.5))
    p = task.make_problem((372, 589))
    demos = [task.demonstration(p, random.Random(i)) for i in range(200)]
    direct = sum(d == "961" for d in demos)
    assert 70 < direct < 130 and all(d == "961" or d == p.metadata["solution"] for d in demos)


def test_demonstration_direct_answer_override():
    import random

    task = ArithmeticTask(ArithmeticConfig(direct_answer_rate=0.5))
    p = task.make_problem((372, 589))
    assert all(task.demonstration(p, random.Random(i), direct_answer_rate=1.0) == "961" for i in range(20))
    assert all(task.demonstration(p, random.Random(i), direct_answer_rate=0.0) == p.metadata["solution"] for i in range(20))


def test_partial_scratchpad_keeps_a_growing_share_of_the_worked_lines():
    from rewards.procedural import partial_scratchpad

    task = ArithmeticTask(ArithmeticConfig(slip_rate=0.0))
    p = task.make_problem((4567, 5678))  # 4 columns: 4 worked lines, then the answer
    lens = [len_reasoning(task, task.demonstration(p, random.Random(0), reasoning_frac=f)) for f in (0, 0.25, 0.5, 0.75, 1)]
    assert lens == sorted(lens) and lens[0] == 0 and len(set(lens)) == 5
    assert task.demonstration(p, random.Random(0), reasoning_frac=1.0) == p.metadata["solution"]
    assert partial_scratchpad("1+2=3\n4+5=9\n93", 0.5).splitlines() == ["1+2=3", "93"]
    assert partial_scratchpad("1+2=3\n4+5=9\n93", 0.75).splitlines() == ["1+2=3", "4+5=9", "93"]  # 1.5 rounds up
