"""GRPO post-training with every GPU-memory move in view.

    python train_grpo.py                                   # embedded tiny model + copy task, CPU ok
    torchrun --nproc_per_node=2 train_grpo.py              # same, 2 processes (gloo on CPU)
    python train_grpo.py --actor.lora_rank=16 --actor.lr=1e-3   # LoRA: adapters train, no ref model
    torchrun --nproc_per_node=8 train_grpo.py --model /models/Qwen2.5-1.5B-Instruct \
        --data gsm8k.parquet --actor.param_offload=true --actor.optimizer_offload=true \
        --ref.param_offload=true --train_batch_size=64 --rollout.response_length=512

One step; each stage's seconds and memory go to <out_dir>/metrics.jsonl. Every move of a role's
bytes happens inside that role's own file (actor.py, ref.py, critic.py, reward_model.py; rollout.py
loads and frees the actor's params around the weight sync): this file orders the stages and keeps
the ledger. --profile_steps=1,3 writes a torch.profiler trace of those steps to <out_dir>/profile/.
Every metric of every step also goes to TensorBoard (`tensorboard --logdir <out_dir>/tensorboard`; or
wandb, or none: --logger, tracker.py); a GPU run ends with <out_dir>/memory.png (tracker.picture).
    generate  : actor params in (if offloaded) -> sample n responses per prompt -> params out
                (actor.defer_param_offload: they are still in from the last update; out after the sync)
    reward    : score each response on the CPU
    reward_model : reward-model params in -> micro-batched scores -> params out (with --reward_model.path);
                mixed with the rule reward (reward_model.weight)
    old_logp  : params in -> micro-batched forward -> params out      (skipped when on-policy)
    ref_logp  : ref params in -> micro-batched forward -> ref params out
                (actor.prefetch_update: meanwhile the actor's params come in on a side stream)
                LoRA (--actor.lora_rank): no ref model; the actor's own forward with its adapter off,
                inside the actor's bracket (prefetch_update: its params then stay for the update)
    values    : critic params in -> micro-batched values -> out             (PPO only)
    advantage : GRPO: (score - group mean) / (group std + eps), the same for every token;
                PPO (--algorithm.adv_estimator=gae): GAE on the critic's values, whitened
    critic_update : critic params + Adam in -> clipped value loss -> both out (PPO only)
    update    : params + Adam state in -> mini/micro-batched clipped PG + KL -> both out
                (Adam in on a side stream during the forward/backward, or just before the step
                with actor.optimizer_load_at_step; params kept for the next sync: defer_param_offload)
Why this order: vLLM's KV cache is the largest block, so it is woken last, once the trainer's
shards and the sync's buffers are gone (waking old weights, KV and new weights together is the
classic colocated OOM); the weights go to vLLM one bounded bucket at a time, never as a state dict
(a live state_dict() result keeps GPU shards alive after an offload).
Around the steps (main): every check that needs no model runs first, on every rank (`preflight`:
options, batch arithmetic, model dir, data, reward, the out_dir policy); a mistake is one line,
`error: ...`, said once, by rank 0. A checkpoint every --save_freq steps, after the last step and
on SIGTERM; the same command resumes a stopped run (checkpoint.py).
How it differs from the GRPO paper (as verl does): KL is a loss term (k3 by default) rather than
a reward term, and with loss_agg_mode=token-mean long responses weigh more than short ones.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record

import actor
import checkpoint
import critic
import data as data_io
import offload
import options
import plan
import ref
import reward_model
import rollout
import tracker                             # issue 28: TensorBoard / wandb, the memory picture
from actor import ActorConfig
from critic import CriticConfig
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
    train_batch_size: int = 16             # prompts per step, over all ranks
    steps: int = 150                       # training steps (a resume continues up to this)
    seed: int = 0                          # model init, data order, sampling
    fsdp_size: int = -1                    # ranks per shard group; -1: all (HSDP when smaller)
    out_dir: str = "out"                   # metrics, checkpoints, final/ (an earlier run is never overwritten)
    save: bool = True                      # Hugging Face checkpoint to <out_dir>/final at the end
    profile_steps: str = ""                # e.g. "1,3": torch.profiler traces of those steps (from 0) to
                                           # <out_dir>/profile/; "": off (no profiler is created)
    offload: str = "manual"                # manual: the flags as given; auto: plan.py picks the offload flags,
                                           # checkpointing and micro-batch sizes that fit this GPU, fastest first
    plan_margin: float = 0.1               # the share of the GPU the plan keeps free (auto, and its warnings)
    memory_history: bool = False           # record every CUDA allocation's stack (slower): an OOM's snapshot
                                           # then shows who allocated what, not only the blocks
    save_freq: int = 50                    # a resumable checkpoint every this many steps, after the last one
                                           # and on SIGTERM; 0: none
    keep_checkpoints: int = 2              # the newest this many stay (a 7B actor's: ~85 GB, fp32 params + Adam)
    resume: str = "auto"                   # auto: continue out_dir's run if it has a checkpoint | never: only
                                           # start fresh | a checkpoint dir (into an empty out_dir)
    dist_timeout_s: float = 600.0          # a collective waiting longer (a stalled rank) ends the run
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
          "fsdp_size": "-1 or >= 1", "save_freq": ">= 0", "keep_checkpoints": ">= 1", "dist_timeout_s": "> 0",
          "plan_margin": "[0, 1)"}
CHOICES = {"reward_error": ("stop", "zero"), "offload": ("manual", "auto"), "logger": tracker.KINDS}
ALGORITHM_CHOICES = {"adv_estimator": ("grpo", "gae")}


# --------------------------------------------------------------------------- config
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
    options.check(sections(cfg))
    r = cfg.rollout
    if r.temperature == 0 and r.n > 1 and cfg.algorithm.adv_estimator == "grpo":
        raise ValueError(f"--rollout.temperature=0 is greedy: the {r.n} samples of a prompt are the same, "
                         f"every GRPO group has zero advantage and nothing trains; use a temperature > 0 "
                         f"(or rollout.n=1, or PPO: --algorithm.adv_estimator=gae)")
    if cfg.actor.offload_policy and (cfg.actor.param_offload or cfg.actor.optimizer_offload):
        raise ValueError("actor.offload_policy (FSDP2 CPUOffloadPolicy) already keeps params and Adam state "
                         "on the CPU; turn actor.param_offload / actor.optimizer_offload off")


def parse_args(argv: list[str]) -> Config:
    """`--key=value` or `--key value`, with dotted keys for the role sections (`--actor.lr=1e-6`),
    typed and range-checked (options.py)."""
    cfg = options.apply(argv, Config())
    check_config(cfg)
    return cfg


def check_sizes(cfg: Config, world: int) -> int:
    """Validate the batch arithmetic once, up front; returns the mini-batch size per rank (samples)."""
    a, n = cfg.actor, cfg.rollout.n
    if cfg.train_batch_size % world:
        raise ValueError(f"train_batch_size={cfg.train_batch_size} is not divisible by the "
                         f"world size {world}; make it a multiple of {world}")
    if cfg.train_batch_size % a.ppo_mini_batch_size:
        raise ValueError(f"train_batch_size={cfg.train_batch_size} is not a multiple of "
                         f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}")
    if (a.ppo_mini_batch_size * n) % world:
        raise ValueError(f"actor.ppo_mini_batch_size x rollout.n = {a.ppo_mini_batch_size * n} "
                         f"samples do not split over {world} ranks; change either")
    mini = a.ppo_mini_batch_size * n // world
    if mini % a.ppo_micro_batch_size_per_gpu and a.ppo_micro_batch_size_per_gpu < mini:
        raise ValueError(f"actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} "
                         f"does not divide the {mini} samples per rank of a mini-batch")
    if cfg.fsdp_size not in (-1, world) and (cfg.fsdp_size < 1 or world % cfg.fsdp_size):
        raise ValueError(f"fsdp_size={cfg.fsdp_size} does not divide the world size {world}")
    if cfg.rollout.tensor_parallel_size < 1 or world % cfg.rollout.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} does not divide "
                         f"the world size {world}: each vLLM engine spans that many ranks")
    return mini


# --------------------------------------------------------------------------- distributed
def init_distributed(timeout_s: float | None = None):
    """torchrun sets RANK/WORLD_SIZE; plain `python` gets a 1-process group with no port at all.
    On GPUs the group has two backends: NCCL for CUDA tensors and gloo for CPU tensors, which
    CPUOffloadPolicy's shards, grads and grad-norm reduction are (an NCCL-only group fails there
    with "No backend type associated with device type cpu"). CPU runs: gloo alone.
    `timeout_s`: how long a collective (and the start-up rendezvous) may wait for the other ranks
    before it raises: a stalled rank then ends the run instead of hanging it (None: torch's default)."""
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        wait = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        if "RANK" in os.environ:
            dist.init_process_group(backend, device_id=device if cuda else None, **wait,
                                    **checkpoint.restart_store(timeout_s))   # torchrun restarted us: a fresh store
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **wait)
    return dist.get_rank(), dist.get_world_size(), device


def build_mesh(device, world: int, fsdp_size: int):
    """("fsdp",) over all ranks, or ("replicate", "fsdp") for hybrid sharding."""
    if fsdp_size in (-1, world):
        return init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device.type, (world // fsdp_size, fsdp_size),
                            mesh_dim_names=("replicate", "fsdp"))


# --------------------------------------------------------------------------- algorithm
def grpo_advantage(scores: torch.Tensor, n: int, mask: torch.Tensor, norm_by_std: bool = True,
                   eps: float = 1e-6) -> torch.Tensor:
    """scores (B,) in groups of n consecutive samples -> advantages (B, R), zero on padding.
    A group of one sample gets mean 0 and std 1, as in verl."""
    g = scores.view(-1, n)                                     # (B/n, n)
    if n == 1:
        mean, std = torch.zeros_like(g), torch.ones_like(g)
    else:
        mean, std = g.mean(-1, keepdim=True), g.std(-1, keepdim=True)   # unbiased std
    adv = g - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.reshape(-1, 1) * mask


# --------------------------------------------------------------------------- logging
def reduce_metrics(m: dict, device) -> dict:
    """Stage times, memory and offload figures: the max over ranks (the slowest / fullest rank).
    Several ranks: also `time_min/<stage>`, the fastest rank's time. A rank that finishes a stage
    early waits for the others in the next stage's first collective, so a stage's time can hold
    the previous stage's imbalance: max - min shows where the ranks drift apart."""
    keys = sorted(k for k in m if k.split("/")[0] in ("time", "mem", "offload", "rollout") or k == "host_rss_gb")
    if dist.get_world_size() > 1 and keys:
        times = [k for k in keys if k.startswith("time/")]
        t = torch.tensor([float(m[k]) for k in keys] + [-float(m[k]) for k in times], device=device,
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)            # one collective: max, and min as -max(-x)
        t = t.tolist()
        m.update(zip(keys, t))
        m.update({"time_min/" + k[5:]: -v for k, v in zip(times, t[len(keys):])})
    return m


def log_line(m: dict, step: int, steps: int, t_start: float, first: int = 0) -> str:
    """The step's one line; `first`: the step this process started at (a resume), for the eta."""
    done = (step + 1) / steps
    eta = (time.time() - t_start) / (step + 1 - first) * (steps - step - 1)
    bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
    head = f"step {step + 1}/{steps} [{bar}] eta {int(eta // 60)}:{int(eta % 60):02d}"
    keys = ["reward_mean", "pg_loss", "kl", "entropy", "grad_norm", "response_length", "time/step",
            "rollout/sync_s", "rollout/sync_transient_gb", "rollout/trainer_gpu_gb", "rollout/logp_diff_mean",
            "rollout/logp_diff_max", "critic/vf_loss"]
    keys += [k for k in m if k.startswith("time/") and k != "time/step"]
    keys += [k for k in m if k.endswith("/peak_gb")] + ["host_rss_gb"]
    keys += [k for k in m if k.endswith("/alloc_retries") and m[k]]   # a stage at the memory limit
    return " | ".join([head] + [f"{k}={m[k]:.4g}" for k in keys if k in m])


def profile_steps(spec: str) -> set[int]:
    """`--profile_steps=1,3` -> {1, 3}: steps numbered from 0, as in metrics.jsonl; "" -> none."""
    try:
        steps = {int(s) for s in spec.split(",") if s.strip()}
    except ValueError:
        steps = {-1}
    if min(steps, default=0) < 0:
        raise ValueError(f"--profile_steps={spec}: give step numbers from 0, separated by commas (e.g. 1,3)")
    return steps


def profile_warning(cfg: Config) -> str | None:
    """--profile_steps naming steps this run never reaches (numbered from 0, up to --steps - 1)."""
    late = sorted(s for s in profile_steps(cfg.profile_steps) if s >= cfg.steps)
    if late:
        return (f"[profile] warning: --profile_steps={cfg.profile_steps}: step(s) {', '.join(map(str, late))} "
                f"never run (--steps={cfg.steps}: steps 0 to {cfg.steps - 1}), so nothing is traced for them")
    return None


@contextlib.contextmanager
def profiled(cfg: Config, step: int, rank: int, device):
    """A torch.profiler trace of this step when --profile_steps names it: CPU ops, CUDA kernels
    (on a GPU), tensor shapes, every allocation and free, each stage a labelled span (offload.stage).
    Written to <out_dir>/profile/step<k>.rank<r>.pt.trace.json (Chrome trace: Perfetto,
    chrome://tracing; the .pt.trace.json suffix is what TensorBoard's profiler plugin reads).
    Any other step runs with no profiler at all."""
    if step not in profile_steps(cfg.profile_steps):
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        yield
    path = os.path.join(cfg.out_dir, "profile", f"step{step}.rank{rank}.pt.trace.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)
    if rank == 0:
        print(f"[profile] step {step}: {path} (one file per rank)", flush=True)


# --------------------------------------------------------------------------- setup
@dataclass
class Trainer:
    """Everything one run holds (state only; the step is a free function). Each role holds its own
    offload groups and moves them itself; the loop only orders the stages."""
    cfg: Config
    rank: int
    world: int
    device: torch.device
    mini_size: int                         # samples per rank in one mini-batch
    tokenizer: object
    prompts: list                          # prompt token ids
    answers: list
    reward_fn: object
    order: list                            # prompt order, the same on every rank
    actor: actor.Actor
    engine: rollout.Engine
    fingerprint: str                       # of the prompts and answers: a resume checks it walks the same data
    ref: ref.Ref | None = None             # only for the KL loss, and not with LoRA (ref.needed)
    critic: critic.Critic | None = None    # only for PPO (adv_estimator=gae)
    chats: list | None = None              # each prompt's chat messages (the reward model re-renders them)
    reward_model: reward_model.RewardModel | None = None   # only with --reward_model.path
    plan: plan.Plan | None = None          # the planner's prediction per stage, logged beside the measurement
    data_offset: int = 0                   # prompts walked before step 0's position (a resume that
                                           # changed train_batch_size keeps its place in the data)
    warned: set = field(default_factory=set)   # warnings already printed (each once per run)


def preflight(cfg: Config):
    """Every check that needs no process group and no model, run on every rank before either
    exists, so that a mistake costs seconds: the batch arithmetic, the model directory (config,
    weights, a decoder layout this code shards), the data and the reward, then the out_dir policy
    (`checkpoint.plan`). Returns ((prompt ids, answers, chats), the checkpoint to resume or None)."""
    check_sizes(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    actor.check_model(cfg.model)
    reward_model.check(cfg.reward_model)
    profile_steps(cfg.profile_steps)
    tracker.resolve(cfg.logger)            # issue 28: a logger asked for but not installed: one line, now
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.mode == "separate":
        critic.check_model(cfg.model)
    tokenizer = data_io.load_tokenizer(cfg.model)
    data = data_io.load_data(cfg.data, tokenizer, cfg.prompt_key, cfg.answer_key, cfg.max_prompt_length, cfg.seed)
    data_io.load_reward(cfg.reward, cfg.data)
    return data, checkpoint.plan(cfg, data_io.fingerprint(*data[:2]))


def setup(cfg: Config, engine: rollout.Engine | None = None, data=None) -> Trainer:
    """Build every role (each offloads what its flags say), then the rollout engine (or reuse
    `engine`). `data`: (prompt ids, answers, chats or None) instead of cfg.data (preflight's, or a
    benchmark's)."""
    actor.check_model_path(cfg.model)
    reward_model.check(cfg.reward_model)
    rank, world, device = init_distributed(cfg.dist_timeout_s)
    mini_size = check_sizes(cfg, world)
    torch.manual_seed(cfg.seed)
    mesh = build_mesh(device, world, cfg.fsdp_size)
    tokenizer = data_io.load_tokenizer(cfg.model)
    prompts, answers, chats = data if data is not None else data_io.load_data(
        cfg.data, tokenizer, cfg.prompt_key, cfg.answer_key, cfg.max_prompt_length, cfg.seed)
    engine_kind = engine.kind if engine is not None else rollout.resolve_engine(cfg.rollout, device)
    prompt_len = max(map(len, prompts))
    if cfg.offload == "auto":              # the planner's choice replaces the flags, before anything is built
        cfg = plan_auto(cfg, world, prompt_len, engine_kind, device, rank)
    memory_watch(cfg, device)
    where = dict(model_path=cfg.model, mesh=mesh, device=device, seed=cfg.seed)
    a = actor.build(cfg.actor, **where)
    r = ref.build(cfg.ref, actor_cfg=cfg.actor, **where) if ref.needed(cfg.actor) else None
    c = critic.build(cfg.critic, actor_cfg=cfg.actor, actor_model=a.model, **where) \
        if cfg.algorithm.adv_estimator == "gae" else None
    rm = reward_model.build(cfg.reward_model, param_dtype=cfg.actor.param_dtype, policy_tokenizer=tokenizer, mesh=mesh,
                            device=device, seed=cfg.seed) if cfg.reward_model.path else None
    os.makedirs(cfg.out_dir, exist_ok=True)
    if engine is None:                     # after the offloads: vLLM sizes itself from free memory
        engine = rollout.build(cfg.rollout, device=device, model_path=cfg.model, config=a.model.config,
                               out_dir=cfg.out_dir, max_model_len=max(map(len, prompts)) + cfg.rollout.response_length,
                               max_num_seqs=cfg.train_batch_size // world * cfg.rollout.n,
                               dtype=cfg.actor.param_dtype, seed=cfg.seed + rank, rank=rank)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    t = Trainer(cfg=cfg, rank=rank, world=world, device=device, mini_size=mini_size, tokenizer=tokenizer,
                prompts=prompts, answers=answers, reward_fn=data_io.load_reward(cfg.reward, cfg.data),
                order=order, actor=a, engine=engine, fingerprint=data_io.fingerprint(prompts, answers),
                ref=r, critic=c, chats=chats, reward_model=rm, plan=plan.predict(cfg, world, prompt_len, engine.kind))
    if rank == 0:
        print("\n".join(report(t)), flush=True)
        print(plan.table(t.plan, gpu_capacity(device)), flush=True)
    return t


def host_bytes_per_rank() -> int:
    """This node's RAM shared by its ranks (the x2 machines grow MemTotal lazily: a lower bound there)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)


def gpu_capacity(device) -> int:
    """The GPU's total memory (what the plan is measured against; 80 GB stands in on a CPU run)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * plan.GB


def plan_auto(cfg: Config, world: int, prompt_len: int, engine_kind: str, device, rank: int) -> Config:
    """--offload=auto: the fastest flags that fit this GPU by the plan (plan.choose)."""
    say = print if rank == 0 else (lambda *a, **k: None)
    if device.type != "cuda":
        say("[plan] --offload=auto on a CPU run: no device memory to plan; the flags stay as given")
        return cfg
    host = host_bytes_per_rank()
    target = plan.Target(world, prompt_len, gpu_capacity(device), cfg.plan_margin, engine_kind, host)
    best, p = plan.choose(cfg, target)
    if best is None:                       # nothing keeps the margin free: the least device memory that fits at all
        best, p = plan.choose(cfg, replace(target, margin=0.0), least_memory=True)
        if best is not None:
            say(f"[plan] --offload=auto: nothing keeps {cfg.plan_margin:.0%} of the GPU free at the device level; "
                f"taking the configuration that needs the least (the allocator may have to free its cache and "
                f"retry near the top; more GPUs or LoRA would leave headroom)")
    if best is None:
        fits = plan.what_would_fit(cfg, target)
        raise ValueError(f"--offload=auto: the plan finds no combination of offload flags, checkpointing and "
                         f"micro-batch sizes that fits {gpu_capacity(device) / plan.GB:.0f} GB per GPU; what would: "
                         + ("; ".join(fits) if fits else "a bigger GPU"))
    say(f"[plan] --offload=auto chose: {' '.join(plan.changes(cfg, best)) or 'the flags as given'} "
        f"(predicted peak {p.peak / plan.GB:.1f} GB allocated, {p.device_peak / plan.GB:.1f} GB device-level, "
        f"step ~{p.seconds:.1f} s)")
    return best


def memory_watch(cfg: Config, device):
    """On a GPU: an OOM leaves a memory snapshot in out_dir (viewable at pytorch.org/memory_viz);
    with memory_history, every allocation's stack is recorded into it as well."""
    if device.type != "cuda":
        return
    if cfg.memory_history:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    path = os.path.join(cfg.out_dir, f"oom_snapshot.rank{dist.get_rank()}.pickle")

    def dump(*_):                          # called by the allocator at the moment it gives up
        torch.cuda.memory._dump_snapshot(path)
    torch._C._cuda_attach_out_of_memory_observer(dump)


def report(t: Trainer) -> list[str]:
    """The run's set-up in a few lines: the engine, and for each offload flag what it moves and when."""
    cfg, a, dev = t.cfg, t.cfg.actor, t.device
    GB, where = offload.GB, "pinned host" if dev.type == "cuda" else "host (CPU run: no device memory to save)"

    def flag(name, nbytes, on):
        return f"[offload] {name}: " + (f"ON: moves {nbytes / GB:.3f} GB to {where} between uses" if on
                                        else f"off: keeps {nbytes / GB:.3f} GB on {dev.type}")
    auto = {"vllm": " (auto: vLLM imports and CUDA is there)", "hf": " (auto: no vLLM or no CUDA)"}
    lines = [f"[data] {len(t.prompts)} prompts; rollout engine: {t.engine.kind}"
             + (auto[t.engine.kind] if cfg.rollout.engine == "auto" else "")]
    lines.append("[checkpoint] " + (f"every {cfg.save_freq} steps, after the last one and on SIGTERM, to "
                                    f"{cfg.out_dir}/checkpoints (the newest {cfg.keep_checkpoints} kept)"
                                    if cfg.save_freq else "off (--save_freq=0): a stopped run cannot resume"))
    lines.append(checkpoint.disk_report(t))   # what the run writes vs what is free (raises when it cannot fit)
    lines += [w for w in [profile_warning(cfg)] if w]   # --profile_steps past --steps
    if t.engine.kind == "vllm":
        kv = (f"KV cache {t.engine.kv_cache_bytes / GB:.2f} GB, sized from the batch "
              f"(+{cfg.rollout.kv_cache_margin:.0%})" if t.engine.kv_cache_bytes else
              f"weights + KV cache {cfg.rollout.gpu_memory_utilization:.0%} of the GPU")
        tp = cfg.rollout.tensor_parallel_size
        lines.append("[rollout] vLLM engine" + (f" (tensor parallel over {tp} ranks)" if tp > 1 else "")
                     + f" built in {t.engine.build_s:.1f} s; {kv}; asleep it keeps "
                     f"{t.engine.asleep_device_gb:.2f} GB on the GPU (CUDA graphs and buffers that sleep cannot free)")
    if dev.type == "cpu" and (a.param_offload or a.optimizer_offload or cfg.ref.param_offload
                              or cfg.reward_model.param_offload):
        lines.append("[offload] warning: running on CPU: offload flags exercise the copies but save no device memory")
    # Adam holds exp_avg + exp_avg_sq shaped like each local shard that trains (counted from shapes:
    # the shards themselves may be on the host already)
    adam_bytes = 2 * sum(p.to_local().numel() * 4 for p in t.actor.model.parameters() if p.requires_grad)
    k = a.param_offload_layers
    if t.actor.lora is not None:
        lines.append(actor.describe_lora(t.actor))
        if a.use_kl_loss and ref.ignored(cfg.ref):
            lines.append(f"[ref] warning: with actor.lora_rank the reference is the actor with its adapter off "
                         f"(no ref model): {', '.join(ref.ignored(cfg.ref))} has no effect")
    elif a.save_merged:
        lines.append("[actor] warning: actor.save_merged has no effect without actor.lora_rank "
                     "(the saved model is the whole policy)")
    lines.append(flag("actor.param_offload" + (f" (first {k} layers)" if k >= 0 else ""),
                      t.actor.params.nbytes + (t.actor.base.nbytes if t.actor.base else 0), a.param_offload))
    lines.append(flag("actor.optimizer_offload (Adam, 2 x fp32 shard)", adam_bytes, a.optimizer_offload))
    timing = []                            # the copy levers: when each offloaded group moves
    if a.param_offload:
        timing.append("params leave " + ("at the next weight sync (not after the update)" if a.defer_param_offload
                                         else "after the update")
                      + (" and return during the ref forward" if a.prefetch_update and t.ref and not t.critic else "")
                      + (" and stay after the ref forward (adapter off) for the update"
                         if a.prefetch_update and t.actor.lora and a.use_kl_loss and not t.critic else ""))
    if a.optimizer_offload:
        timing.append("Adam returns " + ("just before optimizer.step" if a.optimizer_load_at_step
                                         else "on a side stream during the forward/backward"))
    if timing:
        lines.append("[offload] timing: " + "; ".join(timing))
    if t.ref is not None:
        lines.append(flag("ref.param_offload", t.ref.params.nbytes, cfg.ref.param_offload))
    if t.reward_model is not None:
        lines.append(reward_model.describe(t.reward_model))
        lines.append(flag("reward_model.param_offload", t.reward_model.params.nbytes, cfg.reward_model.param_offload))
    elif cfg.reward_model.param_offload or cfg.reward_model.weight != 1.0:
        lines.append("[reward_model] warning: no --reward_model.path: the other reward_model options have no effect")
    if a.offload_policy or cfg.ref.offload_policy:
        lines.append("[offload] offload_policy: FSDP2 CPUOffloadPolicy, params (and grads, Adam) on pinned host, "
                     "copied per layer at all-gather; the optimizer steps on the CPU")
    if t.critic is not None:
        c, held = cfg.critic, sum(p.to_local().numel() * 4 for p in t.critic.model.parameters())
        lines.append(f"[critic] mode={c.mode}: {held / GB:.3f} GB of parameters"
                     + (" (a value head on the actor's trunk: no second model)" if c.mode == "shared" else ""))
        if c.mode == "shared" and (c.param_offload or c.optimizer_offload):
            lines.append("[offload] warning: critic.mode=shared holds only a value head: critic offload flags have no effect")
        lines.append(flag("critic.param_offload", held, c.param_offload and c.mode == "separate"))
        lines.append(flag("critic.optimizer_offload (Adam, 2 x fp32 shard)", 2 * held,
                          c.optimizer_offload and c.mode == "separate"))
    return lines


# --------------------------------------------------------------------------- one step
class StageOutOfMemory(RuntimeError):
    """torch.OutOfMemoryError, explained: the stage, the ledger, the plan, the change to make."""



def reward_errors(t: Trainer, errors: list) -> int:
    """Rewards that raised or returned no finite number, over all ranks (one all-reduce). With
    reward_error=stop every rank raises the first one (so rank 0 can say it); with zero those
    samples scored 0, and the first is shown once as a warning."""
    n = int(actor.all_sum(torch.tensor([float(len(errors))], device=t.device)).item())
    if n and (t.cfg.reward_error == "stop" or "reward" not in t.warned):
        first = [errors[0] if errors else None]
        if t.world > 1:                    # every rank learns the first rank's message
            first = [None] * t.world
            dist.all_gather_object(first, errors[0] if errors else None)
        message = next(e for e in first if e)
        if t.cfg.reward_error == "stop":
            raise ValueError(f"{message} (--reward_error=zero scores such samples 0 and counts them instead)")
        t.warned.add("reward")
        if t.rank == 0:
            print(f"[warn] {n} rewards failed this step and scored 0 (reward/errors counts them; shown once): "
                  f"{message}", flush=True)
    return n



# reward_model sits before old_logp and ref_logp: the actor's offloaded params have left after the sync
# and nothing is prefetched yet, so its shards and activations meet the fewest trainer bytes of the step
STAGES = ("generate", "reward", "reward_model", "old_logp", "ref_logp", "values", "advantage", "critic_update",
          "update")


def train_step(t: Trainer, step: int) -> dict:
    """One GRPO (or PPO) step, stage by stage (module docstring); returns its metrics, reduced over
    ranks. Each role moves its own bytes inside its call; this function only orders the stages."""
    cfg, a, device, m = t.cfg, t.cfg.actor, t.device, {"step": step}
    temperature = rollout.logprob_temperature(cfg.rollout)   # 1 for greedy (temperature 0)

    @contextlib.contextmanager
    def stage(name):                      # the ledger: time and memory of each stage, vLLM's pool taken out
        assert name in STAGES, name
        try:
            with offload.stage(name, m, device, t.engine.pool_bytes):
                yield
        except torch.OutOfMemoryError as e:   # say where, what was resident, the plan, the change
            raise StageOutOfMemory(plan.explain_oom(name, t.plan, m, gpu_capacity(device) / plan.GB)) from e
        predicted = t.plan.stage(name) if t.plan else None
        if predicted is not None:
            m[f"plan/{name}/predicted_gb"] = predicted.total / plan.GB
            m[f"plan/{name}/device_gb"] = t.plan.device.get(name, 0) / plan.GB   # vs mem/<stage>/device_used_gb

    t_step = time.perf_counter()
    pad_id = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else t.tokenizer.eos_token_id
    local_bs = cfg.train_batch_size // t.world
    start = (t.data_offset + step * cfg.train_batch_size) % len(t.order)
    idx = [t.order[(start + t.rank * local_bs + i) % len(t.order)] for i in range(local_bs)]
    on_policy = a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.train_batch_size

    with stage("generate"):                # the actor's offloaded params come in for the sync only
        batch = rollout.generate(t.engine, t.actor.model, [t.prompts[i] for i in idx], cfg.rollout, pad_id,
                                 t.tokenizer.eos_token_id, device,
                                 cfg.seed * 1_000_003 + step * t.world + t.rank, actor.offloaded(t.actor), m)
    # what the trainer kept on the GPU while the engine generated (params, grads, Adam, ref, reward model)
    held = [t.actor.model, t.actor.optimizer] + ([t.ref.model] if t.ref else []) + \
        ([t.critic.model, t.critic.optimizer] if t.critic else []) + \
        ([t.reward_model.model] if t.reward_model else [])
    m["rollout/trainer_gpu_gb"] = offload.gpu_bytes(*held) / offload.GB

    with stage("reward"):                  # CPU: decode and score each response
        mask = batch["response_mask"]
        texts = t.tokenizer.batch_decode([r[:int(k)] for r, k in zip(batch["responses"].tolist(),
                                                                      mask.sum(-1).tolist())],
                                         skip_special_tokens=True)
        scores, errors = data_io.score(t.reward_fn, data_io.reward_name(cfg.reward, cfg.data), texts,
                                       [t.answers[i] for i in idx for _ in range(cfg.rollout.n)])
        m["reward/errors"] = reward_errors(t, errors)   # stops every rank, or counts (reward_error)
        scores = torch.tensor(scores, dtype=torch.float32, device=device)

    if t.reward_model is not None:         # its shards in, scores, out (its position: STAGES)
        with stage("reward_model"):
            chats = [t.chats[i] for i in idx for _ in range(cfg.rollout.n)] if t.chats else None
            with reward_model.resident(t.reward_model, m):
                model_scores = reward_model.compute_scores(t.reward_model, batch, chats)
            scores = reward_model.mix(scores, model_scores, cfg.reward_model.weight, m)

    with stage("old_logp"):
        if not on_policy:                  # on-policy: the update's first forward is the old policy
            batch["old_log_probs"] = actor.compute_old_log_probs(t.actor, batch, temperature, m)
            if "rollout_log_probs" in batch:
                m.update(actor.logprob_mismatch(batch["old_log_probs"], batch))

    with stage("ref_logp"):
        if t.ref is not None:
            with ref.resident(t.ref, m):
                if t.critic is None:       # GRPO: the update comes next (PPO: the critic's stages do)
                    actor.prefetch_update(t.actor, m)
                batch["ref_log_probs"] = ref.compute_log_probs(t.ref, batch, temperature)
        elif a.use_kl_loss:                # LoRA (ref.needed): the actor with its adapter off is the reference
            batch["ref_log_probs"] = actor.compute_ref_log_probs(t.actor, batch, temperature, m,
                                                                 update_next=t.critic is None)

    if t.critic is not None:               # PPO: values of the rollout states
        with stage("values"):
            batch["values"], feats = critic.compute_values(t.critic, batch, t.actor, m)
            if feats is not None:
                batch["features"] = feats

    with stage("advantage"):
        if t.critic is None:
            batch["advantages"] = grpo_advantage(scores, cfg.rollout.n, mask.float(),
                                                 cfg.algorithm.norm_adv_by_std_in_grpo)
        else:                              # the score sits on each response's last token
            last = (mask.sum(-1) - 1).clamp(min=0).long()
            rewards = torch.zeros_like(batch["values"]).scatter_(1, last[:, None], scores[:, None])
            adv, batch["returns"] = critic.gae(rewards, batch["values"], mask.float(),
                                               cfg.critic.gamma, cfg.critic.lam)
            batch["advantages"] = critic.whiten(adv, mask.float())

    if t.critic is not None:
        with stage("critic_update"):
            m.update(critic.update(t.critic, batch, t.mini_size, a.ppo_epochs, m))
        batch.pop("features", None)        # shared mode: the saved actor features, freed

    with stage("update"):
        m.update(actor.update(t.actor, batch, t.mini_size, temperature, m))

    groups = scores.view(-1, cfg.rollout.n)
    flat = (groups.max(-1).values == groups.min(-1).values).sum().item() if cfg.rollout.n > 1 else 0
    sums = actor.all_sum(torch.tensor([scores.sum().item(), len(scores), mask.sum().item(), flat, len(groups)],
                                      device=device, dtype=torch.float64)).tolist()
    m.update(reward_mean=sums[0] / sums[1], response_length=sums[2] / sums[1],
             host_rss_gb=offload.host_rss_gb())
    m["reward/equal_groups_frac"] = sums[3] / sums[4]   # groups whose samples all scored the same
    m["time/step"] = time.perf_counter() - t_step
    return reduce_metrics(m, device)


# --------------------------------------------------------------------------- main
def train(t: Trainer, start: int) -> bool:
    """Steps start .. cfg.steps - 1, one metrics line each, a checkpoint every save_freq steps and
    after the last. Returns False when a SIGTERM stopped it (after the step and its checkpoint)."""
    cfg = t.cfg
    metrics_path = checkpoint.keep_metrics(cfg.out_dir, start, t.rank)   # each step once
    log = tracker.open(cfg.logger, cfg.out_dir, json.dumps(asdict(cfg), indent=1), t.rank, start)  # issue 28
    checkpoint.stop_on_sigterm()
    t_start, seen, host = time.time(), {}, host_bytes_per_rank()
    for step in range(start, cfg.steps):
        with profiled(cfg, step, t.rank, t.device):    # a no-op unless --profile_steps names this step
            m = train_step(t, step)        # an OOM raises StageOutOfMemory: the step's line is not written
        if t.rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
            log.log(m, step)               # issue 28: the same line to TensorBoard / wandb
            print(log_line(m, step, cfg.steps, t_start, start), flush=True)
            if t.device.type == "cuda":    # early warnings: near the limit, retries, off the plan, creep
                for line in plan.watch(m, seen, t.plan, gpu_capacity(t.device), host):
                    print(line, flush=True)
        if m["reward/equal_groups_frac"] == 1 and cfg.algorithm.adv_estimator == "grpo" and "equal" not in t.warned:
            t.warned.add("equal")
            if t.rank == 0:                # GRPO's advantage is then 0 everywhere: only KL / entropy move weights
                print(f"[warn] step {step}: every group's rewards are equal, so every advantage is 0 and the "
                      f"policy loss has no gradient (a reward the model never earns?); shown once, counted "
                      f"in reward/equal_groups_frac and at the end", flush=True)
        stop = checkpoint.stop_requested(t.device)   # a SIGTERM on any rank: all stop after this step
        if cfg.save_freq and ((step + 1) % cfg.save_freq == 0 or step + 1 == cfg.steps or stop):
            checkpoint.save(t, step + 1)
        if stop and step + 1 < cfg.steps:
            log.close()                    # issue 28
            return False
    log.close()                            # issue 28
    return True


def summary(metrics_path: str) -> list[str]:
    """The end-of-run lines, from metrics.jsonl (the whole run, across resumes): did it train?"""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    n = sum(r["optimizer_steps"] for r in rows)
    applied = n - sum(r["skipped_steps"] for r in rows)
    dw = sum(r["delta_w_abs_mean"] for r in rows) / max(len(rows), 1)
    equal = sum(r["reward/equal_groups_frac"] == 1 for r in rows)
    failed = sum(r["reward/errors"] for r in rows)
    lines = [f"[done] {applied} of {n} optimizer steps applied; mean |delta w| {dw:.3g} per step (the first "
             f"{actor.PROBE} weights of each parameter shard); {equal} of {len(rows)} steps had equal rewards "
             f"in every group" + (f"; {failed} rewards failed and scored 0" if failed else "")]
    if dw == 0:
        lines.append("[warn] the weights never moved: this run trained nothing")
    return lines


def fail(message: str, rank: int, code: int = 2):
    """A failed run's one line, printed once and last. Rank 0 says it at once; another rank first
    waits 5 s, since the same error on rank 0 ends the job sooner (torchrun then stops this rank
    before it repeats it), and speaks only if that did not happen (an error of its own). Under
    torchrun the speaking rank also writes the line to its error file, so that torchrun's closing
    summary shows it as the "Root Cause" rather than a traceback."""
    if rank > 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # torchrun's stop ends the wait (no checkpoint now)
        time.sleep(5)
        message = message.replace("error: ", f"error: [rank {rank}] ", 1)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:                               # the format torchrun's @record writes, with our line as the "traceback"
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


@record           # a crash's traceback reaches torchrun's summary (its "Root Cause")
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(options.usage(sections(Config()))) if int(os.environ.get("RANK", 0)) == 0 else None  # once under torchrun
        return
    rank, timeout = int(os.environ.get("RANK", 0)), None
    try:
        cfg = parse_args(argv)
        timeout = cfg.dist_timeout_s
        checkpoint.lock_out_dir(cfg.out_dir, rank)   # one run per out_dir (global rank 0 holds it), before any write
        checkpoint.exit_on_sigint()                  # Ctrl-C before the first step: one line, no traceback
        data, resume = preflight(cfg)
        t = setup(cfg, data=data)
        if t.rank == 0:
            resolved = {"resolved_config": asdict(cfg), "world_size": t.world, "device": str(t.device)}
            print(json.dumps(resolved, indent=1))
            with open(os.path.join(cfg.out_dir, "run_config.json"), "w") as f:
                json.dump(resolved, f, indent=1)
        finished = train(t, checkpoint.load(t, resume) if resume else 0)
        if not finished:                   # SIGTERM or Ctrl-C: checkpointed; the same command resumes
            line, code = checkpoint.stop_line(cfg)
            if t.rank == 0:
                print(line, flush=True)
            sys.exit(code)
        if t.rank == 0:
            print("\n".join(summary(os.path.join(cfg.out_dir, "metrics.jsonl"))), flush=True)
            if t.device.type == "cuda":
                tracker.picture_at_end(cfg.out_dir)   # issue 28: <out_dir>/memory.png (plan.py --plot draws it too)
        if cfg.save:
            checkpoint.save_final(t)
    except StageOutOfMemory as e:          # the stage, the ledger, the plan, the change; a snapshot beside it
        fail(f"error: {e} (memory snapshot: {os.path.join(cfg.out_dir, f'oom_snapshot.rank{rank}.pickle')})", rank, 1)
    except (ValueError, OSError) as e:     # bad input, an unwritable or full disk: what to change
        fail(f"error: {e}", rank)
    except RuntimeError as e:              # a timed-out collective (gloo raises; NCCL's watchdog aborts)
        if not any(w in str(e).lower() for w in ("timed out", "timeout")):
            raise
        fail(f"error: a collective waited more than --dist_timeout_s={timeout:g} s for the other ranks "
             f"(one is stalled or dead): {str(e).strip().splitlines()[0][:200]}", rank)
    dist.barrier()
    dist.destroy_process_group()


def leave(code: int = 0):
    """End this worker process once everything it writes is written: on success every rank waits for
    the others and the process groups are destroyed; then the process exits with `code` without the
    interpreter's teardown. Why not a plain return: DTensor's sharding caches keep the DeviceMesh, and
    through it the gloo group with its loop threads, alive after destroy_process_group, so they are
    torn down during interpreter exit while a peer that exited first closes its sockets under them;
    that can abort a run that had finished (SIGABRT, "terminate called without an active exception",
    once in a CI run of 2 CPU ranks). os._exit skips the teardown; the OS takes back memory, sockets and
    GPU contexts."""
    if code == 0 and dist.is_initialized():
        dist.barrier()                     # no rank tears gloo down while another still talks
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
        exit_code = 0
    except SystemExit as e:                # fail()'s one line (1, 2) or a preemption's 143
        exit_code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    leave(exit_code)
