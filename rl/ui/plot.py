"""`rl plot RUN_DIR... --out FILE.png|svg|pdf`: the dashboard's standard curves as one figure for a report, without a
browser (issue #45 item 5). The same series as the curves page (rl/ui/static/app.js `CHARTS`), from the same reader
(rl/ui/data.py), several runs overlaid, one panel a chart that any run has data for. matplotlib draws it (the Agg
backend: no display needed); it is an optional dependency (`pip install 'asyncrl[plot]'`)."""

from __future__ import annotations

import sys
from pathlib import Path

from rl.ui.data import Dashboard, UIError

CHARTS = (
    ("reward", ("rollout/reward",)), ("accuracy", ("rollout/accuracy",)), ("held-out", ("eval/accuracy",)),
    ("response length", ("rollout/response_len",)), ("entropy", ("rl/entropy",)), ("KL to behaviour", ("rl/kl_behavior",)),
    ("staleness share", ("stale/masked_frac", "async/stale_token_frac")),
    ("time split (cumulative s)", ("time/rollout_s", "time/train_s", "time/reward_wait_s")),
    ("in flight", ("dispatch/inflight", "rollout/concurrency_mean")),
    ("tokens/s", ("rollout/tokens_per_s", "train/tokens_per_s")),
)
"""(panel title, metrics): the curves page's charts, in its order."""
FORMATS = (".png", ".svg", ".pdf")


def with_breakdown(metrics: tuple[str, ...], keys: set[str]) -> list[str]:
    """A chart's metrics that the runs log, each followed by its breakdowns (rl/metrics.py `rollout_breakdown`:
    `rollout/reward/<dataset>`, `.../effort<b>`, `.../teacher_<name>`; `eval/<dataset>/accuracy`): the curves page's
    rule (rl/ui/static/app.js `withBreakdown`)."""
    out = []
    for m in metrics:
        out += [m] if m in keys else []
        if m.startswith("rollout/"):
            out += sorted(k for k in keys if k.startswith(m + "/"))
        if m.startswith("eval/"):
            leaf = m.removeprefix("eval/")
            out += sorted(k for k in keys if k.startswith("eval/") and k.endswith("/" + leaf) and k.count("/") == 2)
    return out


def plot_runs(run_dirs: list[str | Path], out: str | Path, extra: tuple[str, ...] = ()) -> list[str]:
    """Write the figure; returns the panels drawn. UIError (one line) for a bad output name or runs with no metrics."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise UIError(f"--out {out}: expected a .png, .svg or .pdf file")
    try:
        import matplotlib
    except ImportError:
        raise UIError("rl plot needs matplotlib: pip install 'asyncrl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Dashboard(run_dirs)
    try:
        keys = {k: set(d.keys(k)) for k in d.runs}
        logged = set().union(*keys.values())
        panels = [(t, with_breakdown(ms, logged)) for t, ms in CHARTS]
        panels += [(m, [m]) for m in extra if any(m in ks for ks in keys.values())]
        panels = [(t, ms) for t, ms in panels if ms]
        if not panels:
            raise UIError(f"no metrics to plot in {', '.join(str(p) for p in run_dirs)} (no metrics.jsonl rows yet)")
        cols = min(3, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
        names = {k: r.name for k, r in d.runs.items()}
        for ax, (title, metrics) in zip(axes.flat, panels):
            for k in d.runs:
                for m in metrics:
                    c = d.curve(k, m)
                    if c["x"]:  # a few points (held-out evaluations): marked, or one would not show
                        ax.plot(c["x"], c["y"], label=f"{names[k]} {m}" if len(metrics) > 1 else names[k], lw=1.2,
                                marker="o" if len(c["x"]) <= 50 else None, ms=3)
            for k in d.runs:
                for v in d.run_page(k)["config_versions"]:
                    if v.get("status") == "applied":
                        ax.axvline(v["train_step"], color="0.6", ls="--", lw=0.8)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
        plt.close(fig)
    finally:
        d.close()
    return [t for t, _ in panels]


def add_plot_parser(subparsers) -> None:
    p = subparsers.add_parser("plot", help="write runs' standard curves to a PNG, SVG or PDF file")
    p.add_argument("run_dirs", nargs="+", help="run directories (their metrics.jsonl)")
    p.add_argument("--out", required=True, help="the figure: FILE.png, FILE.svg or FILE.pdf")
    p.add_argument("--metric", action="append", default=[], help="one more metric of metrics.jsonl to plot (repeatable)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    try:
        panels = plot_runs(args.run_dirs, args.out, tuple(args.metric))
    except (UIError, OSError) as e:
        print(f"rl plot: {e}", file=sys.stderr)
        return 2
    print(f"rl plot: {len(panels)} panels ({', '.join(panels)}) -> {args.out}")
    return 0
