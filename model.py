"""What every role shares: the model behind --model, FSDP2, layouts, the micro-batched forward, the collectives,
the shapes the predictions count with (what only the trained roles share: adam.py, losses.py). A role file imports
this one, offload.py and packing.py (ulysses.py through packing); copying ref.py brings them, not actor.py.

    python -m pytest -q tests/test_dist.py tests/test_packing.py      # 2 ranks == 1; packed == padded

--model (and --reward_model.path) name one of three things, resolved here and nowhere else:
    None            the embedded tiny Qwen2 (tiny.py), built in code
    random:<size>   a Qwen2.5 size with random weights (random:qwen2.5-7b, random:tiny): benchmarks
    a directory     a local Hugging Face checkpoint (nothing is downloaded)
`load_model` builds it with the head a role needs: "causal" (actor, ref: the LM head), "value"
(the separate critic: one output per token), "score" (the reward model: one per sequence), fp32
on the host (random sizes straight on the GPU: seconds instead of minutes at 7B); `shard` then
leaves each rank its FSDP2 shard on its device.
"""
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import packing

HEADS = {"causal": "CausalLM", "value": "TokenClassification", "score": "SequenceClassification"}

# --------------------------------------------------------------------------- --model
def random_size(path: str | None) -> str | None:
    """"random:<size>" -> "<size>"; None for the tiny default and for a directory."""
    return path[len("random:"):] if path is not None and path.startswith("random:") else None


def is_dir(path: str | None) -> bool:
    """`path` names a local checkpoint (not the tiny default, not random weights)."""
    return path is not None and random_size(path) is None


# --model=random:<size> and the embedded default (None: "tiny", whose 16-character tokenizer is tiny.py's):
# Qwen2 shapes built in code, the memory and speed of a real checkpoint of that size, nothing downloaded
SIZES = {  # vocab, hidden, intermediate, layers, heads, kv heads, tied embeddings
    "tiny": (16, 256, 768, 4, 4, 2, True),             # about 3.2M parameters
    "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": (151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": (151936, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": (151936, 3584, 18944, 28, 28, 4, False),
    "qwen2.5-72b": (151936, 8192, 29568, 80, 64, 8, False),   # its vocabulary is 152,064 (0.01 % more)
}


def size_config(name: str):
    """The Qwen2 config of a SIZES entry (pad id 0, eos id 1, as tiny.py's tokenizer has them)."""
    from transformers import Qwen2Config
    v, h, i, n, heads, kv, tied = SIZES[name]
    tiny = name == "tiny"
    return Qwen2Config(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                       num_key_value_heads=kv, max_position_embeddings=64 if tiny else 32768, tie_word_embeddings=tied,
                       pad_token_id=0, eos_token_id=1, bos_token_id=1 if tiny else None,
                       torch_dtype="float32" if tiny else "bfloat16", architectures=["Qwen2ForCausalLM"])


def hf_config(path: str | None, option: str = "--model"):
    """The HF config of `path` without its weights, a fresh object each call. `option`: how an
    unknown random size or a missing directory is named in the error."""
    size = "tiny" if path is None else random_size(path)
    if size is not None:
        if size not in SIZES:
            raise ValueError(f"{option}={path}: known sizes are " + ", ".join(f"random:{k}" for k in SIZES))
        return size_config(size)
    check_model_path(path, option)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, local_files_only=True)


def head_dim(config) -> int:
    """Per-head width: the config's own, or hidden / heads (Qwen2 and Llama configs may omit it)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_model_path(path: str | None, option: str = "--model"):
    if is_dir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{option} {path}: no config.json there; pass a local Hugging Face "
                                f"model directory (nothing is downloaded)")


def load_model(path: str | None, seed: int = 0, head: str = "causal") -> torch.nn.Module:
    """fp32 weights with `head` (HEADS): built from `seed` (every rank, and the reference, builds the
    same weights), or read from a local checkpoint."""
    import transformers
    config = hf_config(path)
    if head != "causal":                   # one output: a value per token, or a score per sequence
        # Set on the config, not passed to from_pretrained: configs without a classifier_dropout field
        # (Qwen2's) reject it as a keyword. Without it a value head gets dropout 0.1: noisy values.
        config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(seed)
    if not is_dir(path):                   # fp32 master weights, whatever dtype the config names
        gpu = random_size(path) not in (None, "tiny") and torch.cuda.is_available()
        with torch.device("cuda" if gpu else "cpu"):
            return getattr(transformers, f"Qwen2For{HEADS[head]}")(config).float()
    return getattr(transformers, f"AutoModelFor{HEADS[head]}").from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=True, attn_implementation="sdpa")


# --------------------------------------------------------------------------- FSDP2
def one_process_group(device: torch.device, **kw):
    """A process group of this process alone, with no port (plain `python`): FSDP2's mesh needs a group
    even at world 1. Gloo for CPU tensors, and NCCL for CUDA ones on a GPU (CPUOffloadPolicy's shards
    and grad norms are CPU tensors: an NCCL-only group has no backend for them). `kw`: init_process_group's."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)


def build_mesh(device, world: int, fsdp_size: int):
    """("fsdp",) over all ranks, or ("replicate", "fsdp") for hybrid sharding. A script of one process
    with no process group (a role copied into your code, run with plain `python`) gets one of its own
    here; under torchrun, without one, torch's mesh starts it from torchrun's environment."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        if world != 1:
            raise ValueError(f"build_mesh over {world} ranks in a process started without torchrun: start it "
                             f"with torchrun --nproc_per_node={world}, or build the mesh for world 1")
        one_process_group(device)
    if fsdp_size in (-1, world):
        return init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device.type, (world // fsdp_size, fsdp_size),
                            mesh_dim_names=("replicate", "fsdp"))


def shard(model: torch.nn.Module, mesh, device: torch.device, offload_policy: bool = False,
          param_dtype: str = "bfloat16", gradient_checkpointing: bool = False,
          embeddings_apart: bool = True) -> torch.nn.Module:
    """FSDP2: each decoder layer, then (embeddings_apart, an untied model) the input embeddings and the LM head a unit
    each, then the root, which takes what is left (the final norm; tied: the shared embeddings). Inner units first so
    each all-gathers and frees on its own (a backward's end, one table's: 7B's update 73.1 -> 66.1 GB device level).
    A 2-D mesh ("replicate", "fsdp") makes it hybrid sharding. Shards go to `device` (pinned host: CPUOffloadPolicy)."""
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
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()   # (a value / score model: no head)
    tied = head is not None and head.weight is emb.weight   # one table in two modules: it stays in the root
    for end in [m for m in (emb, head) if m is not None] if embeddings_apart and not tied else []:
        fully_shard(end, mesh=mesh, mp_policy=mp, offload_policy=policy)   # gathered and reduced one at a time
    # the root too reshards after forward (FSDP2 keeps it gathered by default): a tied table stays on the GPU otherwise
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=True)
    if not (offload_policy and cuda):
        model.to(device)            # buffers (rotary inv_freq); shards already moved by fully_shard
    return model


# --------------------------------------------------------------------------- forward
@dataclass(frozen=True)
class ForwardSettings:
    """What a role that runs the policy's architecture reads of the actor's config: the compute dtype, how FSDP2
    wraps the model (`shard`) and how samples go through it (`make_layout`). actor.ActorConfig holds the same
    fields as options, with these defaults (each written here once); a role built without the actor's config
    (ref.py copied alone into a script) gets them: `ref.build(..., actor_cfg=ForwardSettings())`, the default."""
    param_dtype: str = "bfloat16"
    remove_padding: bool = True
    logits_chunk_tokens: int = 512
    use_dynamic_bsz: bool = False
    ulysses_sequence_parallel_size: int = 1
    embeddings_apart: bool = True          # FSDP2 units of their own for the embeddings and an untied head (`shard`)


def make_layout(cfg, micro: int, max_tokens: int) -> packing.Layout:
    """How a role splits and runs its batch: `micro` samples, or `max_tokens` with use_dynamic_bsz.
    `cfg`: the actor's config (or `ForwardSettings`), whose packing and sequence-parallel settings every
    role that runs this architecture shares."""
    k = cfg.ulysses_sequence_parallel_size     # a budget is per GPU (as verl's): a group of k runs k x it
    return packing.Layout(micro=micro, max_tokens=max_tokens * k if cfg.use_dynamic_bsz else 0,
                          pack=cfg.remove_padding, chunk=cfg.logits_chunk_tokens, sp=k)


def forward(model, mb: dict, temperature: float, layout: packing.Layout, entropy: str = "none"):
    """Log-probs (and entropy) of the response tokens, (B, R), zero on padding. Only the positions
    that predict a response token reach the LM head, a chunk at a time (packing.py).
    entropy: "none"; "log" (no graph: nothing extra kept for backward); "grad" (in the loss)."""
    logp, ent = packing.response_logprobs(model, mb, temperature, layout, entropy)
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


# --------------------------------------------------------------------------- collectives
def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


# --------------------------------------------------------------------------- predicted bytes
# What every role's predicted section shares (the planner, predict.py, composes them; nothing here
# builds a model). Per rank, in bytes.
@dataclass(frozen=True)
class Shapes:
    """What memory depends on in a decoder-only transformer (Qwen2 / Llama layout)."""
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    fused: bool = False           # --kernels=liger or compile (kernel_choice.FUSED): less kept for backward
    head: tuple = (packing.HEAD_FORWARD, packing.HEAD_BACKWARD)   # the LM head chunk's bytes an element (--head_kernel)
    embeddings_apart: bool = ForwardSettings.embeddings_apart     # the FSDP2 units `shard` makes (the largest: `end`)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:             # q, k, v (with bias), o, gate, up, down, two norms
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_dim
        return h * q + q + 2 * (h * kv + kv) + q * h + 3 * h * self.ffn + 2 * h

    @property
    def root_params(self) -> int:              # embeddings, final norm, untied LM head
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def end(self) -> int:                      # the largest FSDP2 unit outside the layers (`shard`'s)
        return self.vocab * self.hidden if self.embeddings_apart and not self.tied else self.root_params

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def trunk(self) -> int:                    # without an untied LM head: what a value / score model keeps
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    @property
    def largest(self) -> int:                  # the biggest single tensor (the weight sync's unit)
        return max(self.vocab * self.hidden, self.hidden * self.ffn)

    def saved_per_token(self, c: int = 2) -> int:
        """Bytes autograd keeps per token per decoder layer in the compute dtype (`c` bytes): two
        RMSNorms keep an fp32 copy of their input; q, k, v, the attention output and its log-sum-exp;
        the MLP's gate, up, activation and product (counted from the HF Qwen2 layer, test_plan.py). Fused
        (Liger, compiled): the norms add their fp32 rstd only, the MLP no activation (fitted)."""
        h = self.hidden
        norms, mlp = (8, 3) if self.fused else (8 * h + 8, 4)
        return norms + 2 * c * h + c * (4 * h + 2 * self.kv_dim + mlp * self.ffn) + 4 * self.heads

    def gather(self, c: int) -> int:           # FSDP2 in a forward: the layer computed, the next, the largest end
        return c * (2 * self.layer_params + self.end)

    def layer_work(self, n_tok: int, c: int) -> int:   # a no-grad layer's transient over n_tok tokens: the MLP's
        return n_tok * (c * 3 * self.ffn + 8 * self.hidden)   # three ffn-wide tensors, an fp32 norm (fitted)

    def activations(self, n_tok: int, c: int, checkpointing: bool) -> dict:
        """What a forward keeps for backward: every layer's set, or with checkpointing each layer's input and one
        layer's set rebuilt in backward with its gradients' transients (2.5 ffn-wide fused, 5 not; fitted)."""
        if checkpointing:
            return {"activations (layer inputs)": self.layers * n_tok * self.hidden * c,
                    "activations (one layer rebuilt)":
                    n_tok * (self.saved_per_token(c) + int(c * self.ffn * (2.5 if self.fused else 5)))}
        return {"activations": self.layers * n_tok * self.saved_per_token(c) + n_tok * (4 + c) * self.hidden}


def shapes(config) -> Shapes:
    heads = config.num_attention_heads
    return Shapes(config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                  heads, getattr(config, "num_key_value_heads", None) or heads, head_dim(config),
                  bool(getattr(config, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class Sizes:
    """One rank's share of a step, as the predicted sections read it (the planner makes it)."""
    shapes: Shapes                             # the policy's
    world: int                                 # the trainer's ranks
    group: int                                 # the ranks one FSDP2 shard group spans (fsdp_size)
    c: int                                     # bytes of the compute dtype
    samples: int                               # this rank's rows of a step (a Ulysses group's k ranks: the same)
    mini: int                                  # this rank's rows per optimizer step
    prompt_len: int
    response_len: int
    sp: int = 1                                # Ulysses: the ranks that split each micro-batch's tokens

    @property
    def T(self) -> int:                        # tokens of a row: prompt + response
        return self.prompt_len + self.response_len

    def shard(self, n: int, nbytes: int) -> int:
        """Bytes of one rank's shard of n values of `nbytes` each."""
        return math.ceil(n / self.group) * nbytes

    def tokens(self, layout: packing.Layout) -> int:
        """This GPU's tokens of one micro-batch (a token budget: the fewest bins that fit, as
        packing.micro_batches fills them); a Ulysses group's k ranks run 1/k of it each."""
        if not layout.max_tokens:
            return min(layout.micro, self.samples) * self.T // layout.sp
        bins = math.ceil(self.mini * self.T / layout.max_tokens)
        return min(layout.max_tokens, math.ceil(self.mini / bins) * self.T) // layout.sp

    def accumulating(self, layout: packing.Layout) -> bool:
        """2+ micro-batches per optimizer step: the grads are already held when a micro-batch runs."""
        bins = math.ceil(self.mini * self.T / layout.max_tokens) if layout.max_tokens else \
            math.ceil(self.mini / layout.micro)
        return bins > 1

    def head(self, n_tok: int, layout: packing.Layout, per_elt: int) -> int:
        """One LM-head chunk of the response tokens among n_tok, and their hidden states."""
        n_resp = n_tok * self.response_len // self.T
        chunk = min(layout.chunk or n_resp, n_resp)
        return chunk * self.shapes.vocab * per_elt + n_resp * self.shapes.hidden * self.c

    def forward(self, layout: packing.Layout) -> dict:
        """A no-grad forward's transient: the gathered layers and a layer's work or the LM head's chunk."""
        n = self.tokens(layout)
        return {"gathered layers + root": self.shapes.gather(self.c),
                "forward transient": max(self.shapes.layer_work(n, self.c), self.head(n, layout, self.shapes.head[0]))}


def state(nbytes: int, offloaded: bool) -> tuple:
    """A state group's (bytes on the GPU in use, between uses, in pinned host memory) under its flag."""
    return (nbytes, 0, nbytes) if offloaded else (nbytes, nbytes, 0)


def in_use(states: dict, *names) -> dict:
    """The named groups (those present) at their in-use bytes: a phase's terms."""
    return {n: states[n][0] for n in names if n in states}
