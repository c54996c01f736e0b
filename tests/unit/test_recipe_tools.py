"""The recipe's `tools:` section (multi-turn tool calls): what loads, and each refusal as one line naming the field."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rl.recipe_io import load_recipe
from rollout.tool_calls import PYTHON_TOOL, ToolSpec
from tests.unit.test_recipe import GOOD, error_of, line_of

SANDBOX = "sandbox:\n  socket: s.sock\n  limits:\n    timeout_s: 20\n"
HERMES = """\
tools:
  format: hermes
  max_turns: 3
  definitions:
    - name: sh
      description: Run a shell command.
      run: shell
      parameters:
        type: object
        properties:
          command: {type: string}
        required: [command]
"""


@pytest.fixture
def server_socket(tmp_path, monkeypatch):
    """Work in tmp_path (messages name `r.yaml`) beside a listening Unix socket s.sock, as `rl sandbox serve`
    leaves one (validation checks only that it is a socket)."""
    monkeypatch.chdir(tmp_path)
    s = socket.socket(socket.AF_UNIX)
    s.bind("s.sock")
    s.listen()
    yield tmp_path
    s.close()


def test_tools_load_with_defaults_and_give_the_specs(server_socket):
    Path("r.yaml").write_text(GOOD + SANDBOX + HERMES)
    tools = load_recipe("r.yaml").tools
    assert (tools.format, tools.max_turns, tools.max_tool_output_tokens, tools.max_total_tokens, tools.timeout_s) == (
        "hermes", 3, 256, None, 10.0)
    assert tools.specs() == (ToolSpec("sh", "Run a shell command.", tools.definitions[0].parameters, "shell"),)
    Path("r.yaml").write_text(GOOD + SANDBOX + "tools: {format: code}\n")
    assert load_recipe("r.yaml").tools.specs() == (PYTHON_TOOL,)  # the code format's built-in python tool
    Path("r.yaml").write_text(GOOD)
    assert load_recipe("r.yaml").tools is None


@pytest.mark.parametrize("old, new, at, field, needle", [
    ("  format: hermes", "  format: xml", "format:", "tools.format", "Input should be 'hermes' or 'code'"),
    ("        type: object", "        type: array", "parameters:", "tools.definitions.0.parameters",
     "Value error, parameters must be a JSON schema with type: object"),
    ("          command: {type: string}", "          command: {type: text}", "parameters:", "tools.definitions.0.parameters",
     "parameters.properties.command.type 'text' is not a JSON type"),
    ("        required: [command]", "        required: []", "- name: sh", "tools.definitions.0",
     "a `run: shell` tool runs its 'command' argument: parameters must declare 'command' as a required string"),
    ("    - name: sh", "    - name: 'rm -rf'", "- name:", "tools.definitions.0.name", "is not a tool name"),
    ("  max_turns: 3", "  max_turns: 0", "max_turns:", "tools.max_turns", "Input should be greater than 0"),
])
def test_a_bad_tools_field_is_one_line_naming_it(server_socket, old, new, at, field, needle):
    text = GOOD + SANDBOX + HERMES.replace(old, new)
    msg = error_of(text)
    assert msg.startswith(f"r.yaml:{line_of(text, at)}: {field}: ") and needle in msg, msg


@pytest.mark.parametrize("tools, needle", [
    ("tools: {format: hermes}", "tools: Value error, the hermes format needs at least one tool in definitions"),
    ("tools: {format: code, definitions: [{name: a}, {name: b}]}", "the code format calls one python tool"),
    ("tools: {definitions: [{name: a}, {name: a}]}", "tool names must be unique, got ['a', 'a']"),
])
def test_unusable_definitions_are_refused(server_socket, tools, needle):
    assert needle in error_of(GOOD + SANDBOX + tools + "\n")


@pytest.mark.parametrize("extra, needle", [
    ("sandbox: {socket: none.sock}\n", "sandbox.socket: Value error, 'none.sock' is not a socket: start the node's "
                                      "server first (rl sandbox serve --socket none.sock), or say `auto`"),
    (SANDBOX + "tools: {format: code, timeout_s: 30}\n", "tools.timeout_s=30.0 exceeds sandbox.limits.timeout_s=20.0"),
    (SANDBOX + "engine: {max_seq_len: 256}\ntools: {format: code, max_total_tokens: 256}\n",
     "tools.max_total_tokens=256 leaves no room for a prompt in engine.max_seq_len=256"),
])
def test_cross_section_rules(server_socket, extra, needle):
    text = GOOD + extra + ("" if "tools:" in extra else "tools: {format: code}\n")
    assert needle in error_of(text)


@pytest.mark.parametrize("sandbox, tools, server", [
    ("", "tools: {format: code}\n", "auto"),  # tools and no socket: the job starts each node's server
    ("sandbox: {socket: auto}\n", "", "auto"),  # no tools, but verifiers that run code get one
    (SANDBOX, "tools: {format: code}\n", "apart"),  # a server started apart
    ("", "", None),
])
def test_whose_sandbox_servers_a_job_uses(server_socket, sandbox, tools, server):
    Path("r.yaml").write_text(GOOD + sandbox + tools)
    recipe = load_recipe("r.yaml")
    assert recipe.sandbox_server == server
    if recipe.tools is not None:
        assert recipe.tools.on_failure == "zero_reward"  # the default repercussion
    Path("r.yaml").write_text(GOOD + "tools: {format: code, on_failure: ignore}\n")
    assert "tools.on_failure: Input should be 'zero_reward' or 'leave_loss'" in error_of(Path("r.yaml").read_text())


def test_sandboxes_default_to_one_per_sample_in_flight(server_socket):
    """A sample keeps its sandbox from its first call to its end: a server admitting fewer than the engines hold caps
    the samples in flight (issue #43's tool-use specialist: 32 of 256, 40-68 s a GRPO step)."""
    Path("r.yaml").write_text(GOOD + "sandbox: {socket: auto}\ntools: {format: code}\n")
    recipe = load_recipe("r.yaml")
    assert recipe.sandbox_slots() == recipe.engine.max_batch_size * recipe.runtime.num_workers
    Path("r.yaml").write_text(GOOD + "sandbox: {socket: auto, max_sandboxes: 5}\ntools: {format: code}\n")
    assert load_recipe("r.yaml").sandbox_slots() == 5
