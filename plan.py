"""The memory planner: every stage's peak GPU memory per rank (allocator and device level) and the step's time,
predicted from the configs and the model's shapes (config.json) before anything is built; it moves nothing and builds
no model. Choosing the flags that fit, --offload=auto, the run's warnings and the command line are plan_fit.py's.

    python plan.py --model=random:qwen2.5-7b --nproc=8 --gpu_gb=80 --train_batch_size=256 \
        --rollout.n=8 --rollout.response_length=1024 --prompt_len=512      # any train_grpo.py option
    python plan.py --templates                  # the size table: 0.5B / 7B / 72B on 1x80, 8x80, 8x141 GB

How the prediction is made (per rank, bytes; each term named in the table it prints):
- States: fp32 shards of the actor (and critic) are 4 B x params / shard-group size, their grads the same during the
  update, Adam's two moments 8 B x params / group; the frozen reference and reward model hold bf16 shards (2 B). An
  offload flag takes its group out of every stage but the ones that use it (the brackets the roles run).
- FSDP2 gathers: during a forward the layer being computed and the next one are gathered in the compute dtype (2 x
  layer), and the root (embeddings, final norm, LM head) for the whole pass.
- Activations kept for backward, per token per decoder layer in bf16: 20 H + 4 kv_dim + 8 ffn + 4 heads + 8 bytes
  (two RMSNorms keep an fp32 copy of their input; q, k, v, the attention output and its log-sum-exp; the MLP's gate,
  up, activation and product), counted from the tensors autograd saves in the HF Qwen2 layer. With gradient
  checkpointing only each layer's input (H x 2 bytes) stays, and one layer's set is rebuilt in backward.
- The LM head (packing.py): one chunk of (tokens, vocab) at a time, HEAD_FORWARD / HEAD_BACKWARD bytes per element
  (fp32 logits, logsumexp's exp, softmax and its product with the logits; in backward the recomputed chunk too).
- Ulysses (actor.ulysses_sequence_parallel_size=k): a rank holds its group's samples and runs 1/k of each micro-batch's
  tokens, so its activations, LM-head tokens and attention terms divide by k; states do not.
- vLLM (device-level, not in PyTorch's count): its bf16 weights / tp, the KV budget it was given, CUDA graphs and
  workspaces that stay while it sleeps, and the CUDA context.
- The device level (`_device_levels`): the allocator's reserve, carried through the step, plus what lies outside it.
  Calibrated against the H200 measurements in docs/plan_truth.json (test_plan.py checks it).
- Async rollout (rollout.mode=async): the engine lives in its own process, on rollout.gpus GPUs of its own or beside
  rank 0's trainer (gpus=0), holding its weights, KV budget, workspace and CUDA context all the time (`_engine`);
  the trainer's step starts with rollout_wait instead of generate and ends with push (the new weights out to the
  engine), and the host holds the rollout buffer. `world` is then the trainer's ranks (torchrun's N less gpus)."""
import functools
import math
from dataclasses import dataclass, field

import model
import rollout

GB = 1024 ** 3
PINNED_GBPS = 55.2e9         # pinned host<->device copy bandwidth measured on the H200 (BENCHMARKS.md)
TFLOPS = 742e12 * 0.51       # bf16 matmul peak measured there x the share a training step reaches (fitted)
CUDA_CONTEXT = int(0.55 * GB)  # the CUDA context and NCCL's buffers: outside PyTorch's count
CUBLAS = 32 * 2 ** 20        # cuBLAS's workspace, allocated through PyTorch's allocator at the first matmul
VLLM_RESIDENT = rollout.VLLM_GRAPHS   # what a sleeping vLLM engine keeps (CUDA graphs, buffers)
# Device level (what mem_get_info shows), calibrated on the H200 runs of docs/plan_truth.json:
OUTSIDE = int(0.83 * GB)     # device use outside PyTorch's reserve: CUDA context, NCCL and cuBLAS handles
VLLM_OUTSIDE = int(0.27 * GB)  # ... and what an asleep vLLM engine adds to it
FORWARD_SLACK = int(0.8 * GB)  # reserved beyond a no-grad stage's allocated peak (cached blocks of its transients)
UPDATE_SLACK = 0.09          # reserved beyond a full fine-tuning update's allocated peak, as a share of it
LORA_UPDATE_SLACK = 0.05     # ... a LoRA update's (its peak is activations, freed and reused in order)
SECOND_UPDATE_SLACK = 0.18   # ... the actor's update right after the critic's (PPO: two sets of grads cached)
SLEEP_RESIDUE = int(0.6 * GB)  # after vLLM sleeps and the cache is emptied: segments that still hold a live block
HEAD_FORWARD, HEAD_BACKWARD = 12, 20   # bytes per (token, vocab) element of an LM-head chunk: forward, update
ALLOC_SLACK = 1.01           # 512 B rounding, uncounted buffers: peaks run 1-2 % above the terms' sum


# --------------------------------------------------------------------------- shapes
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
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def largest(self) -> int:                  # the biggest single tensor (the weight sync's unit)
        return max(self.vocab * self.hidden, self.hidden * self.ffn)

    def saved_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes autograd keeps per token per decoder layer (module docstring)."""
        h, c = self.hidden, dtype_bytes
        return 8 * h + 8 + 2 * c * h + c * (4 * h + 2 * self.kv_dim + 4 * self.ffn) + 4 * self.heads


def shapes(config) -> Shapes:
    head_dim = model.head_dim(config)
    return Shapes(config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                  config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                  head_dim, bool(getattr(config, "tie_word_embeddings", False)))


@functools.lru_cache(maxsize=16)
def model_config(path: str | None):
    """The HF config of `--model` without building the model (model.hf_config), read once: not to be
    modified."""
    return model.hf_config(path)


# --------------------------------------------------------------------------- the prediction
@dataclass
class Stage:
    name: str
    terms: dict = field(default_factory=dict)   # what is on the GPU at the stage's peak: name -> bytes

    @property
    def total(self) -> int:
        return int(sum(self.terms.values()) * ALLOC_SLACK)


@dataclass
class Plan:
    stages: list                               # Stage per stage of the step, trainer's allocated peak
    vllm_device: dict                          # device-level bytes while vLLM generates (mem_get_info)
    pinned_host: int                           # bytes of pinned host mirrors per rank
    seconds: float                             # the step's exposed copy + compute estimate (for ranking)
    device: dict = field(default_factory=dict)  # stage -> device-level bytes at its highest (mem_get_info)
    engine_device: dict = field(default_factory=dict)   # async: one engine GPU's device-level bytes by part
                                               # (rollout.gpus=0: on rank 0's GPU, inside every stage's device level)
    buffer_host: int = 0                       # async: the host's rollout buffer, bytes
    beside: int = 0                            # bytes on a trainer GPU outside PyTorch's allocator and the trainer's
                                               # CUDA context: a sleeping vLLM's (colocated), the engine's (gpus=0)

    @property
    def peak(self) -> int:
        return max([s.total for s in self.stages] + [sum(self.vllm_device.values())])

    @property
    def device_peak(self) -> int:
        return max(self.device.values(), default=0)

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)


@dataclass(frozen=True)
class Sizes:
    """What one rank's prediction derives from the options, the world and the prompts (per rank)."""
    cfg: object                                # an options.Config
    world: int
    prompt_len: int
    engine: str

    @functools.cached_property
    def shapes(self) -> Shapes:
        return shapes(model_config(self.cfg.model))

    @property
    def group(self) -> int:                    # the ranks one shard group spans (fsdp_size)
        return self.world if self.cfg.fsdp_size in (-1, self.world) else self.cfg.fsdp_size

    @property
    def c(self) -> int:                        # bytes of the compute dtype
        return 4 if self.cfg.actor.param_dtype == "float32" else 2

    @property
    def R(self) -> int:                        # response tokens
        return self.cfg.rollout.response_length

    @property
    def T(self) -> int:                        # tokens of a row: prompt + response
        return self.prompt_len + self.R

    @property
    def sp(self) -> int:                       # Ulysses: the ranks that split each micro-batch's tokens
        return self.cfg.actor.ulysses_sequence_parallel_size

    @property
    def samples(self) -> int:                  # this rank's rows (a Ulysses group's k ranks hold the same)
        return self.cfg.train_batch_size * self.cfg.rollout.n // (self.world // self.sp)

    @property
    def mini(self) -> int:                     # this rank's samples per optimizer step
        return self.cfg.actor.ppo_mini_batch_size * self.cfg.rollout.n // (self.world // self.sp)

    @property
    def asynchronous(self) -> bool:            # the engine in its own process(es), a step ahead of the trainer
        return self.cfg.rollout.mode == "async"

    @property
    def engine_seqs(self) -> int:              # async: the sequences of a step one engine generates
        return self.cfg.train_batch_size * self.cfg.rollout.n // max(self.cfg.rollout.gpus, 1)

    @property
    def gae(self) -> bool:
        return self.cfg.algorithm.adv_estimator == "gae"

    @property
    def separate(self) -> bool:                # PPO with its own critic model
        return self.gae and self.cfg.critic.mode == "separate"

    @property
    def lora(self) -> bool:
        return self.cfg.actor.lora_rank > 0

    @property
    def on_policy(self) -> bool:               # old log-probs are not recomputed (actor.on_policy's rule)
        import actor
        return actor.on_policy(self.cfg.actor, self.cfg.train_batch_size)

    @property
    def prefetch(self) -> bool:                # the actor's params come in during the ref stage
        a = self.cfg.actor
        return a.prefetch_update and a.param_offload and not self.gae

    @property
    def gather(self) -> int:                   # FSDP2: the layer computed, the next one, and the root
        s = self.shapes
        return self.c * (2 * s.layer_params + s.root_params)

    def shard(self, n: int, nbytes: int) -> int:
        """Bytes of one rank's shard of n values of `nbytes` each."""
        return math.ceil(n / self.group) * nbytes

    def tokens(self, micro: int, budget: int) -> int:
        """This GPU's tokens of one micro-batch (`budget`: per GPU, with use_dynamic_bsz): 1/sp of it."""
        if not self.cfg.actor.use_dynamic_bsz:
            return min(micro, self.samples) * self.T // self.sp
        bins = math.ceil(self.mini * self.T / (budget * self.sp))   # the fewest that fit (packing.micro_batches)
        return min(budget * self.sp, math.ceil(self.mini / bins) * self.T) // self.sp

    def accumulating(self, micro: int, budget: int) -> bool:
        """2+ micro-batches per optimizer step: the grads are already held when a micro-batch runs."""
        dynamic = self.cfg.actor.use_dynamic_bsz   # a token budget is per GPU: a group's micro-batch holds sp x it
        return (math.ceil(self.mini * self.T / budget / self.sp) if dynamic else math.ceil(self.mini / micro)) > 1

    def head(self, n_tok: int, per_elt: int) -> int:
        """One LM-head chunk of the response tokens among n_tok."""
        n_resp = n_tok * self.R // self.T
        chunk = min(self.cfg.actor.logits_chunk_tokens or n_resp, n_resp)
        return chunk * self.shapes.vocab * per_elt + n_resp * self.shapes.hidden * self.c

    def forward(self, n_tok: int) -> dict:
        """A no-grad forward's transient: a layer's work or the LM head's chunk, whichever is larger."""
        s = self.shapes
        layer = n_tok * (self.c * (3 * s.ffn + 5 * s.hidden) + 8 * s.hidden)
        return {"gathered layers + root": self.gather, "forward transient": max(layer, self.head(n_tok, HEAD_FORWARD))}


@dataclass(frozen=True)
class Groups:
    """The states by group: name -> (bytes on the GPU while in use, bytes its flag takes off between
    uses); `host_only`: groups FSDP2's CPUOffloadPolicy keeps on the host (a layer at a time comes over)."""
    sizes: dict
    host_only: frozenset = frozenset()

    def resident(self, *loaded) -> dict:
        """What every group keeps on the GPU, with the groups in `loaded` in use."""
        loaded = loaded + (("actor base",) if "actor params" in loaded else ())   # LoRA: they move together
        loaded = tuple(g for g in loaded if g not in self.host_only)
        held = {g: on - (0 if g in loaded else off) for g, (on, off) in self.sizes.items()}
        return {"cuBLAS workspace": CUBLAS, **{g: b for g, b in held.items() if b}}

    def on(self, name: str) -> int:
        return self.sizes.get(name, (0, 0))[0]

    def off(self, name: str) -> int:
        return self.sizes.get(name, (0, 0))[1]

    @property
    def pinned(self) -> int:                   # pinned host mirrors (+ the host grads with CPUOffloadPolicy)
        return sum(off for on, off in self.sizes.values()) + \
            (self.on("actor params") if "actor params" in self.host_only else 0)


def _actor_groups(z: Sizes) -> dict:
    """The policy's params and Adam (full fine-tuning: fp32; LoRA: the adapters fp32, the frozen base
    in the compute dtype); actor.param_offload_layers offloads only the first k layers' shards."""
    a, s = z.cfg.actor, z.shapes
    if z.lora:
        import lora
        n = lora.lora_param_count(model_config(z.cfg.model), a.lora_rank, a.lora_target_modules)
        base, adapters = z.shard(s.params, z.c), z.shard(n, 4)
        return {"actor base": (base, base if a.param_offload else 0),
                "actor params": (adapters, adapters if a.param_offload else 0),
                "actor Adam": (z.shard(n, 8), z.shard(n, 8) if a.optimizer_offload else 0)}
    k = s.layers if a.param_offload_layers < 0 else min(a.param_offload_layers, s.layers)
    part = z.shard(k * s.layer_params + (s.root_params if a.param_offload_layers < 0 else 0), 4)
    return {"actor params": (z.shard(s.params, 4), part if a.param_offload else 0),
            "actor Adam": (z.shard(s.params, 8), z.shard(s.params, 8) if a.optimizer_offload else 0)}


def state_groups(z: Sizes) -> Groups:
    """Every role's states on this rank, and what each offload flag takes off the GPU between uses:
    the same brackets the roles run."""
    cfg, s = z.cfg, z.shapes
    groups, host_only = _actor_groups(z), set()
    ref_p = z.shard(s.params, z.c)
    if cfg.actor.use_kl_loss and not z.lora:   # LoRA: the base is the reference, no ref model
        groups["ref params"] = (ref_p, ref_p if cfg.ref.param_offload else 0)
    if z.separate:                             # the critic: the trunk and a 1-output head, fp32 + Adam
        crit = z.shard(s.params - s.vocab * s.hidden * (0 if s.tied else 1), 4)
        groups["critic params"] = (crit, crit if cfg.critic.param_offload else 0)
        groups["critic Adam"] = (2 * crit, 2 * crit if cfg.critic.optimizer_offload else 0)
    rm = getattr(cfg, "reward_model", None)
    if rm is not None and rm.path:             # a scorer: its trunk in the compute dtype
        rs = shapes(model_config(rm.path))
        rm_p = z.shard(rs.params - rs.vocab * rs.hidden * (0 if rs.tied else 1), z.c)
        groups["reward model"] = (rm_p, rm_p if rm.param_offload else 0)
    if cfg.actor.offload_policy:               # CPUOffloadPolicy: shards, grads and Adam live on the host
        p = groups["actor params"][0]
        groups["actor params"], groups["actor Adam"] = (p, p), (z.shard(s.params, 8), z.shard(s.params, 8))
        host_only |= {"actor params", "actor Adam"}
    if cfg.ref.offload_policy and "ref params" in groups:
        groups["ref params"] = (ref_p, ref_p)
        host_only.add("ref params")
    if z.asynchronous and cfg.rollout.gpus == 0:   # rank 0: the push's bucket, mapped once by the engine (CUDA IPC)
        groups["push bucket"] = (_bucket(z), 0)
    return Groups(groups, frozenset(host_only))


# --------------------------------------------------------------------------- the stages, in their order
def _generate(z: Sizes, g: Groups) -> Stage:
    """The actor's params are in for the weight sync: one bucket + one tensor in flight (vLLM); HF
    generate gathers the whole model and keeps its own KV cache and logits."""
    s, c = z.shapes, z.c
    if z.engine == "vllm":                     # a bucket of layer tensors, or the embedding alone
        sync = max(z.cfg.rollout.sync_bucket_mb * 2 ** 20 + s.hidden * s.ffn * c, s.vocab * s.hidden * c)
        return Stage("generate", {**g.resident("actor params"), "sync bucket": sync})
    kv = z.samples // z.sp * z.T * 2 * s.layers * s.kv_dim * c     # a rank generates 1/sp of its group's
    return Stage("generate", {**g.resident("actor params"), "gathered model": c * s.params, "KV cache": kv,
                              "logits": z.samples // z.sp * s.vocab * 4 * 2})


def _rollout_wait(z: Sizes, g: Groups) -> Stage:
    """Async: the batch comes from the host buffer; the trainer holds what stays between stages."""
    return Stage("rollout_wait", g.resident())


def _reward(z: Sizes, g: Groups) -> Stage:
    return Stage("reward", g.resident())       # on the CPU: what stays between stages


def _reward_model(z: Sizes, g: Groups) -> Stage | None:
    rm = getattr(z.cfg, "reward_model", None)
    if rm is None or not rm.path:
        return None
    rs, c = shapes(model_config(rm.path)), z.c
    n = min(rm.micro_batch_size_per_gpu, z.samples) * z.T
    return Stage("reward_model", {**g.resident("reward model"),
                                  "gathered layers + root": c * (2 * rs.layer_params + rs.root_params),
                                  "forward transient": n * (c * (3 * rs.ffn + 5 * rs.hidden) + 8 * rs.hidden)})


def _old_logp(z: Sizes, g: Groups) -> Stage:
    a = z.cfg.actor
    if z.on_policy:                            # skipped; the ledger still logs the stage
        return Stage("old_logp", g.resident())
    return Stage("old_logp", {**g.resident("actor params"),
                              **z.forward(z.tokens(a.log_prob_micro_batch_size_per_gpu,
                                                   a.log_prob_max_token_len_per_gpu))})


def _ref_logp(z: Sizes, g: Groups) -> Stage | None:
    r = z.cfg.ref
    if not z.cfg.actor.use_kl_loss:
        return None
    loaded = ["actor params" if z.lora else "ref params"] + (["actor params"] if z.prefetch else [])
    return Stage("ref_logp", {**g.resident(*loaded),   # LoRA: the actor's own forward, its adapter off
                              **z.forward(z.tokens(r.log_prob_micro_batch_size_per_gpu,
                                                   r.log_prob_max_token_len_per_gpu))})


def _values(z: Sizes, g: Groups) -> Stage | None:
    cr = z.cfg.critic
    if not z.gae:
        return None
    features = 0 if z.separate else z.samples * z.R * z.shapes.hidden * z.c   # shared: kept for its update
    return Stage("values", {**g.resident("critic params" if z.separate else "actor params"),
                            **z.forward(z.tokens(cr.forward_micro_batch_size_per_gpu, cr.forward_max_token_len_per_gpu)),
                            "features": features})


def _advantage(z: Sizes, g: Groups) -> Stage:
    return Stage("advantage", g.resident(*(["actor params"] if z.prefetch else [])))


def _critic_update(z: Sizes, g: Groups) -> Stage | None:
    cr = z.cfg.critic
    if not z.separate:
        return None
    n = z.tokens(cr.ppo_micro_batch_size_per_gpu, cr.ppo_max_token_len_per_gpu)
    busy = {**_activations(z.shapes, n, cr.gradient_checkpointing, z.c), "gathered layers + root": z.gather}
    return Stage("critic_update", _update_peak(
        g.resident("critic params", "critic Adam"), {"critic grads": g.on("critic params")}, busy,
        z.accumulating(cr.ppo_micro_batch_size_per_gpu, cr.ppo_max_token_len_per_gpu), {}))


def _update(z: Sizes, g: Groups) -> Stage:
    a = z.cfg.actor
    n = z.tokens(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu)
    grads = {"actor grads": 0 if a.offload_policy else g.on("actor params")}
    held = g.resident("actor params", *([] if a.optimizer_load_at_step else ["actor Adam"]))
    busy = {**_activations(z.shapes, n, a.gradient_checkpointing, z.c), "gathered layers + root": z.gather,
            "LM head chunk (backward)": z.head(n, HEAD_BACKWARD)}
    return Stage("update", _update_peak(held, grads, busy,
                                        z.accumulating(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu),
                                        {**g.resident("actor params", "actor Adam"), **grads}))


def _bucket(z: Sizes) -> int:
    """The push's bucket (rollout_async.weight_layout): sync_bucket_mb, or the whole model when it is
    smaller, or the largest tensor when that is larger."""
    s = z.shapes
    return max(min(z.cfg.rollout.sync_bucket_mb * 2 ** 20, z.c * s.params), z.c * s.largest)


def _push(z: Sizes, g: Groups) -> Stage:
    """Async: the new weights out to the engine(s). The actor's params are in (kept after the update
    with defer_param_offload, reloaded otherwise); one tensor at a time is gathered in the compute
    dtype and copied into the bucket: allocated for the push with rollout.gpus >= 1 (NCCL broadcast),
    held all run with 0 (state_groups' "push bucket"). LoRA merges each target in fp32 on the way."""
    s, c = z.shapes, z.c
    bucket = {"push bucket": _bucket(z)} if z.cfg.rollout.gpus else {}
    merge = {"LoRA merge (fp32)": 4 * s.hidden * s.ffn} if z.lora else {}
    return Stage("push", {**g.resident("actor params"), **bucket, "gathered tensor": c * s.largest, **merge})


STAGE_PLANS = (_generate, _reward, _reward_model, _old_logp, _ref_logp, _values, _advantage, _critic_update, _update)
ASYNC_STAGE_PLANS = (_rollout_wait,) + STAGE_PLANS[1:] + (_push,)   # generate runs in the engine's process


def predict(cfg, world: int, prompt_len: int, engine: str = "vllm") -> Plan:
    """Each stage's peak allocated bytes and device level on one rank for `cfg` on `world` ranks,
    with prompts up to `prompt_len` tokens and every response at its full length."""
    z = Sizes(cfg, world, prompt_len, engine)
    g = state_groups(z)
    stages = [st for plan_stage in (ASYNC_STAGE_PLANS if z.asynchronous else STAGE_PLANS)
              if (st := plan_stage(z, g)) is not None]
    if z.asynchronous:
        eng = _engine(z)
        plan = Plan(stages, {}, g.pinned, _async_seconds(z, g), engine_device=eng, buffer_host=_buffer_bytes(z),
                    beside=0 if cfg.rollout.gpus else sum(eng.values()))
    else:
        plan = Plan(stages, _vllm_awake(z, g), g.pinned, _seconds(z, g),
                    beside=VLLM_RESIDENT if engine == "vllm" else 0)
    plan.device = _device_levels(plan, z, sum(g.resident().values()))
    return plan


def _engine(z: Sizes) -> dict:
    """Async: what one engine process keeps on its GPU all the time (it never sleeps): the whole
    model in the compute dtype, the KV budget of its share of a step's sequences, the workspace
    (rollout.engine_bytes, tensor_parallel_size 1) and its own CUDA context. vLLM's parts: an HF
    generate engine runs on the CPU."""
    ro = z.cfg.rollout
    return {**_engine_bytes(z.cfg.model, z.engine_seqs, z.T, z.c, ro.kv_cache_margin), "CUDA context": CUDA_CONTEXT}


@functools.lru_cache(maxsize=64)
def _engine_bytes(path: str | None, seqs: int, T: int, c: int, margin: float) -> dict:
    """rollout.engine_bytes for one GPU, once per shape (its weight count builds a meta model):
    not to be modified."""
    config = model_config(path)
    kv = rollout.kv_cache_bytes(config, seqs, T, c, 1, margin)
    return rollout.engine_bytes(config, kv_bytes=kv, max_num_seqs=seqs, dtype_bytes=c, tp=1)


def _buffer_bytes(z: Sizes) -> int:
    """Async: the host's rollout buffer at its fullest: buffer_limit samples (0: max_staleness
    steps' worth), each its ids and two log-prob rows (int32 and fp32: 4 bytes a token)."""
    ro = z.cfg.rollout
    samples = ro.buffer_limit or ro.max_staleness * z.cfg.train_batch_size * ro.n
    return samples * (z.prompt_len + 2 * z.R) * 4


def _vllm_awake(z: Sizes, g: Groups) -> dict:
    """Device-level bytes while vLLM generates: the trainer's leftovers beside the engine."""
    if z.engine != "vllm":
        return {}
    return {"trainer (allocated)": sum(g.resident().values()),
            "vLLM weights": z.c * z.shapes.params // z.cfg.rollout.tensor_parallel_size,
            "vLLM KV cache": _kv_budget(z), "vLLM graphs + buffers": VLLM_RESIDENT, "CUDA context": CUDA_CONTEXT}


def _device_levels(plan: Plan, z: Sizes, between: int) -> dict:
    """Each stage's device-level bytes at its highest (what mem_get_info shows; nvidia-smi too): the
    allocator's reserve plus what lies outside it. The reserve only grows within a step: nothing
    gives cached blocks back between the weight sync's empty_cache and the next step's, so a stage
    holds the largest reserve of the stages before it as well as its own allocated peak plus the
    cached blocks of its transients (FORWARD_SLACK, UPDATE_SLACK). The generate stage peaks either
    at the weight sync (the trainer's actor params in, beside vLLM's woken weights) or while
    vLLM's KV cache is awake (plan.vllm_device), whichever is higher. With HF generate nothing is
    emptied: every stage sees the step's largest reserve (steady state from the second step). Async
    rollout is the same (no vLLM in the trainer's process), with the engine process beside every
    stage when rollout.gpus=0 (plan.beside). `between`: what the trainer holds between stages."""
    slack = LORA_UPDATE_SLACK if z.lora else UPDATE_SLACK
    colocated_vllm = z.engine == "vllm" and not z.asynchronous
    outside = OUTSIDE + (VLLM_OUTSIDE if colocated_vllm else 0)
    reserve = {}
    carry = between + (0 if z.asynchronous else SLEEP_RESIDUE)   # after generate's empty_cache: live blocks' segments
    for st in plan.stages:
        if st.name == "generate":
            reserve[st.name] = carry
            continue
        if st.name == "update" and "critic_update" in reserve:
            own = st.total * (1 + SECOND_UPDATE_SLACK)
        elif st.name in ("update", "critic_update"):
            own = st.total * (1 + slack)
        else:
            own = st.total + (FORWARD_SLACK if st.total > between + GB // 4 else 0)
        carry = max(carry, int(own))
        reserve[st.name] = carry
    if z.asynchronous:
        return {name: outside + max(reserve.values()) + plan.beside for name in reserve}
    if z.engine != "vllm":
        top = max(max(reserve.values()), int(plan.stages[0].total * (1 + slack)))
        return {name: outside + top for name in reserve}
    merge = 4 * z.shapes.largest if z.lora else 0   # LoRA's sync merges W + BA in fp32: that block stays cached
    vllm_weights = z.c * z.shapes.params // z.cfg.rollout.tensor_parallel_size + merge
    sync = plan.stage("generate").total + vllm_weights + VLLM_OUTSIDE
    out = {name: outside + r for name, r in reserve.items()}
    out["generate"] = max(OUTSIDE + sync, sum(plan.vllm_device.values()) - CUDA_CONTEXT + OUTSIDE)
    return out


def _update_peak(held: dict, grads: dict, busy: dict, accumulating: bool, at_step: dict) -> dict:
    """An update stage's peak, by phase. The sharded grads exist from the first micro-batch's
    backward until the optimizer step frees them: the transients of a micro-batch (activations, the
    LM head's chunk, gathered layers) meet the full grads only when an earlier micro-batch of the
    same optimizer step left them (accumulation). With one micro-batch per step the worst moments
    are its head backward (no grads yet) and the end of its backward (every grad, a layer and the
    root still gathered), and the optimizer step itself (`at_step`: Adam in, with
    optimizer_load_at_step)."""
    phases = [{**held, **grads, **busy}] if accumulating else \
        [{**held, **busy}, {**held, **grads, "gathered layers + root": busy["gathered layers + root"]}]
    return max(phases + ([at_step] if at_step else []), key=lambda p: sum(p.values()))


def _activations(s: Shapes, n_tok: int, checkpointing: bool, c: int) -> dict:
    if checkpointing:                          # each layer's input, and one layer's set rebuilt in backward
        return {"activations (layer inputs)": s.layers * n_tok * s.hidden * c,
                "activations (one layer rebuilt)": n_tok * s.saved_per_token(c)}
    return {"activations": s.layers * n_tok * s.saved_per_token(c) + n_tok * (4 + c) * s.hidden}


def _kv_budget(z: Sizes) -> int:
    """The KV bytes rollout.build gives vLLM on each GPU (an engine serves its tp ranks' sequences);
    0 when a share of the GPU sizes it instead."""
    ro = z.cfg.rollout
    if ro.gpu_memory_utilization > 0:
        return 0
    return rollout.kv_cache_bytes(model_config(z.cfg.model), z.cfg.train_batch_size // z.world * ro.n * ro.tensor_parallel_size,
                                  z.T, 2, ro.tensor_parallel_size, ro.kv_cache_margin)


DECODE_STEP = 2.5e-3          # vLLM: seconds per decoding step beyond reading the weights (CUDA graphs, sampling,
                              # scheduling; 64-128 sequences), fitted on the H200 rows of docs/plan_truth.json
HBM = 4.0e12                  # bytes/s a decoding step reads the weights at (H200: 4.8 TB/s peak)
STAGE_FIXED = 0.2             # seconds each stage pays whatever its size (launches, syncs, the ledger)
MICRO_LAYER = 4.5e-3          # seconds per micro-batch and layer of an update (launches, FSDP2's gathers)
TP_ALLREDUCE = 15e-6          # a tensor-parallel engine's all-reduce, twice per layer per decoding step (latency-bound)
FITTED_SEQS = 128             # the sequences an engine decoded in DECODE_STEP's fit; an async engine's beyond them
                              # add their KV cache's reads to each decoding step
PUSH_BPS = 25e9               # async: bytes/s of the weight push (gather, bucket copy, NCCL broadcast or CUDA IPC);
                              # a placeholder, to be fitted on the H200 from a measured push


def _seconds(z: Sizes, g: Groups) -> float:
    """A step's time, for ranking configurations: generation, the stages' compute, the copies that
    cannot hide, and a fixed cost per micro-batch and layer. Within 20 % of the measured step on the
    H200 rows of docs/plan_truth.json (test_plan.py)."""
    return sum((_generate_seconds(z), *_trainer_seconds(z, g)))


def _trainer_seconds(z: Sizes, g: Groups) -> tuple:
    """A step's time without generation, in parts (summed in this order): compute, exposed copies,
    micro-batches x layers."""
    a, cr = z.cfg.actor, z.cfg.critic
    micro = max(1, z.samples // max(a.ppo_micro_batch_size_per_gpu, 1))     # forward + backward passes
    micro += max(1, z.samples // max(cr.ppo_micro_batch_size_per_gpu, 1)) if z.separate else 0
    return _compute_seconds(z), _copy_seconds(z, g), micro * z.shapes.layers * MICRO_LAYER


def _async_seconds(z: Sizes, g: Groups) -> float:
    """Async: the engine generates the next batch while the trainer trains on this one, so a step
    takes the longer of the two, then the push (the engine waits for the new weights). With
    rollout.gpus=0 both share one GPU, so the max is the optimistic end there."""
    return max(_engine_seconds(z), sum(_trainer_seconds(z, g))) + _push_seconds(z)


def _engine_seconds(z: Sizes) -> float:
    """An async engine's generation of its share of the batch: the colocated rule, and each decoding
    step also reads the KV cache of the sequences beyond FITTED_SEQS (half-filled on average)."""
    s = z.shapes
    kv = max(0, z.engine_seqs - FITTED_SEQS) * (z.prompt_len + z.R // 2) * 2 * s.layers * s.kv_dim * z.c
    return _generate_seconds(z) + z.R * kv / HBM


def _push_seconds(z: Sizes) -> float:
    """The whole model in the compute dtype, at PUSH_BPS."""
    return z.shapes.params * z.c / PUSH_BPS + STAGE_FIXED


def _generate_seconds(z: Sizes) -> float:
    """One decoding step per response token, each reading this GPU's slice of the weights (and two
    all-reduces per layer with a tensor-parallel engine)."""
    s, tp = z.shapes, z.cfg.rollout.tensor_parallel_size
    step = DECODE_STEP + 2 * s.params / tp / HBM + (2 * s.layers * TP_ALLREDUCE if tp > 1 else 0)
    return z.R * step + STAGE_FIXED


def _compute_seconds(z: Sizes) -> float:
    """The training passes at a measured share of the GPU's bf16 rate (an update 3 passes, LoRA's 2:
    the frozen base's weight grads are never computed; +1 with checkpointing; each log-prob or value
    forward 1; a separate critic's update 3 more, +1 with its checkpointing), a fixed cost per stage
    that computes, and a reward model's forward."""
    a, cr, s = z.cfg.actor, z.cfg.critic, z.shapes
    passes = (2 if z.lora else 3) + (1 if a.gradient_checkpointing else 0) + (1 if a.use_kl_loss else 0)
    passes += 0 if z.on_policy else 1
    passes += (1 + 3 + (1 if cr.gradient_checkpointing else 0)) if z.separate else (1 if z.gae else 0)
    tokens = z.samples * z.T // z.sp       # Ulysses: a rank computes 1/sp of its group's tokens (all-to-alls not timed)
    stages = 1 + (1 if a.use_kl_loss else 0) + (2 if z.separate else 1 if z.gae else 0) + (0 if z.on_policy else 1)
    seconds = 2 * s.params * tokens * passes / TFLOPS + stages * STAGE_FIXED
    rm = getattr(z.cfg, "reward_model", None)
    if rm is not None and rm.path:             # the reward model's forward over every sequence
        seconds += 2 * shapes(model_config(rm.path)).params * tokens / TFLOPS + STAGE_FIXED
    return seconds


def _copy_seconds(z: Sizes, g: Groups) -> float:
    """The offload copies that do not hide behind compute, per the copy levers (bytes / pinned
    bandwidth); with CPUOffloadPolicy, the optimizer's step on the CPU instead."""
    a = z.cfg.actor
    if a.offload_policy:                       # 16.2 s for 1.54B params on one H200 host
        return 10.5e-9 * z.shapes.params / max(z.world, 1) + 3 * g.on("actor params") / PINNED_GBPS
    exposed = g.off("actor params") * (1 + (0.25 if a.prefetch_update else 1))   # out at the sync, in for the update
    exposed += g.off("actor Adam") * (1 + (1 if a.optimizer_load_at_step else 0.5))
    exposed += sum(off for name, (on, off) in g.sizes.items() if name not in ("actor params", "actor Adam"))
    return exposed / PINNED_GBPS


# --------------------------------------------------------------------------- the table
def table(plan: Plan, gpu_bytes: int) -> str:
    lines = [f"{'stage':<14}{'predicted GB':>13}{'device GB':>10}   what is on the GPU at the stage's peak (GB)"]
    for st in plan.stages:
        terms = ", ".join(f"{k} {v / GB:.2f}" for k, v in st.terms.items() if v)
        lines.append(f"{st.name:<14}{st.total / GB:>13.2f}{plan.device.get(st.name, 0) / GB:>10.2f}   {terms}")
    if plan.vllm_device:
        terms = ", ".join(f"{k} {v / GB:.2f}" for k, v in plan.vllm_device.items())
        lines.append(f"{'(vLLM awake)':<14}{sum(plan.vllm_device.values()) / GB:>13.2f}   device-level: {terms}")
    if plan.engine_device:                     # async: another process; with gpus=0 inside the rows' device GB
        terms = ", ".join(f"{k} {v / GB:.2f}" for k, v in plan.engine_device.items())
        where = "on rank 0's GPU, inside the rows' device GB" if plan.beside else "on each engine's own GPU"
        lines.append(f"{'(engine GPU)':<14}{'':>13}{sum(plan.engine_device.values()) / GB:>10.2f}   "
                     f"device-level, {where}: {terms}")
    buffer = f"; rollout buffer on the host {plan.buffer_host / 2 ** 20:.0f} MB" if plan.engine_device else ""
    lines.append(f"peak {plan.peak / GB:.2f} GB allocated, {plan.device_peak / GB:.2f} GB device-level (the "
                 f"allocator's reserve, CUDA contexts, vLLM) of {gpu_bytes / GB:.0f} GB; pinned host RAM per rank "
                 f"{plan.pinned_host / GB:.2f} GB{buffer}; step estimate {plan.seconds:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":   # the command line (choosing flags, the table, templates) is plan_fit.py's
    import plan_fit
    plan_fit.main()
