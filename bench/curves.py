"""Held-out accuracy against minutes of training, read from runs' metrics.jsonl: the picture and table of
bench/README.md's "What GRPO does to a real model".

    python bench/curves.py --out=curves.png recipe=out/metrics.jsonl "PPO=runs/ppo/metrics.jsonl" ...

A run's minutes at a validation are its steps' times before it summed (time/step: generation, the log-probs, the
update and the validations on the way; not the start-up, the engine's build nor a resume's load), so a run resumed
across calls reads as one curve. Runs that shared a GPU took longer a step than alone: compare them by step too.
Two panels: the flexible score (the answer's value in any form) and the strict one (the value after ####).
The table (stdout, markdown): each run's validations as flexible / strict % with their minutes.
"""
import argparse
import json


def curve(path: str) -> list[tuple[int, float, float, float]]:
    """(step, minutes of training before it, flexible, strict) at each validation of the run at `path`."""
    minutes, out = 0.0, []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "val/flexible" in row:      # validated at the start of this step: before its own time
                out.append((row["step"], minutes, row["val/flexible"], row["val/strict"]))
            minutes += row.get("time/step", 0.0) / 60
    return out


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
        minutes, style = [m for _, m, _, _ in c], dict(color=f"C{i % 10}", marker="o", ms=3)
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
