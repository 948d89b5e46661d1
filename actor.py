"""The policy: build, FSDP2-shard, micro-batched log-probs, the clipped policy-gradient update, and
every move of the actor's own bytes.

    python -m pytest test_algo.py          # the loss math against hand-computed values
    torchrun --nproc_per_node=2 -m pytest test_dist.py   # 2 ranks == 1 rank

What the actor moves, and when (its two offload groups, `Actor.params` and `Actor.adam`):
    param_offload       fp32 shards live in pinned host memory between uses. In for the weight sync
                        (rollout.py loads and frees `offloaded(a)`), for old log-probs
                        (`compute_old_log_probs`) and for the update (`update`); forward-only uses
                        free them without a copy back.
    optimizer_offload   Adam's exp_avg + exp_avg_sq (2 x the fp32 shards) live on the host outside
                        `update`. They come back on a side stream while the first forward/backward
                        runs; `clipped_step` waits for them right before `optimizer.step()`.
    the levers          prefetch_update (`prefetch_update`, called during the ref forward),
                        defer_param_offload (`update` keeps the params; the next sync copies them
                        out), optimizer_load_at_step (Adam copied in at the step, not before).

Batches are dicts of tensors, one row per sample (prompt left-padded to P, response right-padded to R):
    input_ids, attention_mask, position_ids  (B, P+R)
    responses, response_mask                 (B, R)
    old_log_probs, ref_log_probs, advantages (B, R)   when the stage that makes them has run
"""
import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import offload
import packing


@dataclass
class ActorConfig:
    lr: float = 2e-4                       # tiny model from scratch; real models use ~1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0                 # max global grad norm; a non-finite norm skips the step
    ppo_mini_batch_size: int = 16          # prompts per optimizer step (x n samples, split over ranks)
    ppo_micro_batch_size_per_gpu: int = 16  # samples per forward/backward (gradient accumulation)
    ppo_epochs: int = 1
    log_prob_micro_batch_size_per_gpu: int = 32  # samples per forward for old log-probs
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0              # dual-clip bound for negative advantages
    loss_agg_mode: str = "token-mean"      # or seq-mean-token-sum, seq-mean-token-mean
    entropy_coeff: float = 0.0
    use_kl_loss: bool = True               # KL to the reference policy in the loss (needs ref)
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"       # kl|k1, abs, mse|k2, low_var_kl|k3
    param_offload: bool = False            # shards to pinned host between uses (manual bracket)
    param_offload_layers: int = -1         # with param_offload: only the first k decoder layers (-1: all)
    optimizer_offload: bool = False        # Adam state to pinned host between updates
    prefetch_update: bool = True           # GRPO with param_offload: params come in during the ref
                                           # forward (hides the copy; the ref stage holds them too)
    defer_param_offload: bool = True       # with param_offload: params stay after the update until the next
                                           # weight sync, which copies them out (one reload fewer per step)
    optimizer_load_at_step: bool = False   # with optimizer_offload: Adam comes in just before optimizer.step
                                           # (verl #5282): the update's peak loses the activations, the copy
                                           # is no longer hidden behind the forward/backward
    offload_policy: bool = False           # FSDP2 CPUOffloadPolicy instead: params+grads+Adam live on CPU
    gradient_checkpointing: bool = False   # recompute each layer's activations in backward
    param_dtype: str = "bfloat16"          # compute dtype on GPU; master weights stay fp32 (CPU: fp32)
    # how samples go through the model (packing.py); remove_padding, logits_chunk_tokens and
    # use_dynamic_bsz apply to every role that runs this architecture (ref, critic)
    remove_padding: bool = True            # pack each micro-batch into one row: no compute on padding
    logits_chunk_tokens: int = 1024        # LM head on response tokens only, this many at a time: one
                                           # (chunk, vocab) fp32 block alive, recomputed in backward (0: all
                                           # at once, kept for backward)
    use_dynamic_bsz: bool = False          # micro-batches filled to a token budget instead of a sample count
    ppo_max_token_len_per_gpu: int = 16384     # with use_dynamic_bsz: tokens per update micro-batch
    log_prob_max_token_len_per_gpu: int = 32768  # with use_dynamic_bsz: tokens per old-log-prob forward


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


# --------------------------------------------------------------------------- build
def check_model_path(path: str | None):
    if path is not None and not path.startswith("random:") and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model {path}: no config.json there; pass a local Hugging Face "
                                f"model directory (nothing is downloaded)")


def load_model(path: str | None, seed: int = 0) -> torch.nn.Module:
    """fp32 weights on the host: the tiny default from code, a Qwen2.5 size with random weights
    (`random:qwen2.5-0.5b`, for benchmarks), or a local Hugging Face checkpoint."""
    if path is None or path.startswith("random:"):
        import tiny
        if path is None:
            return tiny.build_tiny_model(seed)
        # random init straight on the GPU when there is one: seconds instead of minutes at 7B
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            return tiny.build_random_model(path[7:], seed)
    check_model_path(path)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                attn_implementation="sdpa")


def shard(model: torch.nn.Module, mesh, device: torch.device, offload_policy: bool = False,
          param_dtype: str = "bfloat16", gradient_checkpointing: bool = False) -> torch.nn.Module:
    """FSDP2: each decoder layer, then the root (which takes the embeddings, norm and lm_head).
    Layers first so each one all-gathers and frees on its own; the root last so it owns the rest.
    With a 2-D mesh ("replicate", "fsdp") this is hybrid sharding. Moves the shards to `device`
    (or to pinned host memory with CPUOffloadPolicy)."""
    cuda = device.type == "cuda"
    packing.use_packed_attention(model)    # SDPA for padded rows, varlen attention for packed ones
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32) \
        if cuda else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy(pin_memory=True) if offload_policy and cuda else OffloadPolicy()
    if gradient_checkpointing:   # per decoder layer; the method was renamed in transformers 5.2x
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    # The root too reshards after forward (FSDP2 keeps the root gathered by default): otherwise the
    # gathered embedding / lm_head (vocab x hidden, bf16) stays on the GPU between stages.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=True)
    if not (offload_policy and cuda):
        model.to(device)            # buffers (rotary inv_freq); shards already moved by fully_shard
    return model


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    """AdamW for the actor or the critic (`cfg` has lr and weight_decay). Adam state (2 x fp32 shard
    bytes) appears at the first step, on the params' device. fused: one kernel per step and no
    temporaries; the default foreach path allocates several param-sized lists in the step (at 7B
    those tens of GB did not fit beside params + grads + Adam on one H200)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)


# --------------------------------------------------------------------------- math
def logprobs_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids) under logits (B, R, V) -> (B, R), without materialising a second (B, R, V)."""
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled tokens (Schulman's k1/k2/k3)."""
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):           # exp(ref - logp) - (ref - logp) - 1 >= 0
        r = (-d).clamp(-20, 20)
        return (r.exp() - r - 1).clamp(-10, 10)
    raise ValueError(f"kl_loss_type={kind!r}: use one of {KL_TYPES}")


def agg_loss(mat: torch.Tensor, mask: torch.Tensor, mode: str, tokens=None, seqs=None) -> torch.Tensor:
    """Reduce a (B, R) per-token loss. `tokens` / `seqs` are the denominators; by default this
    batch's own. The update passes the mini-batch's global counts (over micro-batches and
    ranks) so that the gradient does not depend on how the mini-batch is split."""
    mat = mat * mask
    if mode == "token-mean":
        return mat.sum() / (mask.sum() if tokens is None else tokens)
    per_seq = mat.sum(-1)                                          # (B,)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg_mode={mode!r}: use one of {LOSS_AGG_MODES}")
    return per_seq.sum() / (mask.shape[0] if seqs is None else seqs)


def policy_loss(logp, old_logp, adv, cfg: ActorConfig):
    """Clipped surrogate with dual clip, per token (B, R). Returns (loss, clipped-mask, ratio)."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.minimum(clipped, -adv * cfg.clip_ratio_c)    # bounds the loss when A < 0
    loss = torch.where(adv < 0, dual, clipped)
    return loss, (loss2 > loss1).float(), ratio


# --------------------------------------------------------------------------- forward
def make_layout(cfg: ActorConfig, micro: int, max_tokens: int) -> packing.Layout:
    """How a role splits and runs its batch: `micro` samples, or `max_tokens` with use_dynamic_bsz."""
    return packing.Layout(micro=micro, max_tokens=max_tokens if cfg.use_dynamic_bsz else 0,
                          pack=cfg.remove_padding, chunk=cfg.logits_chunk_tokens)


def split(batch: dict, size: int):
    n = next(iter(batch.values())).shape[0]
    for i in range(0, n, size):
        yield {k: v[i:i + size] for k, v in batch.items()}


def forward(model, mb: dict, temperature: float, layout: packing.Layout, entropy: str = "none"):
    """Log-probs (and entropy) of the response tokens, (B, R), zero on padding. Only the positions
    that predict a response token reach the LM head, a chunk at a time (packing.py).
    entropy: "none"; "log" (no graph: nothing extra kept for backward); "grad" (in the loss)."""
    logp, ent = packing.response_logprobs(model, mb, temperature, layout, entropy_grad=entropy == "grad")
    return logp, (None if entropy == "none" else ent)


@torch.no_grad()
def compute_log_probs(model, batch: dict, layout: packing.Layout, temperature: float) -> torch.Tensor:
    """(B, R) log-probs in micro-batches (peak activation memory scales with the micro-batch),
    returned in the batch's row order whatever order the token-budget bins took."""
    batch = packing.host_lengths(batch)    # one host sync for the stage, none per micro-batch
    out = torch.zeros(batch["responses"].shape, dtype=torch.float32, device=batch["responses"].device)
    for rows in packing.micro_batches(batch, layout):
        logp = forward(model, packing.take(batch, rows), temperature, layout)[0]
        if rows.numel():
            out[rows.to(out.device)] = logp
    return out


# --------------------------------------------------------------------------- update
def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def logprob_mismatch(logp: torch.Tensor, batch: dict) -> dict:
    """|trainer log-prob - rollout engine log-prob| over valid tokens, mean and max over all ranks."""
    m = batch["response_mask"]
    d = (logp.detach() - batch["rollout_log_probs"]).abs() * m
    s = all_sum(torch.stack([d.sum(), m.sum()]).double())
    mx = d.max().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    return {"rollout/logp_diff_mean": (s[0] / s[1]).item(), "rollout/logp_diff_max": mx.item()}


def clipped_step(model, optimizer, grad_clip: float, adam: offload.Stash | None, metrics: dict,
                 who: str) -> float:
    """Clip the global grad norm and step; a non-finite norm skips the step (weights kept, the
    gradients dropped by the caller's next zero_grad). `adam`: the optimizer state's stash when
    it is offloaded (None otherwise). Returns the norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    if math.isfinite(norm):
        metrics.update(offload.ready(adam))   # Adam state: wait for its side-stream copy (or copy it in now)
        optimizer.step()
    else:
        print(f"[{who}] grad norm {norm} is not finite: optimizer step skipped")
    return norm


def global_counts(mini: dict) -> tuple[float, float]:
    """(valid tokens, sequences) of a mini-batch over all ranks: the loss denominators."""
    m = mini["response_mask"]
    c = all_sum(torch.stack([m.sum().double(), torch.tensor(float(m.shape[0]), device=m.device,
                                                            dtype=torch.float64)]))
    tokens, seqs = c.tolist()                   # one host sync per mini-batch
    return tokens, seqs


def update_policy(model, optimizer, batch: dict, cfg: ActorConfig, mini_size: int,
                  temperature: float, adam: offload.Stash | None = None) -> dict:
    """PPO epochs over mini-batches of `mini_size` samples (this rank's share), each split into
    micro-batches whose gradients accumulate. Losses use the mini-batch's global token and
    sequence counts, times the world size because FSDP averages gradients over ranks, so the
    update is the same for any micro-batch size and any number of ranks.
    `adam`: the offloaded optimizer state, made ready right before each optimizer step."""
    device = batch["responses"].device
    world = dist.get_world_size() if dist.is_initialized() else 1
    on_policy = "old_log_probs" not in batch        # one mini-batch, one epoch: old == current
    batch = packing.host_lengths(batch)    # one host sync for the stage, none per micro-batch
    layout = make_layout(cfg, cfg.ppo_micro_batch_size_per_gpu, cfg.ppo_max_token_len_per_gpu)
    names = ("pg_loss", "kl", "entropy", "pg_clipfrac", "ppo_kl")
    sums = torch.zeros(len(names), device=device, dtype=torch.float64)  # summed on device: no syncs
    norms, skipped, mismatch, moved = [], 0, [], {}
    model.train()
    for _ in range(cfg.ppo_epochs):
        for mini in split(batch, mini_size):
            tokens, seqs = global_counts(mini)
            optimizer.zero_grad(set_to_none=True)
            for rows in packing.micro_batches(mini, layout):
                mb = packing.take(mini, rows)
                m = mb["response_mask"]
                agg = lambda x: agg_loss(x, m, cfg.loss_agg_mode, tokens, seqs)  # noqa: E731
                logp, ent = forward(model, mb, temperature, layout, "grad" if cfg.entropy_coeff else "log")
                old = logp.detach() if on_policy else mb["old_log_probs"]
                if on_policy and "rollout_log_probs" in mb:   # this forward is the rollout policy
                    mismatch.append((logp.detach(), mb))
                pg_mat, clipped, ratio = policy_loss(logp, old, mb["advantages"], cfg)
                pg, ent_term = agg(pg_mat), agg(ent)
                loss = pg - cfg.entropy_coeff * ent_term
                kl = torch.zeros((), device=device)
                if cfg.use_kl_loss:
                    kl = agg(kl_penalty(logp, mb["ref_log_probs"], cfg.kl_loss_type))
                    loss = loss + cfg.kl_loss_coef * kl
                (loss * world).backward()
                with torch.no_grad():
                    r = ratio.detach()
                    sums += torch.stack([pg, kl, ent_term, agg(clipped), agg(r - 1 - torch.log(r))]).double()
            norms.append(clipped_step(model, optimizer, cfg.grad_clip, adam, moved, "actor"))
            skipped += not math.isfinite(norms[-1])
    optimizer.zero_grad(set_to_none=True)           # frees the fp32 grad shards before the next stage
    sums = all_sum(sums) / len(norms)               # mean over optimizer steps of global means
    out = dict(zip(names, sums.tolist()))
    finite = [n for n in norms if math.isfinite(n)] or [float("nan")]
    out.update(grad_norm=sum(finite) / len(finite), skipped_steps=skipped, **moved)
    if mismatch:
        out.update(logprob_mismatch(torch.cat([lp for lp, _ in mismatch]),
                                    {k: torch.cat([mb[k] for _, mb in mismatch])
                                     for k in ("response_mask", "rollout_log_probs")}))
    return out


# --------------------------------------------------------------------------- the actor and its moves
@dataclass
class Actor:
    """The policy's state (made by `build`): the FSDP2 model, AdamW, and its two offload groups."""
    cfg: ActorConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: offload.Stash                  # local shards: all, or the first k layers' (param_offload_layers)
    adam: offload.Stash                    # exp_avg + exp_avg_sq: empty until Adam's first step


def build(cfg: ActorConfig, *, mesh, device: torch.device, model_path: str | None = None, seed: int = 0,
          model: torch.nn.Module | None = None) -> Actor:
    """Load (or take `model`, an HF causal LM already built, fp32), shard, make the optimizer;
    with param_offload the shards leave the GPU at once."""
    if cfg.offload_policy and (cfg.param_offload or cfg.optimizer_offload):
        raise ValueError("actor.offload_policy (FSDP2 CPUOffloadPolicy) already keeps params and Adam state "
                         "on the CPU; turn actor.param_offload / actor.optimizer_offload off")
    model = shard(model if model is not None else load_model(model_path, seed), mesh, device,
                  cfg.offload_policy, cfg.param_dtype, cfg.gradient_checkpointing)
    k = cfg.param_offload_layers           # partial offload: only the first k decoder layers' shards
    optimizer = build_optimizer(model, cfg)
    a = Actor(cfg, model, optimizer, offload.param_stash("actor_params", *([model] if k < 0 else model.model.layers[:k])),
              offload.optimizer_stash("actor_optimizer", optimizer))
    for s in offloaded(a):
        offload.offload(s)                 # frees the shard bytes until their first use
    return a


def offloaded(a: Actor) -> list:
    """The parameter groups that live on the host between uses (empty when param_offload is off)."""
    return [a.params] if a.cfg.param_offload else []


@contextlib.contextmanager
def resident(a: Actor, metrics: dict):
    """Params on the GPU for a forward-only use, freed after it (the host copy is current: no copy back)."""
    with offload.loaded(offloaded(a), metrics):
        yield


def compute_old_log_probs(a: Actor, batch: dict, temperature: float, metrics: dict) -> torch.Tensor:
    layout = make_layout(a.cfg, a.cfg.log_prob_micro_batch_size_per_gpu, a.cfg.log_prob_max_token_len_per_gpu)
    with resident(a, metrics):
        return compute_log_probs(a.model, batch, layout, temperature)


def prefetch_update(a: Actor, metrics: dict):
    """The prefetch_update lever: the update's params start coming in on a side stream now (the
    loop calls this while the ref forward runs); `update` then only waits for the copy. They stay
    on the GPU from here on. Not Adam: twice the bytes, and the update hides its copy already."""
    if a.cfg.prefetch_update:
        for s in offloaded(a):
            metrics.update(offload.reload(s, background=True))


def update(a: Actor, batch: dict, mini_size: int, temperature: float, metrics: dict) -> dict:
    """The update stage's bracket: params in -> Adam in on a side stream (waited for right before
    the optimizer step, in `clipped_step`) -> update -> Adam out -> params out, or kept on the GPU
    until the next weight sync has read them (defer_param_offload: one reload fewer per step)."""
    adam = a.adam if a.cfg.optimizer_offload else None
    with offload.loaded(offloaded(a), metrics, modified=True, keep=a.cfg.defer_param_offload):
        if adam is not None and not a.cfg.optimizer_load_at_step:
            metrics.update(offload.reload(adam, background=True))   # overlaps the first forward/backward
        stats = update_policy(a.model, a.optimizer, batch, a.cfg, mini_size, temperature, adam)
        if adam is not None:
            metrics.update(offload.offload(adam))   # frees 2 x fp32 shard bytes until the next update
    return stats


def save(a: Actor, tokenizer, path: str, rank: int):
    with resident(a, {}):
        save_hf(a.model, tokenizer, path, rank)


# --------------------------------------------------------------------------- save
def save_hf(model, tokenizer, path: str, rank: int):
    """A Hugging Face checkpoint (safetensors + config + tokenizer) that from_pretrained and vLLM load.
    Parameters are gathered one at a time to rank 0's host memory (never a GPU state dict)."""
    from safetensors.torch import save_file
    tied = getattr(model.config, "tie_word_embeddings", False)
    sd = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()   # collective: all ranks
        if rank == 0 and not (tied and name == "lm_head.weight"):
            sd[name] = full.to("cpu", copy=True).contiguous()
        del full
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        # fully_shard swaps the class for "FSDP<Name>"; the checkpoint names the plain HF class.
        hf_class = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
        model.config.architectures = [hf_class.__name__]
        model.config.save_pretrained(path)
        tokenizer.save_pretrained(path)
