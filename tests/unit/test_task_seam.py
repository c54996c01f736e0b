"""The task and tokenizer seams: records, the protocol's defaults and checks, effort on chat prompts,
rendering, and a verifier that raises."""

import random

import pytest

from model.config import CharTokenizerConfig
from model.tokenizer import CharTokenizer, Tokenizer
from rewards.config import ArithmeticConfig, CustomTaskConfig
from rewards.effort import EffortConfig, effort_prefix, with_effort
from rewards.task import Message, Problem, Task, Trajectory, Turn, Verdict, VerifyContext, missing_task_methods
from rl.algo import rendering
from rl.algo.rendering import Renderer
from rl.runtime.reward_worker import verify_one
from rollout.types import Generation
from tests.tasks.palindromes import NotATask, Palindromes

CHAT = (Message("system", "Answer yes or no."), Message("user", "pal abba?"))


def test_problem_records_round_trip_text_and_messages():
    for prompt in ("1+2=", CHAT):
        p = Problem("d:1", "d", prompt, "3", {"a": 1, "nested": [1, 2]})
        assert Problem.from_record(p.to_record()) == p


def test_trajectory_response_is_the_last_assistant_turn():
    p = Problem("d:1", "d", "x")
    t = Trajectory(p, (Turn("assistant", "call"), Turn("tool", "out"), Turn("assistant", "final")))
    assert t.response == "final" and Trajectory(p, ()).response == ""


def test_effort_prefix_goes_into_the_system_prompt():
    assert with_effort(CHAT, 50)[0] == Message("system", f"{effort_prefix(50)}\nAnswer yes or no.")
    user_only = (Message("user", "hi"),)
    assert with_effort(user_only, 25) == (Message("system", effort_prefix(25)), Message("user", "hi"))
    assert with_effort(CHAT, None) is CHAT and with_effort("a+b=", 75) == f"{effort_prefix(75)}\na+b="


def test_renderer_chat_and_text_prompts_agree_under_the_char_template():
    tok = CharTokenizer()
    r = Renderer(tok, {}, EffortConfig(levels=[25, 75]), run_seed=3)
    text = Problem("d:1", "d", "Answer yes or no.\npal abba?")
    chat = Problem("d:1", "d", CHAT)
    for effort in (None, 75):
        assert r.prompt_text(chat, effort) == r.prompt_text(text, effort)
        assert r.prompt_tokens(chat, effort)[0] == tok.bos_id
    assert r.sample_seed("s-0") == Renderer(tok, {}, run_seed=3).sample_seed("s-0") != Renderer(tok, {}).sample_seed("s-0")


def test_length_penalty_counts_tokens_of_the_tasks_reasoning():
    task = ArithmeticConfig(name="arith").build()
    effort = EffortConfig(levels=[25, 75], k0=1.0, c_max=10.0, l_norm=10.0)
    r = Renderer(CharTokenizer(), {"arith": task}, effort)
    p = task.make_problem((372, 589))
    from rl.types import Prompt

    prompt = Prompt("p0", "arith", "372+589=", (1,), "961", 4, 0)
    response = p.metadata["solution"]
    g = Generation("p0-0", (1,), tuple(CharTokenizer().encode(response)), (0.0,) * len(response), (0,) * len(response), "eos", None)
    s = r.to_sample(prompt, p, g, Verdict(1.0, True), effort=25)
    assert s.group_id == "p0@25" and s.response_text == response
    assert s.reward == pytest.approx(1.0 - len(response[: response.rfind("\n") + 1]) / 10.0)


def test_protocol_defaults_and_checks():
    assert missing_task_methods(NotATask) == ["verify", "demonstration", "reasoning", "response_budget"]
    assert missing_task_methods(Palindromes) == [] and isinstance(Palindromes("p"), Task)

    class Bare(Task):
        name = "bare"

    b = Bare()
    assert b.reasoning("abc") == "abc" and b.response_budget(Problem("x", "x", "q"), 0) is None
    with pytest.raises(NotImplementedError, match="task 'bare' has no demonstrations"):
        b.demonstration(Problem("x", "x", "q"), random.Random(0))


def test_custom_task_config_builds_the_users_class():
    cfg = CustomTaskConfig(name="pal", task="tests.tasks.palindromes:Palindromes", args={"num_heldout": 4})
    task = cfg.build()
    assert isinstance(task, Palindromes) and task.name == "pal" and len(task.heldout()) == 4
    with pytest.raises(ValueError, match="missing verify"):
        CustomTaskConfig(name="x", task="tests.tasks.palindromes:NotATask")


def test_a_raising_verifier_scores_zero_with_its_error_as_the_reason():
    class Broken(Palindromes):
        def verify(self, trajectory, ctx):
            raise KeyError("boom")

    p = Palindromes("pal").problem_for("abba")
    v = verify_one(Broken("pal"), Trajectory.single(p, "yes"), VerifyContext())
    assert (v.reward, v.correct) == (0.0, False) and v.reason.startswith("verifier error: KeyError")
    assert verify_one(Palindromes("pal"), Trajectory.single(p, "yes"), VerifyContext()) == Verdict(1.0, True, "right")


def test_tokenizer_protocol_and_recipe_field():
    tok = CharTokenizerConfig().build()
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 99
    assert tok.apply_chat_template([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb"


class CountingTokenizer(CharTokenizer):
    """The char tokenizer, counting the texts it encodes."""

    def __init__(self):
        super().__init__()
        self.encoded = 0

    def encode(self, text, **kw):
        self.encoded += 1
        return super().encode(text, **kw)


def test_renderer_renders_a_prompt_once_and_answers_again_from_its_cache(monkeypatch):
    """A file dataset's prompts come back every epoch: the second time a prompt (at an effort level) is rendered it is
    the first rendering's text and ids, without the chat template or the tokenizer. Keyed by what is rendered, not by
    the problem id; the oldest renderings go past RENDER_CACHE_TOKENS."""
    tok = CountingTokenizer()
    r = Renderer(tok, {}, EffortConfig(levels=[25, 75]))
    chat, other = Problem("d:1", "d", CHAT), Problem("d:1", "d", "pal noon?")  # the same id, another prompt
    first = [r.render(chat), r.render(chat, 75), r.render(other)]
    assert tok.encoded == 3 and len({x.text for x in first}) == 3
    again = [r.render(Problem("d:9", "d", CHAT)), r.render(chat, 75), r.render(other)]
    assert again == first and tok.encoded == 3
    fresh = Renderer(CharTokenizer(), {}, EffortConfig(levels=[25, 75]))
    assert [fresh.render(chat), fresh.render(chat, 75), fresh.render(other)] == first  # what an uncached one renders
    assert r.prompt_tokens(chat) == first[0].ids and r.prompt_text(chat) == first[0].text
    assert r.render(Problem("d:3", "d", list(CHAT))) == first[0] and tok.encoded == 3  # messages given as a list
    monkeypatch.setattr(rendering, "RENDER_CACHE_TOKENS", len(first[0].ids) + len(first[2].ids))
    small = Renderer(tok, {})
    small.render(chat), small.render(other), small.render(Problem("d:2", "d", "pal x?"))  # chat's rendering goes
    n = tok.encoded
    small.render(Problem("d:2", "d", "pal x?")), small.render(other)
    assert tok.encoded == n
    small.render(chat)
    assert tok.encoded == n + 1
