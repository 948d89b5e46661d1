"""The policy: build, FSDP2-shard, micro-batched log-probs, the clipped policy-gradient update, and
every move of the actor's own bytes.

    python -m pytest test_algo.py          # the loss math against hand-computed values
    torchrun --nproc_per_node=2 -m pytest test_dist.py   # 2 ranks == 1 rank
    python train_grpo.py --actor.lora_rank=16 --actor.lr=1e-3   # LoRA: adapters train, the base is the ref

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
    checkpoints         `state_in`: both groups in while a checkpoint reads (or a resume writes)
                        them, then out again (checkpoint.py).

LoRA (lora_rank > 0, through peft): only the adapters train. Grads and Adam exist for them alone
(r x (in + out) per target matrix: a few MB), and the frozen base is held in the compute dtype on a
GPU (bf16: half of the fp32 master weights). No reference model is built: the reference log-probs
are the actor's own with its adapter off (`compute_ref_log_probs`). The params group splits in
two: `Actor.params` (the adapters, copied out after each update) and `Actor.base` (frozen: copied
out once, at build; every later bracket only frees it). The weight sync and the merged checkpoint
send W + scale x B @ A per target weight (`weights.hf_weights`), one weight at a time.

Batches are dicts of tensors, one row per sample (prompt left-padded to P, response right-padded to R):
    input_ids, attention_mask, position_ids  (B, P+R)
    responses, response_mask                 (B, R)
    old_log_probs, ref_log_probs, advantages (B, R)   when the stage that makes them has run
"""
import contextlib
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import offload
import packing
import weights


@dataclass
class ActorConfig:
    lr: float = 2e-4                       # tiny model from scratch; real models use ~1e-6
    weight_decay: float = 0.0              # AdamW's decoupled weight decay
    grad_clip: float = 1.0                 # max global grad norm; a non-finite norm skips the step
    ppo_mini_batch_size: int = 16          # prompts per optimizer step (x n samples, split over ranks)
    ppo_micro_batch_size_per_gpu: int = 16  # samples per forward/backward (gradient accumulation)
    ppo_epochs: int = 1                    # passes over each step's batch (more than 1: off-policy)
    log_prob_micro_batch_size_per_gpu: int = 32  # samples per forward for old log-probs
    clip_ratio_low: float = 0.2            # the ratio is clipped below at 1 - this
    clip_ratio_high: float = 0.2           # ... and above at 1 + this
    clip_ratio_c: float = 3.0              # dual-clip bound for negative advantages
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
    optimizer_load_at_step: bool = False   # with optimizer_offload: Adam comes in just before optimizer.step
                                           # (verl #5282): the update's peak loses the activations, the copy
                                           # is no longer hidden behind the forward/backward
    offload_policy: bool = False           # FSDP2 CPUOffloadPolicy instead: params+grads+Adam live on CPU
    gradient_checkpointing: bool = True    # recompute each layer's activations in backward: at 0.5B, micro-batch
                                           # 32 x 320 tokens, the update's peak 25 -> 12 GB for +0.2 s (verl's and
                                           # TRL's default too); --offload=auto turns it off where memory allows
    # LoRA (peft): only low-rank adapters train; the frozen base with the adapter off is the reference
    lora_rank: int = 0                     # 0: off (full fine-tuning); r > 0: adapters of rank r
    lora_alpha: int = 16                   # the adapter's scale is lora_alpha / lora_rank
    lora_target_modules: str = "all-linear"  # comma-separated projections, or all-linear: q,k,v,o_proj and
                                           # gate,up,down_proj of every decoder layer (dropout is always 0)
    save_merged: bool = False              # with lora_rank: the final save also writes base + adapter merged,
                                           # as a Hugging Face model, to <save dir>/merged
    param_dtype: str = "bfloat16"          # compute dtype on GPU; master weights stay fp32 (CPU: fp32)
    # how samples go through the model (packing.py); remove_padding, logits_chunk_tokens and
    # use_dynamic_bsz apply to every role that runs this architecture (ref, critic)
    remove_padding: bool = True            # pack each micro-batch into one row: no compute on padding
    logits_chunk_tokens: int = 512         # LM head on response tokens only, this many at a time: one
                                           # (chunk, vocab) fp32 block alive, recomputed in backward (0: all
                                           # at once, kept for backward)
    use_dynamic_bsz: bool = False          # micro-batches filled to a token budget instead of a sample count
    ppo_max_token_len_per_gpu: int = 16384     # with use_dynamic_bsz: tokens per update micro-batch
    log_prob_max_token_len_per_gpu: int = 32768  # with use_dynamic_bsz: tokens per old-log-prob forward


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# What each option may be, checked when the command line is parsed: outside these a run trains
# nothing (a zero clip, zero epochs), divides by zero, or crashes in the middle.
RANGES = {"lr": ">= 0", "weight_decay": ">= 0", "grad_clip": "> 0", "ppo_mini_batch_size": ">= 1",
          "ppo_micro_batch_size_per_gpu": ">= 1", "ppo_epochs": ">= 1", "log_prob_micro_batch_size_per_gpu": ">= 1",
          "clip_ratio_low": "[0, 1)", "clip_ratio_high": ">= 0", "clip_ratio_c": "> 1", "entropy_coeff": "any",
          "kl_loss_coef": ">= 0", "param_offload_layers": ">= -1", "logits_chunk_tokens": ">= 0",
          "ppo_max_token_len_per_gpu": ">= 1", "log_prob_max_token_len_per_gpu": ">= 1", "lora_rank": ">= 0",
          "lora_alpha": "> 0"}
CHOICES = {"loss_agg_mode": LOSS_AGG_MODES, "kl_loss_type": KL_TYPES,
           "param_dtype": ("bfloat16", "float16", "float32")}


# --------------------------------------------------------------------------- build
def check_model_path(path: str | None):
    if path is not None and not path.startswith("random:") and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model {path}: no config.json there; pass a local Hugging Face "
                                f"model directory (nothing is downloaded)")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
SUPPORTED = ("decoder-only causal LMs laid out as model.model.layers + model.model.norm "
             "(Qwen2/2.5/3, Llama, Mistral, Gemma and the like)")


def check_model(path: str | None):
    """Before any process group or weight is loaded: a local Hugging Face directory with a config,
    weights, and the layout `shard` walks (`model.model.layers`, and `model.model.norm` for the
    shared critic head). The layout is read from a model built on the meta device (no memory)."""
    if path is None:
        return
    if path.startswith("random:"):
        import tiny
        tiny.qwen25_config(path[7:])        # an unknown size is one line
        return
    check_model_path(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise FileNotFoundError(f"--model {path}: no weights there (looked for {', '.join(WEIGHT_FILES)})")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()       # a BERT config's "add is_decoder=True" note is not the error
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"--model {path}: transformers builds no causal LM from its config.json "
                         f"({str(e).splitlines()[0]}); supported: {SUPPORTED}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    inner = getattr(model, "model", None)
    if not (hasattr(inner, "layers") and hasattr(inner, "norm")):
        raise ValueError(f"--model {path}: {type(model).__name__} has no model.model.layers / "
                         f"model.model.norm; supported: {SUPPORTED}")


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
    """AdamW for the actor or the critic (`cfg` has lr and weight_decay), over the parameters that
    train (with LoRA: the adapters only). Adam state (2 x fp32 shard bytes of those) appears at the
    first step, on the params' device. fused: one kernel per step and no temporaries; the default
    foreach path allocates several param-sized lists in the step (at 7B those tens of GB did not fit
    beside params + grads + Adam on one H200)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay, fused=True)


# --------------------------------------------------------------------------- LoRA
# Every linear layer of a Qwen2 / Llama decoder block: what "all-linear" means here. The LM head and
# the embedding are left out (as peft's all-linear does): packing.py applies the head from its weight
# directly, and small Qwen models tie the two.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(spec: str) -> list[str]:
    """`actor.lora_target_modules` -> module names: "all-linear", or a comma-separated subset."""
    names = list(LORA_TARGETS) if spec.strip() == "all-linear" else [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in LORA_TARGETS]
    if bad or not names:
        raise ValueError(f"actor.lora_target_modules={spec}: {', '.join(bad) or 'no name'} is not a decoder "
                         f"projection; use all-linear or a comma-separated subset of {','.join(LORA_TARGETS)}")
    return names


def lora_param_count(config, rank: int, targets: str = "all-linear") -> int:
    """Parameters LoRA adds to a Qwen2 / Llama-style model with this HF config (nothing is built):
    rank x (in + out) per target projection per decoder layer. Each costs 4 bytes (fp32) + 4 of
    grad + 8 of Adam state. For the memory planner."""
    h = config.hidden_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),     # (in, out)
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return config.num_hidden_layers * rank * sum(sum(shapes[t]) for t in lora_targets(targets))


def apply_lora(model: torch.nn.Module, cfg: ActorConfig, device: torch.device):
    """peft's LoRA on `model`, in place, before sharding. Each target nn.Linear becomes a LoRA layer
    holding its frozen weight (`<name>.base_layer.weight`) and the adapter, `<name>.lora_A.default`
    (r, in) and `lora_B` (out, r); B starts at zero, so the policy starts as the base. Every other
    parameter is frozen. Returns peft's wrapper (adapter on/off, its config); `model` stays the HF
    model (the wrapper holds it as base_model.model), so `shard` still finds model.model.layers and
    every other role sees the module it knows.
    On a GPU the frozen base is cast to the compute dtype (bf16: half of its fp32 bytes, as the
    reference model is held) while the adapters stay fp32 master weights. FSDP2 allows the mix in
    one parameter group: it requires a single dtype among the *trainable* parameters only, and
    all-gathers mixed dtypes as bytes (test_lora.py checks both). The forward is unchanged: FSDP2
    casts fp32 weights to bf16 at the all-gather anyway."""
    if cfg.lora_rank < 0:
        raise ValueError(f"actor.lora_rank={cfg.lora_rank}: use 0 (off) or a positive rank")
    from peft import LoraConfig, get_peft_model
    with warnings.catch_warnings():        # peft reads transformers' renamed is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        wrapper = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                   target_modules=lora_targets(cfg.lora_target_modules), bias="none"))
    if device.type == "cuda":
        dtype = getattr(torch, cfg.param_dtype)
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)  # bf16: frees 2 bytes per base parameter, on host and GPU alike
    return wrapper


# --------------------------------------------------------------------------- math
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
    batch's own (sequences: only rows with a valid token, verl's `seq_mask` when it gets no global
    batch size). The update passes the mini-batch's global counts (`global_counts`: over
    micro-batches and ranks, every row for the seq-mean modes, as verl's engine divides by its
    global batch size) so that the gradient does not depend on how the mini-batch is split."""
    mat = mat * mask
    if mode == "token-mean":
        return mat.sum() / (mask.sum() if tokens is None else tokens)
    per_seq = mat.sum(-1)                                          # (B,)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"loss_agg_mode={mode!r}: use one of {LOSS_AGG_MODES}")
    return per_seq.sum() / ((mask.sum(-1) > 0).sum() if seqs is None else seqs)


def policy_stats(clipped: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, tokens) -> torch.Tensor:
    """(pg_clipfrac, ppo_kl) of a micro-batch as shares of a token mean over `tokens` (the
    mini-batch's global count), whatever loss_agg_mode is: summed over micro-batches and ranks
    they are token means over all of them, as verl reports them (a loss-mode "fraction" could
    exceed 1). ppo_kl is KL(old || new) estimated per token by k3 = r - 1 - log r (r = new/old
    probability; >= 0, low variance); verl logs the k1 estimate, the mean of old - new log-prob
    (same expectation under the old policy, noisier, can be negative)."""
    k3 = ratio - 1 - torch.log(ratio)
    return torch.stack([(clipped * mask).sum(), (k3 * mask).sum()]) / tokens


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
    elif not dist.is_initialized() or dist.get_rank() == 0:   # the norm is global: one rank says it
        print(f"[{who}] grad norm {norm} is not finite: optimizer step skipped")
    return norm


def global_counts(mini: dict) -> tuple[float, float]:
    """(valid tokens, rows) of a mini-batch over all ranks: the loss denominators. Rows are all of
    them, an empty response (no valid token) included: verl's engine divides the seq-mean modes by
    the global batch size (ppo_mini_batch_size x n), not by the rows that have a token, so an
    empty row lowers the mean instead of being left out of it."""
    m = mini["response_mask"]
    c = all_sum(torch.stack([m.sum(), torch.tensor(float(m.shape[0]), device=m.device)]).double())
    tokens, seqs = c.tolist()                   # one host sync per mini-batch
    return tokens, seqs


PROBE = 1024                                    # weights per parameter tensor watched for |delta w|


def probe(model) -> torch.Tensor:
    """The first PROBE elements of each local shard, fp32 (a few KB per tensor): how far an update
    moved the weights, without a copy of the model (`update_policy` reports the mean |delta|)."""
    return torch.cat([p.detach().to_local().reshape(-1)[:PROBE].float() if hasattr(p, "to_local")
                      else p.detach().reshape(-1)[:PROBE].float() for p in model.parameters()])


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
    before = probe(model)
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
                    stats = policy_stats(clipped, ratio.detach(), m, tokens)
                    sums += torch.cat([torch.stack([pg, kl, ent_term]), stats]).double()
            norms.append(clipped_step(model, optimizer, cfg.grad_clip, adam, moved, "actor"))
            skipped += not math.isfinite(norms[-1])
    optimizer.zero_grad(set_to_none=True)           # frees the fp32 grad shards before the next stage
    dw = (probe(model) - before).abs()
    dw_sums = torch.stack([dw.sum(), torch.tensor(float(dw.numel()), device=dw.device)]).to(sums)
    sums = all_sum(torch.cat([sums / len(norms), dw_sums]))
    out = dict(zip(names, sums.tolist()))           # means over optimizer steps of global means
    finite = [n for n in norms if math.isfinite(n)] or [float("nan")]
    out.update(grad_norm=sum(finite) / len(finite), optimizer_steps=len(norms), skipped_steps=skipped,
               delta_w_abs_mean=(sums[-2] / sums[-1]).item(), **moved)
    if mismatch:
        out.update(logprob_mismatch(torch.cat([lp for lp, _ in mismatch]),
                                    {k: torch.cat([mb[k] for _, mb in mismatch])
                                     for k in ("response_mask", "rollout_log_probs")}))
    return out


# --------------------------------------------------------------------------- the actor and its moves
@dataclass
class Actor:
    """The policy's state (made by `build`): the FSDP2 model, AdamW, and its offload groups."""
    cfg: ActorConfig
    model: torch.nn.Module                 # the HF model (with LoRA: its target layers hold the adapters)
    optimizer: torch.optim.Optimizer
    params: offload.Stash                  # local shards that train: all, or the first k layers'
                                           # (param_offload_layers); with LoRA the adapters only
    adam: offload.Stash                    # exp_avg + exp_avg_sq: empty until Adam's first step
    device: torch.device
    base: offload.Stash | None = None      # LoRA: the frozen base's shards (bf16 on a GPU); never copied back
    lora: object = None                    # LoRA: peft's wrapper around `model` (disable_adapter, the config)


def build(cfg: ActorConfig, *, mesh, device: torch.device, model_path: str | None = None, seed: int = 0,
          model: torch.nn.Module | None = None) -> Actor:
    """Load (or take `model`, an HF causal LM already built, fp32), add the LoRA adapters
    (lora_rank > 0), shard, make the optimizer; with param_offload the shards leave the GPU at once."""
    if cfg.offload_policy and (cfg.param_offload or cfg.optimizer_offload):
        raise ValueError("actor.offload_policy (FSDP2 CPUOffloadPolicy) already keeps params and Adam state "
                         "on the CPU; turn actor.param_offload / actor.optimizer_offload off")
    model = model if model is not None else load_model(model_path, seed)
    lora = apply_lora(model, cfg, device) if cfg.lora_rank else None   # before fully_shard: it shards what peft made
    model = shard(model, mesh, device, cfg.offload_policy, cfg.param_dtype, cfg.gradient_checkpointing)
    if lora:
        settle_grad_dtypes(model)
    k = cfg.param_offload_layers           # partial offload: only the first k decoder layers' shards
    groups = [model] if k < 0 else model.model.layers[:k]
    optimizer = build_optimizer(model, cfg)
    a = Actor(cfg, model, optimizer, offload.param_stash("actor_params", *groups, trainable=True if lora else None),
              offload.optimizer_stash("actor_optimizer", optimizer), device, lora=lora,
              base=offload.param_stash("actor_base", *groups, trainable=False) if lora else None)
    for s in offloaded(a):
        offload.offload(s)                 # frees the shard bytes until their first use
    return a


def settle_grad_dtypes(model: torch.nn.Module):
    """FSDP2 fixes each group's gradient dtypes (reduce in fp32, fp32 grads for the fp32 adapters) at
    its lazy initialisation, normally the model's first forward, from the parameters that require
    grad at that moment. peft's disable_adapter() turns requires_grad off on the adapters, so if
    LoRA's reference forward came first (GRPO on-policy with vLLM: the actor's first forward), every
    backward after it would hand bf16 grads to fp32 shards and fail (pytorch issue 186998). Running
    that initialisation now, adapters on, settles them; it moves and allocates nothing. (FSDP2 has
    no public call for it; a one-token forward would do the same and leave cuBLAS's workspace.)"""
    model._get_fsdp_state()._lazy_init()


def describe_lora(a: Actor) -> str:
    """The set-up line of a LoRA actor: what trains, what is frozen, and that no reference is held."""
    c, MB = a.cfg, 2 ** 20
    n = sum(p.numel() for p in a.model.parameters() if p.requires_grad)       # whole-model counts
    frozen = [p for p in a.model.parameters() if not p.requires_grad]
    return (f"[lora] rank {c.lora_rank}, alpha {c.lora_alpha}, on {','.join(lora_targets(c.lora_target_modules))}: "
            f"{n:,} adapter parameters train (fp32 {n * 4 / MB:.1f} MB + grads {n * 4 / MB:.1f} MB + Adam "
            f"{n * 8 / MB:.1f} MB over all ranks); the base's {sum(p.numel() for p in frozen):,} are frozen in "
            f"{str(frozen[0].dtype).replace('torch.', '')} ({a.base.nbytes / offload.GB:.3f} GB on this rank); "
            + ("no reference model: the ref log-probs are the actor's with its adapter off" if c.use_kl_loss
               else "no KL loss, no reference"))


def offloaded(a: Actor) -> list:
    """The parameter groups that live on the host between uses (empty when param_offload is off)."""
    if not a.cfg.param_offload:
        return []
    return [a.params] if a.base is None else [a.base, a.params]


@contextlib.contextmanager
def resident(a: Actor, metrics: dict, keep: bool = False):
    """Params on the GPU for a forward-only use, freed after it (the host copy is current: no copy
    back), or left there for the next stage (`keep`)."""
    with offload.loaded(offloaded(a), metrics, keep=keep):
        yield


def compute_old_log_probs(a: Actor, batch: dict, temperature: float, metrics: dict) -> torch.Tensor:
    layout = make_layout(a.cfg, a.cfg.log_prob_micro_batch_size_per_gpu, a.cfg.log_prob_max_token_len_per_gpu)
    with resident(a, metrics):
        return compute_log_probs(a.model, batch, layout, temperature)


def compute_ref_log_probs(a: Actor, batch: dict, temperature: float, metrics: dict,
                          update_next: bool = False) -> torch.Tensor:
    """LoRA's reference log-probs: the actor's own forward with its adapter off, i.e. the frozen
    base, which is the policy at step 0 (no reference model is built or held). Inside the actor's
    bracket. `update_next` (GRPO: the update is the next stage) with prefetch_update: the params stay
    on the GPU after it, so the update copies nothing in (the ref forward needs them itself, so here
    the lever has no copy to hide, only one to save)."""
    layout = make_layout(a.cfg, a.cfg.log_prob_micro_batch_size_per_gpu, a.cfg.log_prob_max_token_len_per_gpu)
    with resident(a, metrics, keep=update_next and a.cfg.prefetch_update), a.lora.disable_adapter():
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


@contextlib.contextmanager
def state_in(a: Actor, loading: bool = False):
    """A checkpoint's bracket: params and Adam on the device while torch's state-dict helpers read
    them (a save) or write into them (a load), then back where they were (`offload.holding`). Why
    through the live tensors and not straight from the host mirrors: those helpers and DCP's
    resharding work on the model and the optimizer, and a load must initialise Adam's lazily created
    state on them. Cost: for the checkpoint's length the device holds what the update does minus
    grads and activations (fp32 params + 2 x params of Adam)."""
    with offload.holding(offloaded(a) + ([a.adam] if a.cfg.optimizer_offload else []), loading):
        yield
        if loading:
            for group in a.optimizer.param_groups:   # this run's settings, not the checkpoint's
                group.update(lr=a.cfg.lr, weight_decay=a.cfg.weight_decay)


def save(a: Actor, tokenizer, path: str, rank: int, model_path: str | None = None) -> str:
    """The final checkpoint in `path`: the policy as a Hugging Face model; with LoRA the adapter in
    peft's format, and with save_merged also the merged model in path/merged. From a local
    `model_path` the input's other files (tokenizer, generation config) are copied as they were.
    Returns what it wrote."""
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
