"""Held-out accuracy against minutes of training, read from runs' metrics.jsonl: the picture and table of
bench/README.md's "What GRPO does to a real model".

    python bench/curves.py --out=curves.png recipe=out/metrics.jsonl "PPO=runs/ppo/metrics.jsonl" ...

A run's minutes at a validation are tracker.learning's, as the run's own val.png has them: its steps' times before
it summed (time/step: generation, the log-probs, the update and the validations on the way; not the start-up, the
engine's build nor a resume's load) and the validation's own, so a run resumed across calls reads as one curve.
Runs that shared a GPU took longer a step than alone: compare them by step too.
Two panels: the flexible score (the answer's value in any form) and the strict one (the value after ####).
The table (stdout, markdown): each run's validations as flexible / strict % with their minutes.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tracker  # noqa: E402  (the project's tracker.py: what a run's val.png draws)


def curve(path: str) -> list[tuple[int, float, float, float]]:
    """(step, minutes of training, flexible, strict) at each validation of the run whose metrics.jsonl is `path`."""
    with open(path) as f:
        v = tracker.learning([json.loads(line) for line in f])["val"]
    return list(zip(v["step"], v["minutes"], v["val/flexible"], v["val/strict"]))


def table(curves: dict) -> str:
    lines = ["| run | held-out flexible / strict % (minutes of training) at steps 0, 10, ... |", "|---|---|"]
    for name, c in curves.items():
        cells = [f"{100 * fl:.1f} / {100 * st:.1f} ({m:.1f})" for _, m, fl, st in c]
        lines.append(f"| {name} | {'; '.join(cells)} |")
    return "\n".join(lines)


def draw(curves: dict, out: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (flex, strict) = plt.subplots(1, 2, figsize=(12, 5.5), sharey=True)
    for i, (name, c) in enumerate(curves.items()):
        minutes = [m for _, m, _, _ in c]            # past ten runs the colours repeat: those lines are dashed
        style = dict(color=f"C{i % 10}", marker="o", ms=3, ls="-" if i < 10 else "--", lw=1.5 if i < 10 else 2.2)
        flex.plot(minutes, [100 * fl for _, _, fl, _ in c], label=name, **style)
        strict.plot(minutes, [100 * st for _, _, _, st in c], **style)
    for ax, what in ((flex, "flexible (the value in any form)"), (strict, "strict (the value after ####)")):
        ax.set_title(f"held-out {what}", fontsize=10)
        ax.set_xlabel("minutes of training (the run's step times summed)")
        ax.grid(alpha=0.3)
    flex.set_ylabel("% of the 319 held-out problems")
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(out, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="curves.png", help="the picture")
    p.add_argument("runs", nargs="+", help="label=path/to/metrics.jsonl, in the legend's order")
    args = p.parse_args(argv)
    curves = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec!r}: give each run as label=path/to/metrics.jsonl")
        curves[name] = curve(path)
    print(table(curves))
    draw(curves, args.out)
    print(f"[curves] {args.out}")


if __name__ == "__main__":
    main()
