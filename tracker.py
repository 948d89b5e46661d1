"""What a run shows beyond metrics.jsonl: its metrics in TensorBoard (or wandb), and the memory picture.

    tensorboard --logdir out/tensorboard         # every metric of every step, named as in metrics.jsonl
    python plan.py --plot=out                    # out/memory.png (also written at the end of every GPU run)

metrics.jsonl stays the source of truth; a logger mirrors each of its lines (the numbers; `step`
is the x axis), written by rank 0 only, into the run folder. --logger picks it:
- tensorboard: <out_dir>/tensorboard/. The resolved config is the text `config`. A resumed run
  opens its writer with purge_step=<the step it resumes at>: the earlier run's events at or after
  that step are discarded when the folder is read, so the curves go on with each step once (as
  metrics.jsonl keeps each step once). Events are flushed after every step (a killed run loses none).
- wandb (only when the package is installed): <out_dir>/wandb/, offline unless WANDB_MODE says
  otherwise (no account needed; `wandb sync <out_dir>/wandb/offline-run-*` uploads later). The run
  id is kept in <out_dir>/wandb/run_id, so a resume logs into the same run; wandb's steps only go
  forward, so a step re-run after a resume keeps its first value there (metrics.jsonl and
  TensorBoard hold the re-run's).
- none: a logger whose methods do nothing (the loop has no branches).
- auto (the default): tensorboard when it imports (it is in requirements.txt), else none, said once.

The picture (`picture`): per stage over the steps, the allocator's measured peak, the device's use
(mem_get_info: vLLM's pool and the CUDA context included), the plan's prediction (and its
device-level figure when the plan gives one); below, every offload copy's GB and GB/s.
"""
import contextlib
import errno
import functools
import io
import json
import math
import os
import re
import secrets
import shlex
import shutil
import sys
import tempfile
import threading
import time

KINDS = ("auto", "tensorboard", "wandb", "none")


# --------------------------------------------------------------------------- loggers
def resolve(kind: str) -> str:
    """The logger `kind` stands for on this machine ("auto": tensorboard when it imports, else none).
    A logger asked for by name whose package is missing raises, with what to do (checked before
    anything is built)."""
    if kind not in KINDS:
        raise ValueError(f"--logger={kind}: use one of {', '.join(KINDS)}")
    if kind in ("auto", "tensorboard"):
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401 (needs the tensorboard package)
            return "tensorboard"
        except ImportError:
            if kind == "tensorboard":
                raise ValueError("--logger=tensorboard: the tensorboard package is not installed "
                                 "(pip install -r requirements.txt), or pass --logger=none") from None
            return "none"
    if kind == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("--logger=wandb: wandb is not installed (pip install wandb), or pass "
                             "--logger=tensorboard") from None
    return kind


def check_dir(kind: str, out_dir: str):
    """The pre-flight's look at the logger's folder (<out_dir>/tensorboard or /wandb): a file of
    that name, or a folder this user cannot write, raises one line naming --logger=none (found
    later, it was a writer thread's traceback after the models were built)."""
    asked, kind = kind, resolve(kind)
    if kind == "none":
        return
    path = os.path.join(out_dir, kind)
    reason = "it is a file" if os.path.exists(path) and not os.path.isdir(path) else None
    if os.path.isdir(path):
        try:
            fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            reason = e.strerror
    if reason:
        raise ValueError(f"--logger={asked}{f' ({kind})' if asked != kind else ''}: {path} is not a writable "
                         f"folder ({reason}); fix it, or pass "
                         f"--logger=none (metrics.jsonl holds every step)")


def _quiet_writer_thread(args, then=threading.excepthook):
    """tensorboard's writer thread keeps its error and the next log() raises it again, where the run
    says it in one line (rundir.write_step): its own traceback is not printed as well. Set by
    TensorBoard; every other thread's error goes to the hook that was there before (`then`)."""
    if type(args.thread).__name__ != "_AsyncWriterThread":
        then(args)


def scalars(metrics: dict) -> dict:
    """The numbers of a metrics line, by their metrics.jsonl names (`step` is the x axis, not a curve)."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}


class Nothing:
    """--logger=none, and every rank but 0: the same methods, doing nothing."""
    kind, path = "none", None

    def log(self, metrics: dict, step: int):
        pass

    def close(self):
        pass


class TensorBoard:
    """<out_dir>/tensorboard: one scalar curve per metrics.jsonl number, the config as text."""
    kind = "tensorboard"

    def __init__(self, out_dir: str, config_text: str, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter
        self.path = os.path.join(out_dir, "tensorboard")
        if getattr(threading.excepthook, "func", None) is not _quiet_writer_thread:
            threading.excepthook = functools.partial(_quiet_writer_thread, then=threading.excepthook)
        # purge_step: what an earlier run wrote at or after the step this one starts at is dropped
        # by the reader (a fresh run passes 0: an attempt that died before its first line leaves nothing)
        self.writer = SummaryWriter(log_dir=self.path, purge_step=resume_step)
        self.writer.add_text("config", "    " + config_text.replace("\n", "\n    "), global_step=resume_step)
        self.writer.flush()

    def log(self, metrics: dict, step: int):
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class Wandb:
    """<out_dir>/wandb: one wandb run (its id kept in run_id across resumes), the config as its config."""
    kind = "wandb"

    def __init__(self, out_dir: str, config_text: str, resume_step: int):
        import wandb
        self.path = os.path.join(out_dir, "wandb")
        os.makedirs(self.path, exist_ok=True)
        id_file = os.path.join(self.path, "run_id")
        if os.path.isfile(id_file):
            with io.open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = secrets.token_hex(4)    # wandb's own generate_id moved between versions
            with io.open(id_file, "w") as f:
                f.write(run_id)
        try:
            config = json.loads(config_text)
        except ValueError:
            config = {"config": config_text}
        self.mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-memory"), dir=out_dir, id=run_id,
                              name=os.path.basename(os.path.abspath(out_dir)), resume="allow", config=config,
                              mode=self.mode)

    def log(self, metrics: dict, step: int):
        self.run.log(scalars(metrics), step=step)

    def close(self):
        self.run.finish()


def open(kind: str, out_dir: str, config_text: str, rank: int, resume_step: int = 0):
    """The run's logger: `log(metrics, step)` after each metrics.jsonl line, `close()` at the end.
    Only rank 0 writes (the others get `Nothing`); `resume_step`: the step this process starts at."""
    asked, kind = kind, resolve(kind)
    if rank != 0 or kind == "none":
        if rank == 0 and asked == "auto":
            print("[logger] none: tensorboard is not installed (pip install -r requirements.txt); "
                  "metrics.jsonl holds every step", flush=True)
        return Nothing()
    try:
        logger = TensorBoard(out_dir, config_text, resume_step) if kind == "tensorboard" else \
            Wandb(out_dir, config_text, resume_step)
    except Exception as e:                 # noqa: BLE001 - a writer's own errors are of any kind
        path = os.path.join(out_dir, kind)
        full = "No space left" in str(e) or getattr(e, "errno", None) == errno.ENOSPC
        why = (f"no space left on device: it needs ~{len(config_text)} bytes, {shutil.disk_usage(out_dir).free} "
               f"bytes free" if full else f"{type(e).__name__}: {e}")
        raise ValueError(f"--logger={kind}: writing {path} failed ({why}): {'free space' if full else 'fix it'}, "
                         f"or pass --logger=none (metrics.jsonl holds every step)") from None
    where = (f"tensorboard --logdir {shlex.quote(logger.path)}" if kind == "tensorboard" else   # pasteable
             f"wandb sync {shlex.quote(logger.path)}/offline-run-*" if logger.mode in ("offline", "dryrun") else
             f"WANDB_MODE={logger.mode}")
    print(f"[logger] {kind}: every metric of every step -> {logger.path} ({where})", flush=True)
    return logger


@contextlib.contextmanager
def profiled(out_dir: str, steps: set, step: int, rank: int, device):
    """A torch.profiler trace of this step when `steps` (--profile_steps) name it: CPU ops, CUDA kernels
    (on a GPU), tensor shapes, every allocation and free, each stage a labelled span (ledger.stage).
    Written to <out_dir>/profile/step<k>.rank<r>.pt.trace.json (Chrome trace: Perfetto,
    chrome://tracing; the .pt.trace.json suffix is what TensorBoard's profiler plugin reads).
    Any other step runs with no profiler at all."""
    if step not in steps:
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        yield
    path = os.path.join(out_dir, "profile", f"step{step}.rank{rank}.pt.trace.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)
    if rank == 0:
        print(f"[profile] step {step}: {path} (one file per rank)", flush=True)


# --------------------------------------------------------------------------- the progress line
def log_line(m: dict, step: int, steps: int, t_start: float, first: int = 0) -> str:
    """The step's one line; `first`: the step this process started at (a resume), for the eta. It starts with the
    step's number as metrics.jsonl, --val_freq and --profile_steps count (from 0), then how many of --steps are
    done: `step 0 (1/150)`."""
    done = (step + 1) / steps
    eta = (time.time() - t_start) / (step + 1 - first) * (steps - step - 1)
    bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
    head = f"step {step} ({step + 1}/{steps}) [{bar}] eta {int(eta // 60)}:{int(eta % 60):02d}"
    keys = ["val/reward_mean", "val/strict", "val/flexible", "reward_mean", "pg_loss", "kl", "entropy", "grad_norm",
            "response_length", "data/epochs", "time/step",
            "rollout/sync_s", "rollout/sync_transient_gb", "rollout/trainer_gpu_gb", "rollout/logp_diff_mean",
            "rollout/logp_diff_max", "critic/vf_loss"]
    keys += [k for k in m if k.startswith("time/") and k != "time/step"]
    keys += [k for k in m if k.endswith("/peak_gb")] + ["host_rss_gb"]
    keys += [k for k in m if k.endswith("/alloc_retries") and m[k]]   # a stage at the memory limit
    return " | ".join([head] + [f"{k}={m[k]:.4g}" for k in keys if k in m])


# --------------------------------------------------------------------------- the memory picture
def rows_of(run_dir: str) -> list[dict]:
    """metrics.jsonl of a run folder; a missing folder, a folder without it or an empty one raise
    one line naming the path."""
    if os.path.isfile(run_dir):
        raise ValueError(f"{run_dir} is a file: pass the run's folder, {os.path.dirname(run_dir) or '.'}")
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir}: no such folder (pass a run's --out_dir)")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist: {run_dir} is not a run folder, or its run has not "
                         f"finished a step")
    rows = []
    with io.open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:   # a line cut by a kill
                pass
    if not rows:
        raise ValueError(f"{path} holds no step yet")
    return rows


def series(rows: list[dict]) -> tuple[dict, dict]:
    """What the picture draws, as numbers (nan where a step lacks the key):
    ({stage: {"peak", "device", "predicted", "plan_device": [per step]}},
     {"<group> <copy>": {"gb", "gbps": [per step]}}) with stages in the order the steps ran them.
    `device` of generate also counts vLLM's pool (rollout/<phase>_device_gb: mem_get_info inside it)."""
    nan = float("nan")

    def col(key):
        return [r.get(key, nan) for r in rows]

    keys = list(dict.fromkeys(k for r in rows for k in r))   # first-seen order: the stages' order
    memory = {}
    for k in keys:
        m = re.fullmatch(r"mem/(.+)/peak_gb", k)
        if not m:
            continue
        st = m.group(1)
        device = col(f"mem/{st}/device_used_gb")
        if st == "generate":
            vllm = [k2 for k2 in keys if re.fullmatch(r"rollout/.+_device_gb", k2)]
            device = [max([v for v in [d] + [r.get(k2, nan) for k2 in vllm] if not math.isnan(v)], default=nan)
                      for d, r in zip(device, rows)]
        memory[st] = {"peak": col(k), "device": device, "predicted": col(f"plan/{st}/predicted_gb"),
                      "plan_device": col(f"plan/{st}/device_gb")}
    copies = {}
    for k in keys:                         # offload/<group>/<copy>_gb (+ _gbps; a background prefetch: _gb only)
        m = re.fullmatch(r"offload/(.+)/([a-z]+)_gb", k)
        if m:
            gbps = col(f"offload/{m.group(1)}/{m.group(2)}_gbps")
            copies[f"{m.group(1)} {m.group(2)}"] = {"gb": col(k), "gbps": gbps}
    return memory, copies


def _drawn(values) -> bool:
    return any(not math.isnan(v) for v in values)


def _top_panel(top, steps: list, memory: dict, run_dir: str):
    """Memory per stage over the steps: one colour per stage, one line style per figure (measured
    peak, device use, the plan's prediction and device-level figure); the styles in the legend."""
    from matplotlib.lines import Line2D
    styles = {"peak": ("-", 1.6), "device": (":", 1.4), "predicted": ("--", 1.0), "plan_device": ("-.", 1.0)}
    names = {"peak": "allocator peak (measured)", "device": "device used (mem_get_info)",
             "predicted": "plan: predicted peak", "plan_device": "plan: device-level"}
    for i, (st, s) in enumerate(memory.items()):
        for what, (ls, lw) in styles.items():
            if _drawn(s[what]):
                top.plot(steps, s[what], color=f"C{i % 10}", linestyle=ls, linewidth=lw,
                         label=st if what == "peak" else None)
    handles, _ = top.get_legend_handles_labels()
    handles += [Line2D([], [], color="gray", linestyle=ls, linewidth=lw, label=names[w])
                for w, (ls, lw) in styles.items() if any(_drawn(s[w]) for s in memory.values())]
    top.legend(handles=handles, fontsize=7, ncol=4, loc="best")
    top.set_ylabel("GB per GPU")
    top.set_title(f"{os.path.basename(os.path.abspath(run_dir))}: memory per stage")


def _bottom_panel(bottom, steps: list, copies: dict):
    """Every offload copy over the steps: GB/s solid on the left axis, GB moved dashed on the right
    (or a line saying the run had none); integer steps on the shared x axis."""
    from matplotlib.ticker import MaxNLocator
    if copies:
        right = bottom.twinx()
        for i, (name, c) in enumerate(copies.items()):
            if _drawn(c["gbps"]):
                bottom.plot(steps, c["gbps"], color=f"C{i % 10}", label=name)
            right.plot(steps, c["gb"], color=f"C{i % 10}", linestyle="--", linewidth=0.8)
        bottom.set_ylabel("GB/s (solid)")
        right.set_ylabel("GB moved (dashed)")
        bottom.legend(fontsize=7, ncol=3, loc="upper left")
        bottom.set_title("offload copies: host<->device GB/s and GB per copy")
    else:
        bottom.text(0.5, 0.5, "no offload copies in this run (no offload flag on)", ha="center", va="center",
                    transform=bottom.transAxes)
        bottom.set_yticks([])
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))


def picture(run_dir: str, path: str | None = None) -> str:
    """<run_dir>/memory.png (or `path`) from its metrics.jsonl; returns where it went. Raises one line
    (ValueError) for a folder that is not a run, or without matplotlib."""
    rows = rows_of(run_dir)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("matplotlib is not installed: no memory.png (pip install -r requirements.txt)") from None
    memory, copies = series(rows)
    steps = [r.get("step", i) for i, r in enumerate(rows)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    _top_panel(top, steps, memory, run_dir)
    _bottom_panel(bottom, steps, copies)
    fig.tight_layout()
    path = path or os.path.join(run_dir, "memory.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


VAL = ("val/reward_mean", "val/strict", "val/flexible")   # the held-out curves (validate.py)


def learning(rows: list[dict]) -> dict:
    """What val.png draws, as numbers: each validation's step, its minutes of training (the steps before it
    and its own time), and each held-out figure; the training steps' reward, length, KL and entropy."""
    nan, clock, val = float("nan"), 0.0, {"step": [], "minutes": [], **{k: [] for k in VAL}}
    for r in rows:
        if "val/reward_mean" in r:
            val["step"].append(r["step"])
            val["minutes"].append((clock + r.get("time/val", 0.0)) / 60)
            for k in VAL:
                val[k].append(r.get(k, nan))
        clock += r.get("time/step", 0.0)
    train = [r for r in rows if "reward_mean" in r]
    return {"val": val, "train": {k: [r.get(k, nan) for r in train] for k in
                                  ("step", "reward_mean", "response_length", "kl", "entropy")}}


def learning_picture(run_dir: str, path: str | None = None) -> str:
    """<run_dir>/val.png (or `path`): the held-out score against steps and against minutes of training
    (what a reader looks at first: did the run make the model better?), beside the training reward and
    response length, the KL to the reference and the entropy. Raises one line for a run without a
    validation."""
    lines = learning(rows_of(run_dir))
    v, t = lines["val"], lines["train"]
    if not v["step"]:
        raise ValueError(f"{run_dir} has no validation (--val_data) to draw")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ((by_step, by_min), (reward, kl)) = plt.subplots(2, 2, figsize=(12, 8))
    for ax, x, label in ((by_step, v["step"], "step"), (by_min, v["minutes"], "minutes of training")):
        for k, style in zip(VAL, ("-o", "--s", ":^")):
            if _drawn(v[k]):
                ax.plot(x, v[k], style, label=k)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out score (greedy)")
        ax.legend(fontsize=8)
    by_step.set_title(f"{os.path.basename(os.path.abspath(run_dir))}: held-out score")
    reward.plot(t["step"], t["reward_mean"], color="C0", label="train reward_mean")
    reward.set_ylabel("train reward (sampled)")
    length = reward.twinx()
    length.plot(t["step"], t["response_length"], color="C1", linewidth=0.8, label="response_length")
    length.set_ylabel("response length (tokens, orange)")
    reward.set_xlabel("step")
    kl.plot(t["step"], t["kl"], color="C2", label="kl")
    kl.set_ylabel("KL to the reference (green)")
    entropy = kl.twinx()
    entropy.plot(t["step"], t["entropy"], color="C3", linewidth=0.8)
    entropy.set_ylabel("entropy (red)")
    kl.set_xlabel("step")
    fig.tight_layout()
    path = path or os.path.join(run_dir, "val.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def picture_at_end(run_dir: str, device_type: str = "cuda"):
    """The end of a run: val.png when it validated (on any device), and on a GPU the memory picture, or
    one [warn] line each (a picture never fails a trained run); on the CPU, where the memory is the
    host's, one line saying how to draw memory.png anyway."""
    try:
        if learning(rows_of(run_dir))["val"]["step"]:
            print(f"[picture] {learning_picture(run_dir)}: the held-out score against steps and minutes", flush=True)
    except Exception as e:             # noqa: BLE001 - the run's results are already written
        print(f"[warn] no val.png: {e}", flush=True)
    if device_type != "cuda":
        print(f"[picture] no memory.png on the CPU; python plan.py --plot={shlex.quote(run_dir)} draws it from "
              f"metrics.jsonl", flush=True)
        return
    try:
        print(f"[picture] {picture(run_dir)}: memory per stage, the plan, the offload copies", flush=True)
    except Exception as e:             # noqa: BLE001 - the run's results are already written
        print(f"[warn] no memory.png: {e}", flush=True)


def plot_command(argv: list[str]) -> int:
    """`plan.py --plot=RUN` / `--plot RUN`: the pictures of a run folder (memory.png, and val.png when it
    validated); a bad folder is one line."""
    args = list(argv)
    i = next(i for i, a in enumerate(args) if a == "--plot" or a.startswith("--plot="))
    run_dir = args[i].partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "")
    if not run_dir:
        print("error: --plot needs a run folder: python plan.py --plot=out", file=sys.stderr)
        return 2
    try:
        print(picture(run_dir))
        if learning(rows_of(run_dir))["val"]["step"]:
            print(learning_picture(run_dir))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
