"""LoRA through peft: the actor's adapters, what they cost, and the one FSDP2 detail they need.

    python train_grpo.py --actor.lora_rank=16 --actor.lr=1e-3   # adapters train, the base is the reference
    python -m pytest tests/test_lora.py -q

Only the adapters train: grads and Adam exist for them alone (r x (in + out) per target matrix: a
few MB), and the frozen base is held in the compute dtype on a GPU (bf16: half of the fp32 master
weights). The actor (actor.py) applies them before sharding and moves their bytes; `cfg` below is
its ActorConfig (lora_rank, lora_alpha, lora_target_modules, param_dtype, use_kl_loss).
"""
import warnings

import torch

from model import head_dim

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
    h, d = config.hidden_size, head_dim(config)
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),     # (in, out)
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return config.num_hidden_layers * rank * sum(sum(shapes[t]) for t in lora_targets(targets))


def apply(model: torch.nn.Module, cfg, device: torch.device):
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


def settle_grad_dtypes(model: torch.nn.Module):
    """FSDP2 fixes each group's gradient dtypes (reduce in fp32, fp32 grads for the fp32 adapters) at
    its lazy initialisation, normally the model's first forward, from the parameters that require
    grad at that moment. peft's disable_adapter() turns requires_grad off on the adapters, so if
    LoRA's reference forward came first (GRPO on-policy with vLLM: the actor's first forward), every
    backward after it would hand bf16 grads to fp32 shards and fail (pytorch issue 186998). Running
    that initialisation now, adapters on, settles them; it moves and allocates nothing. (FSDP2 has
    no public call for it; a one-token forward would do the same and leave cuBLAS's workspace.)"""
    model._get_fsdp_state()._lazy_init()


def describe(model: torch.nn.Module, cfg, base_bytes: int) -> str:
    """The set-up line of a LoRA actor: what trains, what is frozen, and that no reference is held."""
    c, MB = cfg, 2 ** 20
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)       # whole-model counts
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return (f"[lora] rank {c.lora_rank}, alpha {c.lora_alpha}, on {','.join(lora_targets(c.lora_target_modules))}: "
            f"{n:,} adapter parameters train (fp32 {n * 4 / MB:.1f} MB + grads {n * 4 / MB:.1f} MB + Adam "
            f"{n * 8 / MB:.1f} MB over all ranks); the base's {sum(p.numel() for p in frozen):,} are frozen in "
            f"{str(frozen[0].dtype).replace('torch.', '')} ({base_bytes / 2 ** 30:.3f} GB on this rank); "
            + ("no reference model: the ref log-probs are the actor's with its adapter off" if c.use_kl_loss
               else "no KL loss, no reference"))
