"""GRPO post-training with every GPU-memory move in view.

    python train_grpo.py                                   # embedded tiny model + copy task, CPU ok
    torchrun --nproc_per_node=2 train_grpo.py              # same, 2 processes (gloo on CPU)
    python train_grpo.py --actor.lora_rank=16 --actor.lr=1e-3   # LoRA: adapters train, no ref model
    torchrun --nproc_per_node=8 train_grpo.py --model /models/Qwen2.5-1.5B-Instruct \
        --data gsm8k_train.parquet --actor.param_offload=true --actor.optimizer_offload=true \
        --ref.param_offload=true --train_batch_size=64 --rollout.response_length=512

One step; each stage's seconds and memory go to <out_dir>/metrics.jsonl. Every move of a role's bytes happens
inside that role's own file (actor.py, ref.py, critic.py, reward_model.py; rollout.py loads and frees the actor's
params around the weight sync): this file orders the stages and keeps the ledger (ledger.stage).
--profile_steps=1,3 writes a torch.profiler trace of those steps to <out_dir>/profile/.
Every metric also goes to TensorBoard (<out_dir>/tensorboard), wandb or nowhere (--logger); a GPU run ends with
<out_dir>/memory.png.
    [val]     : when due (--val_freq), first: greedy answers to the held-out prompts in a bracket of their own
    generate  : HF: params in -> sample n a prompt -> out; vLLM (rollout.awake): params in -> sync -> out -> KV
                wakes -> sample -> sleep (defer_param_offload: in since the update). Async: rollout_wait, push last
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
Around the steps (main): every check that needs no model runs first, on every rank (trainer.preflight: options,
batch arithmetic, model dir, data, reward, the out_dir policy); a mistake is one line, `error: ...`, said once; then
the set-up (trainer.setup: the plan, each role, the engine). This file reads: the step (`train_step`, then the
helpers it calls, in order), the loop, saving, `main`. A checkpoint
every --save_freq steps, after the last step and on SIGTERM or Ctrl-C; the same command resumes a stopped run.
How it differs from the GRPO paper (as verl does): KL is a loss term (k3 by default) rather than
a reward term, and with loss_agg_mode=token-mean long responses weigh more than short ones.
"""
import contextlib
import json
import os
import sys
import time
import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import actor
import checkpoint
import critic
import data as data_io
import gsm8k
import launch
import ledger
import losses
import offload
import options
import predict
import ref
import reward_model
import rollout
import rollout_async
import rollout_engine
import rundir
import tracker
import ulysses
import validate
import vllm_engine
import watch
from model import all_sum
from options import Config
from trainer import Trainer, preflight, roles, setup, trained   # the run's set-up


# --------------------------------------------------------------------------- one step
def train_step(t: Trainer, step: int) -> dict:
    """One GRPO (or PPO) step, stage by stage (module docstring); returns its metrics, reduced over
    ranks. Each role moves its own bytes inside its call; this function only orders the stages (the
    planner walks the same order: predict.walk)."""
    cfg, m, t0, ppo = t.cfg, {"step": step}, time.perf_counter(), t.critic is not None
    streamed = cfg.rollout.mode == "async"   # t.engine: async rollout's stream, else this rank's engine
    stage = lambda name: in_ledger(t, m, name)  # noqa: E731
    temperature = rollout.logprob_temperature(cfg.rollout)   # 1 for greedy (temperature 0)
    idx, sp = batch_indices(t, step), ulysses.group(cfg.actor.ulysses_sequence_parallel_size)
    if t.val and validate.due(cfg, step):  # the policy after `step` updates answers the held-out prompts
        with stage("val"):
            held_out(t, step, m)
    with stage("rollout_wait" if streamed else "generate"):
        batch = sampled(t, step, idx, sp, m)
    if not streamed:                       # what the trainer kept on the GPU while the engine generated (counted
        m["rollout/trainer_gpu_gb"] = held_gb(t)   # here, unchanged since: 1,400 tensors' walk is not the bracket's)
    with stage("reward"):                  # CPU: decode and score each response
        scores = rule_scores(t, batch, idx, sp.size, m)
    if t.reward_model is not None:         # its shards in, scores, out (its position: ledger.STAGES)
        with stage("reward_model"):
            scores = model_scores(t, batch, idx, scores, m)
    with stage("old_logp"):                # skipped on-policy: the update's first forward is the old policy
        actor.compute_old_log_probs(t.actor, batch, temperature, cfg.train_batch_size, m)
    if cfg.actor.use_kl_loss:              # the reference's log-probs (the actor's prefetch may overlap them)
        with stage("ref_logp"):
            batch["ref_log_probs"] = ref_log_probs(t, batch, temperature, ppo, m)
    if ppo:                                # values of the rollout states
        with stage("values"):
            critic.compute_values(t.critic, batch, m, trunk=t.actor.model, lent=actor.policy_stashes(t.actor))
    with stage("advantage"):               # GRPO: group-normalised scores; PPO: GAE on the critic's values
        batch["advantages"] = critic.advantages(t.critic, batch, scores) if ppo else losses.grpo_advantage(
            scores, cfg.rollout.n, batch["response_mask"].float(), cfg.algorithm.norm_adv_by_std_in_grpo)
    if ppo:
        with stage("critic_update"):
            m.update(critic.update(t.critic, batch, t.mini_size, cfg.actor.ppo_epochs, m))
    with stage("update"):                  # params + Adam in, mini/micro-batched clipped PG + KL, both out
        policy_update(t, batch, temperature, step, m)
    if streamed:
        with stage("push"):                # the new policy to the engines as version step + 1 (params in for it)
            rollout_async.push(t.engine, t.actor.model, actor.policy_stashes(t.actor), step + 1, m)
    m.update(step_figures(t, step, scores, batch), **{"time/step": time.perf_counter() - t0})
    m = ledger.reduce(m, t.device)
    m.update(perf(t, batch, m))            # throughput from the reduced (slowest rank's) times
    return m


class StageOutOfMemory(RuntimeError):
    """torch.OutOfMemoryError, explained: the stage, the ledger, the plan, the change to make."""


@contextlib.contextmanager
def in_ledger(t: Trainer, m: dict, name: str):
    """One stage in the ledger: its time and memory (vLLM's pool taken out) and the plan's prediction
    beside them; an OOM inside it is said with where, what was resident, the plan and the change."""
    assert name in ledger.STAGES, name
    try:
        with ledger.stage(name, m, t.device, pool_bytes(t)):
            yield
    except torch.OutOfMemoryError as e:
        gpu_gb = ledger.gpu_capacity(t.device) / predict.GB
        raise StageOutOfMemory(watch.explain_oom(name, t.plan, m, gpu_gb)) from e
    watch.record(t.plan, name, m)


def pool_bytes(t: Trainer) -> int:
    """vLLM's sleep pool: PyTorch counts it as allocated, so the ledger takes it out (async: no engine here)."""
    return 0 if t.cfg.rollout.mode == "async" else t.engine.pool_bytes


def prompts_walked(t: Trainer, steps: int) -> int:
    """The prompts the run's data order has handed out after `steps` steps (a resume's data_offset included)."""
    return t.data_offset + steps * t.cfg.train_batch_size


def batch_indices(t: Trainer, step: int) -> list[int]:
    """This rank's prompts for `step`: a contiguous slice of the shuffled order, after the prompts
    earlier steps (and a resume's data_offset) walked; one slice per data-parallel group (Ulysses)."""
    g = ulysses.group(t.cfg.actor.ulysses_sequence_parallel_size)
    local_bs = t.cfg.train_batch_size // g.dp_size
    start = prompts_walked(t, step) % len(t.order)
    return [t.order[(start + g.dp_rank * local_bs + i) % len(t.order)] for i in range(local_bs)]


def held_out(t: Trainer, step: int, m: dict):
    """The val stage: the policy after `step` updates answers the held-out prompts (validate.py), through this
    rank's engine or async rollout's stream."""
    engine, stream = (None, t.engine) if t.cfg.rollout.mode == "async" else (t.engine, None)
    m.update(validate.validate(engine, stream, t.actor.model, actor.policy_stashes(t.actor), t.val, cfg=t.cfg,
                               step=step, reward_fn=t.reward_fn, tokenizer=t.tokenizer, warned=t.warned,
                               device=t.device, rank=t.rank, world=t.world))


def sampled(t: Trainer, step: int, idx: list, sp, m: dict) -> dict:
    """The step's batch. Colocated (the generate stage): this rank's share of the prompts through its engine,
    the actor's offloaded params in for the weight sync only; Ulysses: the group's k shares on each of its
    ranks. Async (rollout_wait): sampled while the last step trained, and the next batch is ordered."""
    if t.cfg.rollout.mode == "async":
        return rollout_async.batch(t.engine, rollout_async.take(t.engine, step, lambda j: step_prompts(t, j), m))
    batch = rollout.generate(t.engine, t.actor.model, [t.prompts[i] for i in ulysses.share(idx, sp)],
                             rollout.sample_seed(t.cfg.seed, step, t.rank, t.world), actor.policy_stashes(t.actor), m,
                             logprobs=step % t.cfg.rollout.logprobs_every == 0)
    return ulysses.gather_batch(batch, sp)


def step_prompts(t: Trainer, step: int) -> list:
    """Every data-parallel group's prompts of `step`, in group order (what async rollout orders)."""
    start = prompts_walked(t, step) % len(t.order)
    return [t.prompts[t.order[(start + i) % len(t.order)]] for i in range(t.cfg.train_batch_size)]


def held_gb(t: Trainer) -> float:         # the roles' params, grads and optimizer state on the GPU now
    return ledger.gpu_bytes(*[x for r in roles(t) for x in (r.model, getattr(r, "optimizer", None))
                               if x is not None]) / offload.GB


def rule_scores(t: Trainer, batch: dict, idx: list, copies: int, m: dict) -> torch.Tensor:
    """The reward stage: each response decoded and scored on the CPU; a reward that fails stops the run
    or scores 0 (--reward_error), counted once per sample (`copies`: a Ulysses group's k ranks). With the
    built-in GSM8K rule, the samples' answer forms too (`reward/found_strict`: the share that write `#### N`, the
    form the strict reward pays; `reward/found_boxed`: a `\\boxed{}`): a form no sample writes cannot be learnt
    from its reward, whatever it pays."""
    cfg = t.cfg
    name = data_io.reward_name(cfg.reward, cfg.data, cfg.gsm8k_format)
    answers = [t.answers[i] for i in idx for _ in range(cfg.rollout.n)]
    scores, errors, texts = data_io.score_rollout(t.reward_fn, name, t.tokenizer, batch, answers)
    m["reward/errors"] = data_io.reward_errors(errors, cfg.reward_error, t.warned, t.device, copies)   # or stop
    if data_io.builtin_gsm8k(cfg.reward, cfg.data):   # shares: a Ulysses group's copies cancel
        f = gsm8k.found_forms(texts)       # the forms only: the reward above has scored them
        found = all_sum(torch.tensor([f["found_strict"], f["found_boxed"], len(texts)], device=t.device,
                                     dtype=torch.float64)).tolist()
        m["reward/found_strict"], m["reward/found_boxed"] = found[0] / found[2], found[1] / found[2]
    return torch.tensor(scores, dtype=torch.float32, device=t.device)


def model_scores(t: Trainer, batch: dict, idx: list, rule: torch.Tensor, m: dict) -> torch.Tensor:
    """The reward_model stage: its shards in for its forward (`resident`), its scores mixed with the rule's."""
    with reward_model.resident(t.reward_model, m):
        scores = reward_model.compute_scores(t.reward_model, batch, t.chats and [t.chats[i] for i in idx])
    return reward_model.mix(rule, scores, t.cfg.reward_model.weight, m)


def ref_log_probs(t: Trainer, batch: dict, temperature: float, ppo: bool, m: dict) -> torch.Tensor:
    """The ref stage: the frozen reference lends its bracket, inside which the actor's params start coming
    in when it `prefetches` (GRPO: the update comes next; PPO: the critic's stages do). LoRA (no ref
    model, ref.needed): the actor with its adapter off is the reference."""
    if t.ref is None:
        return actor.compute_ref_log_probs(t.actor, batch, temperature, m, ppo)
    with ref.resident(t.ref, m):
        if actor.prefetches(t.cfg.actor, ppo):
            actor.prefetch_update(t.actor, m)
        return ref.compute_log_probs(t.ref, batch, temperature)


def policy_update(t: Trainer, batch: dict, temperature: float, step: int, m: dict):
    """The update stage (actor.update, which brings the actor's params and Adam in and out). While it runs the
    weights are between two steps: a stop or an error then keeps the last whole step's (`keep`)."""
    t.updating = True
    seed = rollout.sample_seed(t.cfg.seed, step, 0, 1)
    m.update(actor.update(t.actor, batch, t.mini_size, temperature, m, seed=seed))
    t.updates, t.updating = step + 1, False


def step_figures(t: Trainer, step: int, scores: torch.Tensor, batch: dict) -> dict:
    """The step's reward mean, response length, the share of responses cut at the length cap
    (`response/clipped_frac`: no EOS within --rollout.response_length), share of groups with equal rewards, the
    passes over the training prompts after it (`data/epochs`: a held-out score that flattens past 1-2 passes while
    the train reward still rises wants more data, not more steps) and a checksum of the prompts it trained on
    (`data/prompt_crc`: a resumed run's steps show they took the same prompts), over all ranks."""
    groups, mask = scores.view(-1, t.cfg.rollout.n), batch["response_mask"]
    flat = (groups.max(-1).values == groups.min(-1).values).sum().item() if t.cfg.rollout.n > 1 else 0
    prompts = batch["input_ids"][:, :-mask.shape[1]] * batch["attention_mask"][:, :-mask.shape[1]]   # left pads as 0
    crc = zlib.crc32(prompts.cpu().numpy().tobytes()) / t.cfg.actor.ulysses_sequence_parallel_size   # k copies
    capped = (mask.sum(-1) >= t.cfg.rollout.response_length).sum().item()
    sums = all_sum(torch.tensor([scores.sum().item(), len(scores), mask.sum().item(), flat, len(groups), crc, capped],
                                device=t.device, dtype=torch.float64)).tolist()
    return {"reward_mean": sums[0] / sums[1], "response_length": sums[2] / sums[1], "host_rss_gb": ledger.host_rss_gb(),
            "response/clipped_frac": sums[6] / sums[1], "reward/equal_groups_frac": sums[3] / sums[4],
            "data/prompt_crc": sums[5],
            "data/epochs": prompts_walked(t, step + 1) / len(t.order)}


def perf(t: Trainer, batch: dict, m: dict) -> dict:
    """Each compute stage's throughput on this GPU (ledger.throughput): the model FLOPs of the tokens it ran
    through the model (packed: the real ones; a Ulysses group's k ranks each run 1/k of its rows), and the
    decode's against reading the engine's weights (the plan's) once a step, an async engine's too."""
    cfg, k = t.cfg, t.cfg.actor.ulysses_sequence_parallel_size
    mask, resp = batch["attention_mask"], batch["response_mask"]
    tokens = (int(mask.sum()) if cfg.actor.remove_padding else mask.numel()) // k
    if cfg.rollout.mode == "async":        # one engine's share of the tokens, and its weights
        share, weights = t.engine.dp / t.engine.engines, t.plan.engine_device.get("weights", 0)
    else:
        share, weights = cfg.rollout.tensor_parallel_size, t.plan.vllm_device.get("vLLM weights", 0)
    decode = (int(resp.sum() * share) // k, int(resp.sum(-1).max()), weights, torch.cuda.get_device_name(t.device)) \
        if t.engine_kind == "vllm" else None
    return ledger.throughput(m, predict.stage_flops(cfg, tokens), t.peak, decode)


# --------------------------------------------------------------------------- the loop
def train(t: Trainer, start: int) -> bool:
    """Steps start .. cfg.steps - 1, one metrics line each, a checkpoint every save_freq steps and
    after the last. Returns False when a SIGTERM or Ctrl-C stopped it (after the step and its checkpoint)."""
    cfg = t.cfg
    metrics_path = rundir.keep_metrics(cfg.out_dir, start, t.rank)   # each step once
    if cfg.rollout.mode == "async":        # after a resume: the engines start from the checkpoint's policy
        start_stream(t, start)             # (a Ctrl-C meanwhile is set-up's: one line, nothing to save yet)
    rundir.stop_on_sigterm(cfg)
    log = tracker.open(cfg.logger, cfg.out_dir, json.dumps(asdict(cfg), indent=1), t.rank, start)
    t_start, seen, step = time.time(), {}, start - 1
    profiled = options.profile_steps(cfg.profile_steps)
    for step in range(start, cfg.steps):
        with tracker.profiled(cfg.out_dir, profiled, step, t.rank, t.device):   # a no-op unless it names this step
            m = train_step(t, step)        # an OOM raises StageOutOfMemory: the step's line is not written
        vllm_engine.refreeze(step - start)   # the first steps' compiled graphs out of each sleep's collection
        if t.rank == 0:
            rundir.on_rank0(rundir.write_step, metrics_path, log, m, step)   # a failure: every rank stops after it
            print(tracker.log_line(m, step, cfg.steps, t_start, start), flush=True)
            for line in watch.step_warnings(m, seen, t.plan, t.device):   # near the limit, off the plan, creep
                print(line, flush=True)
            if step == start and (line := ledger.perf_line(m, t.peak)):    # each compute stage's throughput
                print(line, flush=True)
        if m["reward/equal_groups_frac"] == 1 and cfg.algorithm.adv_estimator == "grpo" and "equal" not in t.warned:
            t.warned.add("equal")
            if t.rank == 0:                # GRPO's advantage is then 0 everywhere: only KL / entropy move weights
                form = (f" {m['reward/found_strict']:.1%} of its samples wrote `#### N`, the form the strict reward "
                        f"pays." if "reward/found_strict" in m else "")
                print(f"[warn] step {step}: every group's rewards are equal, so every advantage is 0 and the "
                      f"policy loss has no gradient (a reward the model never earns?).{form} Shown once, counted "
                      f"in reward/equal_groups_frac and at the end", flush=True)
        stop, last = rundir.stop_requested(t.device), step + 1 == cfg.steps   # SIGTERM, Ctrl-C, a failed write
        if cfg.save_freq and ((step + 1) % cfg.save_freq == 0 or last) and (last or not stop):
            save(t, step + 1)              # (a stop before the last step keeps the weights in `run`)
        if stop and not last:              # every rank stops after the same step
            break
    if t.val and step + 1 == cfg.steps and validate.due(cfg, cfg.steps) and not rundir.stop_requested(t.device):
        last_validation(t, metrics_path, log)
    log.close()
    if cfg.rollout.mode == "async":        # the engines stop once told (Ctrl-C and SIGTERM are the trainer's)
        rollout_async.close(t.engine)
    return step + 1 == cfg.steps


def start_stream(t: Trainer, step: int):
    """Async rollout: start (or reach) the engines and push them the policy of `step` (its version:
    one update per step). Nothing was buffered before: a resumed run samples its batches again. The stream
    takes the unbuilt engine's place in t.engine (its device, pad and eos ids went into it)."""
    cfg, g = t.cfg, ulysses.group(t.cfg.actor.ulysses_sequence_parallel_size)
    t.engine = rollout_async.start(cfg, t.engine, model=t.actor.model, prompt_len=t.prompt_len, dp=g.dp_size,
                                   dp_rank=g.dp_rank, version=step, stashes=actor.policy_stashes(t.actor))
    if t.rank == 0:
        print("\n".join(rollout_async.describe(t.engine)), flush=True)


def last_validation(t: Trainer, metrics_path: str, log):
    """The held-out score of the trained policy (after --steps updates): a metrics line of its own."""
    m = {"step": t.cfg.steps}
    with in_ledger(t, m, "val"):
        held_out(t, t.cfg.steps, m)
    m = ledger.reduce(m, t.device)
    if t.rank == 0:
        rundir.on_rank0(rundir.write_step, metrics_path, log, m, t.cfg.steps)
        print(f"validation after step {t.cfg.steps} | " + " | ".join(
            f"{k}={v:.4g}" for k, v in m.items() if k in ("val/reward_mean", "val/strict", "val/flexible",
                                                         "val/response_length", "time/val")), flush=True)


# --------------------------------------------------------------------------- saving
def save(t: Trainer, step: int):          # a checkpoint after `step` steps, with the run's place in its data
    checkpoint.save(t.cfg.out_dir, step, trained(t.actor, t.critic), t.cfg.keep_checkpoints, {
        "prompts_seen": prompts_walked(t, step), "data": t.fingerprint,
        "policy_version": step,            # updates so far (async rollout: what a resume pushes to the engines)
        "world_size": t.world, "config": asdict(t.cfg), "engine_prompt_len": t.prompt_len},
        optimizer=t.cfg.save_optimizer)
    t.saved = step


def final_record(t: Trainer) -> dict:
    """final/run_config.json: the run's config, its world size and the prompt length its engine was built for
    (evaluate.py builds the same engine: greedy answers can differ between engines of other batch shapes)."""
    return {**asdict(t.cfg), "world_size": t.world, "engine_prompt_len": t.prompt_len}


def keep(t: Trainer) -> str:            # after a stop or an error: the weights trained so far, kept (rundir.keep)
    def final_at(n):
        checkpoint.save_final(t.cfg.out_dir, t.actor, t.tokenizer, final_record(t), t.cfg.model, steps_done=n,
                              save=actor.save)
    return rundir.keep(t.cfg, t.updates, t.saved, t.updating, checkpoint_at=lambda n: save(t, n), final_at=final_at)


def resume(t: Trainer, path: str) -> int:
    """Load the checkpoint at `path` into the roles; returns the step to start at."""
    meta = checkpoint.load(path, trained(t.actor, t.critic), asdict(t.cfg), t.world)
    t.data_offset = meta["prompts_seen"] - meta["step"] * t.cfg.train_batch_size   # 0 unless the batch size changed
    t.updates = t.saved = meta["step"]
    return meta["step"]


# --------------------------------------------------------------------------- main
@record           # a crash's traceback reaches torchrun's summary (its "Root Cause")
def main(argv=None):
    """The command line: --help, the options, the engine ranks' exit (async rollout), the run, and every
    failure as one `error:` line with its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        if int(os.environ.get("RANK", 0)) == 0:   # once under torchrun
            print(options.usage(options.sections(Config())))
        return
    rank, cfg = int(os.environ.get("RANK", 0)), None
    try:
        cfg = options.parse_args(argv)
        nproc = int(os.environ.get("WORLD_SIZE", 1))
        rollout_engine.check(cfg.rollout, nproc, cfg.train_batch_size)   # before any rank leaves
        if rollout_engine.is_engine_rank(cfg.rollout):   # one of torchrun's last rollout.gpus ranks
            launch.leave(rollout_engine.engine_rank(cfg.rollout))
        rollout_engine.trainer_allocator(cfg.rollout)    # async: before this process's first CUDA allocation
        run(cfg, rank)
    except rollout_engine.EngineDied as e:  # async rollout: an engine process failed or exited
        launch.fail(f"error: {e}", rank, 1)
    except StageOutOfMemory as e:          # the stage, the ledger, the plan, the change; a snapshot beside it
        snapshot = os.path.join(cfg.out_dir, f"oom_snapshot.rank{rank}.pickle")
        launch.fail(f"error: {e} (memory snapshot: {snapshot})", rank, 1)
    except (ValueError, OSError) as e:     # bad input, an unwritable or full disk: what to change
        launch.fail(f"error: {e}", rank)
    except RuntimeError as e:              # a timed-out collective (gloo raises; NCCL's watchdog aborts)
        if not any(w in str(e).lower() for w in ("timed out", "timeout")):
            raise
        launch.fail(f"error: a collective waited more than --dist_timeout_s={cfg.dist_timeout_s:g} s for the other "
                    f"ranks (one is stalled or dead): {str(e).strip().splitlines()[0][:200]}", rank)
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: Config, rank: int):
    """One run once its options are read: out_dir's lock, the pre-flight, the set-up, the steps, the end."""
    with launch.claimed(cfg.out_dir, rank):  # one run per out_dir (rank 0's lock) before any write; gone if refused
        rundir.exit_on_sigint()              # Ctrl-C before the first step: one line, no traceback
        (data, val), start = preflight(cfg)
        t = setup(cfg, data=data, val=val)   # refused there too (host RAM, disk): the out_dir as it was found
        rundir.reserve_final(cfg, t.actor, t.rank)   # --save_freq=0: final/'s room, before the first step
    if t.rank == 0:
        resolved = {"resolved_config": asdict(cfg), "world_size": t.world, "device": str(t.device)}
        print(json.dumps(resolved, indent=1))
        rundir.write_run_config(cfg.out_dir, resolved)
    try:
        with vllm_engine.frozen_heap():    # the set-up's objects left out of each step's full collection
            finished = train(t, resume(t, start) if start else 0)
    except (ValueError, OSError, StageOutOfMemory, rollout_engine.EngineDied) as e:   # the weights kept first
        # (only where every rank raised it: the others may be inside a collective; a dead engine reaches
        # every rank through rank 0's broadcast, rollout_async.take / push / greedy)
        if t.world == 1 or isinstance(e, (data_io.EveryRank, rollout_engine.EngineDied)):
            e.args = (f"{e.args[0] if e.args else e}; {keep(t)}",)
        raise
    failed = rundir.failure(t.device)      # a write that failed on rank 0 (metrics.jsonl, the logger's copy)
    if failed or not finished:             # a failed write, SIGTERM or Ctrl-C: the weights kept, then said
        where = keep(t)
        if failed:
            raise OSError(f"{failed}; {where}")
        line, code = rundir.stop_line(cfg, t.updates, where)
        if t.rank == 0:
            print(line, flush=True)
        sys.exit(code)
    if t.rank == 0:
        print("\n".join(rundir.summary(os.path.join(cfg.out_dir, "metrics.jsonl"))), flush=True)
        tracker.picture_at_end(cfg.out_dir, t.device.type)   # <out_dir>/memory.png on a GPU
    if cfg.save:
        checkpoint.save_final(cfg.out_dir, t.actor, t.tokenizer, final_record(t), cfg.model, steps_done=t.updates,
                              save=actor.save)
    if t.rank == 0:
        print(rundir.finished_line(cfg, t.updates), flush=True)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:                # launch.fail()'s one line (1, 2), a preemption's 143 or Ctrl-C's 130
        # left inside the handler, which still holds the failed run: freed first, a gloo group's destructor
        # could wait on a rank that is itself waiting to be stopped (rank 0 outlived its line: a killed engine)
        launch.leave(0 if e.code is None else e.code if isinstance(e.code, int) else 1)
    launch.leave(0)
