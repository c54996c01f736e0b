"""A task written outside rewards/, as a user would: chat-message prompts and a verifier that is not
arithmetic. Tests name it in recipes as `type: custom, task: "tests.tasks.palindromes:Palindromes"`."""

from __future__ import annotations

import hashlib
import random
import string

from rewards import Message, Problem, Task, Trajectory, Verdict, VerifyContext


class Palindromes(Task):
    """Is a short lowercase word a palindrome? The answer is "yes" or "no"."""

    SYSTEM = "Answer yes or no."

    def __init__(self, name: str, num_heldout: int = 16, seed: int = 0):
        self.name, self.num_heldout, self.seed = name, num_heldout, seed

    def _problem(self, rng: random.Random) -> Problem:
        half = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
        word = half + half[::-1] if rng.random() < 0.5 else half + rng.choice(string.ascii_lowercase[:3]) + half
        if rng.random() < 0.5:  # half of the non-mirrored words are not palindromes
            word = word + rng.choice("de")
        return self.problem_for(word)

    def problem_for(self, word: str) -> Problem:
        is_pal = word == word[::-1]
        return Problem(f"{self.name}:{word}", self.name, (Message("system", self.SYSTEM), Message("user", f"pal {word}?")),
                       answer="yes" if is_pal else "no", metadata={"word": word})

    def _heldout_word(self, word: str) -> bool:  # a fixed fifth of the words, whatever the seed
        return hashlib.blake2b(word.encode(), digest_size=2).digest()[0] % 5 == 0

    def train_stream(self, seed_offset: int = 0):
        rng = random.Random(f"{self.seed}:{seed_offset}")
        while True:
            p = self._problem(rng)
            if not self._heldout_word(p.metadata["word"]):
                yield p

    def heldout(self):
        rng, out, seen = random.Random(f"{self.seed}:heldout"), [], set()
        while len(out) < self.num_heldout:
            p = self._problem(rng)
            if self._heldout_word(p.metadata["word"]) and p.problem_id not in seen:
                seen.add(p.problem_id)
                out.append(p)
        return out

    def verify(self, trajectory: Trajectory, ctx: VerifyContext) -> Verdict:
        said = trajectory.response.strip().lower()
        if said not in ("yes", "no"):
            return Verdict(0.0, False, f"not yes/no: {said[:20]!r}")
        correct = said == trajectory.problem.answer
        return Verdict(1.0 if correct else 0.0, correct, "right" if correct else "wrong")

    def demonstration(self, problem: Problem, rng: random.Random, **_) -> str:
        return problem.answer


class NotATask:
    """Lacks verify: `rl validate` must refuse it with one line."""

    def __init__(self, name: str):
        self.name = name

    def train_stream(self, seed_offset: int = 0):
        yield from ()

    def heldout(self):
        return []
