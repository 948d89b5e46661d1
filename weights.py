"""The policy's weights out of FSDP2, one tensor at a time: into vLLM (the weight sync) and into
a Hugging Face checkpoint, with LoRA adapters merged on the way.

    python -m pytest tests/test_lora.py tests/test_dist.py -q -k "sync or gather or checkpoint"

No state dict is ever built: a live `state_dict()` result keeps the GPU shards alive after an
offload, and a whole gathered model would double the model's bytes. Each parameter is gathered
(an all-gather: every rank iterates to the end), used, and freed before the next.
"""
import os
import shutil

import torch

from model import is_dir

ADAPTER = "default"                        # peft's name for the one adapter


def lora_layers(model: torch.nn.Module) -> dict:
    """{module name: peft LoRA layer} (empty without LoRA)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def merge_lora(weight: torch.Tensor, layer, device) -> torch.Tensor:
    """W + scale x B @ A for one LoRA target, in fp32: `weight` is its gathered base (out, in), the
    adapter is gathered here (r x (in + out) elements). A new tensor: the parameter is never written
    (a gather on one rank can return the shard's own storage)."""
    A = full_param(layer.lora_A[ADAPTER].weight, device)          # (r, in)
    B = full_param(layer.lora_B[ADAPTER].weight, device)          # (out, r)
    return weight.to(torch.float32, copy=True).addmm_(B.float(), A.float(), alpha=layer.scaling[ADAPTER])


def full_param(p: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole parameter on `device` (an all-gather: every rank calls it). With `dtype` the shard
    is cast before the gather, so the gather moves and leaves dtype bytes (bf16: half of the fp32
    master's) and no fp32 copy of the whole tensor exists; the values are those of casting the
    gathered tensor (a cast is elementwise)."""
    if not hasattr(p, "full_tensor"):
        return p.detach().to(device).to(dtype or p.dtype)
    from torch.distributed.tensor import DTensor
    local = p.to_local().detach().to(device, non_blocking=True)   # CPUOffloadPolicy: shards on the host
    local = local.to(dtype) if dtype is not None else local
    if p.device_mesh.size() == 1:   # one rank holds it whole: a DTensor gather costs ~0.07-0.26 ms a tensor for nothing
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()


@torch.no_grad()
def hf_weights(model: torch.nn.Module, device, dtype: torch.dtype | None = None):
    """(Hugging Face name, whole tensor on `device`, in `dtype` if given) for every parameter,
    gathered one at a time in named_parameters() order (all-gathers: every rank iterates to the end).
    With LoRA each target's weight comes merged, W + scale x B @ A in fp32, under its HF name
    (`...q_proj.weight`, not `...q_proj.base_layer.weight`), and the adapter matrices are not
    yielded: what the weight sync and the merged checkpoint need, with no second model built.
    Transient: one gathered weight (+ its fp32 merge and the adapter's r x (in + out) for a target)."""
    layers = lora_layers(model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue                       # each adapter matrix is folded into its base weight below
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):  # a LoRA target: peft's name -> the HF one
            owner = owner[:-len(".base_layer")]
            full = full_param(p, device)
            if leaf == "weight":
                full = merge_lora(full, layers[owner], device)    # the gathered base is freed here
            full = full.to(dtype) if dtype is not None else full
            name = f"{owner}.{leaf}"
        else:                              # cast before the gather: one dtype-sized copy, no fp32 one
            full = full_param(p, device, dtype)
        yield name, full
        del full                           # before the next gather: one weight alive at a time


def hf_shapes(model: torch.nn.Module) -> list:
    """(Hugging Face name, whole shape) of each tensor `hf_weights` yields, in its order, without a
    gather: what a receiver needs to lay out the tensors before they come."""
    out = []
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer"):
            name = f"{owner[:-len('.base_layer')]}.{leaf}"
        out.append((name, tuple(p.shape)))
    return out


def save_adapter(model, peft_config, tokenizer, path: str, rank: int, device):
    """The LoRA adapter in peft's format (`PeftModel.from_pretrained(base, path)` loads it):
    adapter_model.safetensors with each target's lora_A / lora_B under the names peft saves
    (`base_model.model.<module>.lora_A.weight`), adapter_config.json, the tokenizer. Each matrix is
    gathered on its own to rank 0's host memory."""
    sd = {}
    for name, p in model.named_parameters():
        if p.requires_grad:                # the adapters: everything else is the frozen base
            full = full_param(p, device)   # collective: all ranks
            if rank == 0:
                sd["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = full.to("cpu", copy=True).contiguous()
            del full
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        save_safetensors(sd, os.path.join(path, "adapter_model.safetensors"))
        peft_config[ADAPTER].save_pretrained(path)
        tokenizer.save_pretrained(path)


def save_safetensors(sd: dict, file: str):
    """safetensors' save_file, then the mode a plain open() gives a new file (0o666 less the umask):
    save_file makes its file 0600 whatever the umask (0.8.0), so a final/ shared with a group or
    served by another user's vLLM could not be read."""
    from safetensors.torch import save_file
    save_file(sd, file, metadata={"format": "pt"})
    os.chmod(file, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, racing any thread that
    creates a file meanwhile); where /proc does not say, set and restored."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


# files of an input model directory that are not copied to the output: the weights (written anew)
# and the config (written from the trained model)
NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
              ".index.json")


def save_hf(model, tokenizer, path: str, rank: int, device, dtype: torch.dtype | None = None,
            model_path: str | None = None):
    """A Hugging Face checkpoint (safetensors + config + tokenizer) that from_pretrained and vLLM load
    (with LoRA: the merged weights, cast to `dtype`; None keeps each parameter's). Parameters are
    gathered one at a time to rank 0's host memory (never a GPU state dict).
    From a local `model_path` every other file is copied as it was (tokenizer files,
    generation_config.json, chat template, license): re-serialising the tokenizer can change its
    class and how it splits text. The embedded model's tokenizer is saved with save_pretrained."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    sd = {}
    for name, full in hf_weights(model, device):   # collectives: all ranks
        if rank == 0 and not (tied and name == "lm_head.weight"):
            sd[name] = full.to("cpu", dtype or full.dtype, copy=True).contiguous()
        del full
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        save_safetensors(sd, os.path.join(path, "model.safetensors"))
        # fully_shard swaps the class for "FSDP<Name>"; the checkpoint names the plain HF class.
        hf_class = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
        model.config.architectures = [hf_class.__name__]
        model.config.save_pretrained(path)
        if not is_dir(model_path):
            tokenizer.save_pretrained(path)
            return
        for name in sorted(os.listdir(model_path)):
            src = os.path.join(model_path, name)
            if os.path.isfile(src) and name != "config.json" and not name.endswith(NOT_COPIED):
                shutil.copyfile(src, os.path.join(path, name))


def final_bytes(policy, save_merged: bool, model_path: str | None = None) -> int:
    """The final save's bytes (checkpoint.save_final of actor.save; `policy` an actor.Actor): the policy's params
    in their own dtype (LoRA: the adapter, and the merged model with save_merged), and per model folder written its
    config, the tokenizer and the files copied from a local `model_path` (1 MiB for the first two, generously)."""
    params = list(policy.model.parameters())
    files = 2**20 + (sum(os.path.getsize(os.path.join(model_path, n)) for n in os.listdir(model_path)
                         if os.path.isfile(os.path.join(model_path, n)) and not n.endswith(NOT_COPIED))
                     if is_dir(model_path) else 0)
    if policy.lora is None:
        return sum(p.numel() * p.element_size() for p in params) + files
    n = sum(p.numel() * p.element_size() for p in params if p.requires_grad) + files
    merged = sum(p.numel() * p.element_size() for p in params if not p.requires_grad) + files   # with save_merged
    return n + (merged if save_merged else 0)
