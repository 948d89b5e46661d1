"""The 2-GPU report (markdown) from bench/two_gpus.sh's runs: python bench/two_gpus_report.py out/two_gpus

Each run's figures are medians over its steps after the first two (all of them when it has fewer); what
is missing (a part not run, a run that failed) is said as missing, never filled in.
"""
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import profile_table        # noqa: E402


def figures(out: str, run: str) -> dict | None:
    path = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = [r for r in map(json.loads, open(path)) if "optimizer_steps" in r]   # training steps (not validation's)
    rows = rows[2:] or rows
    return {k: statistics.median(r[k] for r in rows if k in r)
            for k in rows[-1] if isinstance(rows[-1][k], (int, float))}


def cell(m, key, fmt="{:.3f}"):
    return fmt.format(m[key]) if m and key in m else "-"


def table(out: str, title: str, runs: list, keys: list) -> list:
    lines = [f"### {title}", "", "| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for run in runs:
        m = figures(out, run)
        lines.append(f"| {run}{'' if m else ' (not run, or failed)'} | " + " | ".join(cell(m, k) for k in keys) + " |")
    return lines + [""]


def ratio(out, a, b, key) -> str:
    ma, mb = figures(out, a), figures(out, b)
    return f"{mb[key] / ma[key]:.3f}" if ma and mb and key in ma and key in mb and ma[key] else "-"


def plan_rows(out: str, runs: list) -> list:
    """Each stage's measured allocator peak beside the plan's, per run (the planner's 2-GPU rows)."""
    lines = ["### The plan beside each stage (allocator peak per GPU, GB: measured / planned)", ""]
    for run in runs:
        m = figures(out, run)
        if not m:
            continue
        stages = [k.split("/")[1] for k in m if k.startswith("plan/") and k.endswith("/predicted_gb")]
        pairs = [f"{s} {m.get(f'mem/{s}/peak_gb', 0):.2f} / {m[f'plan/{s}/predicted_gb']:.2f}" for s in stages]
        lines.append(f"- {run}: " + ", ".join(pairs))
    return lines + [""]


def main(out: str):
    lines = [f"# Two GPUs: {out}", "", "Parts and their exit codes:", "", "```",
             open(os.path.join(out, "summary.txt")).read().strip() if os.path.exists(os.path.join(out, "summary.txt"))
             else "(none ran)", "```", ""]
    lines += table(out, "Ulysses: one long sequence, k=1 against k=2 (per GPU)", ["ulysses_k1", "ulysses_k2"],
                   ["mem/update/peak_gb", "mem/advantage/allocated_gb", "time/update", "plan/update/predicted_gb"])
    k1, k2 = figures(out, "ulysses_k1"), figures(out, "ulysses_k2")
    if k1 and k2:
        act = lambda m: m["mem/update/peak_gb"] - m["mem/advantage/allocated_gb"]  # noqa: E731
        lines += [f"The update's activation peak per GPU (its peak less what is held between stages): k=2 / k=1 = "
                  f"{act(k2) / act(k1):.3f} (goal: at most 0.55).", ""]
    lines += table(out, "Async 1 + 1 against colocated on 2 GPUs", ["async_colocated", "async_1plus1"],
                   ["time/step", "time/generate", "time/rollout_wait", "time/update", "time/push",
                    "rollout/staleness_max", "rollout/push_s", "rollout/push_gb", "rollout/push_transient_gb",
                    "mem/update/peak_gb"])
    lines += [f"Step time async / colocated: {ratio(out, 'async_colocated', 'async_1plus1', 'time/step')} "
              f"(goal: throughput at least 1.3x, i.e. at most 0.77)."]
    push = figures(out, "async_1plus1")
    if push and push.get("rollout/push_s"):
        lines += [f"The NCCL push: {push['rollout/push_gb']:.2f} GB in {push['rollout/push_s']:.3f} s = "
                  f"{push['rollout/push_gb'] * 2 ** 30 / push['rollout/push_s'] / 1e9:.1f} GB/s "
                  f"(predict.PUSH_BPS's fit)."]
    lines += [""]
    lines += table(out, "Scaling 1 -> 2 GPUs, the same work per rank", ["scaling_1gpu", "scaling_2gpu"],
                   ["time/step", "time/generate", "time/ref_logp", "time/update", "perf/update_mfu"])
    lines += [f"Scaling efficiency (1-GPU step / 2-GPU step): "
              f"{ratio(out, 'scaling_2gpu', 'scaling_1gpu', 'time/step')} (goal: at least 0.95).", ""]
    traces = sorted(glob.glob(os.path.join(out, "scaling_2gpu", "profile", "*.rank0.pt.trace.json")))
    if traces:
        lines += ["Where the 2-GPU step spends its time (rank 0, ms):", "", "```"]
        lines += [f"{stage}: {row}" for stage, row in profile_table(traces[-1]).items()] + ["```", ""]
    lines += table(out, "Engine and sharding layouts on 2 GPUs", ["layouts_tp1", "layouts_tp2", "layouts_hsdp"],
                   ["time/step", "time/generate", "rollout/generate_device_gb", "mem/update/peak_gb", "time/update"])
    lines += plan_rows(out, ["ulysses_k1", "ulysses_k2", "async_colocated", "async_1plus1", "scaling_1gpu",
                             "scaling_2gpu", "layouts_tp1", "layouts_tp2", "layouts_hsdp"])
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/two_gpus")
