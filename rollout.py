"""Generation engines behind one function: `generate(engine, ...) -> batch`.

    python train_grpo.py --rollout.engine=hf                      # HF generate on the FSDP actor
    torchrun --nproc_per_node=8 train_grpo.py --rollout.engine=vllm --model=/models/Qwen2.5-1.5B
    python -m pytest tests/test_vllm.py -q                              # GPU + vLLM: parity, sleep, memory

HF engine (hf_engine.py): HF generate on the FSDP2 actor, its shards gathered once a call and freed after it.

vLLM engine: one in-process engine per rank (torchrun ranks are vLLM's workers through its
"external_launcher"), built once with random weights (`load_format="dummy"`) and sleep mode.
With tensor_parallel_size=k one engine spans k consecutive ranks (vLLM's layout): each GPU holds
1/k of its weights and KV heads, and every rank of the engine sends it the same requests (vLLM's
contract for this launcher), so the ranks pool their prompts and each keeps its own rows.
Every step runs the bracket below; each phase's seconds and device memory (`mem_get_info`, the
only figure that sees vLLM's pool) go to the metrics as `rollout/<phase>_s` / `_device_gb`:
    empty_cache     give PyTorch's cached blocks back so vLLM's pool can map them
    wake_weights    vLLM maps its weight memory again (KV cache still released)
    load_params     actor shards in from pinned host (only with actor.param_offload)
    sync            stream the actor's weights in, one bounded bucket at a time
    offload_params  actor shards back out, cache emptied: the trainer leaves the GPU to vLLM
    wake_kv         vLLM maps its KV cache last, when everything else is gone
    generate        sample n responses per prompt, with the sampled tokens' log-probs
    sleep           level 1: weights to host, KV dropped; level 2: both dropped (re-sent anyway)
sleep_level=0: asleep after its build only; from the first bracket on its weights and KV cache stay beside the
trainer and the bracket is the sync alone. Not the default: no faster end to end, for vLLM's memory (bench/README.md).
Checked on vLLM 0.26.0 with torch 2.11 (H200). Below: the config, the engine and `generate`, the bracket, the bytes.
"""
import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

import hf_engine
import offload
import tensor_parallel
import vllm_engine
from model import head_dim, is_dir, shapes


@dataclass
class RolloutConfig:
    engine: str = "auto"                   # vllm | hf | auto (vllm when it imports and CUDA is there)
    n: int = 8                             # samples per prompt (the GRPO group size)
    response_length: int = 4               # max new tokens; responses are right-padded to this
    temperature: float = 1.0              # 0: greedy (log-probs then use 1: the policy's own distribution)
    top_p: float = 1.0                     # nucleus sampling: keep the smallest set with this much mass
    top_k: int = 0                         # 0: off
    gpu_memory_utilization: float = 0.0    # vLLM: share of the WHOLE GPU for weights + KV cache; 0: the KV
                                           # cache is sized from the batch instead (kv_cache_bytes)
    kv_cache_margin: float = 0.1           # vLLM, sized from the batch: this much more KV than the batch needs
    sleep_level: int = 2                   # vLLM: 1 keeps weights in host RAM while asleep, 2 drops them,
                                           # 0 never sleeps after the first bracket (planned awake beside
                                           # every stage; measured no faster end to end: bench/README.md)
    enforce_eager: bool = False            # vLLM: no CUDA graphs (slower decode; graphs survive sleep)
    tensor_parallel_size: int = 1          # vLLM: ranks per engine (must divide the world size)
    sync_bucket_mb: int = 512              # weight sync: max bytes gathered before one load_weights
    logprobs_every: int = 0                # vLLM, colocated: the sampled tokens' log-probs on every k-th step only;
                                           # ~27 % of the decode step (bench/README.md, "Where a decode
                                           # step goes"). Read by the rollout correction (every step: k must be 1)
                                           # and the rollout/logp_diff_* metrics (on the steps that have them).
                                           # 0: 1 with the correction, else LOGPROBS_EVERY (options.check_config)
    dtype: str = "auto"                    # vLLM weights: auto = the actor's compute dtype
    kv_cache_dtype: str = "auto"           # vLLM's KV cache: auto (the weights' dtype) | fp8 (one byte an element:
                                           # half bf16's; the rollout correction turns on, actor.rollout_is)
    quantization: str = "none"             # vLLM's linear weights: none | fp8 (vLLM's online FP8, per tensor,
                                           # from the pushed bf16 weights at each sync; the trainer stays bf16)
    # asynchronous rollout (rollout_async.py, rollout_engine.py): engines in their own processes, a step ahead
    mode: str = "colocated"                # colocated: generate, then train, on the same GPUs (the bracket) |
                                           # async: engine processes fill a bounded host buffer while the
                                           # trainer trains on the previous batch (one-step-off-policy)
    gpus: int = 0                          # async: the last k of the ranks torchrun starts are engines, one a
                                           # GPU; 0: one engine process beside rank 0's trainer on its GPU
    max_staleness: int = 1                 # async: a batch is sampled by a policy at most this many updates
                                           # older than the one it trains (1: one-step-off-policy)
    buffer_limit: int = 0                  # async: samples ordered or waiting on the host at most; the engine
                                           # waits for room beyond it (0: max_staleness steps' worth)



# checked when the command line is parsed (options.check_config)
RANGES = {"n": ">= 1", "response_length": ">= 1", "temperature": ">= 0", "top_p": "(0, 1]", "top_k": ">= 0",
          "gpu_memory_utilization": "[0, 1]", "kv_cache_margin": ">= 0", "tensor_parallel_size": ">= 1",
          "sync_bucket_mb": ">= 1", "logprobs_every": ">= 0", "gpus": ">= 0", "max_staleness": ">= 1",
          "buffer_limit": ">= 0"}

CHOICES = {"engine": ("auto", "hf", "vllm"), "sleep_level": (0, 1, 2), "mode": ("colocated", "async"),
           "dtype": ("auto", "bfloat16", "float16", "float32"), "kv_cache_dtype": ("auto", "fp8"),
           "quantization": ("none", "fp8")}

RESCUE = {"kv_cache_dtype": ("fp8", "the KV cache at one byte an element, the rollout correction on")}   # plan.py
SIZES = {"tensor_parallel_size": "tensor"}   # the sizes plan.py searches: ranks per vLLM engine

LOGPROBS_EVERY = 10   # logprobs_every's 0 without the correction: the engine-vs-trainer gap read each 10th step
                      # (measured: the engine's generation 0.79-0.86x without them at 0.5B and 1.5B)

RELIEF = {  # its terms in a stage's prediction -> the change that shrinks them
    "sync bucket": "a smaller rollout.sync_bucket_mb",
    "KV cache": "fewer samples per GPU (rollout.n, train_batch_size) or more GPUs",
    "gathered model": "--rollout.engine=vllm (HF generate gathers the whole model)"}


def check(cfg: RolloutConfig, world: int):
    """The combinations that cannot run (each option alone is checked at parse time)."""
    if world % cfg.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={cfg.tensor_parallel_size} does not divide "
                         f"the world size {world}: each vLLM engine spans that many ranks")


def logprob_temperature(cfg: RolloutConfig) -> float:
    """What the trainer divides logits by before its log-probs: the sampling temperature, so the
    ratio compares the distributions the samples came from; for greedy decoding (temperature 0:
    the argmax, whose sampled log-prob would be 0) the policy's own distribution, temperature 1."""
    return cfg.temperature if cfg.temperature > 0 else 1.0


@dataclass(frozen=True)
class Request:
    """What one engine is asked to hold at once: its sequences (all its ranks' with tensor parallel),
    their longest length (prompt + response) and its weights' dtype. One rule for the colocated engines
    (`request`), the async engine processes (rollout_engine.request) and the planner."""
    seqs: int
    length: int
    dtype: str                             # the engine's weights and KV cache (auto: the actor's compute dtype)
    kv_dtype: str = "auto"                 # fp8: the KV cache at one byte an element
    quantization: str = "none"             # fp8: the linear layers' weights at one byte

    @property
    def dtype_bytes(self) -> int:          # the pushed weights' (the sync, the push), and the engine's unquantized ones
        return torch.finfo(getattr(torch, self.dtype)).bits // 8

    @property
    def kv_element_bytes(self) -> int:
        return 1 if self.kv_dtype == "fp8" else self.dtype_bytes

    def weight_bytes(self, s) -> int:
        """The engine's weights on one GPU (before tensor parallel) for model.Shapes `s`: FP8 turns the
        decoder's linear weights to one byte; embeddings, the LM head, norms and biases stay."""
        linear = s.layers * (s.layer_params - 2 * s.hidden - s.heads * s.head_dim - 2 * s.kv_dim)
        return s.params * self.dtype_bytes - (linear * (self.dtype_bytes - 1) if self.quantization == "fp8" else 0)


def prompts_per_rank(train_batch_size: int, world: int) -> int:
    """The prompts each colocated rank samples a step (options.check_sizes makes world divide the batch)."""
    return train_batch_size // world


def request(cfg: RolloutConfig, *, prompts: int, prompt_len: int, param_dtype: str) -> Request:
    """The request of an engine whose ranks each sample `prompts` prompts per call (n sequences each)."""
    return Request(prompts * cfg.n * cfg.tensor_parallel_size, prompt_len + cfg.response_length,
                   param_dtype if cfg.dtype == "auto" else cfg.dtype, cfg.kv_cache_dtype, cfg.quantization)


# --------------------------------------------------------------------------- the engine and generate
@dataclass
class Engine:
    """What is fixed when the engine is built: each generate call passes only what changes per step."""
    kind: str                              # "hf" or "vllm"
    cfg: RolloutConfig
    pad_id: int                            # prompts are left-padded and responses right-padded with it
    eos_id: int                            # a response ends at its first EOS (kept, masked after)
    device: torch.device                   # where the batch it returns lives
    llm: object = None                     # the vllm.LLM when kind == "vllm"
    dtype: torch.dtype = torch.bfloat16    # vLLM's weight dtype (the sync casts to it)
    asleep_device_gb: float = 0.0          # what vLLM keeps on the GPU while asleep (CUDA graphs, ...)
    pool_bytes: int = 0                    # vLLM's sleep pool, counted as "allocated" by PyTorch even
                                           # while asleep: the ledger takes it out of the trainer's figures
    build_s: float = 0.0
    kv_cache_bytes: int = 0                # the KV budget asked for (0: vLLM sized it from gpu_memory_utilization)
    group: object = None                   # tensor parallel: gloo group of the ranks sharing this engine


def build(cfg: RolloutConfig, *, device: torch.device, model_path: str | None, config, out_dir: str, req: Request,
          seed: int, pad_id: int, eos_id: int, rank: int = 0) -> Engine:
    """The engine `cfg.engine` resolves to: HF generate needs nothing built; vLLM gets one
    in-process engine on this rank (on tensor_parallel_size ranks together), asleep when returned;
    async rollout builds none here (its engines run in processes of their own, rollout_engine.py).
    `config`: the actor's HF config; `req`: `request`'s; `seed`: this rank's (the ranks of one engine
    take its first rank's)."""
    tp, fixed = cfg.tensor_parallel_size, dict(cfg=cfg, pad_id=pad_id, eos_id=eos_id, device=device)
    kind = resolve_engine(cfg, device)
    if kind == "hf" or cfg.mode == "async":
        if tp != 1 and kind == "hf":
            raise ValueError(f"--rollout.tensor_parallel_size={tp} needs the vLLM engine (HF generate runs "
                             f"on the FSDP actor); use 1 or --rollout.engine=vllm")
        return Engine(kind, **fixed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    check(cfg, world)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))   # torchrun: the ranks on this node
    if per_node % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} does not divide the {per_node} ranks of a node: "
                         f"an engine would span nodes (its all-reduces run every decoded token)")
    group = tensor_parallel.tp_group(tp)
    seed = tensor_parallel.gather(group, seed)[0][0]   # one seed per engine: its ranks must schedule and sample alike
    kv = kv_bytes(cfg, config, req)
    need = engine_bytes(config, kv_bytes=kv, req=req, tp=tp)
    return build_vllm(cfg, model_dir=model_dir(model_path, config, out_dir, rank), req=req, seed=seed, kv=kv,
                      need=need, group=group, fixed=fixed)


def generate(engine: Engine, model, prompts: list[list[int]], seed: int, stashes: list, metrics: dict,
             logprobs: bool = True) -> dict:
    """n samples of each of this rank's `prompts` from the policy `model`, as a batch (actor.py's
    layout). `seed`: this rank's for this step. `stashes`: the actor's parameter groups, in only
    while the engine needs the weights (a no-op for a group whose flag keeps it on the device). `logprobs`:
    vLLM's sampled-token log-probs in the batch (HF generate's colocated batch has none)."""
    if engine.kind == "hf":
        with offload.loaded(stashes, metrics):
            return generate_hf(model, prompts, engine.cfg, engine.pad_id, engine.eos_id, engine.device, seed)
    rows, responses, logps = sample_in_bracket(engine, model, prompts, seed, stashes, metrics, logprobs)
    cfg = engine.cfg                       # vLLM: sampled in the bracket (`awake`), its log-probs in the batch
    return samples_batch(rows, responses, logps, cfg.response_length, engine.pad_id, engine.eos_id, engine.device)


def sample_seed(seed: int, step: int, k: int, n: int) -> int:
    """The sampling seed of sampler k of n at `step` (a rank colocated, an engine async): distinct for every
    (step, sampler), the same when a resumed run samples that step again."""
    return seed * 1_000_003 + step * n + k


def greedy(engine: Engine, model, prompts: list[list[int]], response_length: int, stashes: list, metrics: dict,
           chunk: int) -> list[list[int]]:
    """Validation's use of the engine: one greedy answer of at most `response_length` tokens to each of this
    rank's `prompts`, cut after its EOS. vLLM: in a bracket of its own (`awake`), the engine queueing what its
    batch does not hold; HF: `chunk` prompts a generate call (hf_engine.greedy)."""
    cfg = greedy_config(engine.cfg, response_length)
    if engine.kind == "vllm":
        responses = sample_in_bracket(replace(engine, cfg=cfg), model, prompts, None, stashes, metrics, False)[1]
    else:
        with offload.loaded(stashes, metrics):
            responses = hf_engine.greedy(model, prompts, cfg, engine.pad_id, engine.eos_id, engine.device, chunk)
    return hf_engine.cut(responses, engine.eos_id)


def greedy_config(cfg: RolloutConfig, response_length: int) -> RolloutConfig:
    """Validation's sampling: one answer a prompt, the most likely token each time, at most `response_length`."""
    return replace(cfg, temperature=0.0, n=1, top_p=1.0, top_k=0, response_length=response_length)


def resolve_engine(cfg: RolloutConfig, device: torch.device) -> str:
    has_vllm = importlib.util.find_spec("vllm") is not None
    if cfg.engine == "vllm" and not (has_vllm and device.type == "cuda"):
        raise ValueError("--rollout.engine=vllm needs a CUDA GPU and vLLM installed "
                         "(docs/rollout.md: vLLM on a GPU node); use --rollout.engine=hf")
    kind = ("vllm" if has_vllm and device.type == "cuda" else "hf") if cfg.engine == "auto" else cfg.engine
    check_fp8(cfg, kind)
    if kind == "vllm" and cfg.mode == "colocated":
        vllm_engine.check_allocator()       # now, not minutes later at the engine's build
    return kind


def check_fp8(cfg: RolloutConfig, kind: str):
    """FP8 is vLLM's: HF generate keeps its weights and its KV cache in the weights' dtype, so there the
    flags would change nothing but turn the rollout correction on (actor.rollout_is auto): refused, for
    the run (`resolve_engine`) and the planner alike."""
    asked = [f"--rollout.{k}=fp8" for k in ("kv_cache_dtype", "quantization") if getattr(cfg, k) == "fp8"]
    if asked and kind == "hf":
        how = "--rollout.engine=hf" if cfg.engine == "hf" else "--rollout.engine=auto found no vLLM or no CUDA GPU"
        raise ValueError(f"{' '.join(asked)} needs the vLLM engine, and this run generates with HF generate ({how}), "
                         f"which would ignore it; use --rollout.engine=vllm on a GPU with vLLM, or drop the flag")


def describe(engine: Engine) -> list[str]:
    """The set-up report's line for a vLLM engine: its KV budget and what it keeps while asleep (none for
    async rollout, whose engines live in their processes and are described when they start)."""
    if engine.kind != "vllm" or engine.llm is None:
        return []
    cfg, gb = engine.cfg, offload.GB
    kv = (f"KV cache {engine.kv_cache_bytes / gb:.2f} GB, sized from the batch (+{cfg.kv_cache_margin:.0%})"
          if engine.kv_cache_bytes else f"weights + KV cache {cfg.gpu_memory_utilization:.0%} of the GPU")
    tp = cfg.tensor_parallel_size
    return ["[rollout] vLLM engine" + (f" (tensor parallel over {tp} ranks)" if tp > 1 else "")
            + f" built in {engine.build_s:.1f} s; {kv}; asleep it keeps {engine.asleep_device_gb:.2f} GB "
            f"on the GPU (CUDA graphs and buffers that sleep cannot free)"]


# --------------------------------------------------------------------------- the vLLM engine: its build and the bracket
def model_dir(model_path: str | None, config, out_dir: str, rank: int = 0) -> str:
    """What vLLM reads at build: only a config.json (the weights come from the first sync). A local
    checkpoint is used as it is; the built-in and random models get theirs written here."""
    if is_dir(model_path):
        return model_path
    path = os.path.join(out_dir, "vllm_config", f"rank{rank}")
    config.save_pretrained(path)
    return path


def build_vllm(cfg: RolloutConfig, *, model_dir: str, req: Request, seed: int, kv: int, need: dict,
               group=None, fixed: dict) -> Engine:
    """One engine per rank (or per `group` of tensor_parallel_size ranks, vLLM's external launcher:
    each torchrun rank is one of its workers), in this process, with sleep mode, asleep when returned.
    `fixed`: the Engine's fields that every engine has (config, pad and eos ids, device)."""
    torch.cuda.empty_cache()
    before, alloc_before, t0 = _used_gb(), torch.cuda.memory_allocated(), time.perf_counter()
    llm = vllm_engine.new_llm(cfg, model_dir=model_dir, req=req, seed=seed, kv=kv, need=need,
                  distributed_executor_backend="external_launcher", enable_sleep_mode=True)
    if group is not None:                  # the prompts are pooled over `group`: it must be vLLM's TP group
        from vllm.distributed.parallel_state import get_tp_group
        if list(get_tp_group().ranks) != dist.get_process_group_ranks(group):
            raise RuntimeError(f"vLLM's tensor-parallel group {get_tp_group().ranks} is not the ranks "
                               f"{dist.get_process_group_ranks(group)} this engine pools prompts over")
    vllm_engine.sleep(llm, cfg.sleep_level or 2)   # (vLLM's own level 0 pauses its scheduler and frees nothing)
    torch.cuda.empty_cache()
    # vLLM's pool allocates through PyTorch's allocator and stays "allocated" while asleep
    return Engine("vllm", **fixed, llm=llm, dtype=getattr(torch, req.dtype), asleep_device_gb=_used_gb() - before,
                  pool_bytes=torch.cuda.memory_allocated() - alloc_before, build_s=time.perf_counter() - t0,
                  kv_cache_bytes=kv, group=group)


def sample_in_bracket(engine: Engine, model, prompts: list[list[int]], seed: int | None, stashes: list, metrics: dict,
                      logprobs: bool) -> tuple:
    """(rows, responses, log-probs or None) of this rank's `prompts`, sampled inside the bracket (`awake`). With
    tensor parallelism the engine samples its ranks' pooled prompts on each of them and this rank keeps its own
    rows. `seed`: this rank's, or None: unseeded (validation's greedy answers)."""
    parts, me = tensor_parallel.gather(engine.group, (prompts, seed or 0))   # [(prompts, seed)] of the engine's ranks
    reqs, seeds, owners = tensor_parallel.requests(parts, engine.cfg.n, engine.cfg.temperature == 0)
    with awake(engine, model, stashes, metrics):
        with _phase("generate", metrics):
            outs = vllm_engine.sample_vllm(engine, reqs, seeds if seed is not None else [None] * len(reqs), logprobs)
    return vllm_engine.vllm_samples([(p, out) for p, out, k in zip(reqs, outs, owners) if k == me])


@contextlib.contextmanager
def awake(engine: Engine, model, stashes: list, metrics: dict):
    """The bracket (module docstring) around what the engine generates inside it: the actor's weights synced in,
    its offloaded params in for the sync only, the KV cache woken last; asleep again after (sleep_level 0: woken
    once, the bracket is then the sync). Phases' seconds, device use and their highest to `metrics`."""
    llm = engine.llm
    if wake := llm.llm_engine.is_sleeping():
        with _phase("empty_cache", metrics):   # even where vLLM fits beside the reserve: its sleep would empty
            torch.cuda.empty_cache()           # the cache anyway (vLLM 0.26's CuMemAllocator.sleep)
        with _phase("wake_weights", metrics):
            llm.wake_up(tags=["weights"])
    with _phase("load_params", metrics):
        for s in stashes:
            metrics.update(offload.reload(s))
    with _phase("sync", metrics):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sent = vllm_engine.sync_weights(llm, model, engine.dtype, engine.cfg.sync_bucket_mb, engine.device)
        metrics["rollout/sync_gb"] = sent / offload.GB
        torch.cuda.synchronize()
        metrics["rollout/sync_transient_gb"] = (torch.cuda.max_memory_allocated() - base) / offload.GB
    with _phase("offload_params", metrics):
        for s in stashes:       # freed; copied out only if the last update left them here (defer_param_offload)
            metrics.update(offload.offload(s, modified=False))
        if wake:
            torch.cuda.empty_cache()
    if wake:
        with _phase("wake_kv", metrics):
            llm.wake_up(tags=["kv_cache"])
    yield
    if engine.cfg.sleep_level:
        with _phase("sleep", metrics):
            vllm_engine.sleep(llm, engine.cfg.sleep_level)
            torch.cuda.empty_cache()
    # the bracket's device-level high point: the sync (actor params beside vLLM's weights) or generation
    metrics["rollout/device_peak_gb"] = max(v for k, v in metrics.items() if k.startswith("rollout/")
                                            and k.endswith("_device_gb"))


@contextlib.contextmanager
def _phase(name: str, metrics: dict):
    """One phase of the bracket: its seconds and the device's used memory after it."""
    t0 = time.perf_counter()
    yield
    metrics[f"rollout/{name}_s"] = time.perf_counter() - t0
    metrics[f"rollout/{name}_device_gb"] = _used_gb()


def _used_gb() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / offload.GB


# --------------------------------------------------------------------------- batch layout
def make_batch(prompts: list[list[int]], responses: list[list[int]], R: int, pad_id: int,
               eos_id: int, device) -> dict:
    """Left-pad prompts to the longest (P), right-pad responses to R; the response mask keeps
    tokens up to and including the first EOS. Position ids count only real tokens, so a
    left-padded row sees the same positions as it would alone. Filled in numpy and moved once (a
    tensor a row took 10 ms of the bracket at 128 samples)."""
    P, B = max(len(p) for p in prompts), len(prompts)
    ids, attn = np.full((B, P + R), pad_id, dtype=np.int64), np.zeros((B, P + R), dtype=np.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        r = list(r[:R])
        if eos_id in r:
            r = r[:r.index(eos_id) + 1]            # drop whatever follows the first EOS
        ids[i, P - len(p):P + len(r)] = [*p, *r]
        attn[i, P - len(p):P + len(r)] = 1
    pos = np.maximum(attn.cumsum(-1) - 1, 0)
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
             "responses": ids[:, P:].copy(), "response_mask": attn[:, P:].copy()}
    return {k: torch.from_numpy(v).to(device) for k, v in batch.items()}


def samples_batch(rows: list, responses: list, logps: list | None, R: int, pad_id: int, eos_id: int, device) -> dict:
    """make_batch's layout with the sampled tokens' log-probs as batch["rollout_log_probs"] (0 on padding;
    none when the engine was not asked for them)."""
    batch = make_batch(rows, responses, R, pad_id, eos_id, device)
    if logps is None:
        return batch
    rl = np.zeros((len(rows), R), dtype=np.float32)
    for i, lp in enumerate(logps):
        rl[i, :min(len(lp), R)] = lp[:R]
    batch["rollout_log_probs"] = torch.from_numpy(rl).to(device) * batch["response_mask"]
    return batch


def generate_hf(model, prompts: list[list[int]], cfg: RolloutConfig, pad_id: int, eos_id: int,
                device, seed: int) -> dict:
    """Each prompt n times in a row (a group per prompt), sampled with HF generate (hf_engine.py), as a batch."""
    rows, responses, _ = hf_engine.sample_hf(model, prompts, cfg, pad_id, eos_id, device, seed)
    return make_batch(rows, responses, cfg.response_length, pad_id, eos_id, device)


# --------------------------------------------------------------------------- bytes
def kv_bytes(cfg: RolloutConfig, config, req: Request) -> int:
    """The KV budget one GPU of the engine is given (0: cfg.gpu_memory_utilization sizes it instead)."""
    if cfg.gpu_memory_utilization > 0:
        return 0
    return kv_cache_bytes(config, req.seqs, req.length, req.kv_element_bytes, cfg.tensor_parallel_size,
                          cfg.kv_cache_margin)


def kv_cache_bytes(config, seqs: int, max_model_len: int, dtype_bytes: int, tp: int, margin: float) -> int:
    """The KV cache one GPU needs for `seqs` sequences (all of its engine's) of up to max_model_len
    tokens at once: K and V per layer, per KV head on this GPU (tensor parallel splits them,
    replicating when there are fewer heads than ranks), in vLLM's 16-token blocks, plus `margin`.
    The share of the GPU vLLM would take instead is sized for the GPU, not for the batch: waking
    and sleeping that much costs time every step, and it is memory the trainer could have used."""
    heads = max(1, config.num_key_value_heads // tp)
    per_token = 2 * config.num_hidden_layers * heads * head_dim(config) * dtype_bytes
    return int(seqs * -(-max_model_len // 16) * 16 * per_token * (1 + margin))


VLLM_BATCHED_TOKENS = 16384   # vLLM 0.26's default max_num_batched_tokens for LLM() on a GPU of >= 70 GiB
                              # (8192 below): the tokens of its profiling forward, its largest step
VLLM_GRAPHS = int(1.2 * 2 ** 30)   # CUDA graphs and buffers an engine keeps even asleep (measured, 0.5B-7B)


_COUNTS: dict = {}                  # id(config) -> (config, its parameter count): a meta build costs ~0.2 s at 7B


def weight_count(config) -> int:
    """The model's parameters (tied embeddings once), from a meta-device build: no memory, exact for
    any architecture transformers knows; counted once per config object (the planner asks thousands
    of times; the config is kept, so its id is not reused)."""
    if id(config) not in _COUNTS:
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _COUNTS[id(config)] = (config, sum(p.numel() for p in model.parameters()))
    return _COUNTS[id(config)][1]


def engine_bytes(config, *, kv_bytes: int, req: Request, tp: int) -> dict:
    """What one GPU of an awake engine takes, by part: its weights (1/tp of them; FP8: the linear ones at
    a byte), the KV budget, and the workspace (the profiling forward of VLLM_BATCHED_TOKENS tokens through
    the widest layer, the sampler's fp32 logits of every sequence, CUDA graphs and buffers). vLLM 0.26
    starts only if the free memory is at least gpu_memory_utilization x the GPU, also with the KV cache
    given in bytes: new_llm passes these parts' sum as that share, so the check asks for what it takes."""
    h, ffn, s = config.hidden_size, config.intermediate_size, shapes(config)
    act = VLLM_BATCHED_TOKENS * req.dtype_bytes * (4 * h + 3 * ffn) // tp
    logits = req.seqs * config.vocab_size * 4 * 2
    weights = weight_count(config) * req.dtype_bytes - (s.params * req.dtype_bytes - req.weight_bytes(s))
    return {"weights": weights // tp, "KV cache": kv_bytes, "workspace": act + logits + VLLM_GRAPHS}


# The generate stage in the planner's terms (predict.py composes them): per rank, `z` a model.Sizes.
def predicted_generate(cfg: RolloutConfig, z, policy: dict, kind: str, req: Request) -> list:
    """The trainer's side of the stage (`policy`: the actor's groups, in for the sync). vLLM: one bucket
    and one tensor in flight, in the engine's dtype (the embedding alone when larger); HF generate
    gathers the whole model and keeps its own KV cache and logits for the rank's 1/sp of the rows."""
    s, c, w = z.shapes, z.c, req.dtype_bytes
    if kind == "vllm":
        bucket = max(cfg.sync_bucket_mb * 2 ** 20 + s.hidden * s.ffn * w, s.vocab * s.hidden * w)   # or the embedding
        return [{**policy, "sync bucket": bucket}]
    rows = z.samples // z.sp
    return [{**policy, "gathered model": c * s.params, "KV cache": rows * z.T * 2 * s.layers * s.kv_dim * c,
             "logits": rows * s.vocab * 4 * 2}]


def predicted_val(cfg: RolloutConfig, z, policy: dict, kind: str, req: Request) -> list:
    """Validation's use of the engine (`greedy`) asks no more of the trainer's side than generation: the same
    weight sync (vLLM), or HF generate calls of a training step's rows at most and answers no longer than
    its responses (options.check_config caps --val_response_length)."""
    return predicted_generate(cfg, z, policy, kind, req)


def predicted_awake(cfg: RolloutConfig, z, config, req: Request) -> dict:
    """Device-level bytes of an awake colocated engine on one GPU: its weights' slice, the KV budget, and
    the CUDA graphs and buffers it keeps even asleep."""
    return {"vLLM weights": req.weight_bytes(z.shapes) // cfg.tensor_parallel_size,
            "vLLM KV cache": kv_bytes(cfg, config, req), "vLLM graphs + buffers": VLLM_GRAPHS}
