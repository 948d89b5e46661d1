"""The frozen reference policy: same weights as the actor at step 0, log-probs only, its own offload.

    torchrun --nproc_per_node=2 train_grpo.py --ref.param_offload=true
    python -m pytest test_memory.py -k ref          # on a GPU: ref offload frees its shard bytes

What it holds on the GPU: its shards in the compute dtype (bf16: params x 2 / world bytes), no grads, no
optimizer; a layer's gathered weights and one micro-batch's activations in its forward. What it moves: with
param_offload its shards live in pinned host memory and come in for the ref stage only, inside `resident`, which
the loop holds open (the actor's update params can come in on a side stream meanwhile); they never change, so
they are freed after it without a copy back. verl always puts the reference behind FSDP's CPU offload
(`offload_policy` here); the manual mode (pinned buffers, one copy in per step) is the default, and the two do
not combine (`check`). It exists only to anchor the KL loss (actor.use_kl_loss); with that off it is never
built, nor with LoRA (actor.lora_rank > 0): the frozen base is the step-0 policy, so the actor with its adapter
off is the reference and the options here have no effect (`needed`, `ignored`).
"""
import contextlib
from dataclasses import dataclass, fields

import torch

import offload
import packing
from model import ForwardSettings, compute_log_probs as forward_log_probs, in_use, load_model, make_layout, shard, state


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 32  # samples per forward: bounds the activations
    log_prob_max_token_len_per_gpu: int = 32768  # with actor.use_dynamic_bsz: tokens per forward instead
    param_offload: bool = False            # shards to pinned host except during the ref forward
    offload_policy: bool = False           # FSDP2 CPUOffloadPolicy instead (per-layer copy at all-gather)


RANGES = {"log_prob_micro_batch_size_per_gpu": ">= 1", "log_prob_max_token_len_per_gpu": ">= 1"}  # at parse time
SEARCH = {"param_offload": (False, True)}    # what --offload=auto may turn (plan.py)
SIZES = {"log_prob_micro_batch_size_per_gpu": "forward"}   # searched with the actor's forward (plan.py)
RELIEF = {"ref_params": "--ref.param_offload=true"}   # its term in a stage's prediction -> the change


def needed(actor_cfg) -> bool:
    """A reference model is built for the KL loss, and not with LoRA (its base is the reference)."""
    return actor_cfg.use_kl_loss and actor_cfg.lora_rank == 0


@dataclass
class Ref:                                  # the reference's state, made by `build`
    cfg: RefConfig
    model: torch.nn.Module
    params: offload.Stash                  # its local shards, in the compute dtype; on the host with param_offload
    layout: packing.Layout                 # micro-batches, packing and LM-head chunks (the actor's settings)


def check(cfg: RefConfig):                 # the combination that cannot run (each alone is checked at parse time)
    if cfg.offload_policy and cfg.param_offload:
        raise ValueError("ref.offload_policy (FSDP2 CPUOffloadPolicy) already keeps the ref's params on the CPU; "
                         "turn ref.param_offload off")


def build(cfg: RefConfig, *, model_path, mesh, device, actor_cfg=ForwardSettings(), seed: int = 0) -> Ref:
    """The actor's architecture and initial weights, frozen; its compute dtype and forward settings (packing,
    chunked head, token budgets) from the actor's config (without the actor: model.ForwardSettings, its defaults)."""
    model = load_model(model_path, seed=seed)
    model.requires_grad_(False).eval()     # no grads, no optimizer: params are all it holds
    if device.type == "cuda":
        model.to(getattr(torch, actor_cfg.param_dtype))   # frozen: kept in the compute dtype (bf16: half of fp32)
    model = shard(model, mesh, device, cfg.offload_policy, actor_cfg.param_dtype,
                  embeddings_apart=actor_cfg.embeddings_apart)
    layout = make_layout(actor_cfg, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_max_token_len_per_gpu)
    r = Ref(cfg, model, offload.param_stash("ref_params", model, enabled=cfg.param_offload), layout)
    offload.offload(r.params)              # param_offload: frees the shard bytes until the first ref stage
    return r


def describe(r: Ref) -> list[str]:
    """The set-up report's lines for the reference."""
    lines = [offload.describe("ref.param_offload", r.params.nbytes, r.cfg.param_offload, r.params.views[0].device)]
    return lines + (["[offload] ref.offload_policy: FSDP2 CPUOffloadPolicy, params on pinned host, copied per layer "
                     "at all-gather"] if r.cfg.offload_policy else [])


def ignored(cfg: RefConfig, actor_cfg) -> list[str]:
    """The set-up report's warning when LoRA's base stands in for the reference and ref.* were set."""
    changed = [f"ref.{f.name}={getattr(cfg, f.name)}" for f in fields(cfg) if getattr(cfg, f.name) != f.default]
    return [f"[ref] warning: with actor.lora_rank the reference is the actor with its adapter off "
            f"(no ref model): {', '.join(changed)} has no effect"] if changed and actor_cfg.lora_rank and \
        actor_cfg.use_kl_loss else []


@contextlib.contextmanager
def resident(r: Ref, metrics: dict):
    """The ref stage's bracket: shards in, then freed without a copy back, and their cached blocks given back."""
    with offload.loaded([r.params], metrics):
        yield
    if r.params.enabled and r.params.device.type == "cuda":   # kept, 18.7 GB of them outlived the 7B update (measured)
        reserved = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        metrics["offload/ref_params/released_gb"] = (reserved - torch.cuda.memory_reserved()) / offload.GB


def compute_log_probs(r: Ref, batch: dict, temperature: float) -> torch.Tensor:
    """(B, R) log-probs in micro-batches (inside `resident` when the shards are offloaded)."""
    return forward_log_probs(r.model, batch, r.layout, temperature)


# --------------------------------------------------------------------------- predicted
# Its bytes in the planner's terms (predict.py composes them): per rank, `z` a model.Sizes; its state
# group as (bytes on the GPU in use, between uses, in pinned host memory); its stage as its moments.
def predicted_states(cfg: RefConfig, z) -> dict:
    """Its shards in the compute dtype; FSDP2's CPUOffloadPolicy keeps them on the host (a layer comes over)."""
    p = z.shard(z.shapes.params, z.c)
    return {"ref_params": (0, 0, p) if cfg.offload_policy else state(p, cfg.param_offload)}


def predicted_ref_logp(cfg: RefConfig, z, states: dict, actor_cfg) -> list:
    layout = make_layout(actor_cfg, cfg.log_prob_micro_batch_size_per_gpu, cfg.log_prob_max_token_len_per_gpu)
    return [{**in_use(states, "ref_params"), **z.forward(layout)}]
