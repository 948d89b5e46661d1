"""The policy: its update (its loss math: losses.py; AdamW and its step: adam.py), LoRA, and every move of the
actor's own bytes.

    python -m pytest tests/test_algo.py          # the loss math against hand-computed values
    torchrun --nproc_per_node=2 -m pytest tests/test_dist.py   # 2 ranks == 1 rank
    python train_grpo.py --actor.lora_rank=16 --actor.lr=1e-3   # LoRA: adapters train, the base is the ref

What it holds on the GPU: its fp32 shards, their grads during the update, Adam's two moments
(2 x the fp32 shards, born at the first step), and a layer's gathered bf16 weights in a forward.
What it moves, and when (its offload groups `Actor.params`, `Actor.base`, `Actor.adam`; each
stash knows at build whether its flag puts it on the host, so every bracket reads the same):
    param_offload       fp32 shards live in pinned host memory between uses. In for the weight sync
                        (rollout.py loads and frees `[a.base, a.params]`), for old log-probs
                        (`compute_old_log_probs`) and for the update (`update`); forward-only uses
                        free them without a copy back.
    optimizer_offload   Adam's exp_avg + exp_avg_sq live on the host outside `update`, back on a side
                        stream during the first forward/backward (`clipped_step` waits right before
                        `optimizer.step()`), or with optimizer_stream a window of layers at a time at the
                        step (adam.streamed_step): then the update never holds all of them.
    the levers          prefetch_update (during the ref forward), defer_param_offload (`update` keeps the
                        params for the next sync), optimizer_load_at_step (Adam in at the step, not before).
    checkpoints         `state_in`: every group in while a checkpoint reads (or a resume writes) them.

LoRA (lora_rank > 0, lora.py): only the adapters train (grads and Adam for them alone); the frozen base, in the
compute dtype, is the reference (`compute_ref_log_probs`: adapter off). The params group splits: `Actor.params`
(the adapters) and `Actor.base` (copied out once, at build; later brackets only free it). The planner's: `predicted`.
Batches: rollout.make_batch's dicts (old_log_probs, ref_log_probs, advantages (B, R) as their stages add them).
"""
import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import lora
import offload
import packing
import ulysses
import weights
from adam import (born_on_host, build_optimizer, clipped_step, holding, optimizer_stash, optimizer_windows,
                  row_slices, update_phases, window_peak, window_sizes)
from losses import (IS_STATS, KL_TYPES, LOSS_AGG_MODES, STATS, actor_loss, global_counts, logprob_mismatch, probe,
                    split)
from model import ForwardSettings, all_sum, compute_log_probs, forward, in_use, load_model, make_layout, shard, state


@dataclass
class ActorConfig:
    lr: float = 2e-4                       # tiny model from scratch; real models use ~1e-6
    weight_decay: float = 0.0              # AdamW's decoupled weight decay
    grad_clip: float = 1.0                 # max global grad norm; a non-finite norm skips the step
    ppo_mini_batch_size: int = 16          # prompts per optimizer step (x n samples, split over ranks)
    ppo_micro_batch_size_per_gpu: int = 16  # samples per forward/backward (gradient accumulation)
    ppo_epochs: int = 1                    # passes over each step's batch (more than 1: off-policy)
    shuffle: bool = False                  # mix the samples across mini-batches (TRL does), not whole groups a step
    log_prob_micro_batch_size_per_gpu: int = 32  # samples per forward for old log-probs
    clip_ratio_low: float = 0.2            # the ratio is clipped below at 1 - this
    clip_ratio_high: float = 0.2           # ... and above at 1 + this
    clip_ratio_c: float = 3.0              # dual-clip bound for negative advantages
    rollout_is: str = "auto"               # token: each token's loss x min(pi_old / pi_rollout, threshold), truncated
                                           # importance sampling against the engine's log-probs (verl's rollout
                                           # correction) | none; auto: token with rollout.mode=async or an FP8 engine
    rollout_is_threshold: float = 2.0      # the truncation C of those weights
    loss_agg_mode: str = "token-mean"      # or seq-mean-token-sum, seq-mean-token-mean
    entropy_coeff: float = 0.0             # weight of the entropy bonus in the loss
    use_kl_loss: bool = True               # KL to the reference policy in the loss (needs ref)
    kl_loss_coef: float = 0.001            # weight of the KL-to-reference term in the loss
    kl_loss_type: str = "low_var_kl"       # kl|k1, abs, mse|k2, low_var_kl|k3
    param_offload: bool = False            # shards to pinned host between uses (manual bracket)
    param_offload_layers: int = -1         # with param_offload: only the first k decoder layers (-1: all)
    optimizer_offload: bool = False        # Adam state to pinned host between updates
    prefetch_update: bool = True           # GRPO with param_offload: params come in during the ref
                                           # forward (hides the copy; the ref stage holds them too)
    defer_param_offload: bool = True       # with param_offload: params stay after the update until the next
                                           # weight sync, which copies them out (one reload fewer per step)
    optimizer_load_at_step: bool = False   # with optimizer_offload: Adam comes in just before optimizer.step (verl
                                           # #5282): the update's peak loses the activations, the copy is not hidden
    optimizer_stream: bool = False         # with optimizer_offload: Adam steps a window of layers at a time, each
                                           # window's state in and out on side streams: the step's peak holds ~3
                                           # windows of Adam instead of all of it (8 bytes a param), same numbers
    optimizer_window_layers: int = 1       # with optimizer_stream: decoder layers a window
    optimizer_row_windows: bool = False    # with optimizer_stream: the embeddings and an untied LM head step in row
                                           # slices no larger than a window of layers (adam.Rows, the same numbers):
                                           # a layers' window (1.86 GB at 7B), not theirs (4.06), sets the step's peak
    offload_policy: bool = False           # FSDP2 CPUOffloadPolicy instead: params+grads+Adam live on CPU
    gradient_checkpointing: bool = True    # recompute each layer's activations in backward: at 0.5B, micro-batch 32 x
                                           # 320 tokens, the update's peak 25 -> 12 GB for +0.2 s (verl's and TRL's
                                           # default too); --offload=auto turns it off where memory allows
    # LoRA (peft): only low-rank adapters train; the frozen base with the adapter off is the reference
    lora_rank: int = 0                     # 0: off (full fine-tuning); r > 0: adapters of rank r
    lora_alpha: int = 16                   # the adapter's scale is lora_alpha / lora_rank
    lora_target_modules: str = "all-linear"  # comma-separated projections, or all-linear: q,k,v,o_proj and
                                           # gate,up,down_proj of every decoder layer (dropout is always 0)
    save_merged: bool = False              # with lora_rank: the final save also writes base + adapter merged,
                                           # as a Hugging Face model, to <save dir>/merged
    param_dtype: str = ForwardSettings.param_dtype   # compute dtype on GPU; master weights stay fp32 (CPU: fp32)
    embeddings_apart: bool = ForwardSettings.embeddings_apart   # the embeddings and an untied head FSDP2 units apart
    # how samples go through the model (packing.py) in every role of this architecture; defaults: ForwardSettings'
    remove_padding: bool = ForwardSettings.remove_padding   # pack each micro-batch into one row: no compute on padding
    logits_chunk_tokens: int = ForwardSettings.logits_chunk_tokens   # LM head on response tokens only, this
                                           # many at a time: one (chunk, vocab) fp32 block, recomputed in backward
                                           # (0: all at once, kept for backward)
    use_dynamic_bsz: bool = ForwardSettings.use_dynamic_bsz   # micro-batches filled to a token budget, not a count
    ppo_max_token_len_per_gpu: int = 16384     # with use_dynamic_bsz: tokens per update micro-batch
    log_prob_max_token_len_per_gpu: int = 32768  # with use_dynamic_bsz: tokens per old-log-prob forward
    ulysses_sequence_parallel_size: int = ForwardSettings.ulysses_sequence_parallel_size   # k ranks split
                                           # each packed row (ulysses.py): activations and LM-head tokens per
                                           # rank / k, two all-to-alls a layer; data-parallel size world / k (all roles)


# What each option may be, checked when the command line is parsed: outside these a run trains
# nothing (a zero clip, zero epochs), divides by zero, or crashes in the middle.
RANGES = {"lr": ">= 0", "weight_decay": ">= 0", "grad_clip": "> 0", "ppo_mini_batch_size": ">= 1",
          "ppo_micro_batch_size_per_gpu": ">= 1", "ppo_epochs": ">= 1", "log_prob_micro_batch_size_per_gpu": ">= 1",
          "clip_ratio_low": "[0, 1)", "clip_ratio_high": ">= 0", "clip_ratio_c": "> 1", "entropy_coeff": "any",
          "kl_loss_coef": ">= 0", "param_offload_layers": ">= -1", "logits_chunk_tokens": ">= 0",
          "ppo_max_token_len_per_gpu": ">= 1", "log_prob_max_token_len_per_gpu": ">= 1", "lora_rank": ">= 0",
          "lora_alpha": "> 0", "ulysses_sequence_parallel_size": ">= 1", "rollout_is_threshold": "> 0",
          "optimizer_window_layers": ">= 1"}
CHOICES = {"loss_agg_mode": LOSS_AGG_MODES, "kl_loss_type": KL_TYPES, "rollout_is": ("auto", "token", "none"),
           "param_dtype": ("bfloat16", "float16", "float32")}
SEARCH = {  # what --offload=auto may turn (plan.py), cheapest first; NEEDS: a flag that only acts with another
    "gradient_checkpointing": (False, True), "param_offload": (False, True), "optimizer_offload": (False, True),
    "optimizer_load_at_step": (False, True), "optimizer_stream": (False, True)}
NEEDS = {"optimizer_load_at_step": "optimizer_offload", "optimizer_stream": "optimizer_offload"}
SUPERSEDES = {"optimizer_stream": "optimizer_load_at_step"}   # on, it makes the other needless (plan.py)
LIFTED = ("gradient_checkpointing",)    # on by default, off when the run fits without it (plan.relax)
SIZES = {  # the sizes plan.py searches beside SEARCH, by kind (fit.SIZE_KINDS)
    "ppo_micro_batch_size_per_gpu": "update",           # the update's micro-batch, halved
    "log_prob_micro_batch_size_per_gpu": "forward",     # a log-prob forward's: one size for every role's forward
    "ulysses_sequence_parallel_size": "sequence"}       # the Ulysses group (ulysses.sizes)
RESCUE = {  # what plan.py names when no combination of SEARCH fits
    "lora_rank": (64, "train adapters only: no ref model, grads and Adam for the adapters"),
    "offload_policy": (True, "FSDP2 CPUOffloadPolicy: ~10x slower step")}
CHECKPOINT_RELIEF = "--actor.optimizer_offload=true --actor.optimizer_stream=true"   # Adam stays on the host at one
RELIEF = {  # the actor's terms of a stage's prediction -> the change that removes or shrinks it
    "actor_params": "--actor.param_offload=true", "actor_optimizer": "--actor.optimizer_offload=true",
    "actor grads": "--actor.offload_policy=true (grads and Adam on the CPU: much slower) or more GPUs",
    "activations": "--actor.gradient_checkpointing=true (or a smaller actor.ppo_micro_batch_size_per_gpu)",
    "activations (layer inputs)":
        "a smaller actor.ppo_micro_batch_size_per_gpu (or use_dynamic_bsz with a token budget)",
    "activations (one layer rebuilt)": "a smaller actor.ppo_micro_batch_size_per_gpu",
    "LM head chunk (backward)": "a smaller actor.logits_chunk_tokens", "LM head weight grad": "--actor.lora_rank=64",
    "Adam windows (in, stepping, out)": "a smaller actor.optimizer_window_layers"}


def check(cfg: ActorConfig, world: int):
    """The combinations of options that cannot run (each option alone is checked at parse time)."""
    if cfg.offload_policy and (cfg.param_offload or cfg.optimizer_offload):
        raise ValueError("actor.offload_policy (FSDP2 CPUOffloadPolicy) already keeps params and Adam state "
                         "on the CPU; turn actor.param_offload / actor.optimizer_offload off")
    if cfg.optimizer_stream and not cfg.optimizer_offload:
        raise ValueError("actor.optimizer_stream steps Adam a window at a time from the host: it needs "
                         "--actor.optimizer_offload=true (without it the state stays on the GPU)")
    if cfg.ulysses_sequence_parallel_size > 1 and not cfg.remove_padding:
        raise ValueError("actor.ulysses_sequence_parallel_size splits packed rows: keep actor.remove_padding=true")


def prefetches(cfg: ActorConfig, ppo: bool) -> bool:
    """With param_offload, the params come in during the ref stage and stay for the update (prefetch_update) when a
    ref forward comes right before it (GRPO with the KL loss, not PPO). The loop, describe and the planner read it."""
    return cfg.prefetch_update and cfg.param_offload and cfg.use_kl_loss and not ppo


def on_policy(cfg: ActorConfig, train_batch_size: int) -> bool:
    """One epoch over one mini-batch of the whole batch: the update's first forward is the policy that
    sampled, so the old log-probs are its own (detached) and the old_logp stage is skipped (the planner's rule too)."""
    return cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size == train_batch_size


# --------------------------------------------------------------------------- the actor's state
@dataclass
class Actor:
    """The policy's state (made by `build`): the FSDP2 model, AdamW, and its offload groups."""
    cfg: ActorConfig
    model: torch.nn.Module                 # the HF model (with LoRA: its target layers hold the adapters)
    optimizer: torch.optim.Optimizer
    params: offload.Stash                  # local shards that train: all, or the first k layers'
                                           # (param_offload_layers); with LoRA the adapters only
    base: offload.Stash                    # LoRA: the frozen base's shards (bf16 on a GPU), never copied back; or empty
    adam: offload.Stash                    # exp_avg + exp_avg_sq: empty until Adam's first step
    device: torch.device
    lora: object = None                    # LoRA: peft's wrapper around `model` (disable_adapter, the config)
    windows: list | None = None            # optimizer_stream: the params Adam steps together (adam.optimizer_windows)


def build(cfg: ActorConfig, *, mesh, device: torch.device, model_path: str | None = None, seed: int = 0,
          model: torch.nn.Module | None = None) -> Actor:
    """Load (or take `model`, an HF causal LM already built, fp32), add the LoRA adapters
    (lora_rank > 0), shard, make the optimizer; with param_offload the shards leave the GPU at once."""
    model = model if model is not None else load_model(model_path, seed=seed)
    adapters = lora.apply(model, cfg, device) if cfg.lora_rank else None   # before fully_shard: it shards peft's
    model = shard(model, mesh, device, cfg.offload_policy, cfg.param_dtype, cfg.gradient_checkpointing,
                  embeddings_apart=cfg.embeddings_apart)
    if adapters:
        lora.settle_grad_dtypes(model)
    k = cfg.param_offload_layers           # partial offload: only the first k decoder layers' shards
    groups = [model] if k < 0 else model.model.layers[:k]
    optimizer = build_optimizer(model, cfg)
    on = cfg.param_offload
    a = Actor(cfg, model, optimizer,
              params=offload.param_stash("actor_params", *groups, trainable=True if adapters else None, enabled=on),
              base=offload.param_stash("actor_base", *(groups if adapters else []), trainable=False, enabled=on),
              adam=optimizer_stash("actor_optimizer", optimizer, enabled=cfg.optimizer_offload),
              device=device, lora=adapters, windows=optimizer_windows(
                  model, optimizer, cfg.optimizer_window_layers, cfg.optimizer_row_windows)
              if cfg.optimizer_stream else None)
    offload.offload(a.base)                # frees the shard bytes until their first use (flags off: no-ops)
    offload.offload(a.params)
    return a


# --------------------------------------------------------------------------- what it says at set-up
def describe(a: Actor, ppo: bool = False) -> list[str]:
    """The set-up report's lines for the actor: LoRA, each offload flag with its bytes, when the
    offloaded groups move (`ppo`: the critic's stages sit between the ref forward and the update)."""
    c, lines = a.cfg, []
    if a.lora is not None:
        lines.append(lora.describe(a.model, a.cfg, a.base.nbytes))
    elif c.save_merged:
        lines.append("[actor] warning: actor.save_merged has no effect without actor.lora_rank "
                     "(the saved model is the whole policy)")
    # Adam holds exp_avg + exp_avg_sq like each local shard that trains (from shapes: the shards may be on the host)
    adam_bytes = 2 * sum(p.to_local().numel() * 4 for p in a.model.parameters() if p.requires_grad)
    k = c.param_offload_layers
    lines.append(offload.describe("actor.param_offload" + (f" (first {k} layers)" if k >= 0 else ""),
                                  a.params.nbytes + a.base.nbytes, c.param_offload, a.device))
    lines.append(offload.describe("actor.optimizer_offload (Adam, 2 x fp32 shard)", adam_bytes, c.optimizer_offload,
                                  a.device))
    timing, early = [], prefetches(c, ppo)  # the copy levers: when each offloaded group moves
    if c.param_offload:
        timing.append("params leave " + ("at the next weight sync (not after the update)" if c.defer_param_offload
                                         else "after the update")
                      + ("" if not early else " and stay after the ref forward (adapter off) for the update"
                         if a.lora else " and return during the ref forward"))
    if a.windows:                          # the largest window's Adam (both moments, fp32), ~3 of them at the step
        w = 8 * max(window_sizes(a.windows)) / offload.GB   # a row-windowed embeddings' slice, or layers'
        timing.append(f"Adam steps in {len(a.windows)} windows (by {c.optimizer_window_layers} layer(s)), in and out "
                      f"on side streams: ~3 x {w:.3f} GB at the step, not {adam_bytes / offload.GB:.3f} GB"
                      + (" (optimizer_load_at_step: superseded)" if c.optimizer_load_at_step else ""))
    elif c.optimizer_offload:
        timing.append("Adam returns " + ("just before optimizer.step" if c.optimizer_load_at_step
                                         else "on a side stream during the forward/backward"))
    if timing:
        lines.append("[offload] timing: " + "; ".join(timing))
    if c.ulysses_sequence_parallel_size > 1:
        lines.append(ulysses.describe(c.ulysses_sequence_parallel_size, a.model.config))
    if c.offload_policy:
        lines.append("[offload] actor.offload_policy: FSDP2 CPUOffloadPolicy, params, grads and Adam on pinned "
                     "host, copied per layer at all-gather; the optimizer steps on the CPU")
    return lines


# --------------------------------------------------------------------------- the stages
def policy_stashes(a: Actor) -> list:
    """What a forward of the policy needs in (GROUPS, the planner's names): the frozen base (LoRA) and the
    trained params. The loop lends them to the weight sync, the async push and validation."""
    return [a.base, a.params]


@contextlib.contextmanager
def resident(a: Actor, metrics: dict, keep: bool = False):
    """Params on the GPU for a forward-only use, freed after it (the host copy is current: no copy
    back), or left there for the next stage (`keep`). What the shared critic head borrows."""
    with offload.loaded(policy_stashes(a), metrics, keep=keep):
        yield


def compute_old_log_probs(a: Actor, batch: dict, temperature: float, train_batch_size: int, metrics: dict):
    """The old_logp stage: batch["old_log_probs"], in the params' bracket; nothing on-policy (`on_policy`:
    the update's first forward is the old policy, and the update reads the absence)."""
    if on_policy(a.cfg, train_batch_size):
        return
    layout = make_layout(a.cfg, a.cfg.log_prob_micro_batch_size_per_gpu, a.cfg.log_prob_max_token_len_per_gpu)
    with resident(a, metrics):
        batch["old_log_probs"] = compute_log_probs(a.model, batch, layout, temperature)
    if "rollout_log_probs" in batch:
        metrics.update(logprob_mismatch(batch["old_log_probs"], batch))


def compute_ref_log_probs(a: Actor, batch: dict, temperature: float, metrics: dict, ppo: bool) -> torch.Tensor:
    """LoRA's reference log-probs: the actor's forward with its adapter off (the frozen base, the policy at step 0),
    in its bracket; when it `prefetches` the params stay for the update (no copy to hide, one to save)."""
    layout = make_layout(a.cfg, a.cfg.log_prob_micro_batch_size_per_gpu, a.cfg.log_prob_max_token_len_per_gpu)
    with resident(a, metrics, keep=prefetches(a.cfg, ppo)), a.lora.disable_adapter():
        return compute_log_probs(a.model, batch, layout, temperature)


def prefetch_update(a: Actor, metrics: dict):
    """The prefetch_update lever: the update's params start in on a side stream during the ref forward (when
    the actor `prefetches`) and stay; `update` only waits for the copy. Not Adam: twice the bytes, hidden already."""
    for s in policy_stashes(a):
        metrics.update(offload.reload(s, background=True))


def update(a: Actor, batch: dict, mini_size: int, temperature: float, metrics: dict, seed: int = 0) -> dict:
    """The update stage's bracket: params in -> Adam in on a side stream (waited for in `clipped_step`) -> update ->
    Adam out -> params out, or kept until the next weight sync has read them (defer_param_offload)."""
    if a.cfg.shuffle:   # `seed`: the step's on every rank (Ulysses, a resume: alike); a batch copy, ~8 MB at 256 x 700
        order = torch.randperm(len(batch["responses"]), generator=torch.Generator().manual_seed(seed))
        batch = packing.take(batch, order)
    with offload.loaded(policy_stashes(a), metrics, modified=True, keep=a.cfg.defer_param_offload):
        if not (a.cfg.optimizer_load_at_step or a.windows):
            metrics.update(offload.reload(a.adam, background=True))   # overlaps the first forward/backward
        stats = update_policy(a.model, a.optimizer, batch, a.cfg, mini_size, temperature, adam=a.adam,
                              windows=a.windows)
        metrics.update(offload.offload(a.adam))   # frees 2 x fp32 shard bytes until the next update
    return stats


def update_policy(model, optimizer, batch: dict, cfg: ActorConfig, mini_size: int,
                  temperature: float, *, adam: offload.Stash | None = None, windows: list | None = None) -> dict:
    """PPO epochs over mini-batches of `mini_size` samples (this rank's share), each split into micro-batches whose
    gradients accumulate. Losses use the mini-batch's global token and sequence counts, times the world size (FSDP
    averages gradients over ranks): the same update for any micro-batch size and number of ranks. `adam`: Adam's
    stash, made ready right before each optimizer step (or streamed in a window at a time: `windows`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    on_policy = "old_log_probs" not in batch        # the old_logp stage was skipped: old == current
    batch = packing.host_lengths(batch)    # one host sync for the stage, none per micro-batch
    layout = make_layout(cfg, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu)
    sums = torch.zeros(len(STATS), device=batch["responses"].device, dtype=torch.float64)  # no syncs
    norms, mismatch, moved = [], [], {}
    before = probe(model)
    model.train()
    for _ in range(cfg.ppo_epochs):
        for mini in split(batch, mini_size):
            counts = global_counts(mini, layout.sp)
            optimizer.zero_grad(set_to_none=True)
            for rows in packing.micro_batches(mini, layout):
                mb = packing.take(mini, rows)
                loss, stats, logp = micro_loss(model, mb, cfg, temperature, layout, counts)
                (loss * world).backward()
                sums += stats
                if on_policy and "rollout_log_probs" in mb:   # this forward is the rollout policy
                    mismatch.append((logp, mb))
            norms.append(clipped_step(model, optimizer, cfg.grad_clip, adam, moved, "actor", windows))
    optimizer.zero_grad(set_to_none=True)           # frees the fp32 grad shards before the next stage
    sums = ulysses.once(sums, layout.sp)
    out = update_stats(model, before, sums, norms, mismatch, moved)
    return out if cfg.rollout_is == "token" else {k: v for k, v in out.items() if k not in IS_STATS}


def micro_loss(model, mb: dict, cfg: ActorConfig, temperature: float, layout: packing.Layout, counts: tuple):
    """One micro-batch's forward and its loss (losses.actor_loss: clipped PG - entropy bonus + KL), its STATS
    summed so far (no graph), and its log-probs (detached). `counts`: the mini-batch's global (tokens, sequences)."""
    logp, ent = forward(model, mb, temperature, layout, "grad" if cfg.entropy_coeff else "log")
    loss, stats = actor_loss(logp, ent, mb, cfg, counts)
    return loss, stats, logp.detach()


def update_stats(model, before: torch.Tensor, sums: torch.Tensor, norms: list, mismatch: list, moved: dict) -> dict:
    """The update's metrics: means over optimizer steps of global means, the grad norm, skipped
    steps, |delta w| on the probe, the offload figures, and the on-policy log-prob mismatch."""
    dw = (probe(model) - before).abs()
    dw_sums = torch.stack([dw.sum(), torch.tensor(float(dw.numel()), device=dw.device)]).to(sums)
    sums = all_sum(torch.cat([sums / len(norms), dw_sums]))
    out = dict(zip(STATS, sums.tolist()))
    finite = [n for n in norms if math.isfinite(n)] or [float("nan")]
    out.update(grad_norm=sum(finite) / len(finite), optimizer_steps=len(norms),
               skipped_steps=sum(not math.isfinite(n) for n in norms),
               delta_w_abs_mean=(sums[-2] / sums[-1]).item(), **moved)
    if mismatch:
        logp, mbs = torch.cat([lp for lp, _ in mismatch]), [mb for _, mb in mismatch]   # the on-policy forwards'
        out.update(logprob_mismatch(logp, {k: torch.cat([mb[k] for mb in mbs])
                                                  for k in ("response_mask", "rollout_log_probs")}))
    return out


# --------------------------------------------------------------------------- predicted
# The actor's bytes in the planner's terms (predict.py composes every role's; nothing here builds or
# moves anything): per rank, `z` a model.Sizes, a state group (name: its stash's) as (bytes on the GPU
# in use, between uses, in pinned host memory), a stage as its moments, each {term: bytes}.
GROUPS = ("actor_base", "actor_params")     # what a forward of the policy needs in (`policy_stashes`)


def predicted_states(cfg: ActorConfig, z, config) -> dict:
    """Full fine-tuning: fp32 shards and Adam's two moments (param_offload_layers: the first k layers' shards leave).
    LoRA: the frozen base in the compute dtype, the adapters fp32 and their Adam. CPUOffloadPolicy: all on the host."""
    s = z.shapes
    if cfg.lora_rank:
        n = lora.lora_param_count(config, cfg.lora_rank, cfg.lora_target_modules)
        out = {"actor_base": state(z.shard(s.params, z.c), cfg.param_offload),
               "actor_params": state(z.shard(n, 4), cfg.param_offload),
               "actor_optimizer": state(z.shard(n, 8), cfg.optimizer_offload)}
    else:
        k = s.layers if cfg.param_offload_layers < 0 else min(cfg.param_offload_layers, s.layers)
        p, part = z.shard(s.params, 4), z.shard(k * s.layer_params + (s.root_params if k == s.layers else 0), 4)
        out = {"actor_params": (p, p - part, part) if cfg.param_offload else (p, p, 0),
               "actor_optimizer": state(z.shard(s.params, 8), cfg.optimizer_offload)}
    if cfg.offload_policy:
        out = {g: (0, 0, u * (2 if g == "actor_params" else 1)) for g, (u, b, h) in out.items()}
    return out


def predicted_forward(cfg: ActorConfig, z, states: dict) -> list:
    """A log-prob forward: old_logp (not on-policy), and LoRA's reference (its adapter off)."""
    layout = make_layout(cfg, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_max_token_len_per_gpu)
    return [{**in_use(states, *GROUPS), **z.forward(layout)}]


def predicted_update(cfg: ActorConfig, z, states: dict) -> list:
    layout = make_layout(cfg, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu)
    n, params, adam = z.tokens(layout), in_use(states, *GROUPS), in_use(states, "actor_optimizer")
    grads = {"actor grads": states["actor_params"][0]}     # fp32 shards of what trains (host-side with the policy)
    busy = {**z.shapes.activations(n, z.c, cfg.gradient_checkpointing), "gathered layers + root": z.shapes.gather(z.c),
            "LM head chunk (backward)": z.head(n, layout, z.shapes.head[1])}
    if cfg.gradient_checkpointing:   # the head's backward ends before the last layer is rebuilt: only its excess adds
        head, rebuilt = busy["LM head chunk (backward)"], busy["activations (one layer rebuilt)"]
        busy["LM head chunk (backward)"] = max(0, head - rebuilt)
    held = {**params, **({} if cfg.optimizer_load_at_step else adam)}
    if cfg.optimizer_stream and cfg.optimizer_offload:   # the step holds ~3 windows of Adam, never all of it
        held, adam = params, {"Adam windows (in, stepping, out)": predicted_windows(cfg, z, states)}
    phases = update_phases(held, grads, busy, z.accumulating(layout), {**params, **adam, **grads})
    if not cfg.lora_rank:   # a backward's end: the largest end unit's grads (model.Shapes.end) in fp32 for FSDP's
        # reduce, beside every grad (measured at 7B on an H100, one root: the update's peak, 65.05 GB at micro 2 and 4)
        phases.append({**held, **grads, "gathered layers + root": busy["gathered layers + root"],
                       "the largest end's grads in the reduce (fp32)": 4 * z.shapes.end})
    if cfg.gradient_checkpointing and not z.accumulating(layout):
        phases.append({**held, **last_layer_backward(cfg, z, n, grads["actor grads"], busy["gathered layers + root"])})
    return phases


def last_layer_backward(cfg: ActorConfig, z, n: int, grads: int, gathered: int) -> dict:
    """A checkpointed update's peak (a snapshot at 1.5B, bench/README.md): the last layer at the end of its backward,
    every layer's grads reduced, its rebuilt set still held, the LM head's weight grad (unsharded) not yet reduced."""
    s = z.shapes
    return {"actor grads": grads if cfg.lora_rank else grads * s.layers * s.layer_params // s.params,
            "activations (one layer rebuilt)": n * (s.saved_per_token(z.c) + z.c * (s.ffn + 2 * s.hidden)),
            "LM head weight grad": 0 if cfg.lora_rank else z.c * s.vocab * s.hidden, "gathered layers + root": gathered}


def predicted_windows(cfg: ActorConfig, z, states: dict, over=window_peak) -> int:
    """Adam's bytes on a rank at a streamed step's worst moment (0: not streamed): `over` (adam.window_peak; max:
    the largest) the windows of optimizer_windows (the embeddings, k layers each, the final norm, an untied LM head;
    optimizer_row_windows: the embeddings and the head in row slices no larger than k layers, adam.row_slices)."""
    if not (cfg.optimizer_stream and cfg.optimizer_offload):
        return 0
    s, k = z.shapes, min(cfg.optimizer_window_layers, z.shapes.layers)
    if cfg.lora_rank:
        return over([states["actor_optimizer"][0] * k // s.layers] * -(-s.layers // k))
    layers = [k * s.layer_params] * (s.layers // k) + ([s.layers % k * s.layer_params] if s.layers % k else [])
    table = [(b - a) * s.hidden for a, b in row_slices(s.vocab, s.hidden, layers[0])] if cfg.optimizer_row_windows \
        else [s.vocab * s.hidden]
    sizes = table + layers + [s.hidden] + ([] if s.tied else table)
    return over([z.shard(n, 8) for n in sizes])


def predicted_copy_seconds(cfg: ActorConfig, z, states: dict, ppo: bool, bandwidth: float) -> float:
    """The actor's copies that do not hide behind compute: params out at the sync and in again (behind the ref forward
    when it `prefetches`), Adam in (behind the forward/backward, or at the step) and out; CPUOffloadPolicy's CPU
    step."""
    host = {g: h for g, (u, b, h) in states.items()}
    if cfg.offload_policy:                     # 16.2 s for 1.54B params on one H200 host
        return 10.5e-9 * z.shapes.params / max(z.world, 1) + 1.5 * host["actor_params"] / bandwidth
    exposed = host["actor_params"] * (1 + (0.25 if prefetches(cfg, ppo) else 1)) + host.get("actor_base", 0)
    exposed += host["actor_optimizer"] * (1 + (1 if cfg.optimizer_load_at_step and not cfg.optimizer_stream
                                               else 0.5))   # in: half hidden (the stream's windows too: not measured)
    return exposed / bandwidth


def predicted_checkpoint(cfg: ActorConfig, z, states: dict, optimizer: bool = True) -> list:
    """A checkpoint's bracket (`state_in`): fp32 params, all of Adam and a load's zero grads (torch's helper makes
    a fresh optimizer's state with them); optimizer_stream: params and a window (Adam stays on the host). Without
    `optimizer` (--save_optimizer=false) the params alone: a resume leaves AdamW to make its state at the step."""
    if not optimizer:
        return [in_use(states, *GROUPS)]
    if cfg.optimizer_stream and cfg.optimizer_offload:
        return [{**in_use(states, *GROUPS), "Adam window + its zero grads (a load)": predicted_windows(cfg, z, states)}]
    return [{**in_use(states, *GROUPS, "actor_optimizer"), "zero grads (a load)": states["actor_params"][0]}]


# --------------------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def state_in(a: Actor, loading: bool = False, optimizer: bool = True):
    """A checkpoint's bracket (`predicted_checkpoint`): params and Adam on the device while torch's state-dict
    helpers read (a save) or write (a load) the live tensors, then back where they were (docs/runs.md);
    optimizer_stream: Adam stays on the host, where DCP reads and writes it (`adam.born_on_host`). Without
    `optimizer` (--save_optimizer=false) Adam stays where it is, and a load leaves it unmade."""
    with holding(policy_stashes(a) + ([] if a.windows or not optimizer else [a.adam]), loading):
        if optimizer:
            born_on_host(a.optimizer, a.adam, a.windows)
        yield


def save(a: Actor, tokenizer, path: str, rank: int, model_path: str | None = None) -> str:
    """The final checkpoint in `path`: the policy as a Hugging Face model; LoRA: the adapter in peft's format (and
    with save_merged the merged model in path/merged). From a local `model_path` the input's other files (tokenizer,
    generation config) are copied as they were. Returns what it wrote."""
    with resident(a, {}):
        if a.lora is None:
            weights.save_hf(a.model, tokenizer, path, rank, a.device, model_path=model_path)
            return "safetensors + config + tokenizer"
        weights.save_adapter(a.model, a.lora.peft_config, tokenizer, path, rank, a.device)
        if a.cfg.save_merged:              # in the base's dtype (bf16 on a GPU), as peft's merge_and_unload gives
            base_dtype = next(p.dtype for p in a.model.parameters() if not p.requires_grad)
            weights.save_hf(a.model, tokenizer, os.path.join(path, "merged"), rank, a.device, base_dtype, model_path)
    return "LoRA adapter: adapter_model.safetensors + adapter_config.json + tokenizer" + \
        ("; merged model in merged/" if a.cfg.save_merged else "")
