"""The run's set-up: every check that needs no model (`preflight`), then the process group, the plan, each role
built by its own file and the rollout engine (`setup`), and the set-up report. train_grpo.py runs the steps on
the `Trainer` this returns.

    python train_grpo.py                                   # preflight, setup, then the steps (train_grpo.py)
    python -m pytest -q tests/test_train.py -k "help or range or bad"   # the pre-flight's one-line errors

The order matters for memory: the planner's choice (--offload=auto) and its relaxations replace the flags before
anything is built; each role offloads what its flags say as it is built; the vLLM engine is built last, sizing
itself from the memory the roles left free.
"""
from __future__ import annotations   # the Trainer's fields share their names with the role modules

import os
from dataclasses import dataclass, field, replace

import torch

import actor
import critic
import data as data_io
import kernel_choice
import launch
import ledger
import offload
import options
import plan
import predict
import ref
import reward_model
import rollout
import rollout_async
import rollout_engine
import rundir
import tiny
import tracker
import validate
from checks import check_model
from model import build_mesh, hf_config
from options import Config


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
    # where the step's batches come from: this rank's engine (colocated), or async rollout's stream to the
    # engine processes (rank 0's buffer), which train_grpo.start_stream puts here in place of the unbuilt engine
    engine: rollout.Engine | rollout_async.Stream
    engine_kind: str                       # "vllm" or "hf": what generates, on this rank or in the engine processes
    fingerprint: str                       # of the prompts and answers: a resume checks it walks the same data
    ref: ref.Ref | None = None             # only for the KL loss, and not with LoRA (ref.needed)
    critic: critic.Critic | None = None    # only for PPO (adv_estimator=gae)
    chats: list | None = None              # each prompt's chat messages (the reward model re-renders them)
    reward_model: reward_model.RewardModel | None = None   # only with --reward_model.path
    plan: predict.Plan | None = None       # the planner's prediction per stage, logged beside the measurement
    data_offset: int = 0                   # prompts walked before step 0 (a resume that changed the batch size)
    peak: float = 0.0                      # the GPU's bf16 matmul FLOP/s, measured at set-up (MFU's denominator)
    warned: set = field(default_factory=set)   # warnings already printed (each once per run)
    kernels: str = ""                      # the set-up line of the models' kernels (kernel_choice.use)
    val: tuple | None = None               # held-out (prompt ids, answers, chats), or None: no validation
    prompt_len: int = 0                    # the longest prompt, training or held-out: what the engine is built for
    updates: int = 0                       # steps whose update is done: the weights a stop or an error keeps
    saved: int = -1                        # the step of the newest checkpoint written or resumed from
    updating: bool = False                 # inside the update stage: the weights are between two steps


def preflight(cfg: Config):
    """Every check that needs no process group and no model, run on every rank before either
    exists, so that a mistake costs seconds: the batch arithmetic and each role's combinations, the
    model directory (config, weights, a decoder layout this code shards), the data and the reward,
    then the out_dir policy (`rundir.plan`). Returns (((prompt ids, answers, chats), the held-out ones or
    None), the checkpoint to resume or None)."""
    nproc = int(os.environ.get("WORLD_SIZE", 1))
    rollout_engine.check(cfg.rollout, nproc, cfg.train_batch_size)   # (main checked it first: before a rank leaves)
    options.check_sizes(cfg, rollout_engine.trainer_world(cfg.rollout, nproc))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rollout.resolve_engine(cfg.rollout, device)   # FP8 on HF: refused now
    check_model(cfg.model, cfg.rollout.response_length)
    reward_model.check_model(cfg.reward_model)
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.mode == "separate":
        critic.check_model(cfg.model)
    tokenizer = data_io.load_tokenizer(cfg.model)
    data = data_io.run_data(cfg, tokenizer)   # (training, held-out or None)
    tiny.check_text(cfg.model, cfg.instruction, data)   # the embedded tokenizer's 14 characters: text lost, said
    data_io.load_reward(cfg.reward, cfg.data, cfg.gsm8k_format)
    tracker.resolve(cfg.logger)            # a logger asked for but not installed: one line, now
    start = rundir.plan(cfg, data_io.fingerprint(*data[0][:2]))
    tracker.check_dir(cfg.logger, cfg.out_dir)   # after the policy made out_dir: its folder is writable
    return data, start


def setup(cfg: Config, engine: rollout.Engine | None = None, data=None, val=None) -> Trainer:
    """Build every role (each offloads what its flags say), then the rollout engine (or reuse `engine`, run as `cfg`
    says). `data`, `val`: (prompt ids, answers, chats or None) to train on and hold out (None: no validation), or
    cfg's."""
    nproc = int(os.environ.get("WORLD_SIZE", 1))          # async rollout: the engine ranks are not the trainer's
    rank, world, device = launch.init_distributed(cfg.dist_timeout_s, rollout_engine.trainer_world(cfg.rollout, nproc))
    torch.manual_seed(cfg.seed)
    tokenizer = data_io.load_tokenizer(cfg.model)
    if data is None:
        data, val = data_io.run_data(cfg, tokenizer)
    prompts, answers, chats = data
    prompt_len = max(map(len, prompts + (val[0] if val else [])))   # the engine answers held-out prompts too
    kind = engine.kind if engine is not None else rollout.resolve_engine(cfg.rollout, device)
    # what other processes hold of this GPU, before this run's engine exists (a given engine is this process's;
    # async rollout's own engines beside the trainer are in the plan already and may be building as this runs)
    others = ledger.others_on_gpu(device) if engine is None and cfg.rollout.mode != "async" else 0
    cfg, predicted = planned(cfg, world, prompt_len, kind, device, rank, others=others)
    mini_size = options.check_sizes(cfg, world)   # after auto, which may change micro-batch and Ulysses sizes
    ledger.memory_watch(cfg.out_dir, rank, device, cfg.memory_history)
    peak = ledger.matmul_peak(device)      # measured before anything is built (a 384 MB transient)
    used, kernel_line = kernel_choice.use(cfg.kernels, device, hf_config(cfg.model).model_type,   # before any model
                                          cfg.head_kernel, cfg.actor.logits_chunk_tokens)
    a, r, c, rm = build_roles(cfg, build_mesh(device, world, cfg.fsdp_size), device, tokenizer)
    kernel_choice.compile_layers([x.model for x in (a, r, c, rm) if x is not None], used)
    os.makedirs(cfg.out_dir, exist_ok=True)
    disk = rundir.disk_report(cfg, trained(a, c), a)   # a disk too small stops the run here, before the engine's build
    if engine is None:                     # after the offloads: vLLM sizes itself from free memory
        engine = build_engine(cfg, a, tokenizer, prompt_len, world, device, rank)
    if cfg.expandable_segments and device.type == "cuda":   # after the engine: its pool is made without them
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(data_io.data_seed(cfg))).tolist()
    t = Trainer(cfg=cfg, rank=rank, world=world, device=device, mini_size=mini_size, tokenizer=tokenizer,
                prompts=prompts, answers=answers, order=order, actor=a, ref=r, critic=c, chats=chats,
                reward_fn=data_io.load_reward(cfg.reward, cfg.data, cfg.gsm8k_format),
                engine=replace(engine, cfg=cfg.rollout), engine_kind=engine.kind,
                fingerprint=data_io.fingerprint(prompts, answers), reward_model=rm, plan=predicted, peak=peak,
                kernels=kernel_line, val=val, prompt_len=prompt_len)
    if rank == 0:
        print("\n".join(report(t, disk) + [predict.table(t.plan, ledger.gpu_capacity(device))]), flush=True)
    return t


def planned(cfg: Config, world: int, prompt_len: int, kind: str, device, rank: int, *, others: int = 0) -> tuple:
    """(the run's config once the planner has fitted it to this GPU, its prediction): --offload=auto's choice and
    the relaxed defaults replace the flags before anything is built, fitted to what `others` (the bytes other
    processes hold) leave of the card; a run the host's RAM or the GPU cannot hold at a checkpoint is refused
    here, and one near the GPU's limit by the plan is said."""
    gpu = ledger.gpu_capacity(device) - others if device.type == "cuda" else 0
    if others and rank == 0:
        print(f"[plan] other processes hold {others / predict.GB:.1f} GB of this GPU: the run is fitted to the "
              f"{gpu / predict.GB:.1f} GB left (their later growth is not seen)", flush=True)
    if cfg.offload == "auto":              # the planner's choice replaces the flags, before anything is built
        cfg = plan.plan_auto(cfg, world, prompt_len, kind, device, rank, others=others)
    cfg = plan.relax(cfg, world, prompt_len, kind, gpu, rank)
    predicted = predict.predict(cfg, world, prompt_len, kind)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    predict.host_fits(cfg, predicted, device, ledger.host_available(), local)
    predict.checkpoint_fits(cfg, predicted, gpu)
    if rank == 0 and (line := plan.verdict(cfg, predicted, world, prompt_len, kind, device)):
        print(line, flush=True)            # near or over the GPU by the plan: said before anything is built
    return cfg, predicted


def build_roles(cfg: Config, mesh, device, tokenizer) -> tuple:
    """(actor, ref or None, critic or None, reward model or None), each built by its own file."""
    where = dict(model_path=cfg.model, mesh=mesh, device=device, seed=cfg.seed)
    a = actor.build(cfg.actor, **where)
    r = ref.build(cfg.ref, actor_cfg=cfg.actor, **where) if ref.needed(cfg.actor) else None
    c = critic.build(cfg.critic, actor_cfg=cfg.actor, actor_model=a.model, **where) \
        if cfg.algorithm.adv_estimator == "gae" else None
    rm = reward_model.build(cfg.reward_model, param_dtype=cfg.actor.param_dtype, policy_tokenizer=tokenizer, mesh=mesh,
                            device=device, seed=cfg.seed) if cfg.reward_model.path else None
    return a, r, c, rm


def trained(a: actor.Actor, c: critic.Critic | None) -> list:
    """(name, state, checkpoint bracket) of each trained role; the frozen ones come from --model again."""
    return [("actor", a, actor.state_in)] + ([("critic", c, critic.state_in)] if c else [])


def build_engine(cfg: Config, a: actor.Actor, tokenizer, prompt_len: int, world: int, device, rank: int):
    """This rank's rollout engine, asked to hold a step's share of the prompts (rollout.request)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    req = rollout.request(cfg.rollout, prompts=rollout.prompts_per_rank(cfg.train_batch_size, world),
                          prompt_len=prompt_len, param_dtype=cfg.actor.param_dtype)
    return rollout.build(cfg.rollout, device=device, model_path=cfg.model, config=a.model.config,
                         out_dir=cfg.out_dir, req=req, seed=cfg.seed + rank, pad_id=pad,
                         eos_id=tokenizer.eos_token_id, rank=rank)


def roles(t: Trainer) -> list:           # the roles this run built
    return [x for x in (t.actor, t.reward_model, t.ref, t.critic) if x is not None]


def report(t: Trainer, disk: str) -> list[str]:
    """The run's set-up in a few lines: the data, the engine, the checkpoints and the `disk` line
    (rundir.disk_report's, measured once), then what each role holds and moves, in its own words."""
    cfg, auto = t.cfg, {"vllm": " (auto: vLLM imports and CUDA is there)", "hf": " (auto: no vLLM or no CUDA)"}
    lines = [f"[data] {len(t.prompts)} prompts; rollout engine: {t.engine_kind}"
             + (auto[t.engine_kind] if cfg.rollout.engine == "auto" else "")]
    lines.append("[checkpoint] " + (f"every {cfg.save_freq} steps, after the last one and on SIGTERM or Ctrl-C, to "
                                    f"{cfg.out_dir}/checkpoints (the newest {cfg.keep_checkpoints} kept)"
                                    if cfg.save_freq else "off (--save_freq=0): a stopped run cannot resume"))
    lines.append(disk)
    lines += options.warnings(cfg)     # --profile_steps past --steps; options this run reads nowhere
    lines += validate.describe(cfg, t.val, data_io.reward_name(cfg.reward, cfg.data, cfg.gsm8k_format))
    lines += rollout.describe(t.engine) + [t.kernels]
    if t.peak:
        lines.append(f"[perf] the GPU's bf16 matmul peak, measured (8192^3): {t.peak / 1e12:.0f} TFLOP/s (MFU's base)")
    if t.device.type == "cpu" and any(s.enabled for r in roles(t) for s in vars(r).values()
                                      if isinstance(s, offload.Stash)):
        lines.append("[offload] warning: running on CPU: offload flags exercise the copies but save no device memory")
    lines += actor.describe(t.actor, ppo=t.critic is not None)
    lines += ref.describe(t.ref) if t.ref is not None else ref.ignored(cfg.ref, cfg.actor)
    lines += reward_model.describe(t.reward_model) if t.reward_model else reward_model.ignored(cfg.reward_model)
    return lines + (critic.describe(t.critic) if t.critic is not None else [])
