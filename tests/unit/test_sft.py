"""SFT batches (rl/algo/sft.py): round-robin over tasks, prompts rendered with the effort prefix, targets are the
demonstrations plus EOS, and a restored stream continues exactly."""

import itertools

from model.tokenizer import CharTokenizer
from rewards.config import ArithmeticConfig, UppercaseConfig
from rewards.effort import EffortConfig, effort_prefix
from rl.config import SFTStage
from rl.algo.rendering import Renderer
from rl.algo.sft import DemonstrationStream
from rl.train.trainer import pack

TOK = CharTokenizer()


def _stream(effort=None, **stage) -> DemonstrationStream:
    tasks = {"arith": ArithmeticConfig(max_digits=3, slip_rate=0.5).build(), "upper": UppercaseConfig().build()}
    return DemonstrationStream(tasks, Renderer(TOK, tasks, effort), SFTStage(**stage), seed_offset=7, rng_seed="t")


def test_batches_alternate_tasks_and_score_exactly_the_demonstration_and_eos():
    s = _stream()
    batch = s.next_batch(6)
    prompts = [TOK.decode(p) for p in batch.prompts_B]
    assert [p.startswith("up ") for p in prompts] == [False, True] * 3 and all(p[0] == TOK.bos_id for p in batch.prompts_B)
    assert batch.num_tokens == sum(len(r) for r in batch.responses_B)
    b = pack(batch.prompts_B, batch.responses_B)
    for row, response in enumerate(batch.responses_B):
        targets = b.targets[row][b.mask[row].bool()].tolist()
        assert targets == list(response) and targets[-1] == TOK.eos_id


def test_effort_prefix_on_a_share_of_prompts_and_cold_start_shortens_low_levels():
    effort = EffortConfig(levels=[1, 100], samples_per_level=1)
    s = _stream(effort, effort_prefix_frac=0.5, effort_cold_start=True, cold_start_style="direct")
    rows = []
    for _ in range(20):
        b = s.next_batch(10)
        rows += [(TOK.decode(p), TOK.decode(r)) for p, r in zip(b.prompts_B, b.responses_B)]
    prefixed = [(p, r) for p, r in rows if p.startswith("Reasoning Effort:")]
    assert 0.3 < len(prefixed) / len(rows) < 0.7
    low = [r for p, r in prefixed if p.startswith(effort_prefix(1)) and "+" in p]
    assert low and all("\n" not in r for r in low)  # b = 1: the answer line alone (direct rate 0.99)


def test_a_restored_stream_continues_exactly():
    a = _stream()
    for _ in range(3):
        a.next_batch(5)
    state = a.state_dict()
    b = _stream()
    b.load_state_dict(state)
    for x, y in itertools.islice(zip(iter(lambda: a.next_batch(4), None), iter(lambda: b.next_batch(4), None)), 3):
        assert (x.prompts_B, x.responses_B) == (y.prompts_B, y.responses_B)


def test_a_restored_stream_continues_its_random_choices_exactly():
    """Which prompts carry the effort prefix, at which level, is drawn from the stream's RNG: restored too."""
    effort = EffortConfig(levels=[1, 100], samples_per_level=1)
    a = _stream(effort, effort_prefix_frac=0.5, effort_cold_start=True)
    for _ in range(3):
        a.next_batch(5)
    b = _stream(effort, effort_prefix_frac=0.5, effort_cold_start=True)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        x, y = a.next_batch(4), b.next_batch(4)
        assert (x.prompts_B, x.responses_B) == (y.prompts_B, y.responses_B)
