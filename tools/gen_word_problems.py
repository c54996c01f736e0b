"""Short arithmetic word problems as JSONL: the verifiable chat task of the GRPO recipe from an instruct model
(issue #14, item 5) and of its SFT control arm.

    python tools/gen_word_problems.py          # writes configs/data/word_problems_{train,test,rl,eval}.jsonl
    python tools/gen_word_problems.py --out DIR --train 5000 --test 512 --rl 5000 --seed 0

Each line is {"question", "answer", "solution", "kind"}: `answer` is the number as text; `solution` a short
worked solution ending with "The answer is N." (the SFT target, `demonstration: solution`); `kind` names the
template. Problems use one operation on two-digit numbers (add, subtract, or multiply by one digit), about
apples, money and distances, or as a plain "What is a + b?"; a share are two-step (add, then share equally).
Every question and solution is printable ASCII (the char tokenizer reads them too). The output depends only
on the arguments; no test question occurs in the train file, and the `rl` file (RL prompts of an SFT-then-GRPO
pipeline, configs/smollm2_sft_grpo_fresh.yaml) shares no question with either: it is drawn after them from the same
random stream, so adding it leaves the train and test files as they were. The `eval` file (1,000 held-out problems a
domain is scored on in issue 43's pipeline) is drawn after all three, disjoint from them, and leaves them as they were.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data"

NAMES = [("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Maria", "She"), ("Sam", "He"), ("Lucy", "She"),
         ("Omar", "He"), ("Mia", "She"), ("Leo", "He"), ("Zoe", "She"), ("Ravi", "He"), ("Emma", "She")]
ITEMS = ["a book", "a jacket", "a game", "a bike helmet", "a lamp", "new shoes"]


def _two_digit(rng: random.Random) -> int:
    return rng.randint(10, 99)


def _pair_sub(rng: random.Random) -> tuple[int, int]:
    a, b = sorted(rng.sample(range(10, 100), 2), reverse=True)
    return a, b


def _add_solution(a: int, b: int, unit: str = "") -> str:
    return f"{a} + {b} = {a + b}{unit}. The answer is {a + b}."


def _sub_solution(a: int, b: int, unit: str = "") -> str:
    return f"{a} - {b} = {a - b}{unit}. The answer is {a - b}."


def plain_add(rng):
    a, b = _two_digit(rng), _two_digit(rng)
    return f"What is {a} + {b}?", a + b, _add_solution(a, b)


def plain_sub(rng):
    a, b = _pair_sub(rng)
    return f"What is {a} - {b}?", a - b, _sub_solution(a, b)


def apples_add(rng):
    (name, he), a, b = rng.choice(NAMES), _two_digit(rng), _two_digit(rng)
    return (f"{name} has {a} apples. {he} picks {b} more apples. How many apples does {name} have now?", a + b,
            _add_solution(a, b, " apples"))


def apples_sub(rng):
    (name, _), (friend, _) = rng.sample(NAMES, 2)
    a, b = _pair_sub(rng)
    return (f"{name} has {a} apples and gives {b} of them to {friend}. How many apples does {name} have left?", a - b,
            _sub_solution(a, b, " apples"))


def money_add(rng):
    a, b = _two_digit(rng), _two_digit(rng)
    return (f"A book costs {a} dollars and a bag costs {b} dollars. How many dollars do they cost together?", a + b,
            _add_solution(a, b, " dollars"))


def money_sub(rng):
    (name, _), item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = _pair_sub(rng)
    return (f"{name} had {a} dollars and spent {b} dollars on {item}. How many dollars does {name} have left?", a - b,
            _sub_solution(a, b, " dollars"))


def distance_add(rng):
    a, b = _two_digit(rng), _two_digit(rng)
    return (f"A train travels {a} km in the morning and {b} km in the afternoon. How many km does it travel in total?",
            a + b, _add_solution(a, b, " km"))


def distance_sub(rng):
    (name, _), (a, b) = rng.choice(NAMES), _pair_sub(rng)
    return f"A trail is {a} km long. {name} has walked {b} km of it. How many km are left?", a - b, _sub_solution(a, b, " km")


def _mul_solution(k: int, a: int, unit: str = "") -> str:
    """k * a worked by place value, tens then ones ("9 * 47 = 9 * 40 + 9 * 7 = 360 + 63 = 423"): every step
    is a one-digit product or an addition, so the method carries over to products the training file lacks."""
    tens, ones = a - a % 10, a % 10
    steps = f"{k} * {a} = " + (f"{k} * {tens} + {k} * {ones} = {k * tens} + {k * ones} = " if ones else "")
    return f"{steps}{k * a}{unit}. The answer is {k * a}."


def boxes_mul(rng):
    a, k = _two_digit(rng), rng.randint(2, 9)
    return (f"Each box holds {a} pencils. How many pencils are in {k} boxes?", a * k, _mul_solution(k, a, " pencils"))


def share_two_step(rng):
    (name, he), k = rng.choice(NAMES), rng.randint(2, 9)
    while True:
        a, b = _two_digit(rng), _two_digit(rng)
        if (a + b) % k == 0:
            break
    total = a + b
    return (f"{name} has {a} apples and buys {b} more. {he} shares all of them equally among {k} friends. "
            f"How many apples does each friend get?", total // k,
            f"{a} + {b} = {total} apples. {total} / {k} = {total // k} each. The answer is {total // k}.")


KINDS: dict[str, tuple[float, Callable]] = {
    "plain_add": (0.15, plain_add), "plain_sub": (0.10, plain_sub),
    "apples_add": (0.10, apples_add), "apples_sub": (0.10, apples_sub),
    "money_add": (0.08, money_add), "money_sub": (0.08, money_sub),
    "distance_add": (0.08, distance_add), "distance_sub": (0.08, distance_sub),
    "boxes_mul": (0.08, boxes_mul), "share_two_step": (0.15, share_two_step),
}
"""Template -> (share of the rows, generator); one-step word problems 60%, plain 25%, two-step 15%."""


def generate(n: int, rng: random.Random, exclude: set[str] = frozenset()) -> list[dict]:
    """`n` rows with distinct questions, none of them in `exclude`."""
    names, weights = list(KINDS), [w for w, _ in KINDS.values()]
    rows, seen = [], set(exclude)
    while len(rows) < n:
        kind = rng.choices(names, weights)[0]
        question, answer, solution = KINDS[kind][1](rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": str(answer), "solution": solution, "kind": kind})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="output directory (default configs/data)")
    p.add_argument("--train", type=int, default=5000, help="train rows")
    p.add_argument("--test", type=int, default=512, help="held-out rows")
    p.add_argument("--rl", type=int, default=5000, help="rows of the RL prompt file, disjoint from train and test")
    p.add_argument("--eval", type=int, default=1000, help="rows of a second held-out file (word_problems_eval.jsonl), "
                   "disjoint from the others: the 1,000 problems a domain is scored on in the pipeline (issue 43)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    test = generate(a.test, rng)
    train = generate(a.train, rng, exclude={r["question"] for r in test})
    rl = generate(a.rl, rng, exclude={r["question"] for r in test + train})
    evaluation = generate(a.eval, rng, exclude={r["question"] for r in test + train + rl})
    write_jsonl(a.out / "word_problems_test.jsonl", test)
    write_jsonl(a.out / "word_problems_train.jsonl", train)
    write_jsonl(a.out / "word_problems_rl.jsonl", rl)
    write_jsonl(a.out / "word_problems_eval.jsonl", evaluation)
    print(f"wrote {len(train)} train, {len(test)} test, {len(rl)} RL and {len(evaluation)} eval rows to {a.out}")


if __name__ == "__main__":
    main()
