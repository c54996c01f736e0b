"""Hostile chat templates (issue 40, class 7): a template is untrusted code, so every render runs under a time and a
size budget and ends, whatever the template does, in one ChatTemplateError line; `rl validate` of a recipe whose
tokenizer carries such a template exits 2 with one line naming the template's tokenizer."""

import pytest

from model import chat_template
from model.chat_template import ChatTemplateError, render_chat_template
from tests.tiny_tokenizer import write_hf_dir

MSGS = [{"role": "user", "content": "hi"}]


def _render(source: str) -> str:
    return render_chat_template(source, MSGS, add_generation_prompt=True, special_tokens={"eos_token": "</s>"})


@pytest.mark.parametrize("source, reason", [
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
    ("{{ 'x' * 3000000000 }}", "over its size budget"),
    ("{{ ['x'] * 3000000000 }}", "over its size budget"),
    ("{{ 7 ** 100000000 }}", "over its size budget"),
    ("{{ 'x'.center(3000000000) }}", "over its size budget"),
    ("{{ 'x' | center(3000000000) }}", "over its size budget"),
    ("{{ '%3000000000s' % 'x' }}", "over its size budget"),
    ("{{ '%3000000000s' | format('x') }}", "over its size budget"),
    ("{{ '{:>3000000000}'.format('x') }}", "over its size budget"),
    ("{{ ('x' * 4000000).replace('x', 'x' * 4000000) }}", "over its size budget"),
    ("{{ ('x' * 4000000) | replace('x', 'x' * 4000000) }}", "over its size budget"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
     "over its size budget"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
     "over its size budget"),
    ("{{ ('x' * 4000000).join(['a'] * 100) }}", "over its size budget"),
    ("{{ (['x' * 4000000] * 100) | join('y') }}", "over its size budget"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "over its size budget"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "over its time budget"),
], ids=["recursive-macro", "str-times-3e9", "list-times-3e9", "power-tower", "center-method", "center-filter",
        "percent-width", "format-filter-width", "str-format-width", "replace-method", "replace-filter", "concat-doubling",
        "plus-doubling", "join-method", "join-filter", "output-size", "spin"])
def test_a_hostile_template_is_one_line_within_its_budgets(monkeypatch, source, reason):
    monkeypatch.setattr(chat_template, "TIME_BUDGET_S", 0.5)
    with pytest.raises(ChatTemplateError) as e:
        _render(source)
    line = str(e.value)
    assert reason in line and "\n" not in line, line


def test_ordinary_templates_still_render_and_the_budget_disarms(monkeypatch):
    """Under budget nothing changes, and a render that ended is never interrupted afterwards."""
    import time

    monkeypatch.setattr(chat_template, "TIME_BUDGET_S", 0.2)
    assert _render("{{ 'ab' * 3 }}{{ '%5s' % 'x' }}{{ '{:>4}'.format('y') }}{{ 'x'.center(5) }}{{ [1] * 2 }}") == \
        "ababab    x   y  x  [1, 1]"
    assert _render("{% for m in messages %}{{ m.role ~ ':' ~ m.content }}{% endfor %}{{ eos_token }}") == "user:hi</s>"
    assert _render("{{ 2 ** 10 }}{{ ', '.join(['a', 'b']) }}{{ ['a', 'b'] | join('-') }}") == "1024a, ba-b"
    deadline = time.monotonic() + 0.6  # past the budget: a stray interrupt would land in this loop
    while time.monotonic() < deadline:
        sum(range(1000))


@pytest.mark.integration
def test_validate_names_the_template_over_budget(tmp_path):
    from tests.unit.test_recipe import run_cli

    tok = write_hf_dir(tmp_path / "tok", template_file="{{ 'x' * 3000000000 }}")
    (tmp_path / "d.jsonl").write_text('{"q": "1+1?", "a": "2"}\n' * 4)
    (tmp_path / "r.yaml").write_text(f"tokenizer: {{type: hf, path: {tok}}}\nmodel: {{vocab_size: 640}}\n"
                                     "datasets: [{type: jsonl, name: d, path: d.jsonl, prompt: q, answer: a, chat: true,"
                                     " verifier: exact, heldout: {fraction: 0.25}}]\nstages: [{type: sft, max_steps: 1}]\n")
    proc = run_cli("validate", "r.yaml", cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(tok) in lines[0] and "chat template" in lines[0] and "size budget" in lines[0], lines[0]
