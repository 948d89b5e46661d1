"""The frozen reference policy: same weights as the actor at step 0, log-probs only, own offload flag.

    torchrun --nproc_per_node=2 train_grpo.py --ref.param_offload=true
    python -m pytest test_memory.py -k ref          # on a GPU: ref offload frees its shard bytes

It exists only to anchor the KL loss (actor.use_kl_loss); with that off it is never built.
verl always puts the reference behind FSDP's CPU offload; here both modes are offered and the
manual one (pinned buffers, one copy in per step) is the default.
"""
from dataclasses import dataclass

import torch

import actor
import offload


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 32  # samples per forward: bounds the (B, R, vocab) logits
    param_offload: bool = False            # shards to pinned host except during the ref forward
    offload_policy: bool = False           # FSDP2 CPUOffloadPolicy instead (per-layer copy at all-gather)


def build(model_path, mesh, device, cfg: RefConfig, param_dtype: str, seed: int = 0):
    """Returns (model, stash). The stash holds the shards when param_offload is on, else is None."""
    model = actor.load_model(model_path, seed)
    model.requires_grad_(False).eval()     # no grads, no optimizer: params are all it holds
    if device.type == "cuda":
        model.to(getattr(torch, param_dtype))   # frozen: kept in the compute dtype (bf16: half of fp32)
    model = actor.shard(model, mesh, device, cfg.offload_policy, param_dtype)
    stash = offload.param_stash("ref_params", model)
    if cfg.param_offload:
        offload.offload(stash)             # frees the ref's shard bytes until the first ref stage
    return model, stash


def compute_ref_log_probs(model, stash, batch: dict, cfg: RefConfig, temperature: float,
                          metrics: dict, prefetch=()) -> torch.Tensor:
    """load -> micro-batched forward -> offload (the bracket is a no-op when param_offload is off).
    `prefetch`: stashes of the next stage copied in on a side stream while this forward runs
    (issued after the ref's own reload, so they do not share the link with it)."""
    with offload.loaded([stash] if cfg.param_offload else [], metrics):
        for s in prefetch:
            metrics.update(offload.reload(s, background=True))
        return actor.compute_log_probs(model, batch, cfg.log_prob_micro_batch_size_per_gpu, temperature)
