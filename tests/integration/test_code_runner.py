"""Verifiers that must run code get an execution handle from rl/ (issue #16, item 3): a RewardWorker of a
recipe with `sandbox.socket` hands its task a `CodeRunner` backed by a real sandbox server (bubblewrap);
the task's verdicts come from what the response printed, and a response that spins or reads the host's files
is contained and scored 0 with its reason."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from rewards import Trajectory
from rl.config import Recipe
from rl.runtime.reward_worker import RewardWorker
from sandbox_client import LocalServer
from tests.tasks.python_answers import PythonAnswers

pytestmark = pytest.mark.integration


def test_a_verifier_runs_the_answer_in_the_nodes_sandbox():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-runner-"))  # sandbox uids traverse it
    scratch.chmod(0o711)
    server = LocalServer(scratch / "s.sock", scratch / "state", max_sandboxes=2)
    try:
        recipe = Recipe.model_validate({
            "datasets": [{"type": "custom", "name": "py", "task": "tests.tasks.python_answers:PythonAnswers"}],
            "stages": [{"type": "sft", "max_steps": 1}],
            "sandbox": {"socket": str(scratch / "s.sock"), "limits": {"timeout_s": 5, "cpu_s": 2}}})
        worker = RewardWorker(recipe)
        p = PythonAnswers("py").problem_for(3, 4)
        responses = ["print(3 + 4)", "print(3 * 4)", "while True: pass",
                     f"print(open({str(Path.home() / '.bashrc')!r}).read())", "import sys; sys.exit(3)"]
        verdicts = worker.verify([Trajectory.single(p, r, "stop") for r in responses])
        assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert verdicts[0].reason == "printed '7', exit 0" and verdicts[1].reason == "printed '12', exit 0"
        assert verdicts[2].reason in ("killed: sandbox: cpu", "killed: sandbox: timeout"), verdicts[2].reason
        assert verdicts[3].reason == "printed '', exit 1"  # the host's home is not there
        assert verdicts[4].reason == "printed '', exit 3"
        worker.ctx.code.close()
        with pytest.raises(ValidationError, match="is not a socket: start the node's server first"):
            Recipe.model_validate({**recipe.model_dump(mode="json"), "sandbox": {"socket": str(scratch / "none.sock")}})
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
