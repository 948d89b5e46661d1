"""The memory planner: every stage's peak GPU memory per rank, predicted from the configs and the
model's shapes before anything is built; the fastest set of flags that fits; what would fit when
nothing does. It moves nothing and builds no model (shapes come from config.json).

    python plan.py --model=random:qwen2.5-7b --nproc=8 --gpu_gb=80 --train_batch_size=256 \
        --rollout.n=8 --rollout.response_length=1024 --prompt_len=512      # any train_grpo.py option
    python plan.py --model=random:qwen2.5-72b --nproc=8 --gpu_gb=141 --host_gb=560   # pinned RAM checked too
    python plan.py --templates                  # the size table: 0.5B / 7B / 72B on 1x80, 8x80, 8x141 GB
    python plan.py --plot=out                   # out/memory.png from a run's metrics.jsonl (tracker.picture)

How the prediction is made (per rank, bytes; each term named in the table it prints):
- States: fp32 shards of the actor (and critic) are 4 B x params / shard-group size, their grads
  the same during the update, Adam's two moments 8 B x params / group; the frozen reference and
  reward model hold bf16 shards (2 B). An offload flag takes its group out of every stage but the
  ones that use it (the same brackets actor.py, ref.py and critic.py run).
- FSDP2 gathers: during a forward the layer being computed and the next one are gathered in the
  compute dtype (2 x layer), and the root (embeddings, final norm, LM head) for the whole pass.
- Activations kept for backward, per token per decoder layer in bf16: 20 H + 4 kv_dim + 8 ffn
  + 4 heads + 8 bytes (two RMSNorms keep an fp32 copy of their input; q, k, v, the attention output
  and its log-sum-exp; the MLP's gate, up, activation and product), counted from the tensors
  autograd saves in the HF Qwen2 layer. With gradient checkpointing only each layer's input
  (H x 2 bytes) stays, and one layer's set is rebuilt in backward.
- The LM head (packing.py): one chunk of (tokens, vocab) at a time, about 12 B per element in a
  forward (fp32 logits, the exp inside logsumexp, softmax and its product with the logits) and 20
  in backward (the recomputed chunk plus its gradient).
- vLLM (device-level, not in PyTorch's count): its bf16 weights / tp, the KV budget it was given,
  CUDA graphs and workspaces that stay while it sleeps, and the CUDA context.
Calibrated against the H200 measurements kept in docs/plan_truth.json (test_plan.py checks it).
"""
import functools
import math
import sys
from dataclasses import dataclass, field

GB = 1024 ** 3
PINNED_GBPS = 55.2e9         # pinned host<->device copy bandwidth measured on the H200 (BENCHMARKS.md)
TFLOPS = 742e12 * 0.46       # bf16 matmul peak measured there x the share a training step reaches (fitted)
CUDA_CONTEXT = int(0.55 * GB)  # the CUDA context and NCCL's buffers: outside PyTorch's count
CUBLAS = 32 * 2 ** 20        # cuBLAS's workspace, allocated through PyTorch's allocator at the first matmul
VLLM_RESIDENT = int(1.2 * GB)  # what a sleeping vLLM engine keeps (CUDA graphs, buffers), measured
# Device level (what mem_get_info shows), calibrated on the H200 runs in docs/ (52 stages):
OUTSIDE = int(0.83 * GB)     # device use outside PyTorch's reserve: CUDA context, NCCL and cuBLAS handles
VLLM_OUTSIDE = int(0.27 * GB)  # ... and what an asleep vLLM engine adds to it
FORWARD_SLACK = int(0.8 * GB)  # reserved beyond a no-grad stage's allocated peak (cached blocks of its transients)
UPDATE_SLACK = 0.09          # reserved beyond a full fine-tuning update's allocated peak, as a share of it
LORA_UPDATE_SLACK = 0.05     # ... a LoRA update's (its peak is activations, freed and reused in order)
SECOND_UPDATE_SLACK = 0.18   # ... the actor's update right after the critic's (PPO: two sets of grads cached)
SLEEP_RESIDUE = int(0.6 * GB)  # after vLLM sleeps and the cache is emptied: segments that still hold a live block
ALLOC_SLACK = 1.01           # allocations are rounded up to 512 B blocks and a few buffers go uncounted:
                             # measured peaks run 1-2 % above the sum of the terms (docs/plan_truth.json)


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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Shapes(config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                  config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                  head_dim, bool(getattr(config, "tie_word_embeddings", False)))


@functools.lru_cache(maxsize=16)
def model_config(path: str | None):
    """The HF config of `--model` without building the model: the tiny default, a random size, or a
    local directory's config.json (read once; not to be modified)."""
    import tiny
    if path is None:
        return tiny.tiny_config()
    if path.startswith("random:"):
        return tiny.qwen25_config(path[7:])
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, local_files_only=True)


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

    @property
    def peak(self) -> int:
        return max([s.total for s in self.stages] + [sum(self.vllm_device.values())])

    @property
    def device_peak(self) -> int:
        return max(self.device.values(), default=0)

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)


def predict(cfg, world: int, prompt_len: int, engine: str = "vllm") -> Plan:
    """Each stage's peak allocated bytes on one rank for `cfg` (a train_grpo.Config) on `world`
    ranks, with prompts up to `prompt_len` tokens and every response at its full length."""
    s = shapes(model_config(cfg.model))
    a, r, ro = cfg.actor, cfg.ref, cfg.rollout
    group = world if cfg.fsdp_size in (-1, world) else cfg.fsdp_size
    c = 4 if a.param_dtype == "float32" else 2
    P, T, R = s.params, prompt_len + ro.response_length, ro.response_length
    shard = lambda n, b: math.ceil(n / group) * b  # noqa: E731  (bytes of a shard of n values, b bytes each)
    samples = cfg.train_batch_size * ro.n // world                   # this rank's rollout
    mini = a.ppo_mini_batch_size * ro.n // world
    gae = cfg.algorithm.adv_estimator == "gae"

    # states: bytes on the GPU between stages, by group, unless its flag puts it on the host
    k = s.layers if a.param_offload_layers < 0 else min(a.param_offload_layers, s.layers)
    actor_p = shard(P, 4)
    actor_off = shard(k * s.layer_params + (s.root_params if a.param_offload_layers < 0 else 0), 4)
    groups = {"actor params": (actor_p, actor_off if a.param_offload else 0),
              "actor Adam": (shard(P, 8), shard(P, 8) if a.optimizer_offload else 0)}
    lora = a.lora_rank > 0                     # adapters train (fp32, Adam); the frozen base is in the
    if lora:                                   # compute dtype; no ref model (the base is the reference)
        import actor
        adapters = actor.lora_param_count(model_config(cfg.model), a.lora_rank, a.lora_target_modules)
        actor_p = shard(adapters, 4)
        groups = {"actor base": (shard(P, c), shard(P, c) if a.param_offload else 0),
                  "actor params": (actor_p, actor_p if a.param_offload else 0),
                  "actor Adam": (shard(adapters, 8), shard(adapters, 8) if a.optimizer_offload else 0)}
    if a.use_kl_loss and not lora:
        groups["ref params"] = (shard(P, c), shard(P, c) if r.param_offload else 0)
    crit = shard(P - s.vocab * s.hidden * (0 if s.tied else 1), 4) if gae and cfg.critic.mode == "separate" else 0
    if crit:
        groups["critic params"] = (crit, crit if cfg.critic.param_offload else 0)
        groups["critic Adam"] = (2 * crit, 2 * crit if cfg.critic.optimizer_offload else 0)
    rm = getattr(cfg, "reward_model", None)
    if rm is not None and rm.path:
        rs = shapes(model_config(rm.path))
        rm_p = shard(rs.params - rs.vocab * rs.hidden * (0 if rs.tied else 1), c)
        groups["reward model"] = (rm_p, rm_p if rm.param_offload else 0)
    host_only = set()                          # CPUOffloadPolicy: shards, grads and Adam live on the host; only
    if a.offload_policy:                       # a layer at a time comes over (the gathered-layer term)
        groups["actor params"], groups["actor Adam"] = (actor_p, actor_p), (shard(P, 8), shard(P, 8))
        host_only |= {"actor params", "actor Adam"}
    if a.use_kl_loss and r.offload_policy and "ref params" in groups:
        groups["ref params"] = (shard(P, c), shard(P, c))
        host_only.add("ref params")

    def resident(*loaded):                     # what every group keeps on the GPU, plus the ones in use
        loaded = loaded + (("actor base",) if "actor params" in loaded else ())   # LoRA: they move together
        loaded = tuple(g for g in loaded if g not in host_only)
        held = {g: on - (0 if g in loaded else off) for g, (on, off) in groups.items()}
        return {"cuBLAS workspace": CUBLAS, **{g: b for g, b in held.items() if b}}

    gather = c * (2 * s.layer_params + s.root_params)

    def tokens(micro, budget):                 # tokens in one micro-batch (budget: use_dynamic_bsz)
        if not a.use_dynamic_bsz:
            return min(micro, samples) * T
        bins = math.ceil(mini * T / budget)    # the fewest bins that fit, balanced (packing.micro_batches)
        return min(budget, math.ceil(mini / bins) * T)

    def accumulating(micro, budget):          # 2+ micro-batches per optimizer step: grads already held
        bins = math.ceil(mini / micro) if not a.use_dynamic_bsz else math.ceil(mini * T / budget)
        return bins > 1

    def head(n_tok, per_elt):                  # one LM-head chunk of response tokens
        n_resp = n_tok * R // T
        return min(a.logits_chunk_tokens or n_resp, n_resp) * s.vocab * per_elt + n_resp * s.hidden * c

    def forward(n_tok):                        # a no-grad forward's transient: a layer's work or the head
        layer = n_tok * (c * (3 * s.ffn + 5 * s.hidden) + 8 * s.hidden)
        return {"gathered layers + root": gather, "forward transient": max(layer, head(n_tok, 12))}

    stages = []
    # generate: the actor's params are in for the weight sync; one bucket + one fp32 tensor in flight
    if engine == "vllm":                       # the sync: a bucket of layer tensors, or the embedding alone
        sync = max(ro.sync_bucket_mb * 2 ** 20 + s.hidden * s.ffn * c, s.vocab * s.hidden * c)
        stages.append(Stage("generate", {**resident("actor params"), "sync bucket": sync}))
    else:                                      # HF generate: the whole model gathered, its KV cache
        kv = samples * T * 2 * s.layers * s.kv_dim * c
        stages.append(Stage("generate", {**resident("actor params"), "gathered model": c * P, "KV cache": kv,
                                         "logits": samples * s.vocab * 4 * 2}))
    stages.append(Stage("reward", resident()))
    if rm is not None and rm.path:
        n = min(rm.micro_batch_size_per_gpu, samples) * T
        stages.append(Stage("reward_model", {**resident("reward model"), "gathered layers + root":
                                             c * (2 * rs.layer_params + rs.root_params),
                                             "forward transient": n * (c * (3 * rs.ffn + 5 * rs.hidden) + 8 * rs.hidden)}))
    on_policy = a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.train_batch_size
    stages.append(Stage("old_logp", resident() if on_policy else     # on-policy: skipped, the ledger still logs it
                        {**resident("actor params"),
                         **forward(tokens(a.log_prob_micro_batch_size_per_gpu, a.log_prob_max_token_len_per_gpu))}))
    prefetch = a.prefetch_update and a.param_offload and not gae
    if a.use_kl_loss:                          # LoRA: the actor's own forward, its adapter off
        stages.append(Stage("ref_logp", {**resident("actor params" if lora else "ref params",
                                                    *(["actor params"] if prefetch else [])),
                                         **forward(tokens(r.log_prob_micro_batch_size_per_gpu, r.log_prob_max_token_len_per_gpu))}))
    if gae:
        cr = cfg.critic
        stages.append(Stage("values", {**resident("critic params" if crit else "actor params"),
                                       **forward(tokens(cr.forward_micro_batch_size_per_gpu, cr.forward_max_token_len_per_gpu)),
                                       "features": 0 if crit else samples * R * s.hidden * c}))
    stages.append(Stage("advantage", resident(*(["actor params"] if prefetch else []))))   # (run order)
    if gae and crit:
        n = tokens(cr.ppo_micro_batch_size_per_gpu, cr.ppo_max_token_len_per_gpu)
        held = resident("critic params", "critic Adam")
        stages.append(Stage("critic_update", _update_peak(
            held, {"critic grads": crit}, {**_activations(s, n, cr.gradient_checkpointing, c),
                                           "gathered layers + root": gather},
            accumulating(cr.ppo_micro_batch_size_per_gpu, cr.ppo_max_token_len_per_gpu), {})))
    n = tokens(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu)
    grads = {"actor grads": 0 if a.offload_policy else actor_p}
    held = resident("actor params", *([] if a.optimizer_load_at_step else ["actor Adam"]))
    busy = {**_activations(s, n, a.gradient_checkpointing, c), "gathered layers + root": gather,
            "LM head chunk (backward)": head(n, 20)}
    stages.append(Stage("update", _update_peak(
        held, grads, busy, accumulating(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu),
        {**resident("actor params", "actor Adam"), **grads})))

    kv_bytes = _kv_budget(cfg, world, T)
    dev = {}
    if engine == "vllm":                       # device-level while vLLM generates: the trainer's leftovers
        dev = {"trainer (allocated)": sum(resident().values()), "vLLM weights": c * P // ro.tensor_parallel_size,
               "vLLM KV cache": kv_bytes, "vLLM graphs + buffers": VLLM_RESIDENT, "CUDA context": CUDA_CONTEXT}
    pinned = sum(off for on, off in groups.values()) + (actor_p if a.offload_policy else 0)   # + the host grads
    plan = Plan(stages, dev, pinned, _seconds(cfg, s, world, samples, T, groups, engine))
    merge = 4 * s.largest if lora else 0       # LoRA's sync merges W + BA in fp32: that block stays cached
    slack = LORA_UPDATE_SLACK if lora else UPDATE_SLACK
    plan.device = _device_levels(plan, sum(resident().values()), c * P // ro.tensor_parallel_size + merge,
                                 engine, slack)
    return plan


def _device_levels(plan: Plan, between: int, vllm_weights: int, engine: str, slack: float) -> dict:
    """Each stage's device-level bytes at its highest (what mem_get_info shows; nvidia-smi too): the
    allocator's reserve plus what lies outside it. The reserve only grows within a step: nothing
    gives cached blocks back between the weight sync's empty_cache and the next step's, so a stage
    holds the largest reserve of the stages before it as well as its own allocated peak plus the
    cached blocks of its transients (FORWARD_SLACK, UPDATE_SLACK). The generate stage peaks either
    at the weight sync (the trainer's actor params in, beside vLLM's woken weights) or while
    vLLM's KV cache is awake (plan.vllm_device), whichever is higher. With HF generate nothing is
    emptied: every stage sees the step's largest reserve (steady state from the second step)."""
    outside = OUTSIDE + (VLLM_OUTSIDE if engine == "vllm" else 0)
    reserve = {}
    carry = between + SLEEP_RESIDUE            # after generate's empty_cache: the live blocks' segments
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
    if engine != "vllm":
        top = max(max(reserve.values()), int(plan.stages[0].total * (1 + slack)))
        return {name: outside + top for name in reserve}
    gen = plan.stage("generate")
    sync = gen.total + vllm_weights + VLLM_OUTSIDE if gen else 0
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


def _kv_budget(cfg, world: int, T: int) -> int:
    """The KV bytes rollout.build gives vLLM on each GPU (an engine serves its tp ranks' sequences);
    0 when a share of the GPU sizes it instead."""
    ro = cfg.rollout
    if ro.gpu_memory_utilization > 0:
        return 0
    import rollout
    return rollout.kv_cache_bytes(model_config(cfg.model), cfg.train_batch_size // world * ro.n * ro.tensor_parallel_size,
                                  T, 2, ro.tensor_parallel_size, ro.kv_cache_margin)


DECODE_STEP = 3.5e-3          # vLLM: seconds per decoding step beyond reading the weights (CUDA graphs, sampling,
                              # scheduling; 64-128 sequences), fitted on the H200 rows of docs/plan_truth.json
HBM = 4.0e12                  # bytes/s a decoding step reads the weights at (H200: 4.8 TB/s peak)
STAGE_FIXED = 0.2             # seconds each stage pays whatever its size (launches, syncs, the ledger)
TP_ALLREDUCE = 15e-6          # a tensor-parallel engine's all-reduce, twice per layer per decoding step (latency-bound)


def _seconds(cfg, s: Shapes, world: int, samples: int, T: int, groups: dict, engine: str) -> float:
    """A step's time, for ranking configurations: generation (one decoding step per response token,
    each reading the weights once), the training compute at a measured share of the GPU's bf16 rate
    (update 3 passes, +1 with checkpointing; each log-prob or value forward 1 pass; a separate
    critic's update 3-4 more), and the copies that cannot hide (bytes / pinned bandwidth), per the
    copy levers. Within 20 % of the measured step on the H200 rows (test_plan.py)."""
    a, cr, ro = cfg.actor, cfg.critic, cfg.rollout
    tokens = samples * T
    gae = cfg.algorithm.adv_estimator == "gae"
    separate = gae and cr.mode == "separate"
    lora = a.lora_rank > 0                     # the frozen base's weight grads are never computed: 2 passes
    passes = (2 if lora else 3) + (1 if a.gradient_checkpointing else 0) + (1 if a.use_kl_loss else 0)
    passes += 0 if (a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.train_batch_size) else 1
    passes += (1 + 3 + (1 if cr.gradient_checkpointing else 0)) if separate else (1 if gae else 0)
    compute = 2 * s.params * tokens * passes / TFLOPS
    rm = getattr(cfg, "reward_model", None)
    if rm is not None and rm.path:             # the reward model's forward over every sequence
        compute += 2 * shapes(model_config(rm.path)).params * tokens / TFLOPS + STAGE_FIXED
    tp = ro.tensor_parallel_size
    generate = ro.response_length * (DECODE_STEP + 2 * s.params / tp / HBM + (2 * s.layers * TP_ALLREDUCE if tp > 1 else 0))
    stages = 2 + (1 if a.use_kl_loss else 0) + (2 if separate else 1 if gae else 0)    # the stages that compute
    stages += 0 if (a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.train_batch_size) else 1
    fixed = generate + stages * STAGE_FIXED
    exposed = 0.0
    p_off, a_off = groups["actor params"][1], groups["actor Adam"][1]
    if a.offload_policy:                       # the optimizer steps on the CPU: 16.2 s for 1.54B params on
        return fixed + compute + 10.5e-9 * s.params / max(world, 1) + 3 * groups["actor params"][0] / PINNED_GBPS
    exposed += p_off * (1 + (0.25 if a.prefetch_update else 1)) / PINNED_GBPS   # out at the sync, in for the update
    exposed += a_off * (1 + (1 if a.optimizer_load_at_step else 0.5)) / PINNED_GBPS
    exposed += sum(off for g, (on, off) in groups.items() if g not in ("actor params", "actor Adam")) / PINNED_GBPS
    micro = max(1, samples // max(a.ppo_micro_batch_size_per_gpu, 1))
    return fixed + compute + exposed + micro * s.layers * 1.5e-3


# --------------------------------------------------------------------------- choosing flags
SEARCH = {  # the flags the planner may turn, cheapest first
    "actor.gradient_checkpointing": (False, True),
    "ref.param_offload": (False, True),
    "actor.param_offload": (False, True),
    "actor.optimizer_offload": (False, True),
    "actor.optimizer_load_at_step": (False, True),
    "critic.param_offload": (False, True),     # PPO with a separate critic only
    "critic.optimizer_offload": (False, True),
}


def budget(gpu_bytes: int, margin: float, engine: str) -> int:
    """What PyTorch may allocate on one GPU: the GPU less `margin`, the CUDA context and (with vLLM)
    what the sleeping engine keeps, divided by the allocator's slack."""
    return int((gpu_bytes * (1 - margin) - CUDA_CONTEXT - (VLLM_RESIDENT if engine == "vllm" else 0)))


def candidates(cfg, world: int):
    """Every combination of SEARCH, of halved micro-batch sizes and of vLLM tensor-parallel sizes
    that divide the world, as copies of `cfg`."""
    import copy
    import itertools
    a = cfg.actor

    def halvings(m):
        return sorted({x for x in (m, m // 2, m // 4, m // 8, 1) if x >= 1}, reverse=True)
    tps = [t for t in (1, 2, 4, 8) if world % t == 0 and t >= cfg.rollout.tensor_parallel_size]
    for values, micro, lp_micro, tp in itertools.product(itertools.product(*SEARCH.values()),
                                                         halvings(a.ppo_micro_batch_size_per_gpu),
                                                         halvings(a.log_prob_micro_batch_size_per_gpu), tps):
        flags = dict(zip(SEARCH, values))
        if flags["actor.optimizer_load_at_step"] and not flags["actor.optimizer_offload"]:
            continue
        if flags["ref.param_offload"] and not cfg.actor.use_kl_loss:
            continue
        separate = cfg.algorithm.adv_estimator == "gae" and cfg.critic.mode == "separate"
        if not separate and (flags["critic.param_offload"] or flags["critic.optimizer_offload"]):
            continue
        c = copy.deepcopy(cfg)
        for key, v in flags.items():
            section, name = key.split(".")
            setattr(getattr(c, section), name, v)
        c.rollout.tensor_parallel_size = tp     # vLLM's weights (and KV heads) split over tp GPUs
        c.actor.ppo_micro_batch_size_per_gpu = micro
        c.actor.log_prob_micro_batch_size_per_gpu = lp_micro
        c.ref.log_prob_micro_batch_size_per_gpu = min(c.ref.log_prob_micro_batch_size_per_gpu, lp_micro)
        yield c


def choose(cfg, world: int, prompt_len: int, gpu_bytes: int, margin: float, engine: str, host_bytes: int = 0,
           least_memory: bool = False):
    """(the fastest configuration whose every stage fits, its Plan), or (None, None). A stage fits
    when its allocated peak fits `budget` and its device level (plan.device: the allocator's reserve,
    the contexts, vLLM) keeps `margin` of the GPU free. `host_bytes`: the pinned host memory one rank
    may use (0: not checked). `least_memory`: the one with the lowest device level instead."""
    limit = budget(gpu_bytes, margin, engine)
    best, key = None, None
    for c in candidates(cfg, world):
        p = predict(c, world, prompt_len, engine)
        if host_bytes and p.pinned_host > 0.9 * host_bytes:
            continue
        if max(s.total for s in p.stages) <= limit and p.device_peak <= gpu_bytes * (1 - margin):
            k = (round(p.seconds, 2), len(changes(cfg, c)))     # the fastest; of equals, the fewest changes
            k = (p.device_peak,) + k if least_memory else k
            if best is None or k < key:
                best, key = (c, p), k
    return best or (None, None)


def changes(before, after) -> list[str]:
    """The options `after` sets differently from `before`, as command-line flags."""
    out = []
    for key in list(SEARCH) + ["actor.ppo_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu",
                               "ref.log_prob_micro_batch_size_per_gpu", "rollout.tensor_parallel_size"]:
        section, name = key.split(".")
        v0, v1 = getattr(getattr(before, section), name), getattr(getattr(after, section), name)
        if v0 != v1:
            out.append(f"--{key}={str(v1).lower() if isinstance(v1, bool) else v1}")
    return out


def what_would_fit(cfg, world: int, prompt_len: int, gpu_bytes: int, margin: float, engine: str,
                   host_bytes: int = 0) -> list[str]:
    """When nothing fits: the smallest change of each kind that would (more GPUs, fewer samples,
    shorter responses, FSDP2's CPU offload policy)."""
    import copy
    tries = []
    for k in (2, 4, 8, 16, 32, 64):            # the same samples per GPU on more GPUs
        tries.append((f"{world * k} GPUs (torchrun --nnodes / --nproc_per_node; train_batch_size x{k} keeps "
                      f"the samples per GPU)", world * k,
                      lambda c, k=k: (setattr(c, "train_batch_size", c.train_batch_size * k),
                                      setattr(c.actor, "ppo_mini_batch_size", c.actor.ppo_mini_batch_size * k))))
    for k in (2, 4, 8):
        tries.append((f"rollout.n={max(1, cfg.rollout.n // k)}", world,
                      lambda c, k=k: setattr(c.rollout, "n", max(1, c.rollout.n // k))))
        tries.append((f"rollout.response_length={max(1, cfg.rollout.response_length // k)}", world,
                      lambda c, k=k: setattr(c.rollout, "response_length", max(1, c.rollout.response_length // k))))
    if not cfg.actor.lora_rank:
        tries.append(("actor.lora_rank=64 (train adapters only: no ref model, grads and Adam for the adapters)",
                      world, lambda c: setattr(c.actor, "lora_rank", 64)))
    tries.append(("actor.offload_policy=true (FSDP2 CPUOffloadPolicy: ~10x slower step)", world,
                  lambda c: setattr(c.actor, "offload_policy", True)))
    found, kinds = [], set()
    for label, w, change in tries:
        kind = label.split("=")[0] if "=" in label.split(" ")[0] else "GPUs"
        if kind in kinds:
            continue
        c = copy.deepcopy(cfg)
        change(c)
        if (c.train_batch_size * c.rollout.n) % w or c.train_batch_size % w:
            continue
        if choose(c, w, prompt_len, gpu_bytes, margin, engine, host_bytes)[0] is not None:
            found.append(label)
            kinds.add(kind)
    return found


# --------------------------------------------------------------------------- reporting
def table(plan: Plan, gpu_bytes: int) -> str:
    lines = [f"{'stage':<14}{'predicted GB':>13}{'device GB':>10}   what is on the GPU at the stage's peak (GB)"]
    for st in plan.stages:
        terms = ", ".join(f"{k} {v / GB:.2f}" for k, v in st.terms.items() if v)
        lines.append(f"{st.name:<14}{st.total / GB:>13.2f}{plan.device.get(st.name, 0) / GB:>10.2f}   {terms}")
    if plan.vllm_device:
        terms = ", ".join(f"{k} {v / GB:.2f}" for k, v in plan.vllm_device.items())
        lines.append(f"{'(vLLM awake)':<14}{sum(plan.vllm_device.values()) / GB:>13.2f}   device-level: {terms}")
    lines.append(f"peak {plan.peak / GB:.2f} GB allocated, {plan.device_peak / GB:.2f} GB device-level (the "
                 f"allocator's reserve, CUDA contexts, vLLM) of {gpu_bytes / GB:.0f} GB; pinned host RAM per rank "
                 f"{plan.pinned_host / GB:.2f} GB; step estimate {plan.seconds:.1f} s")
    return "\n".join(lines)


def report(cfg, world: int, prompt_len: int, gpu_bytes: int, margin: float, engine: str, host_bytes: int = 0) -> str:
    """The table for `cfg`, then the fastest configuration that fits (or what would)."""
    plan = predict(cfg, world, prompt_len, engine)
    out = [f"[plan] {cfg.model or 'tiny'} on {world} x {gpu_bytes / GB:.0f} GB, {engine} rollout, "
           f"prompt {prompt_len} + response {cfg.rollout.response_length} tokens"
           + (f", {host_bytes / GB:.0f} GB of host RAM per rank:" if host_bytes else ":"), table(plan, gpu_bytes)]
    best, best_plan = choose(cfg, world, prompt_len, gpu_bytes, margin, engine, host_bytes)
    limit = budget(gpu_bytes, margin, engine)
    if best is None:
        fits = what_would_fit(cfg, world, prompt_len, gpu_bytes, margin, engine, host_bytes)
        out.append(f"[plan] nothing fits under {limit / GB:.1f} GB per GPU ({margin:.0%} margin) with any "
                   f"combination of offload flags, checkpointing and micro-batch sizes; what would: "
                   + ("; ".join(fits) if fits else "nothing tried (a bigger GPU)"))
    else:
        flags = changes(cfg, best)
        out.append(f"[plan] fastest that fits under {limit / GB:.1f} GB ({margin:.0%} margin): "
                   + (" ".join(flags) if flags else "the configuration as given")
                   + f" (peak {best_plan.peak / GB:.1f} GB allocated, {best_plan.device_peak / GB:.1f} GB device-level, "
                   f"step ~{best_plan.seconds:.1f} s)")
    return "\n".join(out)


def templates() -> str:
    """The size table: 0.5B / 7B / 72B GRPO (16 prompts x 8 samples per GPU... see the text) on
    1 x 80 GB, 8 x 80 GB and 8 x 141 GB GPUs."""
    import train_grpo
    rows = ["| model | GPUs | fastest that fits (beyond the defaults) | peak GB/GPU allocated | device level GB/GPU "
            "| pinned host GB/rank |", "|---|---|---|---|---|---|"]
    for model in ("random:qwen2.5-0.5b", "random:qwen2.5-7b", "random:qwen2.5-72b"):
        for world, gb in ((1, 80), (8, 80), (8, 141)):
            cfg = train_grpo.parse_args([f"--model={model}", f"--train_batch_size={8 * world}", "--rollout.n=8",
                                         f"--actor.ppo_mini_batch_size={8 * world}", "--rollout.response_length=1024",
                                         "--actor.ppo_micro_batch_size_per_gpu=8"])
            host = int((560 if world == 8 else 128) * GB / world)      # the device machines' RAM per rank
            best, p = choose(cfg, world, 512, gb * GB, 0.1, "vllm", host)
            if best is None:
                fits = what_would_fit(cfg, world, 512, gb * GB, 0.1, "vllm", host)
                rows.append(f"| {model[7:]} | {world} x {gb} | does not fit; would: {'; '.join(fits[:2]) or '-'} "
                            f"| - | - | - |")
            else:
                rows.append(f"| {model[7:]} | {world} x {gb} | {' '.join(changes(cfg, best)) or '(none)'} | "
                            f"{p.peak / GB:.1f} | {p.device_peak / GB:.1f} | {p.pinned_host / GB:.1f} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- during the run
RELIEF = {  # the biggest term of a stage -> the change that removes or shrinks it
    "actor Adam": "--actor.optimizer_offload=true",
    "actor params": "--actor.param_offload=true",
    "ref params": "--ref.param_offload=true",
    "critic params": "--critic.param_offload=true",
    "critic Adam": "--critic.optimizer_offload=true",
    "reward model": "--reward_model.param_offload=true",
    "activations": "--actor.gradient_checkpointing=true (or a smaller actor.ppo_micro_batch_size_per_gpu)",
    "activations (layer inputs)": "a smaller actor.ppo_micro_batch_size_per_gpu (or use_dynamic_bsz with a token budget)",
    "activations (one layer rebuilt)": "a smaller actor.ppo_micro_batch_size_per_gpu",
    "LM head chunk (backward)": "a smaller actor.logits_chunk_tokens",
    "forward transient": "a smaller *.log_prob_micro_batch_size_per_gpu (or actor.logits_chunk_tokens)",
    "actor grads": "--actor.offload_policy=true (grads and Adam on the CPU: much slower) or more GPUs",
    "sync bucket": "a smaller rollout.sync_bucket_mb",
    "gathered model": "--rollout.engine=vllm (HF generate gathers the whole model)",
    "KV cache": "fewer samples per GPU (rollout.n, train_batch_size) or more GPUs",
}


def relief(st: Stage) -> str:
    """The cheapest change for a stage: the one that removes its biggest term."""
    name = max(st.terms, key=st.terms.get) if st.terms else ""
    return f"{name} is its biggest term ({st.terms.get(name, 0) / GB:.1f} GB): {RELIEF.get(name, 'more GPUs')}"


def watch(m: dict, seen: dict, p: Plan, gpu_bytes: int, host_bytes: int, every: int = 50) -> list[str]:
    """This step's early warnings, one line each, each kind at most once per `every` steps: a stage
    above 90 % of the GPU; allocator retries; a measured peak off the plan by more than 10 % and
    0.25 GB; reserved memory growing while allocated does not; host RSS growing; pinned host memory
    short."""
    out = []

    def warn(kind, text):
        if m["step"] - seen.get(kind, -every) >= every:
            seen[kind] = m["step"]
            out.append("[memory] warning: " + text)

    for st in p.stages:
        peak = m.get(f"mem/{st.name}/peak_gb")
        if peak is None:
            continue
        if peak * GB > 0.9 * gpu_bytes:
            warn(f"high/{st.name}", f"{st.name} peaked at {peak:.1f} GB, over 90 % of the GPU's "
                                    f"{gpu_bytes / GB:.0f} GB; {relief(st)}")
        if m.get(f"mem/{st.name}/alloc_retries", 0) > 0:
            warn(f"retries/{st.name}", f"{st.name}: the allocator freed its cache and retried "
                                       f"{m[f'mem/{st.name}/alloc_retries']:.0f} times (it runs at the memory "
                                       f"limit, and pays in time); {relief(st)}")
        pred = st.total / GB                   # off by 10 %, and by more than the model's resolution
        if m["step"] >= 1 and abs(peak - pred) > max(0.1 * pred, 0.25):   # (a 30 MB stage is no news)
            warn(f"plan/{st.name}", f"{st.name} peaked at {peak:.2f} GB, the plan predicted {pred:.2f} GB "
                                    f"({peak / pred - 1:+.0%}); plan.py's terms for it: "
                                    + ", ".join(f"{k} {v / GB:.2f}" for k, v in st.terms.items() if v))
    last = p.stages[-1].name                   # after the last stage: what stays between steps
    alloc, reserved, rss = (m.get(f"mem/{last}/allocated_gb"), m.get(f"mem/{last}/reserved_gb"), m.get("host_rss_gb"))
    if alloc is not None and m["step"] >= 3:   # after warm-up (Adam's state, the caches)
        a0, r0, h0 = seen.setdefault("base", (alloc, reserved, rss))
        if reserved - r0 > 0.05 * r0 + 0.5 and alloc - a0 < 0.1:
            warn("reserved", f"reserved memory grew {r0:.1f} -> {reserved:.1f} GB since step 3 while allocated stayed "
                             f"at {alloc:.1f} GB: fragmentation; it will end in an OOM that more memory would not need")
        if rss is not None and rss - h0 > 0.05 * h0 + 0.5:
            warn("rss", f"host RSS grew {h0:.1f} -> {rss:.1f} GB since step 3: host memory creeps "
                        f"(pinned buffers re-made, or a reference kept per step)")
    if host_bytes and p.pinned_host > 0.9 * host_bytes:
        warn("pinned", f"the offloaded groups need {p.pinned_host / GB:.1f} GB of pinned host memory per rank, "
                       f"over 90 % of the {host_bytes / GB:.0f} GB this process's share of the host has")
    return out


def explain_oom(stage: str, p: Plan, m: dict, device_gb: float) -> str:
    """An OOM inside a stage, in one message: where, what the ledger saw resident before it, what
    the plan predicted, and the change to make."""
    held = {k.split("/")[1]: v for k, v in m.items() if k.startswith("mem/") and k.endswith("/allocated_gb")}
    before = (f"{held[list(held)[-1]]:.1f} GB allocated after {list(held)[-1]}" if held
              else "(no stage finished this step)")
    st = p.stage(stage)
    pred = f"the plan predicted {st.total / GB:.1f} GB for it; {relief(st)}" if st else "the plan has no such stage"
    return (f"out of GPU memory in stage {stage} (a {device_gb:.0f} GB GPU): {before}; {pred}. "
            f"Or let the planner choose: --offload=auto.")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {"nproc": 1, "gpu_gb": 80.0, "margin": 0.1, "prompt_len": 0, "engine": "vllm",
           "host_gb": 0.0, "nproc_per_node": 0}       # host_gb: RAM per node (0: pinned memory not checked)
    if any(a == "--plot" or a.startswith("--plot=") for a in argv):   # issue 28: the picture is tracker.py's
        import tracker
        sys.exit(tracker.plot_command(argv))
    rest = []
    for arg in argv:
        key, _, value = arg[2:].partition("=")
        if arg == "--templates":
            print(templates())
            return
        if key in own:
            own[key] = type(own[key])(value)
        else:
            rest.append(arg)
    import train_grpo
    try:
        cfg = train_grpo.parse_args(rest)
        prompt_len = own["prompt_len"] or _prompt_len(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    per_node = own["nproc_per_node"] or min(own["nproc"], 8)
    print(report(cfg, own["nproc"], prompt_len, int(own["gpu_gb"] * GB), own["margin"], own["engine"],
                 int(own["host_gb"] * GB / per_node)))


def _prompt_len(cfg) -> int:
    """The longest prompt the run will see: read from --data (tokenized), the copy task's otherwise."""
    import data
    tok = data.load_tokenizer(cfg.model)
    prompts = data.load_data(cfg.data, tok, cfg.prompt_key, cfg.answer_key, cfg.max_prompt_length, cfg.seed)[0]
    return max(map(len, prompts))


if __name__ == "__main__":
    main()
