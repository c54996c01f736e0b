"""The shipped word-problem data (configs/data/) is what its generator (tools/gen_word_problems.py) writes, its
answers are right, its splits are disjoint, and it loads as the README's JSONL dataset with `verifier: math`."""

import importlib.util
import json
import re
from pathlib import Path

from rewards.datasets import JsonlDatasetConfig
from rewards.task import Trajectory

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "configs" / "data"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_word_problems", ROOT / "tools" / "gen_word_problems.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def _chain(text: str) -> list[int]:
    """The value of each side of "9 * 47 = 9 * 40 + 9 * 7 = 360 + 63 = 423" (integer division for /)."""
    return [eval(side.replace("/", "//"), {"__builtins__": {}}) for side in text.split(" = ")]


def test_the_shipped_files_are_the_generators_output(tmp_path):
    _generator().main(["--out", str(tmp_path)])
    for name in ("word_problems_train.jsonl", "word_problems_test.jsonl", "word_problems_rl.jsonl", "word_problems_eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"regenerate {name}: python tools/gen_word_problems.py"


def test_answers_solutions_and_splits():
    train, test, rl = _rows("word_problems_train.jsonl"), _rows("word_problems_test.jsonl"), _rows("word_problems_rl.jsonl")
    evaluation = _rows("word_problems_eval.jsonl")
    assert (len(train), len(test), len(rl), len(evaluation)) == (5000, 512, 5000, 1000)
    q = [{r["question"] for r in rows} for rows in (train, test, rl, evaluation)]
    assert not q[0] & q[1] and not q[2] & (q[0] | q[1]) and len(q[2]) == len(rl)
    assert not q[3] & (q[0] | q[1] | q[2]) and len(q[3]) == len(evaluation)
    assert len({r["kind"] for r in train}) == len({r["kind"] for r in rl}) == len(_generator().KINDS)
    for r in train + test + rl + evaluation:
        assert r["question"].isascii() and r["solution"].isascii()
        chains = [_chain(c) for c in re.findall(r"\d[\d +*/-]* = [\d =+*/-]*\d", r["solution"])]
        assert chains and all(len(set(c)) == 1 for c in chains), r  # every side of every "a = b = c" is equal
        assert chains[-1][-1] == int(r["answer"]) and r["solution"].endswith(f"The answer is {r['answer']}.")
        if r["kind"] == "boxes_mul" and int(re.search(r"holds (\d+)", r["question"]).group(1)) % 10:
            assert len(chains[0]) == 4, r  # k * ab = k * a0 + k * b = .. + .. = product: the method, not the product alone
        numbers = [int(n) for n in re.findall(r"\d+", r["question"])]  # two-digit operands, one-digit multipliers and shares
        assert all(2 <= n <= 99 for n in numbers) and any(n >= 10 for n in numbers), r


def test_they_load_as_a_chat_dataset_whose_demonstrations_the_math_verifier_accepts():
    cfg = JsonlDatasetConfig(name="wp", path=DATA / "word_problems_train.jsonl", prompt="question", chat=True,
                             system="Solve the problem.", answer="answer", demonstration="solution", verifier="math",
                             heldout={"path": DATA / "word_problems_test.jsonl"})
    task = cfg.build()
    assert task.scan() == (f"dataset wp: 5000 train rows, 512 held out (from {DATA / 'word_problems_test.jsonl'}; "
                           "0 train rows repeat a held-out prompt and are left out)")
    for p in task.heldout()[:64]:
        assert task.verify(Trajectory.single(p, task.demonstration(p, None))).correct
        assert task.verify(Trajectory.single(p, f"The answer is {int(p.answer) + 1}.")).reason == \
            f"parsed {int(p.answer) + 1}, expected {p.answer}"
