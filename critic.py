"""The critic for PPO: a value per response token, GAE, a clipped value loss, its own offload flags.

    python train_grpo.py --algorithm.adv_estimator=gae                          # PPO, separate critic
    python train_grpo.py --algorithm.adv_estimator=gae --critic.mode=shared     # value head on the actor
    python -m pytest test_critic.py -q

Two modes:
- "separate" (verl's critic): a causal-LM trunk with a scalar head per token
  (`AutoModelForTokenClassification`, num_labels=1), initialised from the actor's checkpoint (or
  the tiny default), FSDP2-sharded like the actor, with its own Adam, `param_offload` and
  `optimizer_offload`. It costs a second model: params + grads + Adam state of a whole LM.
- "shared" (what the second article calls `share_actor_weights`; verl has no such option): one
  Linear(hidden, 1) head reads the actor's final hidden states; no second model is held. What
  changes: the values come from the policy's features, and the head trains on them detached, so
  the value loss never moves the trunk (the policy is trained by the policy loss alone, exactly
  as with GRPO); the critic's capacity is one linear layer. The values stage is an extra actor
  forward; the critic update reuses the features saved there and needs no forward at all.

What it moves (separate mode; the shared head is a few KB and never moves): with param_offload
its fp32 shards come in for the values stage (freed after, no copy back) and for the critic
update (copied back out); with optimizer_offload its Adam state comes in on a side stream
during the update's forward/backward and is waited for right before the step, like the actor's.
In shared mode the values stage needs the actor's trunk: it asks the actor for it
(`actor.resident`). A checkpoint brings the critic's params and Adam in and out again through
`state_in`, like the actor's.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import actor
import offload
import packing


@dataclass
class CriticConfig:
    mode: str = "separate"                 # separate | shared (see the module docstring)
    lr: float = 1e-3                       # tiny model from scratch; real critics use ~1e-5
    weight_decay: float = 0.0              # AdamW's decoupled weight decay
    grad_clip: float = 1.0                 # max global grad norm; a non-finite norm skips the step
    cliprange_value: float = 0.5           # new values stay within old +- this in the clipped loss
    loss_agg_mode: str = "token-mean"      # or seq-mean-token-sum, seq-mean-token-mean
    ppo_micro_batch_size_per_gpu: int = 16  # samples per forward/backward of the critic update
    forward_micro_batch_size_per_gpu: int = 32  # samples per forward of the values stage
    ppo_max_token_len_per_gpu: int = 16384     # with actor.use_dynamic_bsz: tokens per update micro-batch
    forward_max_token_len_per_gpu: int = 32768  # with actor.use_dynamic_bsz: tokens per values forward
    gamma: float = 1.0                     # GAE discount
    lam: float = 1.0                       # GAE lambda
    param_offload: bool = False            # separate mode: trunk shards to pinned host between uses
    optimizer_offload: bool = False        # separate mode: Adam state to pinned host between updates
    gradient_checkpointing: bool = True    # separate mode: recompute each layer in backward (as verl's critic):
                                           # at 1.5B, micro 16 x 320 tokens, the update's activations 14.8 -> 0.8 GB


# checked when the command line is parsed (train_grpo.check_config)
RANGES = {"lr": ">= 0", "weight_decay": ">= 0", "grad_clip": "> 0", "cliprange_value": "> 0",
          "ppo_micro_batch_size_per_gpu": ">= 1", "forward_micro_batch_size_per_gpu": ">= 1",
          "gamma": "[0, 1]", "lam": "[0, 1]", "ppo_max_token_len_per_gpu": ">= 1",
          "forward_max_token_len_per_gpu": ">= 1"}
CHOICES = {"mode": ("separate", "shared"), "loss_agg_mode": actor.LOSS_AGG_MODES}


# --------------------------------------------------------------------------- math
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE over (B, R) token rewards and values. Masked positions are skipped: the next value and
    the running advantage are carried through them unchanged. Returns (advantages, returns),
    advantages not yet whitened; returns = advantages + values."""
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        next_value = values[:, t] * m + (1 - m) * next_value
        running = step * m + (1 - m) * running
        out.append(running)
    adv = torch.stack(out[::-1], dim=1)
    return adv * mask, (adv + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the valid tokens of ALL ranks (unbiased variance), zero on padding.
    Two passes in float64, the mean first, then the squared deviations from it: one pass of
    E[x^2] - mean^2 in fp32 loses every digit of the variance when |mean| >> std."""
    xd, md = x.double(), mask.double()
    s = actor.all_sum(torch.stack([(xd * md).sum(), md.sum()]))
    mean = s[0] / s[1]
    var = actor.all_sum(((xd - mean).square() * md).sum()) / (s[1] - 1).clamp(min=1)
    return ((xd - mean) * torch.rsqrt(var + eps)).float() * mask


def value_loss(v, old_v, returns, mask, cfg: CriticConfig, tokens=None, seqs=None):
    """0.5 * agg(max((v - R)^2, (clip(v, old +- c) - R)^2)) and where the clip bit (B, R). v itself
    is clamped, as verl does: inside the range it stays exactly v (old + clamp(v - old) is not v
    in fp32, and ~1 % of unclipped tokens would count as clipped)."""
    clipped = torch.clamp(v, old_v - cfg.cliprange_value, old_v + cfg.cliprange_value)
    l1, l2 = (v - returns).square(), (clipped - returns).square()
    loss = 0.5 * actor.agg_loss(torch.maximum(l1, l2), mask, cfg.loss_agg_mode, tokens, seqs)
    return loss, (l2 > l1).float()


# --------------------------------------------------------------------------- build
@dataclass
class Critic:
    """The critic's state (made by `build`): the value model (or the shared head), its AdamW, and
    its offload groups."""
    cfg: CriticConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: offload.Stash
    adam: offload.Stash                    # empty until Adam's first step
    forward_layout: packing.Layout         # the values stage's micro-batches (and packing)
    update_layout: packing.Layout          # the update's


def build(cfg: CriticConfig, *, model_path, mesh, device, actor_cfg: actor.ActorConfig, actor_model=None,
          seed: int = 0) -> Critic:
    """Separate: a token-classification LM; shared: the value head only (on `actor_model`'s features).
    Compute dtype and forward settings (packing, token budgets) come from the actor's config."""
    param_dtype = actor_cfg.param_dtype
    if cfg.mode == "shared":
        torch.manual_seed(seed)
        head = torch.nn.Linear(actor_model.config.hidden_size, 1)
        torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)   # V = 0 at the start
        fully_shard(head, mesh=mesh, reshard_after_forward=True)   # FSDP averages its grads over ranks
        head.to(device)
    elif cfg.mode == "separate":
        head = actor.shard(load_value_model(model_path, seed), mesh, device, param_dtype=param_dtype,
                           gradient_checkpointing=cfg.gradient_checkpointing)
    else:
        raise ValueError(f"critic.mode={cfg.mode}: use separate or shared")
    optimizer = actor.build_optimizer(head, cfg)
    c = Critic(cfg, head, optimizer, offload.param_stash("critic_params", head),
               offload.optimizer_stash("critic_optimizer", optimizer),
               actor.make_layout(actor_cfg, cfg.forward_micro_batch_size_per_gpu, cfg.forward_max_token_len_per_gpu),
               actor.make_layout(actor_cfg, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu))
    for s in offloaded(c):
        offload.offload(s)                 # frees the critic's shard bytes until the values stage
    return c


def offloaded(c: Critic) -> list:
    """The critic's parameter groups that live on the host between uses (separate mode only)."""
    return [c.params] if c.cfg.param_offload and c.cfg.mode == "separate" else []


@contextlib.contextmanager
def state_in(c: Critic, loading: bool = False):
    """A checkpoint's bracket, as the actor's (`actor.state_in`): params and Adam on the device
    while the state-dict helpers read or write them, then back where they were (separate mode;
    the shared head never moves). Device cost for the checkpoint's length: params + 2 x params."""
    adam = [c.adam] if c.cfg.optimizer_offload and c.cfg.mode == "separate" else []
    with offload.holding(offloaded(c) + adam, loading):
        yield
        if loading:
            for group in c.optimizer.param_groups:   # this run's settings, not the checkpoint's
                group.update(lr=c.cfg.lr, weight_decay=c.cfg.weight_decay)


def check_model(path):
    """Before anything is built: transformers has a token-classification class (the separate
    critic's value head) for this model type."""
    if path is None or path.startswith("random:"):
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
    kind = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if kind not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(f"--model {path}: transformers has no token-classification model for "
                         f"model_type {kind!r} (the separate critic); use --critic.mode=shared")


def load_value_model(path, seed: int = 0):
    """The actor's architecture with a 1-output head per token (fp32 host weights)."""
    from transformers import AutoConfig, AutoModelForTokenClassification, Qwen2ForTokenClassification
    import tiny
    torch.manual_seed(seed)
    if path is None or path.startswith("random:"):
        config = tiny.tiny_config() if path is None else tiny.qwen25_config(path[7:])
    else:
        actor.check_model_path(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    # Set on the config, not passed to from_pretrained: model configs without a classifier_dropout
    # field (Qwen2's) reject it as a keyword. Without it the head gets dropout 0.1: noisy values.
    config.num_labels, config.classifier_dropout = 1, 0.0
    if path is None or path.startswith("random:"):
        with torch.device("cuda" if path and torch.cuda.is_available() else "cpu"):
            # fp32 master weights: the config's bf16 dtype reaches the trunk but not the new head
            return Qwen2ForTokenClassification(config).float()
    return AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=True, attn_implementation="sdpa")


# --------------------------------------------------------------------------- values
def _features(actor_model, mb: dict, packed: bool) -> torch.Tensor:
    """The actor's final normed hidden states at the positions that predict each response token
    (B, R, H), zero on padding, from a forward whose logits are cut to one position (no vocab-sized
    tensor)."""
    kw, at, p = packing.model_inputs(mb, packed)
    got = []
    hook = actor_model.model.norm.register_forward_hook(lambda m, i, o: got.append(o))
    try:
        actor_model(**kw, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    B, R = mb["responses"].shape
    h = got[0].reshape(-1, got[0].shape[-1]).index_select(0, at)             # (N, H)
    feats = h.new_zeros(B * R, h.shape[-1]).index_copy(0, packing.to_device(p["dst"], h.device), h)
    return feats.view(B, R, -1)


def _values(model, mb: dict, cfg: CriticConfig, packed: bool, features=None) -> torch.Tensor:
    """(B, R) values of the states before each response token, fp32, zero on padding."""
    if cfg.mode == "shared":
        return model(features.float())[..., 0] * mb["response_mask"]
    kw, at, p = packing.model_inputs(mb, packed)
    out = model(**kw, use_cache=False).logits                  # (B or 1, T, 1): one number per position
    B, R = mb["responses"].shape
    v = out.reshape(-1).index_select(0, at).float()            # (N,)
    return torch.zeros(B * R, dtype=torch.float32, device=v.device).index_put(
        (packing.to_device(p["dst"], v.device),), v).view(B, R)


def compute_values(c: Critic, batch: dict, a: "actor.Actor", metrics: dict):
    """The values stage's bracket: the critic's shards in (shared mode: the actor's trunk), values,
    then freed again without a copy back."""
    with actor.resident(a, metrics) if c.cfg.mode == "shared" else offload.loaded(offloaded(c), metrics):
        return values(c.model, batch, c.cfg, c.forward_layout, a.model)


@torch.no_grad()
def values(model, batch: dict, cfg: CriticConfig, layout: packing.Layout, actor_model=None):
    """Micro-batched values (B, R), in the batch's row order; in shared mode also the features
    (B, R, H; bf16 or fp32), kept for the critic update so that it needs no forward pass."""
    batch = packing.host_lengths(batch)    # one host sync for the stage, none per micro-batch
    resp = batch["response_mask"]
    vals = torch.zeros(resp.shape, dtype=torch.float32, device=resp.device)
    feats = None
    for rows in packing.micro_batches(batch, layout):
        mb = packing.take(batch, rows)
        f = _features(actor_model, mb, layout.pack) if cfg.mode == "shared" else None
        v = _values(model, mb, cfg, layout.pack, f)
        if rows.numel():
            vals[rows.to(vals.device)] = v
            if f is not None:
                feats = feats if feats is not None else f.new_zeros(*resp.shape, f.shape[-1])
                feats[rows.to(vals.device)] = f
    return vals, feats


# --------------------------------------------------------------------------- update
def update(c: Critic, batch: dict, mini_size: int, epochs: int, metrics: dict) -> dict:
    """The critic update's bracket: params in -> Adam in on a side stream (waited for right before
    the step) -> clipped value loss -> both out again (separate mode)."""
    adam = c.adam if c.cfg.optimizer_offload and c.cfg.mode == "separate" else None
    with offload.loaded(offloaded(c), metrics, modified=True):
        if adam is not None:
            metrics.update(offload.reload(adam, background=True))   # overlaps the first forward/backward
        stats = update_critic(c.model, c.optimizer, batch, c.cfg, c.update_layout, mini_size, epochs, adam)
        if adam is not None:
            metrics.update(offload.offload(adam))   # frees 2 x fp32 shard bytes until the next update
    return stats


def update_critic(model, optimizer, batch: dict, cfg: CriticConfig, layout: packing.Layout, mini_size: int,
                  epochs: int, adam: offload.Stash | None = None) -> dict:
    """Clipped value loss over the same mini-batches as the actor, gradients accumulated over
    micro-batches and normalised by global counts (invariant to micro-batch size and ranks).
    `adam`: the offloaded optimizer state, made ready right before each optimizer step."""
    device = batch["responses"].device
    world = dist.get_world_size() if dist.is_initialized() else 1
    batch = packing.host_lengths(batch)    # one host sync for the stage, none per micro-batch
    sums, norms, moved = torch.zeros(2, device=device, dtype=torch.float64), [], {}
    model.train()
    for _ in range(epochs):
        for mini in actor.split(batch, mini_size):
            tokens, seqs = actor.global_counts(mini)
            optimizer.zero_grad(set_to_none=True)
            for rows in packing.micro_batches(mini, layout):
                mb = packing.take(mini, rows)
                m = mb["response_mask"].float()
                v = _values(model, mb, cfg, layout.pack, mb.get("features"))
                loss, clipped = value_loss(v, mb["values"], mb["returns"], m, cfg, tokens, seqs)
                (loss * world).backward()
                with torch.no_grad():      # vf_clipfrac: a token mean over all ranks, whatever the loss mode
                    sums += torch.stack([loss, (clipped * m).sum() / tokens]).double()
            norms.append(actor.clipped_step(model, optimizer, cfg.grad_clip, adam, moved, "critic"))
    optimizer.zero_grad(set_to_none=True)           # frees the grads before the actor's update
    sums = actor.all_sum(sums) / len(norms)
    return {"critic/vf_loss": sums[0].item(), "critic/vf_clipfrac": sums[1].item(),
            "critic/grad_norm": sum(norms) / len(norms), **moved}
