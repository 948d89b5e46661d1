"""The corpus of measured memory: every run in bench/results whose memory behaviour is today's, one row a run,
each stage's allocator peak (mem/<stage>/peak_gb) and device level (what mem_get_info saw) beside the options,
world size, GPU, commit and raw file it came from (bench/results/corpus.json). tests/test_corpus.py replays every
row through predict.predict on the CPU and holds each stage above 1 GB to 5 % at the allocator and 8 % at the
device level (a row's `bounds` widen a stage where a known term is not modelled, with the reason). Runs left out
(measured before a change to what a stage holds) are listed in the corpus with the reason.

    python bench/corpus.py add OUT_DIR --gpu=H100 --commit=abc1234             # a run's metrics.jsonl + run_config.json
    python bench/corpus.py add OUT_DIR --gpu=H200 --commit=X --prompt_len=232 --log=OUT_DIR/log.txt \\
        --model_as=bench/results/models/qwen2.5-coder-0.5b-instruct --pin=--kernels=liger --bound=upper
                                                                # a real model's run (its answers end early)
    python bench/corpus.py table                                               # the figures bench/README.md quotes

A row's device level is the stage's end (mem/<stage>/device_used_gb: the allocator's reserve only grows inside a
stage, so its end is its high point) and generate's the engine's high point (rollout/device_peak_gb); a stage
whose allocator retried is not recorded at the device level (the retry gave the cache back), nor are ref_logp and
advantage where the reference's offload gave its cache back (`offload/ref_params/released_gb`)."""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import options  # noqa: E402  (the repository's top-level files, run from anywhere)
import predict  # noqa: E402

CORPUS = os.path.join(HERE, "bench", "results", "corpus.json")
ALLOCATOR, DEVICE = 0.05, 0.08     # the bounds every stage above FLOOR_GB is held to, as a share of the measurement
FLOOR_GB = 1.0                     # below it a stage is the run's fixed costs: no news at any share
# options that name files and places or say when things happen: nothing a stage holds on the GPU follows them
RUN_ONLY = {"data", "reward", "reward_error", "prompt_key", "answer_key", "instruction", "gsm8k_format", "val_data",
            "val_freq", "val_before_train", "val_max_prompts", "val_response_length", "steps", "seed", "data_seed",
            "out_dir", "save", "profile_steps", "memory_history", "keep_checkpoints", "resume", "dist_timeout_s",
            "logger", "max_prompt_length"}


# the stages whose end comes after the reference's offload gave its cached blocks back (ref.param_offload): their
# device level at the end is not their high point, so a run that released there records none for them
RELEASED = ("ref_logp", "advantage")


# --------------------------------------------------------------------------- a run's row
def load_run(out_dir: str) -> tuple:
    """(the metrics lines, the run's config as run_config.json resolved it, its world size) of a run's out_dir."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    with open(os.path.join(out_dir, "run_config.json")) as f:
        rc = json.load(f)
    return lines, rc["resolved_config"], rc.get("world_size", 1)


def stage_figures(lines: list) -> tuple:
    """({stage: allocator peak GB}, {stage: device level GB}), medians over the steps after the first (its Adam
    and caches are born in it; all of them for a one-step run). Validation is left out: it runs on some steps."""
    steps = [m for m in lines if m.get("step", 0) >= 1] or lines
    stages = sorted({k.split("/")[1] for m in steps for k in m if k.startswith("mem/") and k.endswith("/peak_gb")})
    peak, device = {}, {}
    for s in (x for x in stages if x != "val"):
        peak[s] = statistics.median(m[f"mem/{s}/peak_gb"] for m in steps if f"mem/{s}/peak_gb" in m)
        key = "rollout/device_peak_gb" if s == "generate" else f"mem/{s}/device_used_gb"
        seen = [m[key] for m in steps if key in m and not m.get(f"mem/{s}/alloc_retries", 0)
                and not (s in RELEASED and m.get("offload/ref_params/released_gb", 0))]
        if seen:
            device[s] = statistics.median(seen)
    return peak, device


def args_of(resolved: dict, model_as: str | None = None) -> list:
    """The options that differ from today's defaults, as flags (a run's config, whatever defaults it ran under);
    RUN_ONLY's and options that no longer exist are left out, `model_as` stands in for a model not on this
    machine (a real model's config by its size: random:qwen2.5-0.5b)."""
    default, out = vars(options.parse_args([])), []
    for key, value in resolved.items():
        if key in RUN_ONLY or key not in default:
            continue
        if isinstance(value, dict):
            section = vars(default[key])
            out += [_flag(f"{key}.{k}", v) for k, v in value.items() if k in section and section[k] != v]
        elif key == "model":
            out += [_flag("model", model_as or value)] if (model_as or value) else []
        elif default[key] != value:
            out.append(_flag(key, value))
    return out


def _flag(key: str, value) -> str:
    return f"--{key}={str(value).lower() if isinstance(value, bool) else value}"


def relaxed_in(log: str) -> list:
    """The sizes and levers plan.relax set at the run's start, as flags: its set-up line `[plan] a=1 b=2: faster,
    ...` (run_config.json keeps the command line's values)."""
    line = next((x for x in log.splitlines() if x.startswith("[plan] ") and ": faster, and the run keeps" in x), "")
    return [f"--{kv}" for kv in line.removeprefix("[plan] ").split(":")[0].split()] if line else []


def row_from_run(out_dir: str, *, name: str, gpu: str, commit: str, prompt_len: int, model_as: str | None = None,
                 pins: tuple = (), bound: str = "close", source: str | None = None) -> dict:
    """A corpus row from a run's out_dir: its options (`pins` added: what the run chose on its machine and
    run_config.json keeps as `auto`, e.g. --kernels=liger), world, each stage's figures. `bound`: "close" (held
    both ways) or "upper" (a real model's answers end early: the plan, for full-length answers, bounds it)."""
    lines, resolved, world = load_run(out_dir)
    peak, device = stage_figures(lines)
    engine = "vllm" if any("rollout/device_peak_gb" in m or "rollout/engine_device_gb" in m for m in lines) else "hf"
    # (any line: a run's last may be its final validation's, which carries no rollout figures)
    row = {"name": name, "args": args_of(resolved, model_as) + list(pins), "world": world, "prompt_len": prompt_len,
           "engine": engine, "peak_gb": peak, "device_gb": device, "gpu": gpu, "commit": commit,
           "source": source or os.path.relpath(os.path.abspath(out_dir), HERE)}
    if bound == "upper":
        row["bound"] = "upper"
    return row


# --------------------------------------------------------------------------- the replay
def replay(row: dict) -> list:
    """[(stage, level, measured GB, planned GB, bound, why)] for every stage above FLOOR_GB of a row: the plan for
    its options now (predict.predict, CPU), each beside the bound it is held to (the row's own where it gives one:
    `bounds` {"stage" or "device stage": [share, why]})."""
    p = predict.predict(options.parse_args(local(row["args"])), row["world"], row["prompt_len"], row["engine"])
    out, wider = [], row.get("bounds", {})
    for level, figures, bound in (("allocator", row["peak_gb"], ALLOCATOR),
                                  ("device", row.get("device_gb", {}), DEVICE)):
        for s, measured in figures.items():
            if measured <= FLOOR_GB:
                continue
            key = s if level == "allocator" else f"device {s}"
            planned = (p.stage(s).total if level == "allocator" else p.device[s]) / predict.GB
            share, why = wider.get(key, (bound, ""))
            out.append((s, level, measured, planned, share, why))
    return out


def local(args: list) -> list:
    """A row's options with a model folder kept in the repository (bench/results/models/: a real model's
    config.json, all the plan reads of it) made absolute, so the replay runs from any directory."""
    return [f"--model={os.path.join(HERE, a[8:])}" if a.startswith("--model=bench/") else a for a in args]


def misses(row: dict) -> list[str]:
    """The stages of a row off the plan by more than their bound (`upper` rows: only above it), each one line with
    the row's name, stage, measured and planned GB."""
    out = []
    for s, level, measured, planned, share, why in replay(row):
        off = planned / measured - 1       # - : the run held more than the plan
        if -off > share or (row.get("bound") != "upper" and off > share):
            out.append(f"{row['name']}: {level} {s} measured {measured:.2f} GB, planned {planned:.2f} GB "
                       f"(the plan {off:+.1%} of the measurement; bound {share:.0%}{', ' + why if why else ''})")
    return out


def load(path: str = CORPUS) -> dict:
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- what bench/README.md quotes
def size_of(row: dict) -> str:
    """A row's model size ("0.5b"): a random model's, or a real model's folder named for it."""
    model = next(a.split("=", 1)[1] for a in row["args"] if a.startswith("--model="))
    return model.removeprefix("random:qwen2.5-").rsplit("-", 2)[-2] if "/" in model else \
        model.removeprefix("random:qwen2.5-")


# the rows spelt out stage by stage below the table
TEMPLATES = ("qwen2.5-7b the 1 x 80 GB template with the embeddings and the LM head FSDP2 units of their own",)


def table(corpus: dict) -> str:
    """bench/README.md's planner figures: by model size, the rows, the stages held, the median and the largest
    miss at each level (the plan against the measurement, signed: + the plan above it); then the 7B template's rows
    (TEMPLATES)."""
    lines = ["| model | rows | stages held (allocator / device) | allocator: median, largest miss | "
             "device: median, largest miss |", "|---|---|---|---|---|"]
    by = {}
    for row in corpus["rows"]:                 # a real model's rows apart: the plan bounds them from above only
        key = size_of(row) + (", real model (the plan an upper bound)" if row.get("bound") else "")
        by.setdefault(key, []).append(row)
    for size in sorted(by, key=lambda s: (float(s.split(",")[0].rstrip("b")), s)):
        held = [x for row in by[size] for x in replay(row)]
        cols = []
        for level in ("allocator", "device"):
            errs = [planned / measured - 1 for s, lv, measured, planned, *_ in held if lv == level]
            worst = max(errs, key=abs, default=0)
            cols.append(f"{statistics.median(map(abs, errs)):.1%}, {worst:+.1%}" if errs else "-")
        n = [sum(lv == level for _, lv, *_ in held) for level in ("allocator", "device")]
        lines.append(f"| {size} | {len(by[size])} | {n[0]} / {n[1]} | {cols[0]} | {cols[1]} |")
    for start in TEMPLATES:
        template = next(r for r in corpus["rows"] if r["name"].startswith(start))
        where = f"{template['gpu']}, at {template['commit']}, `{template['source'].split(' (')[0]}`"
        lines += ["", f"{template['name']} ({where}), GB:", "",
                  "| stage | allocator measured | plan | device measured | plan |", "|---|---|---|---|---|"]
        got = {(s, lv): (m, p) for s, lv, m, p, *_ in replay(template)}
        for s in template["peak_gb"]:
            a, d = got.get((s, "allocator")), got.get((s, "device"))
            lines.append(f"| {s} | " + " | ".join(f"{x[0]:.2f} | {x[1]:.2f}" if x else "- | -" for x in (a, d)) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="a run's out_dir (metrics.jsonl, run_config.json) into the corpus")
    add.add_argument("out_dir")
    add.add_argument("--gpu", required=True, help="the GPU it ran on (nvidia-smi's name: H100, H200)")
    add.add_argument("--commit", required=True, help="the commit whose code ran")
    add.add_argument("--name", default="", help="the row's name (default: the out_dir's)")
    add.add_argument("--prompt_len", type=int, default=4, help="the longest prompt in tokens (4: the copy task's)")
    add.add_argument("--model_as", default=None, help="a stand-in for a model folder not on this machine")
    add.add_argument("--pin", action="append", default=[], help="an option the run resolved on its machine")
    add.add_argument("--log", default="", help="the run's printed output: plan.relax's choices are read from it")
    add.add_argument("--bound", choices=("close", "upper"), default="close")
    add.add_argument("--shared", action="store_true", help="the GPU was shared with other runs: what mem_get_info "
                     "saw holds theirs too, so the device levels are left out (each process's allocator peaks stay)")
    add.add_argument("--corpus", default=CORPUS)
    sub.add_parser("table", help="the figures bench/README.md quotes").add_argument("--corpus", default=CORPUS)
    a = ap.parse_args(argv)
    if a.cmd == "table":
        print(table(load(a.corpus)))
        return
    if not os.path.exists(os.path.join(a.out_dir, "metrics.jsonl")):
        sys.exit(f"error: {a.out_dir} has no metrics.jsonl: pass a run's --out_dir")
    home = os.path.dirname(os.path.abspath(a.corpus))        # bench/results: a row's raw files are on record there
    if os.path.relpath(os.path.abspath(a.out_dir), home).startswith(".."):
        sys.exit(f"error: {a.out_dir} is outside {home}: copy its metrics.jsonl and run_config.json (and its log) "
                 f"into {home}/<date>-<what>/<run>/ first, so the row's raw files are on record")
    corpus = load(a.corpus)
    relaxed = relaxed_in(open(a.log, errors="replace").read()) if a.log else []
    row = row_from_run(a.out_dir, name=a.name or os.path.basename(os.path.normpath(a.out_dir)), gpu=a.gpu,
                       commit=a.commit, prompt_len=a.prompt_len, model_as=a.model_as, pins=tuple(relaxed + a.pin),
                       bound=a.bound)
    if a.shared:
        row["device_gb"] = {}
        row["source"] += ("; the GPU was shared with other runs, so what mem_get_info saw holds theirs: the device "
                          "levels are left out, the allocator's peaks (each process's own) kept")
    corpus["rows"] = [r for r in corpus["rows"] if r["name"] != row["name"]] + [row]
    with open(a.corpus, "w") as f:
        json.dump(corpus, f, indent=1)
        f.write("\n")
    print(f"{row['name']}: {len(row['peak_gb'])} stages; " + ("; ".join(misses(row)) or "every stage within its bound"))


if __name__ == "__main__":
    main()
