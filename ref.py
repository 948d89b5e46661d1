"""The frozen reference policy: same weights as the actor at step 0, log-probs only, its own offload.

    torchrun --nproc_per_node=2 train_grpo.py --ref.param_offload=true
    python -m pytest test_memory.py -k ref          # on a GPU: ref offload frees its shard bytes

It exists only to anchor the KL loss (actor.use_kl_loss); with that off it is never built, nor with
LoRA (actor.lora_rank > 0): the frozen base is the step-0 policy, so the actor with its adapter off
is the reference (actor.compute_ref_log_probs) and the options here have no effect (`needed`).
What it moves: with param_offload its bf16 shards live in pinned host memory and come in for
the ref stage only (`resident`); they never change, so they are freed after it without a copy
back. verl always puts the reference behind FSDP's CPU offload; here both modes are offered
(`offload_policy` is that one) and the manual one (pinned buffers, one copy in per step) is the
default.
"""
import contextlib
from dataclasses import dataclass, fields

import torch

import actor
import offload
import packing


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 32  # samples per forward: bounds the activations
    log_prob_max_token_len_per_gpu: int = 32768  # with actor.use_dynamic_bsz: tokens per forward instead
    param_offload: bool = False            # shards to pinned host except during the ref forward
    offload_policy: bool = False           # FSDP2 CPUOffloadPolicy instead (per-layer copy at all-gather)


RANGES = {"log_prob_micro_batch_size_per_gpu": ">= 1", "log_prob_max_token_len_per_gpu": ">= 1"}   # checked at parse time (train_grpo.check_config)


@dataclass
class Ref:
    """The reference's state (made by `build`)."""
    cfg: RefConfig
    model: torch.nn.Module
    params: offload.Stash                  # its local shards, in the compute dtype
    layout: packing.Layout                 # micro-batches, packing and LM-head chunks (the actor's settings)


def needed(actor_cfg: actor.ActorConfig) -> bool:
    """A reference model is built for the KL loss, and not with LoRA (its base is the reference)."""
    return actor_cfg.use_kl_loss and actor_cfg.lora_rank == 0


def ignored(cfg: RefConfig) -> list[str]:
    """The ref.* options set away from their defaults: what to warn about when none is built."""
    return [f"ref.{f.name}={getattr(cfg, f.name)}" for f in fields(cfg) if getattr(cfg, f.name) != f.default]


def build(cfg: RefConfig, *, model_path, mesh, device, actor_cfg: actor.ActorConfig, seed: int = 0) -> Ref:
    """The actor's architecture and initial weights, frozen; its compute dtype and forward
    settings (packing, chunked head, token budgets) come from the actor's config."""
    model = actor.load_model(model_path, seed)
    model.requires_grad_(False).eval()     # no grads, no optimizer: params are all it holds
    if device.type == "cuda":
        model.to(getattr(torch, actor_cfg.param_dtype))   # frozen: kept in the compute dtype (bf16: half of fp32)
    model = actor.shard(model, mesh, device, cfg.offload_policy, actor_cfg.param_dtype)
    layout = actor.make_layout(actor_cfg, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_max_token_len_per_gpu)
    r = Ref(cfg, model, offload.param_stash("ref_params", model), layout)
    if cfg.param_offload:
        offload.offload(r.params)          # frees the ref's shard bytes until the first ref stage
    return r


@contextlib.contextmanager
def resident(r: Ref, metrics: dict):
    """The ref stage's bracket: shards in, then freed (no copy back: they never change)."""
    with offload.loaded([r.params] if r.cfg.param_offload else [], metrics):
        yield


def compute_log_probs(r: Ref, batch: dict, temperature: float) -> torch.Tensor:
    """(B, R) log-probs in micro-batches (inside `resident` when the shards are offloaded)."""
    return actor.compute_log_probs(r.model, batch, r.layout, temperature)
