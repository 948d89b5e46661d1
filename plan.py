"""The planner fitted to a GPU: the fastest set of the flags each role declares (its SEARCH), with
checkpointing, micro-batch sizes, vLLM tensor-parallel size and Ulysses sequence-parallel size (the roles'
SIZES), that fits (fit.py's `choose`); what would fit when nothing does; `--offload=auto`; the defaults it
trades for speed when the run fits without them (`relax`); the set-up's verdict near the GPU; the command
line. The warnings that compare the prediction with each step's measurement are watch.py's.
With async rollout the engine's GPU must fit too (fit.engine_fits); a colocated run on 2+ GPUs is told
when async rollout would be faster (`async_suggestion`), never switched to it. It moves nothing and
builds no model, and it names no role's flag: the roles declare them (SEARCH, SIZES, NEEDS, RESCUE, RELIEF).

    python plan.py --model=random:qwen2.5-7b --nproc=8 --gpu_gb=80 --train_batch_size=256 \
        --rollout.n=8 --rollout.response_length=1024 --prompt_len=512      # any train_grpo.py option
    python plan.py --templates                  # the size table: 0.5B / 7B / 72B on 1x80, 8x80, 8x141 GB
    python plan.py --plot=out                   # out/memory.png from a run's metrics.jsonl (tracker.picture)
"""
import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass, replace
from operator import attrgetter

import actor
import fit
import kernel_choice
import ledger
import ref
import rollout
import rollout_engine
from fit import Target, changes, choose, choose_levers, fits_at_all, with_options   # the search (fit.py)
from predict import GB, Plan, model_config, predict, table

FORWARD_TOKENS = 2 ** 16   # relax grows a log-prob forward to this many tokens (its launches a small share of it)


# --------------------------------------------------------------------------- what would fit
def what_would_fit(cfg, t: Target) -> list[str]:
    """When nothing fits: the smallest change of each kind that would (more GPUs, fewer samples, shorter
    responses, the roles' RESCUE)."""
    tries, engines = [], cfg.rollout.gpus if cfg.rollout.mode == "async" else 0   # async: torchrun starts them too
    for k in (2, 4, 8, 16, 32, 64):            # the same samples per GPU on more GPUs
        split = f" ({t.world * k} trainer + {engines} rollout)" if engines else ""
        tries.append((f"{t.world * k + engines} GPUs{split} (torchrun --nnodes / --nproc_per_node; train_batch_size "
                      f"x{k} keeps the samples per GPU)", t.world * k,
                      {"train_batch_size": cfg.train_batch_size * k,
                       "actor.ppo_mini_batch_size": cfg.actor.ppo_mini_batch_size * k}))
    for k in (2, 4, 8):
        tries.append((f"rollout.n={max(1, cfg.rollout.n // k)}", t.world, {"rollout.n": max(1, cfg.rollout.n // k)}))
        length = max(1, cfg.rollout.response_length // k)
        tries.append((f"rollout.response_length={length}", t.world, {"rollout.response_length": length}))
    if cfg.save_freq:                          # a checkpoint's bracket: a role's params and all of its Adam at once
                                               # (the stream's: params and a window, in the flags tried above)
        ck = predict(cfg, t.world, t.prompt_len, t.engine).checkpoint
        tries.append((f"save_freq=0 (a checkpoint brings a role's params and all of its Adam in at once, a resume zero "
                       f"grads too: {ck / GB:.1f} GB; "
                       f"final/ keeps the weights whatever stops the run)", t.world, {"save_freq": 0}))
    for section, mod in (("rollout", rollout), ("actor", actor)):   # each role's last resorts (RESCUE)
        for name, (value, why) in mod.RESCUE.items():
            if getattr(getattr(cfg, section), name) != value and not (name == "lora_rank" and cfg.actor.lora_rank):
                tries.append((f"{section}.{name}={str(value).lower()} ({why})", t.world, {f"{section}.{name}": value}))
    found, kinds = [], set()
    for label, w, change in tries:
        kind = label.split("=")[0] if "=" in label.split(" ")[0] else "GPUs"
        if kind in kinds:
            continue
        c = with_options(cfg, change)
        if c.train_batch_size % w == 0 and fits_at_all(c, replace(t, world=w)):
            found.append(label)
            kinds.add(kind)
    return found


def async_suggestion(cfg, t: Target, colocated: Plan | None) -> str | None:
    """Colocated on N >= 2 GPUs: the fastest async layout with k = 1 .. N // 2 rollout GPUs (the
    trainer on N - k) that fits, in one line, when it beats `colocated` (the best colocated plan;
    None: nothing colocated fits). Only said: the off-policy lag changes the algorithm, so
    --offload=auto never switches the mode."""
    import options
    if t.world < 2 or cfg.rollout.mode != "colocated":
        return None
    best = None
    for k in range(1, t.world // 2 + 1):
        c = with_options(cfg, {"rollout.mode": "async", "rollout.gpus": k, "rollout.tensor_parallel_size": 1})
        try:
            options.check_sizes(c, t.world - k)   # the batch splits over the trainer's ranks
            found, p = choose(c, replace(t, world=t.world - k))
        except ValueError:                     # sizes that do not split, or an engine that does not fit
            continue
        if found is not None and (best is None or p.seconds < best[2].seconds):
            best = (k, found, p)
    if best is None or (colocated is not None and best[2].seconds >= colocated.seconds):
        return None
    k, found, p = best
    flags = ["--rollout.mode=async", f"--rollout.gpus={k}"] + changes(cfg, found)   # tensor parallel back to 1 too
    lag = "one step" if cfg.rollout.max_staleness == 1 else f"up to {cfg.rollout.max_staleness} steps"
    versus = f"~{colocated.seconds:.1f} s colocated" if colocated is not None else "colocated does not fit"
    return (f"[plan] async with {k} rollout GPU{'s' if k > 1 else ''} ({' '.join(flags)}): "
            f"~{p.seconds:.1f} s/step vs {versus}; {lag} off-policy")


# --------------------------------------------------------------------------- reporting
def report(cfg, t: Target) -> str:
    """The assumptions (`assumed`), the table for `cfg`, the fastest that fits (or what would), async's line."""
    plan = predict(cfg, t.world, t.prompt_len, t.engine)
    ro = cfg.rollout
    gpus = f"{t.world} trainer + {ro.gpus} rollout" if ro.mode == "async" and ro.gpus else f"{t.world}"
    mode = (f"async {t.engine} rollout" + ("" if ro.gpus else " beside rank 0's trainer")) if ro.mode == "async" \
        else f"{t.engine} rollout"
    out = [f"[plan] {cfg.model or 'tiny'} on {gpus} x {t.gpu_bytes / GB:.0f} GB, {mode}, "
           f"prompt {t.prompt_len} + response {ro.response_length} tokens"
           + (f", {t.host_bytes / GB:.0f} GB of host RAM per rank:" if t.host_bytes else ":"), assumed(cfg, t.engine),
           table(plan, t.gpu_bytes)]
    try:
        best, best_plan = choose(cfg, t)
        if best is None:                       # the reserve's levers (fit.RESERVE_LEVERS)
            best, best_plan = choose_levers(cfg, t)
    except ValueError as e:                    # async: the engine's GPU does not fit
        return "\n".join(out + [f"[plan] {e}"])
    if best is None:
        out += _nothing_fits(cfg, t, plan)
    else:
        flags = changes(cfg, best)
        out.append(f"[plan] fastest that fits {t.says(best_plan.beside)}: "
                   + (" ".join(flags) if flags else "the configuration as given")
                   + f" (peak {best_plan.peak / GB:.1f} GB allocated, {best_plan.device_peak / GB:.1f} GB "
                   f"device-level, step ~{best_plan.seconds:.1f} s)")
    suggestion = async_suggestion(cfg, t, best_plan)
    return "\n".join(out + ([suggestion] if suggestion else []))


def assumed(cfg, engine: str) -> str:
    """The report's line of what the plan takes for the run's own choices, each with why and how to plan the
    other: the rollout engine (`auto`: vLLM, a GPU node's) and the kernels (kernel_choice.planned: the run's rule).
    A ValueError where the run would refuse the options (FP8 on HF generate, liger for a model not Qwen2)."""
    rollout.check_fp8(cfg.rollout, engine)
    used, why = kernel_choice.planned(cfg.kernels, model_config(cfg.model).model_type)
    how = "as given" if cfg.rollout.engine != "auto" else \
        "auto: a GPU node with vLLM; --rollout.engine=hf plans HF generate"
    head = kernel_choice.planned_head(cfg.head_kernel)
    return f"[plan] assumed: {engine} rollout ({how}); {used} kernels ({why}); the LM head {head}" + \
        (" (auto: a GPU's; --head_kernel=eager plans the other)" if cfg.head_kernel == "auto" else " (as given)")


def _nothing_fits(cfg, t: Target, plan: Plan) -> list[str]:
    """The report's lines when nothing keeps the margin: what would (`what_would_fit`), and, when a smaller
    margin is what fits (`margin_fit`), that margin with the fastest configuration under it."""
    budget, ro = t.room(plan.beside), cfg.rollout
    fits, under = what_would_fit(cfg, t), margin_fit(cfg, t)
    if under:
        m, p = under[0], under[2]
        fits = [f"--plan_margin={m:.2f} (it needs {p.device_peak / GB:.1f} GB device-level of the "
                f"{t.gpu_bytes / GB:.0f} GB GPU; the {t.margin:.0%} margin keeps "
                f"{t.margin * t.gpu_bytes / GB:.1f} GB free)"] + fits
    room = (t.says(plan.beside) if budget > 0 else
            f"on a {t.gpu_bytes / GB:.1f} GB GPU: its {t.margin:.0%} margin, the CUDA context and "
            f"{plan.beside / GB:.1f} GB outside the trainer ({'the engine' if ro.mode == 'async' else 'vLLM'}) "
            f"leave it no room")
    out = [f"[plan] nothing fits {room} with any combination of offload flags, checkpointing, micro-batch and "
           f"sequence-parallel sizes; what would: " + ("; ".join(fits) if fits else "nothing tried (a bigger GPU)")]
    if under:
        m, best, p = under
        out.append(f"[plan] with --plan_margin={m:.2f}: {' '.join(changes(cfg, best)) or 'the configuration as given'} "
                   f"(peak {p.peak / GB:.1f} GB allocated, {p.device_peak / GB:.1f} GB device-level, "
                   f"step ~{p.seconds:.1f} s; near the top the allocator may have to free its cache and retry)")
    return out


def margin_fit(cfg, t: Target):
    """(the largest margin in hundredths something keeps, the fastest there, its Plan), or None: none fits. With the
    reserve's levers on (`choose_levers`: row windows only where the choice streams Adam)."""
    for m in (x / 100 for x in range(math.ceil(t.margin * 100 - 1e-6) - 1, -1, -1)):
        if fits_at_all(with_options(cfg, fit.RESERVE_LEVERS), replace(t, margin=m)):
            return (m,) + choose_levers(cfg, replace(t, margin=m))
    return None


CARD_GB = {80: 79.2, 141: 139.8}   # what CUDA counts of an 80 GB H100 and a 141 GB H200 (mem_get_info's total, GB)


# the size table's rows: (model, GPUs, GB a GPU, answer tokens); 7B with long answers, what RL on reasoning needs
TEMPLATE_ROWS = [(size, world, gb, 1024) for size in ("qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b")
                 for world, gb in ((1, 80), (8, 80), (8, 141))] + [("qwen2.5-7b", 1, 80, 4096)]


def templates() -> str:
    """The size table: 0.5B / 7B / 72B GRPO on 1 x 80, 8 x 80 and 8 x 141 GB, and 7B with 4,096-token answers on one
    80 GB GPU, at 10 % margin or the most kept."""
    rows = ["| model | GPUs | fastest that fits (beyond the defaults) | peak GB/GPU allocated | device level GB/GPU "
            "| pinned host GB/rank |", "|---|---|---|---|---|---|"]
    return "\n".join(rows + [template_row(*row) for row in TEMPLATE_ROWS])


def template_row(size: str, world: int, gb: int, length: int) -> str:
    """One row of the size table: 8 prompts x 8 answers of `length` tokens a GPU, 512-token prompts."""
    import options
    cfg = options.parse_args([f"--model=random:{size}", f"--train_batch_size={8 * world}", "--rollout.n=8",
                              f"--actor.ppo_mini_batch_size={8 * world}", f"--rollout.response_length={length}",
                              "--actor.ppo_micro_batch_size_per_gpu=8"])
    host = int((560 if world == 8 else 128) * GB / world)      # the device machines' RAM per rank
    target = Target(world, 512, int(CARD_GB[gb] * GB), 0.1, "vllm", host)
    best, p = choose(cfg, target)
    if best is None:                   # with the reserve's levers (fit.RESERVE_LEVERS)?
        best, p = choose_levers(cfg, target)
    if best is None:                   # without checkpoints (their bracket holds all of Adam at once)?
        best, p = choose(with_options(cfg, {"save_freq": 0}), target)
    margin = None if best else margin_fit(cfg, target)   # a smaller margin than the 10 % (--plan_margin)?
    best, p = margin[1:] if margin else (best, p)
    label = size + ("" if length == 1024 else f", {length:,}-token answers")
    if best is None:
        would = "; ".join(what_would_fit(cfg, target)[:2]) or "-"
        return f"| {label} | {world} x {gb} | does not fit; would: {would} | - | - | - |"
    flags = ((["--save_freq=0"] if best.save_freq != cfg.save_freq else []) + changes(cfg, best)
             + ([f"--plan_margin={margin[0]:.2f}"] if margin else []))
    return (f"| {label} | {world} x {gb} | {' '.join(flags) or '(none)'} | "
            f"{p.peak / GB:.1f} | {p.device_peak / GB:.1f} | {p.pinned_host / GB:.1f} |")


@dataclass
class PlanConfig:                          # plan.py's own options (everything else is a train_grpo.py option)
    nproc: int = 1                         # GPUs (ranks) torchrun starts (async: the trainer's are
                                           # nproc - rollout.gpus)
    gpu_gb: float = 80.0                   # memory of one GPU, GB
    prompt_len: int = 0                    # the longest prompt in tokens (0: read from --data, or the copy task's)
    host_gb: float = 0.0                   # host RAM per node, GB (0: pinned memory not checked)
    nproc_per_node: int = 0                # ranks per node (0: min(nproc, 8))


RANGES = {"nproc": ">= 1", "gpu_gb": "> 0", "prompt_len": ">= 0", "host_gb": ">= 0", "nproc_per_node": ">= 0"}
CHOICES = {}   # the margin (--plan_margin), the engine and the kernels are the run's options: the plan reads them


def _own(argv: list) -> tuple:
    """(plan.py's own options, typed and checked as train_grpo.py's are, the rest of argv)."""
    import options
    names, own, rest, args = {f.name for f in dataclasses.fields(PlanConfig)}, [], [], list(argv)
    while args:
        arg = args.pop(0)
        mine = arg.startswith("--") and arg[2:].partition("=")[0] in names
        (own if mine else rest).append(arg)
        if mine and "=" not in arg and args:   # --key value
            own.append(args.pop(0))
    cfg = options.apply(own, PlanConfig())
    options.check({"": (cfg, RANGES, CHOICES)})
    return cfg, rest


def usage() -> str:
    import options
    return "\n".join(["python plan.py [plan options] [any train_grpo.py option: python train_grpo.py --help]",
                      "  --templates  the size table (0.5B / 7B / 72B on 1x80, 8x80, 8x141 GB)",
                      "  --plot=RUN   RUN/memory.png from its metrics.jsonl",
                      "  the margin, the engine and the kernels are the run's own: --plan_margin, --rollout.engine, "
                      "--kernels",
                      options.usage({"": (PlanConfig(), RANGES, CHOICES)}).split("\n", 3)[3]
                      .replace("[run]", "plan.py's own options:")])


def main(argv=None):
    """plan.py's command line: train_grpo.py's parsing and checks (options, ranges, the batch arithmetic on
    --nproc ranks, the model's resolution) plus its own options; a mistake is one `error:` line, exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv or "--templates" in argv:
        print(usage() if "--templates" not in argv else templates())
        return
    if any(a == "--plot" or a.startswith("--plot=") for a in argv):   # the picture is tracker.py's
        import tracker
        sys.exit(tracker.plot_command(argv))
    import checks
    import options
    try:
        own, rest = _own(argv)
        cfg = options.parse_args(rest)
        checks.check_model(cfg.model, cfg.rollout.response_length, weights=False)   # config, layout, positions
        rollout_engine.check(cfg.rollout, own.nproc, cfg.train_batch_size)
        world = rollout_engine.trainer_world(cfg.rollout, own.nproc)   # async: less the engine ranks
        options.check_sizes(cfg, world)
        engine = "hf" if cfg.rollout.engine == "hf" else "vllm"   # auto: a GPU node with vLLM (`assumed` says so)
        assumed(cfg, engine)                   # what the run would refuse (FP8 on HF, liger off Qwen2): refused here
        prompt_len = own.prompt_len or _prompt_len(cfg)
    except (ValueError, OSError) as e:     # FileNotFoundError included
        print(f"error: {e}" + (" (plan.py's own: " + ", ".join(f.name for f in dataclasses.fields(PlanConfig)) + ")"
                               if str(e).startswith("unknown option --") else ""), file=sys.stderr)
        sys.exit(2)
    t = Target(world, prompt_len, int(own.gpu_gb * GB), cfg.plan_margin, engine,
               int(own.host_gb * GB / (own.nproc_per_node or min(own.nproc, 8))))
    relaxed = relax(cfg, world, prompt_len, engine, t.gpu_bytes, rank=1)   # the run's own config on this GPU
    moved = changes(cfg, relaxed)
    print(report(relaxed, t) + (f"\n[plan] planned as the run sets itself up on this GPU (plan.relax): "
                                f"{' '.join(moved)}; the command line keeps what it sets" if moved else ""))


def _prompt_len(cfg) -> int:
    """The longest prompt the run will see, as data.run_data reads it (--instruction appended)."""
    import data
    try:
        tokenizer = data.load_tokenizer(cfg.model)
    except FileNotFoundError:              # a folder with config.json alone: the plan needs no weights nor tokenizer
        print(f"[plan] --model {cfg.model} has no tokenizer to measure the prompts: planned at --max_prompt_length="
              f"{cfg.max_prompt_length} tokens, the longest a prompt can be (--prompt_len=N plans another length)")
        return cfg.max_prompt_length
    train, val = data.run_data(cfg, tokenizer)
    return max(map(len, train[0] + (val[0] if val else [])))


# --------------------------------------------------------------------------- the run's glue
# What train_grpo.py asks of the planner while it runs: the device's size, --offload=auto's choice,
# the prediction beside each stage's measurement, and the warnings that compare the two.
def plan_auto(cfg, world: int, prompt_len: int, engine_kind: str, device, rank: int, *, others: int = 0):
    """--offload=auto: the fastest flags that fit this GPU by the plan (`choose`), as a new config (`others`: the
    bytes other processes hold on the GPU, not this run's to plan for).
    When nothing keeps plan_margin free at the device level, the one that needs the least device
    memory, said in one line; when nothing fits at all, a ValueError naming what would (async: also
    when the engine's GPU cannot fit). `world`: the trainer's ranks. A colocated run on 2+ GPUs is
    told when async rollout would be faster."""
    say = print if rank == 0 else (lambda *a, **k: None)
    if device.type != "cuda":
        say("[plan] --offload=auto on a CPU run: no device memory to plan; the flags stay as given")
        return cfg
    target = Target(world, prompt_len, ledger.gpu_capacity(device) - others, cfg.plan_margin, engine_kind,
                    ledger.host_bytes_per_rank())
    best, p, kept = auto_choice(cfg, target)
    if not kept:                           # nothing keeps the margin free: the least device memory that fits at all
        if best is not None:
            say(f"[plan] --offload=auto: nothing keeps {cfg.plan_margin:.0%} of the GPU free at the device level; "
                f"taking the configuration that needs the least (the allocator may have to free its cache and "
                f"retry near the top; more GPUs or LoRA would leave headroom)")
    if best is None:
        fits = what_would_fit(cfg, target)
        suggestion = async_suggestion(cfg, target, None)
        raise ValueError(f"--offload=auto: the plan finds no combination of offload flags, checkpointing and "
                         f"micro-batch sizes that fits {target.gpu_bytes / GB:.0f} GB per GPU; what would: "
                         + "; ".join(fits + ([suggestion.removeprefix("[plan] ")] if suggestion else [])
                                     or ["a bigger GPU"]))
    say(f"[plan] --offload=auto chose: {' '.join(changes(cfg, best)) or 'the flags as given'} "
        f"(predicted peak {p.peak / GB:.1f} GB allocated, {p.device_peak / GB:.1f} GB device-level, "
        f"step ~{p.seconds:.1f} s)")
    if rank == 0 and (suggestion := async_suggestion(cfg, target, p)):   # said, never switched to
        say(suggestion)
    return best


def auto_choice(cfg, t: Target) -> tuple:
    """What --offload=auto takes: (config, its Plan, whether it keeps the margin). The fastest that keeps it, then
    with the reserve's levers (fit.RESERVE_LEVERS: they hold what a step holds), else the one that needs the least
    device memory at any margin; (None, None, False) when nothing fits."""
    best, p = choose(cfg, t)
    if best is None:
        best, p = choose_levers(cfg, t)
    if best is not None:
        return best, p, True
    best, p = choose(cfg, replace(t, margin=0.0), least_memory=True)
    return best, p, False


def relax(cfg, world: int, prompt_len: int, engine: str, gpu_bytes: int, rank: int = 0):
    """Without --offload=auto, the defaults that buy memory with time are sold back while the run fits a GPU of
    `gpu_bytes` keeping plan_margin free (`Target.fits`), unless the command line set them (`relaxations`): the
    fastest by the plan, then the fewest log-prob forwards (not timed), then the least device memory; said in
    one line. `gpu_bytes` 0: a CPU run. A new config."""
    if not gpu_bytes or cfg.offload == "auto":
        return cfg
    t = Target(world, prompt_len, gpu_bytes, cfg.plan_margin, engine)
    scored = [(p.seconds, -c.actor.log_prob_micro_batch_size_per_gpu - c.ref.log_prob_micro_batch_size_per_gpu,
               p.device_peak, i, c) for i, c in enumerate(relaxations(cfg, world, prompt_len))
              if t.fits(p := predict(c, world, prompt_len, engine))]   # of equal times the fewest forwards
    best = min(scored, key=lambda x: x[:4])[4] if scored else cfg
    if (moved := changes(cfg, best)) and rank == 0:
        print(f"[plan] {' '.join(m.lstrip('-') for m in moved)}: faster, and the run keeps {cfg.plan_margin:.0%} "
              f"of the {gpu_bytes / GB:.0f} GB GPU free by the plan (pass {' '.join(changes(best, cfg))} to keep "
              f"the defaults)", flush=True)
    return best if moved else cfg


def relaxations(cfg, world: int, prompt_len: int) -> list:
    """What `relax` weighs, `cfg` first: each LIFTED lever the command line left on (the actor's gradient
    checkpointing, ~1/4 more update compute) off or kept, times the micro-batch sizes it left, doubled while
    they divide the rank's mini-batch (the update) or its batch (the log-prob forwards, to FORWARD_TOKENS; each
    micro-batch pays its launches and FSDP2 gathers a layer: predict.MICRO_LAYER); none with a token budget."""
    a, given, dp = cfg.actor, getattr(cfg, "_given", ()), world // cfg.actor.ulysses_sequence_parallel_size
    off = {f"actor.{k}": False for k in actor.LIFTED if getattr(a, k) and f"actor.{k}" not in given}
    rows, cap = cfg.train_batch_size * cfg.rollout.n // dp, FORWARD_TOKENS // (prompt_len + cfg.rollout.response_length)
    bound = {"update": (a.ppo_mini_batch_size * cfg.rollout.n // dp, rows), "forward": (rows, cap)}
    runs = {"actor": not actor.on_policy(a, cfg.train_batch_size), "ref": ref.needed(a)}   # whose forward runs
    grow = {k: bound[kind] for k, kind in fit.sizes().items()         # the roles' SIZES of these two kinds
            if kind == "update" or (kind == "forward" and runs[k.partition(".")[0]])}
    sizes = []                                 # each key's m, 2m, 4m, ... (m itself always)
    for key, (n, top) in grow.items():
        m = attrgetter(key)(cfg)
        more = [] if key in given or a.use_dynamic_bsz else range(1, 12)
        sizes.append([m] + [m << i for i in more if (m << i) <= min(n, top) and n % (m << i) == 0])
    return [with_options(cfg, {**lift, **dict(zip(grow, s))}) for lift in ([{}, off] if off else [{}])
            for s in itertools.product(*sizes)]


def verdict(cfg, p: Plan, world: int, prompt_len: int, engine: str, device) -> str | None:
    """The set-up report's line when a stage's predicted device level is inside the margin --offload=auto keeps
    (plan_margin) or over the GPU: the allocator frees its cache and retries (slower), or runs out. Said before
    any model is built, with what --offload=auto would choose."""
    if device.type != "cuda":
        return None
    gpu = ledger.gpu_capacity(device)
    worst = max(p.device, key=p.device.get)
    if p.device[worst] <= gpu * (1 - cfg.plan_margin):
        return None
    where = "over the GPU's" if p.device[worst] > gpu else f"inside the {cfg.plan_margin:.0%} margin of the GPU's"
    auto = ""
    if cfg.offload != "auto":                  # what plan_auto would do: the fastest that keeps the margin, or the
                                               # least
        best, bp, kept = auto_choice(cfg, Target(world, prompt_len, gpu, cfg.plan_margin, engine,
                                                 ledger.host_bytes_per_rank()))
        how = "choose" if kept else "take the least device memory (nothing keeps the margin)"
        auto = f"; --offload=auto would {how}: {' '.join(changes(cfg, best)) or 'the flags as given'} " \
               f"({bp.device_peak / GB:.1f} GB device-level)" if best else "; nothing fits this GPU by the plan"
    return (f"[plan] warning: {worst}'s predicted device level, {p.device[worst] / GB:.1f} GB, is {where} "
            f"{gpu / GB:.1f} GB: the allocator will free its cache and retry there (slower), or run out{auto}")


if __name__ == "__main__":
    main()
