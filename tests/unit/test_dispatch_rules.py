"""Dispatch rules at their boundaries (pure logic, no Ray): per-dataset caps that are not a multiple of the
group size, counted cap skips, a blocked draw released next, the rest of a capped batch, the exact
stale-token bound, warm-up discard limits, live caps, and what a restored dispatcher still knows."""

import json
import random

from rl.dispatch import DispatchConfig, Dispatcher, FinishedMeta


def make(policy="sample", datasets=("a",), G=4, per_step=2, seed=0, **kw):
    return Dispatcher(DispatchConfig(policy=policy, **kw), datasets=list(datasets), group_size=G, prompts_per_step=per_step,
                      seed=seed)


def finish(d, ticket, j, tokens=10):
    d.on_finished(FinishedMeta(f"{ticket.prompt_id}-{j}", ticket.prompt_id, tokens, ticket.version))


def finish_group(d, ticket, tokens=10):
    for j in range(ticket.group_size):
        finish(d, ticket, j, tokens)


def test_a_cap_that_is_not_a_multiple_of_the_group_size_is_never_exceeded():
    """Cap 6 with groups of 4: one group of `a` at a time (4 <= 6, 8 > 6); the rest of the room goes to `b`,
    and `a` is drawn again once its group is done."""
    d = make(datasets=("a", "b"), G=4, max_inflight=16, dataset_max_inflight={"a": 6}, mixture={"a": 3.0, "b": 1.0})
    rng, open_, released = random.Random(0), [], []
    for _ in range(120):
        for t in d.dispatch():
            released.append(t.dataset)
            open_ += [(t, j) for j in range(t.group_size)]
            assert d.inflight["a"] <= 6 and d.total_inflight <= 16
        t, j = open_.pop(rng.randrange(len(open_)))
        finish(d, t, j)
    assert released.count("a") >= 5 and released.count("b") >= 5


def test_cap_skips_count_exactly_the_draws_that_found_a_dataset_at_its_cap():
    d = make(datasets=("a", "b"), G=4, max_inflight=12, dataset_max_inflight={"a": 5}, mixture={"a": 100.0, "b": 1.0})
    tickets = d.dispatch()
    assert [t.dataset for t in tickets] == ["a", "b", "b"]  # a first (weight 100), then a is at its cap
    assert d.stats.cap_skips == 3  # the two b releases and the draw that found max_inflight reached
    uncapped = make(datasets=("a", "b"), G=4, max_inflight=12, dataset_max_inflight={"a": 100})
    uncapped.dispatch()
    assert uncapped.stats.cap_skips == 0


def test_a_drawn_but_blocked_prompt_is_released_next_so_large_groups_are_not_starved():
    sizes = {"big": 8, "small": 2}
    d = Dispatcher(DispatchConfig(max_inflight=8), datasets=["big", "small"], group_size=sizes.__getitem__,
                   prompts_per_step=1, seed=0)
    rng, open_, released = random.Random(1), [], []
    for _ in range(200):
        for t in d.dispatch():
            released.append(t.dataset)
            open_ += [(t, j) for j in range(t.group_size)]
        t, j = open_.pop(rng.randrange(len(open_)))
        finish(d, t, j)
    # without the rule a small group fits every time 2 samples finish, and `big` (8) almost never gets in
    assert released.count("big") >= 0.25 * len(released)


def test_batch_policy_releases_the_rest_of_a_capped_batch_later():
    d = make("batch", G=4, per_step=2, batch_prefill=1, max_inflight=64, dataset_max_inflight={"a": 4})
    (first,) = d.dispatch()  # a batch is 2 prompts; the cap lets one in
    assert d.dispatch() == []
    finish_group(d, first)
    (second,) = d.dispatch()  # the rest of the batch, without waiting for a train step that cannot come
    finish_group(d, second)
    assert sorted(d.take_batch([], lambda pid: (40, 0))) == [first.prompt_id, second.prompt_id]


def test_a_batch_exactly_at_the_stale_token_bound_is_taken():
    d = make(max_inflight=16, per_step=2, max_stale_token_frac=0.25)
    a, b, _, _ = d.dispatch()
    finish_group(d, a)
    finish_group(d, b)
    assert d.take_batch([], lambda pid: (40, 10)) == [a.prompt_id, b.prompt_id]  # 20 / 80 = 0.25 exactly


def test_warmup_discards_only_shorter_samples_and_only_during_its_steps():
    d = make(max_inflight=8, warmup_discard={"steps": 1, "min_response_tokens": 5})
    a, b = d.dispatch()
    finish_group(d, a, tokens=5)  # exactly the minimum: kept
    assert not d.is_discarded(a.prompt_id) and d.num_ready_groups == 1
    assert d.take_batch([], lambda pid: (20, 0)) is None  # per_step 2
    d.on_train_step()  # warm-up (1 step) is over
    finish_group(d, b, tokens=1)
    assert not d.is_discarded(b.prompt_id) and d.num_ready_groups == 2 and d.stats.discarded_samples == 0


def test_reconfigured_caps_apply_from_the_next_draw():
    d = make(datasets=("a", "b"), G=4, max_inflight=16)
    d.reconfigure({"a": 100.0, "b": 1.0}, {"a": 4})
    tickets = d.dispatch()
    assert [t.dataset for t in tickets].count("a") == 1 and d.inflight["a"] == 4
    d.reconfigure({"a": 100.0, "b": 1.0}, {})  # cap removed: a may take more than 4 from now on
    finish_group(d, tickets[1])
    finish_group(d, tickets[2])
    d.dispatch()
    assert d.inflight["a"] == 8


def _through_json(d: Dispatcher, **kw) -> Dispatcher:
    restored = make(**kw)
    restored.load_state_dict(json.loads(json.dumps(d.state_dict())))
    return restored


def test_a_restored_dispatcher_still_knows_the_groups_warmup_discarded():
    kw = dict(max_inflight=8, warmup_discard={"steps": 2, "min_response_tokens": 5})
    d = make(**kw)
    a, b = d.dispatch()
    finish_group(d, a, tokens=1)
    finish(d, b, 0, tokens=1)  # b is discarded too, still generating
    restored = _through_json(d, **kw)
    assert restored.is_discarded(a.prompt_id) and restored.is_discarded(b.prompt_id)
    assert restored.drain_closed() == [(a.prompt_id, "discarded")]


def test_a_restored_dispatcher_releases_the_prompt_it_had_drawn_next():
    sizes = {"big": 8, "small": 2}

    def fresh():
        return Dispatcher(DispatchConfig(max_inflight=8, mixture={"big": 1.0, "small": 3.0}), datasets=["big", "small"],
                          group_size=sizes.__getitem__, prompts_per_step=1, seed=6)

    d = fresh()
    tickets = d.dispatch()
    assert [t.dataset for t in tickets] == ["small"] * 4
    assert d.state_dict()["pending_draw"] == "big"  # drawn, but 8 samples do not fit beside the small groups
    restored = fresh()
    restored.load_state_dict(json.loads(json.dumps(d.state_dict())))
    for t in tickets:
        finish_group(d, t)
        finish_group(restored, t)
    assert [t.dataset for t in restored.dispatch()] == [t.dataset for t in d.dispatch()] == ["big"]
