"""Held-out evaluation reports, next to accuracy, the share of responses with a readable answer and the
share cut at the length limit (issue #14: a gain must be told apart from format learning). Pure logic:
`generate` is a stand-in that answers from a script; the verdicts come from the tasks."""

import math

from model.tokenizer import CharTokenizer
from rewards.task import Problem, Task, Verdict
from rl.algo.evaluation import evaluate
from rl.algo.rendering import Renderer
from rollout.types import Generation


class Scripted(Task):
    """Held-out problems 0..n-1; a response "=N" is an answer (right when N is the answer), anything else is
    no answer; `says` False: the verifier does not tell (answered None)."""

    def __init__(self, name: str, n: int, says: bool = True):
        self.name, self.n, self.says = name, n, says

    def heldout(self):
        return [Problem(f"{self.name}:{i}", self.name, f"q{i}", str(i)) for i in range(self.n)]

    def train_stream(self, seed_offset: int = 0):
        yield from self.heldout()

    def verify(self, trajectory, ctx):
        text = trajectory.response
        answered = text.startswith("=")
        ok = answered and text[1:] == trajectory.problem.answer
        return Verdict(float(ok), ok, "", answered=answered if self.says else None)


def _generate(script: dict[str, tuple[str, str]]):
    tok = CharTokenizer()

    def generate(reqs):
        out = []
        for r in reqs:
            text, finish = script[r.sample_id.removeprefix("eval-")]
            out.append(Generation(r.sample_id, tuple(r.prompt_tokens), tuple(tok.encode(text)), (0.0,) * len(text),
                                  (0,) * len(text), finish, None))
        return out
    return generate


def test_answered_and_truncated_shares_per_dataset_and_their_means():
    tasks = {"a": Scripted("a", 4), "b": Scripted("b", 2), "c": Scripted("c", 2, says=False)}
    script = {"a:0": ("=0", "eos"), "a:1": ("=7", "eos"), "a:2": ("no idea", "length"), "a:3": ("=3", "eos"),
              "b:0": ("hmm", "length"), "b:1": ("=1", "eos"), "c:0": ("=0", "eos"), "c:1": ("x", "length")}
    m = evaluate(_generate(script), Renderer(CharTokenizer(), tasks), tasks, max_new_tokens=8)
    assert (m["eval/a/accuracy"], m["eval/a/answered"], m["eval/a/truncated"]) == (0.5, 0.75, 0.25)
    assert (m["eval/b/accuracy"], m["eval/b/answered"], m["eval/b/truncated"]) == (0.5, 0.5, 0.5)
    assert m["eval/c/accuracy"] == 0.5 and math.isnan(m["eval/c/answered"]) and m["eval/c/truncated"] == 0.5
    assert m["eval/accuracy"] == 0.5 and m["eval/truncated"] == (0.25 + 0.5 + 0.5) / 3
    assert m["eval/answered"] == (0.75 + 0.5) / 2  # c's verifier does not say: left out of the mean
