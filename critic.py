"""The critic for PPO: a value per response token, GAE, a clipped value loss, its own offload flags.

    python train_grpo.py --algorithm.adv_estimator=gae                          # PPO, separate critic
    python train_grpo.py --algorithm.adv_estimator=gae --critic.mode=shared     # value head on the actor
    python -m pytest tests/test_critic.py -q

Two modes:
- "separate" (verl's critic): a causal-LM trunk with a scalar head per token
  (`AutoModelForTokenClassification`, num_labels=1), initialised from the actor's checkpoint (or
  the tiny default), FSDP2-sharded like the actor, with its own Adam, `param_offload` and
  `optimizer_offload`. It costs a second model: params + grads + Adam state of a whole LM.
- "shared" (a value head on the policy's trunk, sometimes called `share_actor_weights`; verl has no
  such option): one
  Linear(hidden, 1) head reads the actor's final hidden states; no second model is held. What
  changes: the values come from the policy's features, and the head trains on them detached, so
  the value loss never moves the trunk (the policy is trained by the policy loss alone, exactly
  as with GRPO); the critic's capacity is one linear layer. The values stage is an extra actor
  forward; the critic update reuses the features saved there and needs no forward at all.

What it holds on the GPU (separate mode): fp32 shards, their grads in the update, Adam's two
moments (2 x the shards); the shared head is a few KB and never moves.
What it moves (separate mode; its stashes know their flags at build, as the actor's): with
param_offload its fp32 shards come in for the values stage (freed after, no copy back) and for the
critic update (copied back out); with optimizer_offload its Adam state comes in on a side stream
during the update's forward/backward and is waited for right before the step, like the actor's.
In shared mode the values stage needs the actor's trunk: the caller lends it, the model and the stashes
that hold its params (`actor.policy_stashes`), and the values stage brings those in and frees them, as the
weight sync does; this file never imports actor.py. A checkpoint brings the critic's params and Adam in and
out again through `state_in`, like the actor's.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import offload
import packing
import ulysses
from adam import (born_on_host, build_optimizer, clipped_step, holding, optimizer_stash, optimizer_windows,
                  row_slices, update_phases, window_peak)
from losses import LOSS_AGG_MODES, agg_loss, global_counts, split
from model import ForwardSettings, all_sum, in_use, is_dir, load_model, make_layout, shard, state


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
    optimizer_stream: bool = False         # with optimizer_offload: Adam steps a window of layers at a time from
                                           # the host (as actor.optimizer_stream)
    optimizer_window_layers: int = 1       # with optimizer_stream: decoder layers a window
    optimizer_row_windows: bool = False    # with optimizer_stream: the embeddings step in row slices no larger than
                                           # a window of layers (as actor.optimizer_row_windows)
    gradient_checkpointing: bool = True    # separate mode: recompute each layer in backward (as verl's critic):
                                           # at 1.5B, micro 16 x 320 tokens, the update's activations 14.8 -> 0.8 GB


# checked when the command line is parsed (options.check_config)
RANGES = {"lr": ">= 0", "weight_decay": ">= 0", "grad_clip": "> 0", "cliprange_value": "> 0",
          "ppo_micro_batch_size_per_gpu": ">= 1", "forward_micro_batch_size_per_gpu": ">= 1",
          "gamma": "[0, 1]", "lam": "[0, 1]", "ppo_max_token_len_per_gpu": ">= 1",
          "forward_max_token_len_per_gpu": ">= 1", "optimizer_window_layers": ">= 1"}
CHOICES = {"mode": ("separate", "shared"), "loss_agg_mode": LOSS_AGG_MODES}
SEARCH = {"param_offload": (False, True), "optimizer_offload": (False, True),   # --offload=auto's, separate mode
          "optimizer_stream": (False, True)}
NEEDS = {"optimizer_stream": "optimizer_offload"}
RELIEF = {"critic_params": "--critic.param_offload=true", "critic_optimizer": "--critic.optimizer_offload=true",
          "critic Adam windows (in, stepping, out)": "a smaller critic.optimizer_window_layers"}


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


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, sp: int = 1) -> torch.Tensor:
    """(x - mean) / std over the valid tokens of ALL ranks (unbiased variance), zero on padding.
    Two passes in float64, the mean first, then the squared deviations from it: one pass of
    E[x^2] - mean^2 in fp32 loses every digit of the variance when |mean| >> std. `sp`: the k ranks
    of a Ulysses group hold the same rows, so each sum counts them once (divided by k)."""
    xd, md = x.double(), mask.double()
    s = all_sum(torch.stack([(xd * md).sum(), md.sum()]))
    s = ulysses.once(s, sp)
    mean = s[0] / s[1]
    var = ulysses.once(all_sum(((xd - mean).square() * md).sum()), sp) / (s[1] - 1).clamp(min=1)
    return ((xd - mean) * torch.rsqrt(var + eps)).float() * mask


def advantages(c: "Critic", batch: dict, scores: torch.Tensor) -> torch.Tensor:
    """The advantage stage for PPO: each response's score sits on its last token (the token
    rewards, (B, R)), GAE over the critic's values, whitened over all ranks; batch["returns"] too."""
    mask = batch["response_mask"].float()
    last = (mask.sum(-1) - 1).clamp(min=0).long()
    rewards = torch.zeros_like(batch["values"]).scatter_(1, last[:, None], scores[:, None])
    adv, batch["returns"] = gae(rewards, batch["values"], mask, c.cfg.gamma, c.cfg.lam)
    return whiten(adv, mask, sp=c.update_layout.sp)


def value_loss(v, old_v, returns, mask, cfg: CriticConfig, tokens=None, seqs=None):
    """0.5 * agg(max((v - R)^2, (clip(v, old +- c) - R)^2)) and where the clip bit (B, R). v itself
    is clamped, as verl does: inside the range it stays exactly v (old + clamp(v - old) is not v
    in fp32, and ~1 % of unclipped tokens would count as clipped)."""
    clipped = torch.clamp(v, old_v - cfg.cliprange_value, old_v + cfg.cliprange_value)
    l1, l2 = (v - returns).square(), (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), mask, cfg.loss_agg_mode, tokens, seqs)
    return loss, (l2 > l1).float()


def check_model(path):
    """Before anything is built: transformers has a token-classification class (the separate
    critic's value head) for this model type."""
    if not is_dir(path):
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES
    kind = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if kind not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(f"--model {path}: transformers has no token-classification model for "
                         f"model_type {kind!r} (the separate critic); use --critic.mode=shared")


# --------------------------------------------------------------------------- the critic's state
@dataclass
class Critic:
    """The critic's state (made by `build`): the value model (or the shared head), its AdamW, and
    its offload groups (their flags only ever on in separate mode)."""
    cfg: CriticConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: offload.Stash
    adam: offload.Stash                    # empty until Adam's first step
    forward_layout: packing.Layout         # the values stage's micro-batches (and packing)
    update_layout: packing.Layout          # the update's
    windows: list | None = None            # optimizer_stream: the params Adam steps together


def build(cfg: CriticConfig, *, model_path, mesh, device, actor_cfg=ForwardSettings(), actor_model=None,
          seed: int = 0) -> Critic:
    """Separate: a token-classification LM; shared: the value head only (on `actor_model`'s features).
    Compute dtype and forward settings (packing, token budgets) come from the actor's config (`actor_cfg`:
    actor.ActorConfig; without the actor, model.ForwardSettings, its defaults)."""
    separate = cfg.mode == "separate"
    if separate:
        model = load_model(model_path, seed, head="value")
        own_output(model.score)            # the token-classification head (transformers' generic one)
        head = shard(model, mesh, device, param_dtype=actor_cfg.param_dtype,
                     gradient_checkpointing=cfg.gradient_checkpointing, embeddings_apart=actor_cfg.embeddings_apart)
    else:
        torch.manual_seed(seed)
        # own_output before fully_shard: its hook runs first
        head = own_output(torch.nn.Linear(actor_model.config.hidden_size, 1))
        torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)   # V = 0 at the start
        fully_shard(head, mesh=mesh, reshard_after_forward=True)   # FSDP averages its grads over ranks
        head.to(device)
    optimizer = build_optimizer(head, cfg)
    c = Critic(cfg, head, optimizer,
               offload.param_stash("critic_params", head, enabled=cfg.param_offload and separate),
               optimizer_stash("critic_optimizer", optimizer, enabled=cfg.optimizer_offload and separate),
               make_layout(actor_cfg, cfg.forward_micro_batch_size_per_gpu, cfg.forward_max_token_len_per_gpu),
               make_layout(actor_cfg, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu),
               optimizer_windows(head, optimizer, cfg.optimizer_window_layers, cfg.optimizer_row_windows)
               if separate and cfg.optimizer_offload and cfg.optimizer_stream else None)
    offload.offload(c.params)              # param_offload: frees the shard bytes until the values stage
    return c


def own_output(head: torch.nn.Linear) -> torch.nn.Linear:
    """The value head's output as a tensor of its own. A Linear to one output applied to (B, T, H)
    returns a view of its (B*T, 1) product, and FSDP2 then warns at every update's forward that an
    in-place op on a wrapped module's view output would skip its pre-backward hook (its all-gather).
    Nothing here writes the values in place (`_values` reads them out of place), so it never applied;
    the copy (4 bytes a token) ends both the hazard for code that would, and the warning."""
    head.register_forward_hook(lambda module, args, out: out.clone() if out._base is not None and out.requires_grad
                               else out)   # FSDP2 checks only outputs that need grad (the update's)
    return head


def describe(c: Critic) -> list[str]:
    """The set-up report's lines for the critic: its size and each offload flag with its bytes."""
    cfg, held = c.cfg, sum(p.to_local().numel() * 4 for p in c.model.parameters())
    device = next(c.model.parameters()).device
    lines = [f"[critic] mode={cfg.mode}: {held / offload.GB:.3f} GB of parameters"
             + (" (a value head on the actor's trunk: no second model)" if cfg.mode == "shared" else "")]
    if cfg.mode == "shared" and (cfg.param_offload or cfg.optimizer_offload or cfg.optimizer_stream):
        lines.append("[offload] warning: critic.mode=shared holds only a value head: critic offload flags have "
                     "no effect")
    elif cfg.optimizer_stream and not cfg.optimizer_offload:
        lines.append("[offload] warning: critic.optimizer_stream does nothing without critic.optimizer_offload=true")
    lines.append(offload.describe("critic.param_offload", held, c.params.enabled, device))
    lines.append(offload.describe("critic.optimizer_offload (Adam, 2 x fp32 shard)", 2 * held, c.adam.enabled,
                                  device))
    return lines


# --------------------------------------------------------------------------- values
def _features(actor_model, mb: dict, layout: packing.Layout) -> torch.Tensor:
    """The actor's final normed hidden states at the positions that predict each response token
    (B, R, H), zero on padding, from a forward whose logits are cut to one position (no vocab-sized
    tensor); with Ulysses each rank's own tokens', gathered (no graph: the head trains on them detached)."""
    kw, at, p = packing.model_inputs(mb, layout.pack, layout.sp)
    got = []
    hook = actor_model.model.norm.register_forward_hook(lambda m, i, o: got.append(o))
    try:
        actor_model(**kw, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    B, R = mb["responses"].shape
    h = ulysses.gather(got[0].reshape(-1, got[0].shape[-1]).index_select(0, at), p)   # (N, H)
    feats = h.new_zeros(B * R, h.shape[-1]).index_copy(0, packing.to_device(p["dst"], h.device), h)
    return feats.view(B, R, -1)


def _values(model, mb: dict, cfg: CriticConfig, layout: packing.Layout, features=None) -> torch.Tensor:
    """(B, R) values of the states before each response token, fp32, zero on padding."""
    if cfg.mode == "shared":
        return model(features.float())[..., 0] * mb["response_mask"]
    kw, at, p = packing.model_inputs(mb, layout.pack, layout.sp)
    out = model(**kw, use_cache=False).logits                  # (B or 1, T, 1): one number per position
    B, R = mb["responses"].shape
    v = ulysses.gather(out.reshape(-1).index_select(0, at).float(), p)   # (N,): this rank's, then the group's
    return torch.zeros(B * R, dtype=torch.float32, device=v.device).index_put(
        (packing.to_device(p["dst"], v.device),), v).view(B, R)


def compute_values(c: Critic, batch: dict, metrics: dict | None = None, *, trunk=None, lent: list = ()):
    """The values stage: batch["values"] (and in shared mode batch["features"], for the update),
    inside the critic's bracket: its shards in, then freed without a copy back. Shared mode reads the
    actor's trunk instead: `trunk`, the actor's model, and `lent`, the stashes of its params
    (actor.policy_stashes), brought in and freed the same way; separate mode needs neither.
    `metrics`: where the bracket's moves are logged (None: nowhere)."""
    metrics = {} if metrics is None else metrics
    shared = c.cfg.mode == "shared"
    if shared and trunk is None:
        raise ValueError("critic.mode=shared reads the actor's features: pass compute_values the actor's model "
                         "(trunk=a.model) and its stashes (lent=actor.policy_stashes(a))")
    with offload.loaded(list(lent) if shared else [c.params], metrics):
        batch["values"], feats = values(c.model, batch, c.cfg, c.forward_layout, trunk if shared else None)
    if feats is not None:
        batch["features"] = feats


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
        f = _features(actor_model, mb, layout) if cfg.mode == "shared" else None
        v = _values(model, mb, cfg, layout, f)
        if rows.numel():
            vals[rows.to(vals.device)] = v
            if f is not None:
                feats = feats if feats is not None else f.new_zeros(*resp.shape, f.shape[-1])
                feats[rows.to(vals.device)] = f
    return vals, feats


# --------------------------------------------------------------------------- update
def update(c: Critic, batch: dict, mini_size: int, epochs: int, metrics: dict) -> dict:
    """The critic update's bracket: params in -> Adam in on a side stream (waited for right before
    the step) -> clipped value loss -> both out again (separate mode). Frees the shared mode's
    saved features after it."""
    with offload.loaded([c.params], metrics, modified=True):
        if not c.windows:                  # (a streamed step brings Adam in a window at a time, at the step)
            metrics.update(offload.reload(c.adam, background=True))   # overlaps the first forward/backward
        stats = update_critic(c, batch, mini_size, epochs)
        metrics.update(offload.offload(c.adam))   # frees 2 x fp32 shard bytes until the next update
    batch.pop("features", None)
    return stats


def update_critic(c: Critic, batch: dict, mini_size: int, epochs: int) -> dict:
    """Clipped value loss over the same mini-batches as the actor, gradients accumulated over
    micro-batches and normalised by global counts (invariant to micro-batch size and ranks).
    Adam's stash is made ready right before each optimizer step (`clipped_step`)."""
    model, optimizer, cfg, layout = c.model, c.optimizer, c.cfg, c.update_layout
    device = batch["responses"].device
    world = dist.get_world_size() if dist.is_initialized() else 1
    # FSDP averages over the world. The separate critic's ranks of a Ulysses group each compute their
    # tokens' share (their sum is the group's gradient); the shared head sees the gathered features
    # whole on each of the k ranks, so its loss counts 1/k per rank
    scale = world / layout.sp if cfg.mode == "shared" and layout.sp > 1 else world
    batch = packing.host_lengths(batch)    # one host sync for the stage, none per micro-batch
    sums, norms, moved = torch.zeros(2, device=device, dtype=torch.float64), [], {}
    model.train()
    for _ in range(epochs):
        for mini in split(batch, mini_size):
            tokens, seqs = global_counts(mini, layout.sp)
            optimizer.zero_grad(set_to_none=True)
            for rows in packing.micro_batches(mini, layout):
                mb = packing.take(mini, rows)
                m = mb["response_mask"].float()
                v = _values(model, mb, cfg, layout, mb.get("features"))
                loss, clipped = value_loss(v, mb["values"], mb["returns"], m, cfg, tokens, seqs)
                (loss * scale).backward()
                with torch.no_grad():      # vf_clipfrac: a token mean over all ranks, whatever the loss mode
                    sums += torch.stack([loss, (clipped * m).sum() / tokens]).double()
            norms.append(clipped_step(model, optimizer, cfg.grad_clip, c.adam, moved, "critic", c.windows))
    optimizer.zero_grad(set_to_none=True)           # frees the grads before the actor's update
    sums = all_sum(ulysses.once(sums, layout.sp)) / len(norms)
    return {"critic/vf_loss": sums[0].item(), "critic/vf_clipfrac": sums[1].item(),
            "critic/grad_norm": sum(norms) / len(norms), **moved}


# --------------------------------------------------------------------------- predicted
# Its bytes in the planner's terms (predict.py composes them): per rank, `z` a model.Sizes, each state
# group as (bytes on the GPU in use, between uses, in pinned host memory), each stage as its moments.
def predicted_states(cfg: CriticConfig, z) -> dict:
    """Separate: the trunk and its value head (hidden + 1), fp32, and Adam; shared: the head alone."""
    s = z.shapes
    if cfg.mode == "shared":                   # never moves
        n = z.shard(s.hidden + 1, 4)
        return {"critic_params": (n, n, 0), "critic_optimizer": (2 * n, 2 * n, 0)}
    p = z.shard(s.trunk + s.hidden + 1, 4)
    return {"critic_params": state(p, cfg.param_offload), "critic_optimizer": state(2 * p, cfg.optimizer_offload)}


def _saved(cfg: CriticConfig, z) -> dict:   # shared: the actor's features, from the values stage to the update
    return {"features": z.samples * z.response_len * z.shapes.hidden * z.c} if cfg.mode == "shared" else {}


def predicted_values(cfg: CriticConfig, z, states: dict, actor_cfg, policy: dict) -> list:
    """Its forward (shared: the actor's, whose groups in use are `policy`)."""
    layout = make_layout(actor_cfg, cfg.forward_micro_batch_size_per_gpu, cfg.forward_max_token_len_per_gpu)
    model = policy if cfg.mode == "shared" else in_use(states, "critic_params")
    return [{**model, **z.forward(layout), **_saved(cfg, z)}]


def predicted_advantage(cfg: CriticConfig, z) -> list:
    return [_saved(cfg, z)]


def predicted_update(cfg: CriticConfig, z, states: dict, actor_cfg) -> list:
    if cfg.mode == "shared":                   # the head on the saved features: no forward of a model
        return [{**_saved(cfg, z), **in_use(states, "critic_params", "critic_optimizer")}]
    layout = make_layout(actor_cfg, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu)
    n = z.tokens(layout)
    busy = {**z.shapes.activations(n, z.c, cfg.gradient_checkpointing), "gathered layers + root": z.shapes.gather(z.c)}
    grads = {"critic grads": states["critic_params"][0]}
    if cfg.optimizer_stream and cfg.optimizer_offload:   # a few windows of Adam at the step (adam.window_peak)
        held = in_use(states, "critic_params")
        return update_phases(held, grads, busy, z.accumulating(layout), {**held, **grads,
                             "critic Adam windows (in, stepping, out)": predicted_windows(cfg, z)})
    return update_phases(in_use(states, "critic_params", "critic_optimizer"), grads, busy, z.accumulating(layout))


def predicted_windows(cfg: CriticConfig, z, over=window_peak) -> int:
    """The critic's Adam bytes at a streamed step's worst moment (`over`: adam.window_peak; max: the largest); 0
    when its Adam is not streamed (predict.freed_windows asks every separate critic)."""
    if not (cfg.optimizer_stream and cfg.optimizer_offload):
        return 0
    s, k = z.shapes, min(cfg.optimizer_window_layers, z.shapes.layers)
    table = [(b - a) * s.hidden for a, b in row_slices(s.vocab, s.hidden, k * s.layer_params)] \
        if cfg.optimizer_row_windows else [s.vocab * s.hidden]      # optimizer_row_windows: at most k layers a slice
    sizes = table + [k * s.layer_params] * -(-s.layers // k) + [s.hidden, s.hidden + 1]
    return over([z.shard(n, 8) for n in sizes])


def predicted_checkpoint(cfg: CriticConfig, z, states: dict, optimizer: bool = True) -> list:
    """A checkpoint's bracket (`state_in`, separate mode), as the actor's: params and all of Adam at once, and a
    resume's zero grads; optimizer_stream: params and a window of Adam with its zero grads. Without `optimizer`
    (--save_optimizer=false): the params alone."""
    if not optimizer:
        return [in_use(states, "critic_params")]
    if cfg.optimizer_stream and cfg.optimizer_offload:
        return [{**in_use(states, "critic_params"),
                 "critic Adam window + its zero grads (a load)": predicted_windows(cfg, z)}]
    return [{**in_use(states, "critic_params", "critic_optimizer"), "zero grads (a load)": states["critic_params"][0]}]


# --------------------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def state_in(c: Critic, loading: bool = False, optimizer: bool = True):
    """A checkpoint's bracket, as the actor's (`actor.state_in`): params and Adam on the device
    while the state-dict helpers read or write them, then back where they were (separate mode;
    the shared head never moves). Device cost for the checkpoint's length: params + 2 x params
    (optimizer_stream: params and a window of Adam; Adam is read and written on the host; without
    `optimizer`, --save_optimizer=false: params, Adam left where it is)."""
    with holding([c.params] + ([] if c.windows or not optimizer else [c.adam]), loading):
        if optimizer:
            born_on_host(c.optimizer, c.adam, c.windows)
        yield
