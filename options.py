"""The command line: the composed config (every role's section), each option's range or choices
(checked at parse time), the checks that combine options and need no model, --help, all read from
the config dataclasses (every default and its comment written once, there).

    python train_grpo.py --help
    python plan.py --model=random:qwen2.5-7b --nproc=8 --gpu_gb=80     # the planner parses the same options
    python -m pytest tests/test_train.py -q -k "help or range or bad"

Each role file keeps its config dataclass with RANGES and CHOICES beside it, and a `check(cfg, world)`
for the rules that combine its options; `sections` lists them with the section each belongs to.
"""
import ast
import inspect
import io
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

import actor
import critic
import gsm8k
import kernel_choice
import lora
import ref
import reward_model
import rollout
import tracker
import ulysses
from actor import ActorConfig
from critic import CriticConfig
from model import hf_config
from ref import RefConfig
from reward_model import RewardModelConfig
from rollout import RolloutConfig


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"            # grpo | gae (PPO with the critic)
    norm_adv_by_std_in_grpo: bool = True   # false: Dr.GRPO (score - group mean only)


@dataclass
class Config:
    model: str | None = None               # local HF model dir; None: the embedded tiny model
    data: str | None = None                # .jsonl / .parquet with prompt + answer; None: copy task
    reward: str | None = None              # module:function(response, answer) -> float
    reward_error: str = "stop"             # a reward that raises or returns no finite number: stop (one line
                                           # naming the reward and the sample) | zero (it scores 0, counted)
    prompt_key: str = "prompt"             # the data's prompt field (a string or chat messages)
    answer_key: str = "answer"             # the data's answer field, passed to the reward
    max_prompt_length: int = 1024          # longer prompts are dropped at load time (counted)
    instruction: str = ""                  # appended to every prompt (training and held-out) after a space, e.g.
                                           # verl's GSM8K one: Let's think step by step and output the final
                                           # answer after "####".
    gsm8k_format: str = "strict"           # what the built-in GSM8K reward reads: strict (the last `#### N`, the form
                                           # GSM8K's own answers end with) | flexible (the value of the last
                                           # \boxed{}, else of #### N, else the last number: answer_value.py) |
                                           # both (their mean: 0.5 for the right value, 1 for it after ####) |
                                           # bonus (0.8 for the right value, 0.2 for ending in #### N: gsm8k.py)
    # validation: greedy answers to held-out prompts, through the run's own engine, scored by the run's reward
    val_data: str | None = None            # held-out prompts, .jsonl / .parquet as --data; None: none (without --data
                                           # either: the built-in task's 100 held-out items)
    val_freq: int = 10                     # validate every this many steps and after the last (0: not during training)
    val_before_train: bool = True          # validate the starting policy before the first step
    val_max_prompts: int = 0               # validate on the first this many held-out prompts (0: all)
    val_response_length: int = 0           # max new tokens of a held-out answer (0: rollout.response_length, its cap)
    train_batch_size: int = 16             # prompts per step, over all ranks
    steps: int = 150                       # training steps (a resume continues up to this)
    seed: int = 0                          # model init, sampling, and the data (unless --data_seed)
    data_seed: int = -1                    # the data's own seed (the prompt order, the built-in task's items); -1:
                                           # --seed. Runs that differ in --seed alone then train the same prompts at
                                           # each step on other samples: a run's spread on one task
    fsdp_size: int = -1                    # ranks per shard group; -1: all (HSDP when smaller)
    out_dir: str = "out"                   # metrics, checkpoints, final/ (an earlier run is never overwritten)
    save: bool = True                      # Hugging Face checkpoint to <out_dir>/final at the end
    profile_steps: str = ""                # e.g. "1,3": torch.profiler traces of those steps (from 0) to
                                           # <out_dir>/profile/; "": off (no profiler is created)
    offload: str = "manual"                # manual: the flags as given; auto: plan.py picks the offload flags,
                                           # checkpointing and micro-batch sizes that fit this GPU, fastest first
    plan_margin: float = 0.1               # the share of the GPU the plan keeps free (auto, its warnings,
                                           # python plan.py)
    memory_history: bool = False           # record every CUDA allocation's stack (slower): an OOM's snapshot
                                           # then shows who allocated what, not only the blocks
    expandable_segments: bool = False      # the trainer's allocator grows segments in place once the engine is built
                                           # (vLLM's sleep pool is made without them): the update reserves less
                                           # beyond its peak (7B: 2.2 GB, predict.EXPANDABLE_UPDATE_SLACK); async
                                           # rollout's trainer has them anyway (rollout_engine.trainer_allocator)
    save_freq: int = 50                    # a resumable checkpoint every this many steps, after the last one
                                           # and on SIGTERM; 0: none
    keep_checkpoints: int = 2              # the newest this many stay (a 7B actor's: ~85 GB, fp32 params + Adam)
    save_optimizer: bool = True            # AdamW's two moments in each checkpoint (2/3 of its bytes); false: params,
                                           # RNG and data position only, and a resume starts AdamW afresh
    resume: str = "auto"                   # auto: continue out_dir's run if it has a checkpoint | never: only
                                           # start fresh | a checkpoint dir (into an empty out_dir)
    dist_timeout_s: float = 600.0          # a collective waiting longer (a stalled rank) ends the run
    kernels: str = "auto"                  # the models' kernels (kernel_choice.py): liger (Liger-Kernel's fused
                                           # RMSNorm, SwiGLU, RoPE) | compile (each decoder layer compiled) | torch;
                                           # auto: liger when installed and on a GPU, else torch
    head_kernel: str = "auto"              # the LM head's log-prob chunk (packing.py): compile (its reductions fused:
                                           # the 1.5B update 1.20x faster; compiles at the first steps) | eager;
                                           # auto: compile on a GPU with Triton, else eager (and with --memory_history)
    logger: str = "auto"                   # every metric of every step to tensorboard (<out_dir>/tensorboard) | wandb
                                           # (<out_dir>/wandb, offline unless WANDB_MODE) | none; auto: tensorboard
                                           # when installed, else none (metrics.jsonl is always written)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)


# checked when the command line is parsed, like each role's RANGES and CHOICES (check_config)
RANGES = {"max_prompt_length": ">= 1", "train_batch_size": ">= 1", "steps": ">= 1", "seed": ">= 0",
          "data_seed": ">= -1", "fsdp_size": "-1 or >= 1", "save_freq": ">= 0", "keep_checkpoints": ">= 1",
          "dist_timeout_s": "> 0", "plan_margin": "[0, 1)", "val_freq": ">= 0", "val_max_prompts": ">= 0",
          "val_response_length": ">= 0"}
CHOICES = {"reward_error": ("stop", "zero"), "gsm8k_format": tuple(gsm8k.REWARDS), "offload": ("manual", "auto"),
           "logger": tracker.KINDS, "kernels": kernel_choice.KERNELS, "head_kernel": kernel_choice.HEAD_KERNELS}
ALGORITHM_CHOICES = {"adv_estimator": ("grpo", "gae")}


# --------------------------------------------------------------------------- the checks
def sections(cfg: Config) -> dict:
    """"" for the top level, then each role's section: (its config, its RANGES, its CHOICES)."""
    return {"": (cfg, RANGES, CHOICES), "actor": (cfg.actor, actor.RANGES, actor.CHOICES),
            "ref": (cfg.ref, ref.RANGES, {}), "rollout": (cfg.rollout, rollout.RANGES, rollout.CHOICES),
            "critic": (cfg.critic, critic.RANGES, critic.CHOICES),
            "reward_model": (cfg.reward_model, reward_model.RANGES, {}),
            "algorithm": (cfg.algorithm, {}, ALGORITHM_CHOICES)}


def check_config(cfg: Config):
    """Every option against its range or its choices, and the combinations that would train
    nothing: a bad value stops the run before anything is built, with what to change."""
    check(sections(cfg))
    r = cfg.rollout
    if r.temperature == 0 and r.n > 1 and cfg.algorithm.adv_estimator == "grpo":
        raise ValueError(f"--rollout.temperature=0 is greedy: the {r.n} samples of a prompt are the same, "
                         f"every GRPO group has zero advantage and nothing trains; use a temperature > 0 "
                         f"(or rollout.n=1, or PPO: --algorithm.adv_estimator=gae)")
    if cfg.val_response_length > r.response_length:
        raise ValueError(f"--val_response_length={cfg.val_response_length} is over --rollout.response_length="
                         f"{r.response_length}, the length the engine is built for; use at most that (0: the same)")
    if cfg.memory_history and cfg.head_kernel != "eager":   # torch 2.11's compiled head fails while stacks are recorded
        if cfg.head_kernel == "compile":
            raise ValueError("--head_kernel=compile with --memory_history=true: the compiled LM head fails while the "
                             "allocator records every allocation's stack; use --head_kernel=eager (auto picks it then)")
        cfg.head_kernel = "eager"
    if cfg.actor.rollout_is == "auto":     # corrected: an async batch's lag, an FP8 engine's rounding; else nothing
        fp8 = "fp8" in (r.kv_cache_dtype, r.quantization)
        cfg.actor.rollout_is = "token" if r.mode == "async" or fp8 else "none"
    if r.logprobs_every == 0:              # auto: the correction reads them every step, else a reading now and then
        r.logprobs_every = 1 if cfg.actor.rollout_is == "token" else rollout.LOGPROBS_EVERY
    if cfg.actor.rollout_is == "token" and r.logprobs_every > 1:
        raise ValueError(f"--rollout.logprobs_every={r.logprobs_every} with the rollout correction (actor.rollout_is="
                         f"token, on with async and FP8): it reads the engine's log-probs on every step; use "
                         f"--rollout.logprobs_every=1 or turn the correction off (--actor.rollout_is=none)")
    if cfg.actor.rollout_is == "token" and (r.top_p < 1 or r.top_k > 0):
        cut = f"--rollout.top_p={r.top_p}" if r.top_p < 1 else f"--rollout.top_k={r.top_k}"
        raise ValueError(f"{cut} with the rollout correction (actor.rollout_is=token, on with async and FP8): "
                         f"the engine's log-probs are those of the truncated, renormalised distribution, so every "
                         f"importance weight would be off by the kept probability mass; sample from the whole "
                         f"distribution (top_p=1, top_k=0) or turn the correction off (--actor.rollout_is=none)")


def parse_args(argv: list[str]) -> Config:
    """`--key=value` or `--key value`, with dotted keys for the role sections (`--actor.lr=1e-6`),
    typed and range-checked."""
    cfg = apply(argv, Config())
    cfg._given = {a[2:].partition("=")[0] for a in argv if a.startswith("--")}   # what was set (plan.relax reads it)
    check_config(cfg)
    return cfg


def check_sizes(cfg: Config, world: int) -> int:
    """The checks that need the world size (the batch arithmetic, each role's combinations), once,
    up front; returns the mini-batch size per rank (samples). With Ulysses (k =
    actor.ulysses_sequence_parallel_size) the k ranks of a group hold the same samples: the batch
    splits over world / k data-parallel groups, and each rank generates 1/world of the prompts."""
    a, n, k = cfg.actor, cfg.rollout.n, cfg.actor.ulysses_sequence_parallel_size
    ulysses.check(k, world, hf_config(cfg.model) if k > 1 and world % k == 0 else None)
    dp, per = world // k, (f"data-parallel size {world // k} (world {world} / "
                           f"actor.ulysses_sequence_parallel_size {k})" if k > 1 else f"world size {world}")
    if cfg.train_batch_size % world:
        raise ValueError(f"train_batch_size={cfg.train_batch_size} is not divisible by the "
                         f"world size {world} (each rank generates its share); make it a multiple of {world}")
    if cfg.train_batch_size % a.ppo_mini_batch_size:
        raise ValueError(f"train_batch_size={cfg.train_batch_size} is not a multiple of "
                         f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}; pass a divisor of it, such as "
                         f"--actor.ppo_mini_batch_size="
                         f"{_divisor(cfg.train_batch_size, a.ppo_mini_batch_size, lambda d: d * n % dp == 0)}")
    if (a.ppo_mini_batch_size * n) % dp:
        raise ValueError(f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * n} "
                         f"samples do not split over the {per}; change either")
    check_step_size(cfg, world)
    mini = a.ppo_mini_batch_size * n // dp
    if mini % a.ppo_micro_batch_size_per_gpu and a.ppo_micro_batch_size_per_gpu < mini:
        raise ValueError(f"actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} "
                         f"does not divide the {mini} samples per rank of a mini-batch ({per}); pass "
                         f"--actor.ppo_micro_batch_size_per_gpu={_divisor(mini, a.ppo_micro_batch_size_per_gpu)}")
    if cfg.fsdp_size not in (-1, world) and (cfg.fsdp_size < 1 or world % cfg.fsdp_size):
        raise ValueError(f"fsdp_size={cfg.fsdp_size} does not divide the world size {world}")
    actor.check(cfg.actor, world)          # the rules that combine a role's options
    ref.check(cfg.ref)
    if cfg.actor.lora_rank:                # a target that is no decoder projection: now, not at the actor's build
        lora.lora_targets(cfg.actor.lora_target_modules)
    rollout.check(cfg.rollout, world)
    profile_steps(cfg.profile_steps)
    return mini


# The most one rank samples and trains in a step, on the CPU as on a GPU. Large GRPO runs sample a few thousand
# responses per GPU a step; 65,536 is 16x that, and 2^26 response tokens are hours of one 7B step on an H100 at
# 6 x 7e9 FLOPs a token. Past either the step never ends (rollout.n=100000 on the embedded model: 1.6M rows
# in HF generate) and nothing else would say why.
MAX_SAMPLES_PER_RANK = 65_536
MAX_TOKENS_PER_RANK = 2 ** 26


def check_step_size(cfg: Config, world: int):
    """A step one rank can finish: train_batch_size x rollout.n samples over `world` ranks, each of up to
    rollout.response_length tokens, within the bounds above; else one line with the largest rollout.n that fits."""
    r, b = cfg.rollout, cfg.train_batch_size
    per = b * r.n // world
    cap = min(MAX_SAMPLES_PER_RANK, MAX_TOKENS_PER_RANK // r.response_length)
    if per <= cap:
        return
    raise ValueError(f"--rollout.n={r.n} x train_batch_size={b} is {b * r.n:,} samples a step, {per:,} on each of "
                     f"{world} rank(s) (x rollout.response_length={r.response_length}: {per * r.response_length:,} "
                     f"response tokens): over the {MAX_SAMPLES_PER_RANK:,} samples or {MAX_TOKENS_PER_RANK:,} "
                     f"tokens one rank can sample and train in a step (it would not end); use at most --rollout.n="
                     f"{max(1, cap * world // b)} here, or a smaller train_batch_size or rollout.response_length")


def _divisor(total: int, below: int, fits=lambda d: True) -> int:
    """The size a bad-batch line suggests: the largest divisor of `total` not above `below` that `fits`,
    else the smallest one above it that does (`total` itself fits every caller's rule)."""
    ok = [d for d in range(1, total + 1) if total % d == 0 and fits(d)]
    return max((d for d in ok if d <= below), default=min(ok))


def profile_steps(spec: str) -> set[int]:
    """`--profile_steps=1,3` -> {1, 3}: steps numbered from 0, as in metrics.jsonl; "" -> none."""
    try:
        steps = {int(s) for s in spec.split(",") if s.strip()}
    except ValueError:
        steps = {-1}
    if min(steps, default=0) < 0:
        raise ValueError(f"--profile_steps={spec}: give step numbers from 0, separated by commas (e.g. 1,3)")
    return steps


# --------------------------------------------------------------------------- parsing and --help
def within(value, rule: str) -> bool:
    """`value` satisfies `rule`: "any" (finite), ">= a", "> a", "[a, b)" (any bracket mix), "x or RULE"."""
    if not math.isfinite(value):
        return False
    if " or " in rule:
        first, rest = rule.split(" or ", 1)
        return value == float(first) or within(value, rest)
    if rule == "any":
        return True
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        return (lo <= value if rule[0] == "[" else lo < value) and (value <= hi if rule[-1] == "]" else value < hi)
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def profile_warning(cfg: Config) -> str | None:
    """--profile_steps naming steps this run never reaches (numbered from 0, up to --steps - 1)."""
    late = sorted(s for s in profile_steps(cfg.profile_steps) if s >= cfg.steps)
    if late:
        return (f"[profile] warning: --profile_steps={cfg.profile_steps}: step(s) {', '.join(map(str, late))} "
                f"never run (--steps={cfg.steps}: steps 0 to {cfg.steps - 1}), so nothing is traced for them")
    return None


def warnings(cfg: Config) -> list[str]:
    """The set-up report's warnings about options this run reads nowhere: --profile_steps past --steps, and the
    options of a part the run does not have (said, not refused: one config file may serve several runs), a
    window size without the streamed Adam it sizes.
    ref.* under LoRA, reward_model.* without its path and actor.save_merged say so in their own roles."""
    a, gae = cfg.actor, cfg.algorithm.adv_estimator == "gae"
    budgets = _changed("actor", a, ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu")) + _changed(
        "ref", cfg.ref, ("log_prob_max_token_len_per_gpu",)) + (_changed("critic", cfg.critic, (
            "ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")) if gae else [])
    idle = [(not gae, _changed("critic", cfg.critic),
             "under GRPO, which has no critic (--algorithm.adv_estimator=gae)"),
            (not a.lora_rank, _changed("actor", a, ("lora_alpha", "lora_target_modules")), "without actor.lora_rank"),
            (not a.use_kl_loss, _changed("actor", a, ("kl_loss_coef", "kl_loss_type")), "with actor.use_kl_loss=false"),
            (not a.use_dynamic_bsz, budgets, "without actor.use_dynamic_bsz=true (micro-batches count samples)"),
            (cfg.rollout.mode != "async", _changed("rollout", cfg.rollout, ("max_staleness", "buffer_limit")),
             "without rollout.mode=async"),
            (not a.optimizer_stream, _changed("actor", a, ("optimizer_window_layers", "optimizer_row_windows")),
             "without actor.optimizer_stream=true (Adam steps whole)"),
            (gae and not cfg.critic.optimizer_stream, _changed("critic", cfg.critic, ("optimizer_window_layers",
                                                                                      "optimizer_row_windows")),
             "without critic.optimizer_stream=true (Adam steps whole)")]
    return [w for w in [profile_warning(cfg)] if w] + [
        f"[options] warning: {', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect {why}"
        for off, names, why in idle if off and names]


def _changed(section: str, obj, names=None) -> list[str]:
    """`section.name=value` for each of `obj`'s fields (of `names`, else all) that is not at its default."""
    return [f"{section}.{f.name}={getattr(obj, f.name)}" for f in fields(obj) if (names is None or f.name in names)
            and f.default is not MISSING and getattr(obj, f.name) != f.default]


def check(sections: dict):
    """Every option of every section against its rule or its choices; the first outside raises,
    with the option as it is typed. `sections`: {"actor": (cfg.actor, RANGES, CHOICES), ...},
    "" for the top level."""
    for name, (obj, ranges, choices) in sections.items():
        prefix = f"{name}." if name else ""
        for key, rule in ranges.items():
            if not within(getattr(obj, key), rule):
                raise ValueError(f"--{prefix}{key}={getattr(obj, key)}: must be {rule}"
                                 + (" (a finite number)" if rule == "any" else ""))
        for key, allowed in choices.items():
            if getattr(obj, key) not in allowed:
                raise ValueError(f"--{prefix}{key}={getattr(obj, key)}: use one of {', '.join(map(str, allowed))}")


def apply(argv: list[str], cfg):
    """`cfg` (a dataclass with dataclass sections) with each `--key=value` / `--key value` of
    `argv` set, converted to the field's type; an unknown key or a value of the wrong type raises
    with what to change."""
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --actor.lr=1e-6")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ValueError(f"--{key} needs a value")
            value = args.pop(0)
        *path, name = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part, None)
            if not is_dataclass(obj):
                names = ", ".join(f.name for f in fields(cfg) if is_dataclass(getattr(cfg, f.name)))
                raise ValueError(f"unknown option --{key}; sections: {names}")
        hints = typing.get_type_hints(type(obj))
        if name not in hints or is_dataclass(hints[name]):
            known = ", ".join(f.name for f in fields(obj) if not is_dataclass(getattr(obj, f.name)))
            inside = [f"--{f.name}.{name}" for f in fields(obj) if is_dataclass(getattr(obj, f.name))
                      and name in typing.get_type_hints(type(getattr(obj, f.name)))]   # --lr: --actor.lr?
            raise ValueError(f"unknown option --{key}" + (f" (did you mean {' or '.join(inside)}?)" if inside else "")
                             + f"; known here: {known}")
        setattr(obj, name, _convert(value, hints[name], key))
    return cfg


def _convert(text: str, typ, key: str):
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{key}={text}: expected true or false")
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return None if text.lower() in ("none", "null", "") else text
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"--{key}={text}: expected {typ.__name__}") from None


def field_comments(cls) -> dict:
    """Each field's comment in the class source (its line's, then comment-only lines under it):
    what --help prints, so every default and its explanation are written once, in the dataclass."""
    src = textwrap.dedent(inspect.getsource(cls))
    by_line = {t.start[0]: t.string.lstrip("#").strip()
               for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body[0].body:
        if isinstance(node, ast.AnnAssign):
            text, n = [by_line.get(node.lineno, "")], node.lineno + 1
            # continuation lines sit under the field's comment, indented past the field; a comment
            # at the field's own indent heads the next group of fields and is not this one's
            while n in by_line and lines[n - 1].lstrip().startswith("#") and \
                    len(lines[n - 1]) - len(lines[n - 1].lstrip()) > node.col_offset:
                text.append(by_line[n])
                n += 1
            out[node.target.id] = " ".join(t for t in text if t)
    return out


def usage(sections: dict) -> str:
    """--help: every option with its type, range, default and comment. `sections`: as for `check`,
    built from a default config (sections(Config()))."""
    out = ["usage: python train_grpo.py [--key=value ...]   (or torchrun --nproc_per_node=N train_grpo.py ...)",
           "options are --key=value or --key value; a role's keys take its section: --actor.lr=1e-6", ""]
    for name, (obj, ranges, choices) in sections.items():
        out.append(f"[{name or 'run'}]")
        comments = field_comments(type(obj))
        for f in fields(obj):
            if is_dataclass(getattr(obj, f.name)):
                continue
            hint = typing.get_type_hints(type(obj))[f.name]
            kind = "str or none" if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint.__name__
            rule = ranges.get(f.name) or ("|".join(map(str, choices[f.name])) if f.name in choices else "")
            out.append(f"  --{name + '.' if name else ''}{f.name}={getattr(obj, f.name)}  ({kind}"
                       f"{'; ' + rule if rule and rule != 'any' else ''})  {comments.get(f.name, '')}")
        out.append("")
    return "\n".join(out)
