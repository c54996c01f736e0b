"""Tool use learning on this CPU (issue #16, part 5): `configs/tool_arith.yaml` (3-digit products; SFT on slipped
demonstrations of calling the Python tool, then GRPO whose rollouts run their calls in a sandbox server) next to
the same recipe and budget without tools (demonstrations answer directly, with the same slip rate).

    python bench/tool_use.py --quick        # a few steps of each arm: the plumbing (< 60 s)
    python bench/tool_use.py                # the recipe's budgets (3 min SFT + 4 min GRPO per arm), arms in turn

Each arm is one `rl train` run; accuracies are the runs' own greedy held-out evaluations (128 problems) after
SFT and after GRPO. From the tools arm's store: the share of trained samples that called the tool, the share of
calls that ran cleanly (status ok), and the share of a sample's generation time spent waiting on its tools.
Last line: RESULT tools_sft_acc=.. tools_grpo_acc=.. grpo_gain_tools=.. no_tools_sft_acc=.. no_tools_grpo_acc=..
tools_minus_no_tools=.. called_frac=.. calls_ok_frac=.. tool_wait_share=..
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUICK = ["stages.0.max_steps=15", "stages.0.batch_size=8", "stages.1.max_steps=2", "stages.1.prompts_per_step=2",
         "stages.1.group_size=4", "stages.1.dispatch.max_inflight=8", "engine.max_batch_size=16",
         "datasets.0.args.num_heldout=8"]
NO_TOOLS = ["tools=null", "datasets.0.args.use_tool=false"]


def run_arm(name: str, out: Path, sets: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())", "train", "configs/tool_arith.yaml",
           "--run-dir", str(out / name), *[a for s in sets for a in ("--set", s)]]
    print(f"[{name}] rl train configs/tool_arith.yaml " + " ".join(f"--set {s}" for s in sets), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    last = p.stdout.strip().splitlines()[-1]
    print(f"[{name}] {last}", flush=True)
    fields = dict(kv.split("=") for kv in last.removeprefix("RESULT ").split())
    return {k: float(v) for k, v in fields.items()}


def tool_stats(run_dir: Path) -> dict[str, float]:
    from rl.store.trajectories import TrajectoryStore

    store = TrajectoryStore.for_run_dir(run_dir)
    samples = [store.get_sample(r.sample_id) for r in store.query(limit=100000) if r.train_step is not None]
    store.close()
    called = [s for s in samples if s.turns]
    calls = [t for s in called for t in s.turns if t.kind == "tool"]
    waits = [sum(t.wall_s or 0.0 for t in s.turns if t.kind == "tool") / s.timings["generate_s"]
             for s in called if s.timings.get("generate_s")]
    nan = float("nan")
    return {"called_frac": len(called) / len(samples) if samples else nan,
            "calls_ok_frac": sum(t.status == "ok" for t in calls) / len(calls) if calls else nan,
            "tool_wait_share": sum(waits) / len(waits) if waits else nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from sandbox_client import LocalServer

    out = args.out or Path(tempfile.mkdtemp(prefix="asyncrl-tool-use-"))
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o711)  # sandbox uids traverse the server's state directory
    server = LocalServer(out / "sandbox.sock", out / "sandbox-state", max_sandboxes=32)
    try:
        quick = QUICK if args.quick else []
        base = [f"sandbox.socket={out / 'sandbox.sock'}", "logging.progress_bar=false", *quick]
        tools = run_arm("tools", out, base)
        plain = run_arm("no_tools", out, [*base, *NO_TOOLS])
        stats = tool_stats(out / "tools")
    finally:
        server.stop()
    result = {"tools_sft_acc": tools["sft_acc"], "tools_grpo_acc": tools["grpo_acc"],
              "grpo_gain_tools": tools["grpo_acc"] - tools["sft_acc"],
              "no_tools_sft_acc": plain["sft_acc"], "no_tools_grpo_acc": plain["grpo_acc"],
              "tools_minus_no_tools": tools["grpo_acc"] - plain["grpo_acc"], **stats,
              "minutes_tools": tools["minutes"], "minutes_no_tools": plain["minutes"]}
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
