"""The planner's prediction: every stage's peak GPU memory per rank (allocator and device level) and the step's
time, before anything is built. Each role predicts its own state groups and stages (the `predicted` section of
actor.py, ref.py, critic.py, reward_model.py, rollout.py, rollout_async.py, rollout_buffer.py, rollout_engine.py);
this file walks them in train_grpo.train_step's order, adds what every other group holds between its uses, and
calibrates the device level and the time on bench/results/corpus.json's H200 runs. It names no role's flags,
moves nothing and builds no model; plan.py fits the prediction to a GPU (the search, --offload=auto, the command
line), and watch.py reads it beside each step's measurement.

    python plan.py --model=random:qwen2.5-7b --nproc=8 --gpu_gb=80    # the table, and what fits (plan.py)
    python -m pytest -q tests/test_plan.py tests/test_corpus.py        # the terms against the model and the GPU runs

The terms (per rank, bytes; each named in the table): a role's state group is (bytes on the GPU in use, between
uses, in pinned host memory) under its flags; a stage is its owner's moments, each {term: bytes}, beside every
other group's between-bytes and cuBLAS's workspace; its peak is the largest moment. The shapes (model.Shapes) give
the fp32 shards, Adam's moments, FSDP2's gathered layers, the activations autograd keeps per token, the LM head's
chunk (packing.HEAD_*), the engine's weights and KV cache (rollout.Request). Async rollout (rollout.mode=async):
the engine's GPU (`Plan.engine_device`: on rank 0's GPU with rollout.gpus=0, inside every stage's device level)
and the host buffer; `world` is the trainer's ranks."""
import functools
from dataclasses import dataclass, field, replace

import actor
import critic
import kernel_choice
import model
import ref
import reward_model
import rollout
import rollout_async
import rollout_buffer
import rollout_engine
import validate

GB = 1024 ** 3
PINNED_GBPS = 55.2e9         # pinned host<->device copy bandwidth measured on the H200 (bench/README.md)
TFLOPS = 742e12 * 0.51       # bf16 matmul peak measured there x the share a training step reaches (fitted)
CUDA_CONTEXT = int(0.55 * GB)  # the CUDA context and NCCL's buffers: outside PyTorch's count
CUBLAS = 32 * 2 ** 20        # cuBLAS's workspace, allocated through PyTorch's allocator at the first matmul
VLLM_RESIDENT = rollout.VLLM_GRAPHS   # what a sleeping vLLM engine keeps (CUDA graphs, buffers)
# Device level (what mem_get_info shows), calibrated on the H200 runs of bench/results/corpus.json:
OUTSIDE = int(0.83 * GB)     # device use outside PyTorch's reserve: CUDA context, NCCL and cuBLAS handles
VLLM_OUTSIDE = int(0.27 * GB)  # ... and what an asleep vLLM engine adds to it
FORWARD_SLACK = int(0.8 * GB)  # reserved beyond a no-grad stage's allocated peak (cached blocks of its transients)
UPDATE_SLACK = 0.09          # reserved beyond a full fine-tuning update's allocated peak, as a share of it
LORA_UPDATE_SLACK = 0.05     # ... a LoRA update's (its peak is activations, freed and reused in order)
EXPANDABLE_UPDATE_SLACK = 0.06   # ... with --expandable_segments (7B, H200: 72.72 GB reserved for a 64.89 GB peak
                                 # and one 4.06 GB Adam window, against 74.96 for 65.05 without)
SECOND_UPDATE_SLACK = 0.18   # ... the actor's update right after the critic's (PPO: two sets of grads cached)
SLEEP_RESIDUE = int(0.6 * GB)  # after vLLM sleeps and the cache is emptied: segments that still hold a live block
ALLOC_SLACK = 1.01           # 512 B rounding, uncounted buffers: peaks run 1-2 % above the terms' sum
DECODE_STEP = 2.5e-3         # vLLM: seconds per decoding step beyond reading the weights (CUDA graphs, sampling,
                             # scheduling; 64-128 sequences), fitted on the H200 rows of corpus.json
HBM = 4.0e12                 # bytes/s a decoding step reads the weights at (H200: 4.8 TB/s peak)
STAGE_FIXED = 0.2            # seconds each stage pays whatever its size (launches, syncs, the ledger)
MICRO_LAYER = 4.5e-3         # seconds per micro-batch and layer of an update (launches, FSDP2's gathers)
TP_ALLREDUCE = 15e-6         # a tensor-parallel engine's all-reduce, twice per layer per decoding step
FITTED_SEQS = 128            # the sequences of DECODE_STEP's fit; an async engine's beyond them add their KV reads
EMPTY_S_PER_GB = 0.9e-3      # vLLM asleep: the bracket's first empty_cache, s a GiB of the reserve it gives back; and
SLEEP_WAKE_S = (0.025, 0.007)  # its sleep and two wakes, s + s a GiB of its weights and KV (measured on the 7B runs)
PUSH_BPS = 25e9              # async: bytes/s of the weight push (gather, bucket copy, NCCL or CUDA IPC); a
                             # placeholder until a 2-GPU push is measured (the 1-GPU one: 2.9 GB in 0.094 s)


@functools.lru_cache(maxsize=16)
def model_config(path: str | None):
    """The HF config of `--model` without building the model (model.hf_config), read once: not to be
    modified."""
    return model.hf_config(path)


@functools.lru_cache(maxsize=16)
def shapes(path: str | None) -> model.Shapes:
    return model.shapes(model_config(path))


# --------------------------------------------------------------------------- the prediction
@dataclass
class Stage:
    name: str
    terms: dict = field(default_factory=dict)   # what is on the GPU at the stage's peak: name -> bytes
    moments: list = field(default_factory=list, repr=False)   # every moment's terms (the peak is the largest)

    @functools.cached_property
    def total(self) -> int:
        return int(sum(self.terms.values()) * ALLOC_SLACK)

    def held(self, group: str) -> int:
        """A state group's bytes on the GPU at its most during the stage."""
        return max(m.get(group, 0) for m in self.moments)


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
    checkpoint: int = 0                        # allocated at a checkpoint's bracket (0: --save_freq=0, none written)
    response_length: int = 0                   # the tokens of every response the stages assume (their full length)

    @property
    def peak(self) -> int:
        return max([s.total for s in self.stages] + [sum(self.vllm_device.values())])

    @property
    def device_peak(self) -> int:
        return max(self.device.values(), default=0)

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)


@dataclass(frozen=True)
class Run:
    """What one prediction reads off the options, besides the per-rank sizes (`z`, a model.Sizes)."""
    cfg: object                                # an options.Config
    z: model.Sizes
    engine: str                                # vllm | hf
    req: rollout.Request                       # one engine's sequences, length, dtype (colocated or async)

    @property
    def asynchronous(self) -> bool:            # the engine in its own process(es), a step ahead of the trainer
        return self.cfg.rollout.mode == "async"

    @property
    def ppo(self) -> bool:
        return self.cfg.algorithm.adv_estimator == "gae"

    @property
    def separate(self) -> bool:                # PPO with its own critic model
        return self.ppo and self.cfg.critic.mode == "separate"

    @property
    def lora(self) -> bool:
        return self.cfg.actor.lora_rank > 0

    @property
    def on_policy(self) -> bool:               # old log-probs are not recomputed (the actor's rule)
        return actor.on_policy(self.cfg.actor, self.cfg.train_batch_size)


def sizes(cfg, world: int, prompt_len: int) -> model.Sizes:
    """One rank's share: a Ulysses group's k ranks hold the same rows (the batch splits over world / k); the
    kernels and LM head a GPU run would use (liger and compile keep less for backward; a compiled head's chunk)."""
    k = cfg.actor.ulysses_sequence_parallel_size
    head = kernel_choice.HEAD_BYTES[kernel_choice.planned_head(cfg.head_kernel)]
    n, dp = cfg.rollout.n, world // k
    fused = kernel_choice.fused(cfg.kernels, model_config(cfg.model).model_type)
    group = world if cfg.fsdp_size in (-1, world) else cfg.fsdp_size
    ends = cfg.actor.embeddings_apart
    return model.Sizes(replace(shapes(cfg.model), fused=fused, head=head, embeddings_apart=ends), world, group,
                       4 if cfg.actor.param_dtype == "float32" else 2, cfg.train_batch_size * n // dp,
                       cfg.actor.ppo_mini_batch_size * n // dp, prompt_len, cfg.rollout.response_length, k)


def run(cfg, world: int, prompt_len: int, engine: str = "vllm") -> Run:
    ro, dtype = cfg.rollout, cfg.actor.param_dtype
    req = rollout_engine.request(ro, cfg.train_batch_size, prompt_len, dtype) if ro.mode == "async" else \
        rollout.request(ro, prompts=rollout.prompts_per_rank(cfg.train_batch_size, world), prompt_len=prompt_len,
                        param_dtype=dtype)
    return Run(cfg, sizes(cfg, world, prompt_len), engine, req)


def states(r: Run) -> dict:
    """Every role's state groups on this rank: name -> (bytes on the GPU in use, between uses, pinned host)."""
    cfg, z = r.cfg, r.z
    out = actor.predicted_states(cfg.actor, z, model_config(cfg.model))
    if ref.needed(cfg.actor):
        out.update(ref.predicted_states(cfg.ref, z))
    if r.ppo:
        out.update(critic.predicted_states(cfg.critic, z))
    if cfg.reward_model.path:
        out.update(reward_model.predicted_states(cfg.reward_model, z, model_config(cfg.reward_model.path)))
    if r.asynchronous:
        out.update(rollout_async.predicted_states(cfg.rollout, z, r.req))
    return out


def stage(name: str, st: dict, moments: list) -> Stage:
    """A stage from its owner's moments, each beside what every other group holds between its uses."""
    between = {"cuBLAS workspace": CUBLAS, **{g: b for g, (u, b, h) in st.items() if b}}
    full = [{**between, **m} for m in moments]
    return Stage(name, max(full, key=lambda m: sum(m.values())), full)


def walk(r: Run, st: dict) -> list:
    """Each stage's prediction from its owner, in train_grpo.train_step's order (the two must agree:
    test_plan.py runs one step of each kind and compares the stages and what each group held)."""
    cfg, z, a = r.cfg, r.z, r.cfg.actor
    policy = model.in_use(st, *actor.GROUPS)   # the actor's groups, in for a forward or the weights out
    kept = policy if actor.prefetches(a, r.ppo) else {}   # in from the ref stage until the update
    out = []

    def add(name, moments, extra=None):
        out.append(stage(name, st, [{**(extra or {}), **m} for m in moments]))
    if validate.enabled(cfg):                  # on the steps its schedule names: the engine's greedy answers
        add("val", [{}] if r.asynchronous else rollout.predicted_val(cfg.rollout, z, policy, r.engine, r.req))
    if r.asynchronous:
        add("rollout_wait", [{}])              # the batch comes from the host buffer
    else:
        add("generate", rollout.predicted_generate(cfg.rollout, z, policy, r.engine, r.req))
    add("reward", [{}])                        # on the CPU
    if cfg.reward_model.path:
        add("reward_model", reward_model.predicted_stage(cfg.reward_model, z, st, model_config(cfg.reward_model.path)))
    add("old_logp", [{}] if r.on_policy else actor.predicted_forward(a, z, st))
    if a.use_kl_loss:                          # LoRA: the actor's forward with its adapter off
        forward = actor.predicted_forward(a, z, st) if r.lora else ref.predicted_ref_logp(cfg.ref, z, st, a)
        add("ref_logp", forward, kept)
    if r.ppo:
        add("values", critic.predicted_values(cfg.critic, z, st, a, policy))
    add("advantage", critic.predicted_advantage(cfg.critic, z) if r.ppo else [{}], kept)
    if r.ppo:
        add("critic_update", critic.predicted_update(cfg.critic, z, st, a))
    add("update", actor.predicted_update(a, z, st))
    if r.asynchronous:
        add("push", rollout_async.predicted_push(cfg.rollout, z, policy, r.req, r.lora))
    return out


def predict(cfg, world: int, prompt_len: int, engine: str = "vllm") -> Plan:
    """Each stage's peak allocated bytes and device level on one rank for `cfg` on `world` ranks,
    with prompts up to `prompt_len` tokens and every response at its full length."""
    r = run(cfg, world, prompt_len, engine)
    st = states(r)
    stages, pinned = walk(r, st), sum(h for u, b, h in st.values())
    if r.asynchronous:
        eng = {**rollout_engine.predicted(cfg.rollout, model_config(cfg.model), r.req), "CUDA context": CUDA_CONTEXT}
        plan = Plan(stages, {}, pinned, _async_seconds(r, st), engine_device=eng,
                    buffer_host=rollout_buffer.buffer_bytes(cfg.rollout, cfg.train_batch_size, prompt_len),
                    beside=0 if cfg.rollout.gpus else sum(eng.values()))
    else:
        vllm = rollout.predicted_awake(cfg.rollout, r.z, model_config(cfg.model), r.req) if engine == "vllm" else {}
        awake = vllm and {"trainer (allocated)": sum(stage("between", st, [{}]).terms.values()), **vllm,
                          "CUDA context": CUDA_CONTEXT}
        beside = sum(vllm.values()) if never_sleeps(r) else VLLM_RESIDENT if engine == "vllm" else 0
        plan = Plan(stages, awake, pinned, _seconds(r, st), beside=beside)
    plan.device = _device_levels(plan, r, sum(stage("between", st, [{}]).terms.values()), freed_windows(r, st))
    plan.seconds += bracket_seconds(plan, r)
    plan.checkpoint = checkpoint_bytes(r, st) if cfg.save_freq else 0
    plan.response_length = cfg.rollout.response_length
    return plan


def never_sleeps(r: Run) -> bool:
    """A colocated vLLM engine awake all run (rollout.sleep_level=0): beside every stage, never woken again."""
    return r.engine == "vllm" and not r.asynchronous and r.cfg.rollout.sleep_level == 0


def bracket_seconds(plan: Plan, r: Run) -> float:
    """A colocated engine's sleep a step (0 awake, async, HF): the first empty_cache gives back the update's reserve
    (the highest stage's device level less generate's), then vLLM's sleep and two wakes of its weights and KV."""
    if r.engine != "vllm" or r.asynchronous or never_sleeps(r):
        return 0.0
    freed = max(plan.device.values()) - plan.device["generate"]
    mapped = plan.vllm_device["vLLM weights"] + plan.vllm_device["vLLM KV cache"]
    return max(0, freed) / GB * EMPTY_S_PER_GB + SLEEP_WAKE_S[0] + mapped / GB * SLEEP_WAKE_S[1]


def checkpoint_bytes(r: Run, st: dict) -> int:
    """A checkpoint's bracket (checkpoint._write and load: one trained role at a time, its predicted_checkpoint),
    beside what every other group holds between uses; the larger role's. --save_optimizer=false: the run's own
    checkpoints bring the params alone (a resume from one written with Adam still brings Adam in)."""
    roles, adam = [(actor, r.cfg.actor)] + ([(critic, r.cfg.critic)] if r.separate else []), r.cfg.save_optimizer
    return max(stage("checkpoint", st, role.predicted_checkpoint(cfg, r.z, st, adam)).total for role, cfg in roles)


def freed_windows(r: Run, st: dict) -> dict:
    """A streamed role's update whose root FSDP2 group holds an untied model's two tables (--actor.embeddings_apart=
    false) or a tied model's one reserves, beyond its slack, the bytes of its largest whole Adam window (the
    embeddings', 8 x vocab x hidden at Qwen2.5). nvidia-smi put it in the first micro-batch's backward, not the
    step (row windows did not change it): 7B, the 1 x 80 GB template on an H100, 72.05 GB reserved for 65.05
    allocated (expandable segments); on an H200 74.96 for 65.05 without, 72.72 for 64.89 with; 1.5B: 25.96 against
    25.79. With the 7B's embeddings and head units of their own it went: 65.02 reserved for 62.44, inside the slack
    (bench/results/2026-12-07-7b-apart-h100). So those bytes are the root group's backward end (both tables gathered
    and their grads in fp32 for the reduce) left in cached blocks, and an untied model's actor with its tables apart
    reserves none; a tied model's root holds its table either way (the 1.5B and 3B rows keep the term)."""
    whole = {"optimizer_row_windows": False}
    apart = r.z.shapes.end < r.z.shapes.root_params     # model.Shapes.end: one table, not the root
    out = {"update": 0 if apart else actor.predicted_windows(replace(r.cfg.actor, **whole), r.z, st, max)}
    if r.separate:                             # 0 above and here: not streamed
        out["critic_update"] = critic.predicted_windows(replace(r.cfg.critic, **whole), r.z, max)
    return out


def _device_levels(plan: Plan, r: Run, between: int, freed: dict) -> dict:
    """Each stage's device-level bytes at its highest (what mem_get_info shows; nvidia-smi too): the allocator's
    reserve plus what lies outside it. The reserve only grows within a step: nothing gives cached blocks back between
    the weight sync's empty_cache and the next step's, so a stage holds the largest reserve of the stages before it
    as well as its own allocated peak plus the cached blocks of its transients (FORWARD_SLACK, UPDATE_SLACK). The
    generate stage peaks at the weight sync (the actor's params in, beside vLLM's woken weights) or while vLLM's KV
    cache is awake (plan.vllm_device), whichever is higher. With HF generate nothing is emptied: every stage sees
    the step's largest reserve (steady state from the second step); async rollout too (no vLLM in the trainer's
    process), the engine beside every stage with rollout.gpus=0 (plan.beside). `between`: what the trainer holds
    between stages; `freed`: freed_windows."""
    slack = LORA_UPDATE_SLACK if r.lora else EXPANDABLE_UPDATE_SLACK if r.cfg.expandable_segments else UPDATE_SLACK
    colocated_vllm = r.engine == "vllm" and not r.asynchronous
    outside = OUTSIDE + (VLLM_OUTSIDE if colocated_vllm else 0)
    reserve = {}
    merge = 4 * r.z.shapes.largest if r.lora and colocated_vllm else 0   # LoRA's sync merges W + BA in fp32: that
    # block stays cached, past the bracket's empty_cache too (the reserve after it: +0.9 GB at 3B, +1.8 GB at 7B)
    carry = between + (0 if r.asynchronous else SLEEP_RESIDUE) + merge   # what generate's empty_cache cannot give back
    for st in plan.stages:
        if st.name in ("val", "generate"):     # the engine's bracket empties the cache before and after it
            reserve[st.name] = carry
            continue
        if st.name == "update" and r.separate:
            own = st.total * (1 + SECOND_UPDATE_SLACK)
        elif st.name == "update" or (st.name == "critic_update" and r.separate):   # shared: a head's update
            own = st.total * (1 + slack) + _grads_apart(st, r)
        else:
            own = st.total + (FORWARD_SLACK if st.total > between + GB // 4 else 0)
        carry = max(carry, int(own) + freed.get(st.name, 0))
        reserve[st.name] = carry
    if r.asynchronous:
        return {name: outside + max(reserve.values()) + plan.beside for name in reserve}
    if never_sleeps(r):                        # nothing emptied; vLLM's forwards cache their transients too; its
        gen = between + rollout.engine_bytes(model_config(r.cfg.model), kv_bytes=0, req=r.req,   # graphs in beside
                                             tp=r.cfg.rollout.tensor_parallel_size)["workspace"] - VLLM_RESIDENT
        return {name: OUTSIDE + max(*reserve.values(), gen) + plan.beside for name in reserve}
    if r.engine != "vllm":
        top = max(max(reserve.values()), int(plan.stages[0].total * (1 + slack)))
        return {name: outside + top for name in reserve}
    sync = plan.stage("generate").total + plan.vllm_device["vLLM weights"] + merge + VLLM_OUTSIDE
    out = {name: outside + v for name, v in reserve.items()}
    out["generate"] = max(OUTSIDE + sync, sum(plan.vllm_device.values()) - CUDA_CONTEXT + OUTSIDE)
    if "val" in out:                           # validation's bracket: the same sync, the same engine awake
        out["val"] = out["generate"]
    return out


def _grads_apart(st: Stage, r: Run) -> int:
    """A checkpointed update reserves its fp32 grads beside the layer inputs its backward frees (smaller than a layer's
    grads: never reused for them): on a peak before the grads, the grads; on the last layer's (at 1.5B), the inputs."""
    group = "activations (layer inputs)" if "LM head weight grad" in st.terms else "actor grads"   # last_layer_backward
    return st.held(group) if r.cfg.actor.gradient_checkpointing and group not in st.terms else 0


def checkpoint_fits(cfg, p: Plan, gpu_bytes: int):
    """A run whose checkpoint cannot fit the GPU at all (the plan's allocated bytes at its bracket, past the
    GPU less the CUDA context and what lies beside the trainer) is refused at start with its fix, not after
    --save_freq steps of work. `gpu_bytes` 0 (no GPU): nothing to check."""
    room = gpu_bytes - CUDA_CONTEXT - p.beside
    if gpu_bytes and p.checkpoint > room:
        what = "and all of its Adam onto the GPU at once, and a resume from it zero grads too" \
            if cfg.save_optimizer else "onto the GPU at once"
        raise ValueError(f"a checkpoint every --save_freq={cfg.save_freq} steps brings a trained role's fp32 params "
                         f"{what} "
                         f"({p.checkpoint / GB:.1f} GB by the plan; "
                         f"{room / GB:.1f} GB can be allocated here): use {actor.CHECKPOINT_RELIEF} (and the critic's: "
                         f"Adam then stays on the host at a checkpoint), --save_freq=0 "
                         f"(final/ keeps the weights whatever stops the run), or more GPUs")


def host_fits(cfg, p: Plan, device, available: int, local: int):
    """Raise one line, before any model is built, when this node's RAM cannot hold what the run puts there:
    each of its `local` ranks reads the model in fp32 (each role's model in turn: the largest, once) and keeps
    its pinned mirrors (p.pinned_host); on the CPU the stages' memory is the host's too (the plan's peak).
    `available`: the node's free RAM now (ledger.host_available)."""
    models = [cfg.model] + ([cfg.reward_model.path] if cfg.reward_model.path else [])
    load = max(4 * shapes(m).params for m in models)
    stages = p.peak if device.type == "cpu" else 0
    need = local * (load + p.pinned_host + stages)
    if need <= available:
        return
    parts = " + ".join(f"{what} {b / GB:.1f} GB" for what, b in (("the model read in fp32", load), (
        "pinned offload mirrors", p.pinned_host), ("the step's largest stage (on the CPU, host memory)", stages))
        if b >= GB // 20)
    raise ValueError(f"this node has {available / GB:.1f} GB of RAM free but the run needs ~{need / GB:.1f} GB there "
                     f"({local} rank(s) x ({parts})): run on a node with more RAM or fewer ranks per node"
                     + (", or make the step smaller (train_batch_size, rollout.n, rollout.response_length)"
                        if stages else "") + (", or turn offload flags off" if p.pinned_host else ""))


# --------------------------------------------------------------------------- time
def _seconds(r: Run, st: dict) -> float:
    """A step's time, for ranking configurations: generation, the stages' compute, the copies that
    cannot hide, and a fixed cost per micro-batch and layer. Within 20 % of the measured step on the
    H200 rows of bench/results/corpus.json (test_plan.py)."""
    return sum((_generate_seconds(r), *_trainer_seconds(r, st)))


def _trainer_seconds(r: Run, st: dict) -> tuple:
    """A step's time without generation, in parts (summed in this order): compute, exposed copies,
    micro-batches x layers."""
    a, cr, z = r.cfg.actor, r.cfg.critic, r.z
    micro = max(1, z.samples // max(a.ppo_micro_batch_size_per_gpu, 1))     # forward + backward passes
    micro += max(1, z.samples // max(cr.ppo_micro_batch_size_per_gpu, 1)) if r.separate else 0
    others = sum(h for g, (u, b, h) in st.items() if not g.startswith("actor_"))   # each in once per step
    copies = actor.predicted_copy_seconds(a, z, st, r.ppo, PINNED_GBPS) + others / PINNED_GBPS
    return _compute_seconds(r), copies, micro * z.shapes.layers * MICRO_LAYER


def _async_seconds(r: Run, st: dict) -> float:
    """Async: the engine generates the next batch while the trainer trains on this one, so a step
    takes the longer of the two, then the push (the engine waits for the new weights). With
    rollout.gpus=0 both share one GPU, so the max is the optimistic end there."""
    return max(_engine_seconds(r), sum(_trainer_seconds(r, st))) + r.z.shapes.params * r.req.dtype_bytes / PUSH_BPS \
        + STAGE_FIXED


def _engine_seconds(r: Run) -> float:
    """An async engine's generation of its share of the batch: the colocated rule, and each decoding
    step also reads the KV cache of the sequences beyond FITTED_SEQS (half-filled on average)."""
    s, z = r.z.shapes, r.z
    kv = max(0, r.req.seqs - FITTED_SEQS) * (z.prompt_len + z.response_len // 2) * 2 * s.layers * s.kv_dim * z.c
    return _generate_seconds(r) + z.response_len * kv / HBM


def _generate_seconds(r: Run) -> float:
    """One decoding step per response token, each reading this GPU's slice of the weights (FP8: the linear
    ones at a byte) and two all-reduces per layer with a tensor-parallel engine."""
    s, tp = r.z.shapes, r.cfg.rollout.tensor_parallel_size
    step = DECODE_STEP + r.req.weight_bytes(s) / tp / HBM + (2 * s.layers * TP_ALLREDUCE if tp > 1 else 0)
    return r.z.response_len * step + STAGE_FIXED


def _compute_seconds(r: Run) -> float:
    """The training passes at a measured share of the GPU's bf16 rate (an update 3 passes, LoRA's 2:
    the frozen base's weight grads are never computed; +1 with checkpointing; each log-prob or value
    forward 1; a separate critic's update 3 more, +1 with its checkpointing), a fixed cost per stage
    that computes, and a reward model's forward."""
    a, cr, z, s = r.cfg.actor, r.cfg.critic, r.z, r.z.shapes
    passes = (2 if r.lora else 3) + (1 if a.gradient_checkpointing else 0) + (1 if a.use_kl_loss else 0)
    passes += 0 if r.on_policy else 1
    passes += (1 + 3 + (1 if cr.gradient_checkpointing else 0)) if r.separate else (1 if r.ppo else 0)
    tokens = z.samples * z.T // z.sp       # Ulysses: a rank computes 1/sp of its group's tokens (all-to-alls not timed)
    stages = 1 + (1 if a.use_kl_loss else 0) + (2 if r.separate else 1 if r.ppo else 0) + (0 if r.on_policy else 1)
    seconds = 2 * s.params * tokens * passes / TFLOPS + stages * STAGE_FIXED
    if r.cfg.reward_model.path:                # the reward model's forward over every sequence
        seconds += 2 * shapes(r.cfg.reward_model.path).params * tokens / TFLOPS + STAGE_FIXED
    return seconds


def stage_flops(cfg, tokens: int) -> dict:
    """Each compute stage's model FLOPs on one GPU for the `tokens` it ran through the model: 2 x params a
    token for a forward, 6 with its backward (LoRA 4: the frozen base's weight grads are not computed);
    gradient checkpointing's recompute is not counted (model FLOPs: the MFU convention), nor attention's
    T^2 term. The stages the step-time estimate counts passes for (`_compute_seconds`)."""
    a, P = cfg.actor, shapes(cfg.model).params
    out = {"ref_logp": 2 * P * tokens, "update": (4 if a.lora_rank else 6) * P * tokens * a.ppo_epochs}
    if not actor.on_policy(a, cfg.train_batch_size):
        out["old_logp"] = 2 * P * tokens
    if cfg.algorithm.adv_estimator == "gae":
        out["values"] = 2 * P * tokens
        if cfg.critic.mode == "separate":
            out["critic_update"] = 6 * P * tokens * a.ppo_epochs
    if cfg.reward_model.path:
        out["reward_model"] = 2 * shapes(cfg.reward_model.path).params * tokens
    return out


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
