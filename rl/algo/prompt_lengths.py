"""Prompts longer than the engine takes, found before a job starts (issue 40, class 7).

The engine is given prompts of at most `engine.prompt_limit` tokens; the loop skips longer ones as it draws them
(`Renderer.draw_fitting`, `rollout/prompts_too_long`). Left at that, a dataset whose prompts are all too long
passed `rl validate` and ended `rl train` with a traceback after the run directory was claimed. So the job (and
`rl validate`, for what it can see instantly) renders and counts the prompts first, as verl does when it loads a
dataset, and `engine.overlong_prompts` says what a prompt over the limit means:

- refuse (the default, verl's `truncation: error`): one DatasetError line naming the first such prompt (a file's
  row number, else the problem id), its length, the limit and the option; nothing is created.
- drop (verl's `filter_overlong_prompts`): a line says how many were found; the loop skips them and counts them.

Either way a dataset none of whose checked prompts fits is refused: training on it would only spin.

What is checked: every row of a dataset file (train and held-out, as the job's scan read them; `rl validate`: the
first rows it reads anyway, so that it stays instant); for a procedural
or custom task, which has no end, its held-out set and its first `SAMPLED_DRAWS` train problems (their longest
prompt is the length the recipe's numbers allow; a rarer longer one is still skipped and counted by the loop). Each
prompt is rendered exactly as the loop renders it (tools, chat template) with no effort prefix and at every effort
level of the recipe; the longest counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from rewards.dataset_io import DatasetError
from rewards.datasets import PREVIEW_ROWS, FileDataset, row_problem, train_rows
from rewards.procedural import ProceduralTask
from rewards.task import Problem, Task
from rl.algo.rendering import Renderer

SAMPLED_DRAWS = 256
"""Train problems drawn from a task without an end (procedural, custom) to find its longest prompt."""


def check_prompt_lengths(renderer: Renderer, tasks: Mapping[str, Task], mode: str, efforts: Sequence[int | None],
                         say: Callable[[str], None] = print, *, preview: bool = False) -> None:
    """DatasetError (one line) per the module docstring; `efforts`: the recipe's levels (empty: none). `preview`
    (`rl validate`, which stays instant): of a dataset file only the first rows that recipe validation reads."""
    limit = renderer.max_prompt_tokens
    if limit is None:
        return
    levels = (None, *efforts)
    for name, task in tasks.items():
        checked = over = 0
        for problem in _problems(task, preview):
            checked += 1
            length = max(len(renderer.render(problem, b).ids) for b in levels)
            if length <= limit:
                continue
            over += 1
            if mode == "refuse":
                raise DatasetError(**_where(name, task, problem), message=f"the prompt has {length} tokens, more than "
                                   f"engine.max_prompt_tokens={limit} (or max_seq_len - 1): shorten or remove it, raise "
                                   "the limit, or set engine.overlong_prompts: drop to skip such prompts")
        if checked and over == checked:
            raise DatasetError(f"dataset {name}", f"all {checked} prompts checked are longer than "
                               f"engine.max_prompt_tokens={limit} (or max_seq_len - 1): nothing would be left to train on")
        if over:
            say(f"dataset {name}: {over} of {checked} prompts are longer than {limit} tokens and are skipped "
                "(engine.overlong_prompts: drop)")


def _problems(task: Task, preview: bool) -> Iterator[Problem]:
    """Held-out problems, then train problems: a file's every row (one epoch of its stream, which visits each train
    row once), else the first SAMPLED_DRAWS. `preview`: a file's first PREVIEW_ROWS train rows, read again."""
    if preview and isinstance(task, FileDataset):
        cfg = task.cfg
        (path, split), *_ = cfg.sources()
        for n, row in train_rows(cfg, path, split, min(PREVIEW_ROWS, cfg.max_rows or PREVIEW_ROWS)):
            if cfg.keeps(row):
                yield row_problem(cfg, path, n, row)
        return
    if preview and not isinstance(task, ProceduralTask):
        return  # a custom task's draws are user code: the job checks them
    yield from task.heldout()
    seen: set[str] = set()
    for problem in task.train_stream(0):
        if problem.problem_id in seen or (not isinstance(task, FileDataset) and len(seen) >= SAMPLED_DRAWS):
            return
        seen.add(problem.problem_id)
        yield problem


def _where(name: str, task: Task, problem: Problem) -> dict:
    """DatasetError's place: a file's row (train file, or the held-out file its id names), else the problem id."""
    row = problem.metadata.get("row_number")
    if isinstance(task, FileDataset) and isinstance(row, int):
        (path, _), *held = task.cfg.sources()
        if held and ":heldout:" in problem.problem_id:
            path = held[0][0]
        return {"path": path, "row": row}
    return {"path": f"dataset {name}: problem {problem.problem_id}"}
