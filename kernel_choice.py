"""Which kernels the trainer's models run: transformers' own modules, Liger-Kernel's fused ones, or each
decoder layer compiled. One process-wide choice (`--kernels`), made before any model is built.

    python -m pytest -q -m gpu tests/test_packing.py -k kernels   # each as close to fp32 as torch's bf16 (GPU)

Why: at 0.5B the update's GPU idles a third of the stage, waiting for the host to launch the next of
many small kernels, and of its busy time the norms and elementwise kernels take more than twice the
matmuls' (bench/README.md, kernels). Fewer, larger kernels are the lever (and they keep less for backward):
- liger    Liger-Kernel's Triton RMSNorm, SwiGLU and RoPE (`pip install liger-kernel`; Qwen2 models, GPU).
           Each is one kernel per call where transformers runs several, and they keep less for backward
           (an RMSNorm its bf16 input and one fp32 scalar per token, not an fp32 copy of its input).
           Liger replaces the classes in transformers' Qwen2 module, so every Qwen2 model built after this
           (actor, reference, critic, reward model) has them; the parameter names are the same, so
           checkpoints, the weight sync and LoRA see no difference.
- compile  torch.compile of each decoder layer's forward (regional compilation; FSDP's hooks stay outside
           it). The first steps pay the compilation.
- torch    transformers' modules as they are.
- auto     liger where it runs (installed, a GPU, a Qwen2 model), else torch.
The LM head is not among them: packing.py already applies it to response tokens only, a chunk at a time.
"""
import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

import packing

KERNELS = ("auto", "liger", "compile", "torch")
HEAD_KERNELS = ("auto", "eager", "compile")   # the LM head's chunk (compile_head): --head_kernel
# What they keep for backward: liger and compile alike keep no fp32 copy of each RMSNorm's input and no
# MLP activation (model.Shapes.fused); measured update peaks with checkpointing off, 0.5B / 1.5B:
# torch 23.75 / 56.18 GB, liger 19.70 / 47.96, compile 19.74 / 48.02 (bench/README.md)
FUSED = ("liger", "compile")


def fused(kind: str, model_type: str) -> bool:
    """Does a GPU run with `--kernels=kind` keep the fused kernels' activations? (`planned`'s answer.)"""
    return planned(kind, model_type)[0] in FUSED


def planned(kind: str, model_type: str) -> tuple[str, str]:
    """(the kernels a GPU run with `--kernels=kind` uses, why): the planner's assumption wherever it runs, by
    `resolve`'s rule on a GPU. What it cannot see is the GPU node's liger-kernel: this machine's stands in
    for it under `auto` (the why says so, and how to plan the other way); an explicit liger is planned as
    given (the run checks it is installed), but not for a model the run refuses it for."""
    if kind == "liger" and model_type != "qwen2":
        raise ValueError(f"--kernels=liger needs a Qwen2 model (this one is {model_type}); use --kernels=torch")
    if kind != "auto":
        return kind, "as given"
    used, why = resolve(kind, torch.device("cuda"), model_type)
    if model_type != "qwen2":                  # the model decides, wherever the run is
        return used, why
    if used == "liger":                        # the package decides: this machine's may not be the GPU node's
        return used, "auto: liger-kernel imports on this machine; a GPU node without it runs torch: " \
                     "--kernels=torch plans that"
    return used, f"auto: this machine lacks {_liger()[1]}; a GPU node with it runs liger: --kernels=liger plans that"


@functools.cache
def _torch_modules() -> dict:
    """transformers' own, kept at the first `use` (before any swap) so that `torch` can undo `liger`."""
    from transformers.models.qwen2 import modeling_qwen2 as m
    return {"Qwen2RMSNorm": m.Qwen2RMSNorm, "Qwen2MLP": m.Qwen2MLP, "apply_rotary_pos_emb": m.apply_rotary_pos_emb}


@functools.cache
def _liger() -> tuple:
    """(RMSNorm, SwiGLU MLP, RoPE) from Liger-Kernel and "", or None and what is missing. Imported once:
    installed is not enough (a Triton it does not support fails at import)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None, "liger-kernel (pip install liger-kernel)"
    # its registry logs a warning per optional backend it lacks (CuTe DSL, Ascend): not this run's business
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    try:
        from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP, liger_rotary_pos_emb
    except Exception as e:
        return None, f"a liger-kernel that imports (it raised {type(e).__name__}: {str(e)[:160]})"
    return (LigerRMSNorm, LigerSwiGLUMLP, liger_rotary_pos_emb), ""


def resolve(kind: str, device: torch.device, model_type: str) -> tuple[str, str]:
    """(the kernels used, why): `auto` becomes liger or torch; liger where it cannot run is an error."""
    missing = ("a GPU" if device.type != "cuda" else      # the model before the package: installing would not help
               f"a Qwen2 model (this one is {model_type})" if model_type != "qwen2" else _liger()[1])
    if kind == "auto":
        return ("liger", "auto: installed, a GPU, Qwen2") if not missing else ("torch", f"auto: liger needs {missing}")
    if kind == "liger" and missing:
        raise ValueError(f"--kernels=liger needs {missing}; use --kernels=torch")
    if kind == "compile" and device.type != "cuda":
        raise ValueError("--kernels=compile needs a GPU; use --kernels=torch")
    return kind, "as given"


def use(kind: str, device: torch.device, model_type: str, head: str = "eager", rows: int = 512) -> tuple[str, str]:
    """Before any model is built: transformers' Qwen2 module gets `kind`'s classes (liger) or its own
    back (torch, compile), so the models built afterwards have them (RoPE is looked up at each call:
    it follows at once); the LM head's chunks of `rows` tokens run `head` (eager, or compile: a GPU's).
    Returns (the kernels used, the set-up line)."""
    from transformers.models.qwen2 import modeling_qwen2 as m
    given, head = head, resolve_head(head, device)
    compile_head(head == "compile", rows)
    used, why = resolve(kind, device, model_type)
    own = _torch_modules()
    if used == "liger":
        m.Qwen2RMSNorm, m.Qwen2MLP, m.apply_rotary_pos_emb = _liger()[0]
    else:
        for name, obj in own.items():
            setattr(m, name, obj)
    return used, f"[kernels] {used} ({why}): {WHAT[used]}; the LM head's chunk {head}" + " (auto)" * (given == "auto")


# The LM head chunk's bytes per (token, vocab) element at its peak, no-grad forward / backward (model.Shapes.head):
# eager's (packing.HEAD_*); compiled, the bf16 logits its matmul writes (test_memory.py's plan test's ref stage,
# 6.92 GB measured, 7.00 planned), in backward with their gradient and the chunk's weight gradient (bench_head.py:
# 0.58 GB a 512-token chunk at 1.5B, 0.44 at 0.5B, measured)
HEAD_BYTES = {"eager": (packing.HEAD_FORWARD, packing.HEAD_BACKWARD), "compile": (2, 8)}


def planned_head(head: str) -> str:
    """The LM head's chunk a GPU run with `--head_kernel=head` uses: the planner's, wherever it runs."""
    return resolve_head(head, torch.device("cuda"))


def resolve_head(head: str, device: torch.device) -> str:
    """The LM head's chunk a run uses: auto is compile on a GPU inductor writes Triton kernels for (Triton
    installed, compute capability 7.0 or newer) and eager elsewhere; compile where there is no GPU is an error."""
    if head == "compile" and device.type != "cuda":
        raise ValueError("--head_kernel=compile needs a GPU; use --head_kernel=eager")
    if head != "auto":
        return head
    triton = importlib.util.find_spec("triton") is not None   # the planner on a CPU: the GPU node's, by this one's
    new = not torch.cuda.is_available() or torch.cuda.get_device_capability(device) >= (7, 0)
    return "compile" if device.type == "cuda" and triton and new else "eager"


WHAT = {"liger": "Liger-Kernel's RMSNorm, SwiGLU and RoPE in every Qwen2 model", "torch": "transformers' modules",
        "compile": "each decoder layer's forward compiled (the first steps compile)"}


@functools.cache
def _compiled_head(backend: str):
    return torch.compile(packing._head_chunk, backend=backend)


def _padded(compiled, rows: int, h, w, ids, temperature: float, entropy: str):
    """`compiled` on h's rows padded to a multiple of `rows` (the chunk: every chunk one shape, a batch's last
    one too, none padded beyond its chunk), the padding dropped from what it returns. While the CUDA allocator
    records stacks (--memory_history, test_memory.py's leak test) the chunk runs eager: torch 2.11's compiled
    autograd function fails there ("SystemError: ... returned NULL without setting an exception")."""
    if _recording(h):
        return packing._head_chunk(h, w, ids, temperature, entropy)
    n = h.shape[0]
    pad = -n % rows if n else rows         # an empty chunk (a rank with no response tokens) runs padding
    if pad:
        h, ids = F.pad(h, (0, 0, 0, pad)), F.pad(ids, (0, pad))
    return compiled(h, w, ids, temperature, entropy)[:n]


def _recording(h) -> bool:
    return h.is_cuda and torch._C._cuda_isHistoryEnabled()


def compile_head(on: bool, rows: int = 512, backend: str = "inductor") -> bool:
    """The LM head's chunk function (packing.HEAD), process-wide: compiled, on chunks of `rows` response tokens
    (actor.logits_chunk_tokens; <= 0, the whole batch at once: multiples of 512), or eager. `backend`: inductor
    on a GPU; a test's aot_eager traces the same graph without generating code. Returns `on`. Compiled, the
    cast, the temperature, logsumexp, the gather and the entropy fuse into a few reductions over a chunk's
    logits instead of a dozen eager passes over its (chunk, vocab) fp32 block: at 1.5B's head over 32k
    response tokens, forward + backward 2.0x faster and the chunk's peak 0.58 GB against 1.45
    (bench/bench_head.py); the planner counts its chunk's bytes (HEAD_BYTES)."""
    if on:
        packing.HEAD["chunk"] = functools.partial(_padded, _compiled_head(backend), rows if rows > 0 else 512)
    else:
        packing.HEAD.pop("chunk", None)
    return on


def compile_layers(models: list, used: str) -> int:
    """With `used` == compile: torch.compile each decoder layer's forward in place, after
    sharding (FSDP2's all-gather and reshard hooks run around it, uncompiled). Sizes change every
    micro-batch, so shapes are dynamic from the start (one graph, not one per length). A model seen twice
    (PPO's shared critic) is compiled once. Returns the layers compiled."""
    if used != "compile":
        return 0
    layers = {id(m): m for model in models for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
    for layer in layers.values():
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)
