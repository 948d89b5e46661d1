"""Generation engines behind one function: `generate(engine, ...) -> batch`.

    python train_grpo.py --rollout.engine=hf                      # HF generate on the FSDP actor
    torchrun --nproc_per_node=8 train_grpo.py --rollout.engine=vllm --model=/models/Qwen2.5-1.5B
    python -m pytest test_vllm.py -q                              # GPU + vLLM: parity, sleep, memory

HF engine: gathers the actor's FSDP2 shards once for the whole generate call (one all-gather per
layer, not one per decoded token), samples, and frees the gathered weights again.

vLLM engine: one in-process engine per rank (torchrun ranks are vLLM's workers through its
"external_launcher"), built once with random weights (`load_format="dummy"`) and sleep mode.
Every step runs the bracket below; each phase's seconds and device memory (`mem_get_info`, the
only figure that sees vLLM's pool) go to the metrics as `rollout/<phase>_s` / `_device_gb`:
    empty_cache     give PyTorch's cached blocks back so vLLM's pool can map them
    load_params     actor shards in from pinned host (only with actor.param_offload)
    wake_weights    vLLM maps its weight memory again (KV cache still released)
    sync            stream the actor's weights in, one bounded bucket at a time
    offload_params  actor shards back out, cache emptied: the trainer leaves the GPU to vLLM
    wake_kv         vLLM maps its KV cache last, when everything else is gone
    generate        sample n responses per prompt, with the sampled tokens' log-probs
    sleep           level 1: weights to host, KV dropped; level 2: both dropped (re-sent anyway)
Checked on vLLM 0.26.0 with torch 2.11 (H200).
"""
import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

import offload


@dataclass
class RolloutConfig:
    engine: str = "auto"                   # vllm | hf | auto (vllm when it imports and CUDA is there)
    n: int = 8                             # samples per prompt (the GRPO group size)
    response_length: int = 4               # max new tokens; responses are right-padded to this
    temperature: float = 1.0              # 0: greedy (log-probs then use 1: the policy's own distribution)
    top_p: float = 1.0                     # nucleus sampling: keep the smallest set with this much mass
    top_k: int = 0                         # 0: off
    gpu_memory_utilization: float = 0.5    # vLLM: share of the WHOLE GPU for its weights + KV cache
    sleep_level: int = 2                   # vLLM: 1 keeps weights in host RAM while asleep, 2 drops them
    enforce_eager: bool = False            # vLLM: no CUDA graphs (slower decode; graphs survive sleep)
    tensor_parallel_size: int = 1          # vLLM: ranks per engine (must divide the world size)
    sync_bucket_mb: int = 512              # weight sync: max bytes gathered before one load_weights
    dtype: str = "auto"                    # vLLM weights: auto = the actor's compute dtype


# checked when the command line is parsed (train_grpo.check_config)
RANGES = {"n": ">= 1", "response_length": ">= 1", "temperature": ">= 0", "top_p": "(0, 1]", "top_k": ">= 0",
          "gpu_memory_utilization": "(0, 1]", "tensor_parallel_size": ">= 1", "sync_bucket_mb": ">= 1"}
CHOICES = {"engine": ("auto", "hf", "vllm"), "sleep_level": (1, 2),
           "dtype": ("auto", "bfloat16", "float16", "float32")}


def logprob_temperature(cfg: RolloutConfig) -> float:
    """What the trainer divides logits by before its log-probs: the sampling temperature, so the
    ratio compares the distributions the samples came from; for greedy decoding (temperature 0:
    the argmax, whose sampled log-prob would be 0) the policy's own distribution, temperature 1."""
    return cfg.temperature if cfg.temperature > 0 else 1.0


@dataclass
class Engine:
    kind: str                              # "hf" or "vllm"
    llm: object = None                     # the vllm.LLM when kind == "vllm"
    dtype: torch.dtype = torch.bfloat16    # vLLM's weight dtype (the sync casts to it)
    asleep_device_gb: float = 0.0          # what vLLM keeps on the GPU while asleep (CUDA graphs, ...)
    pool_bytes: int = 0                    # vLLM's sleep pool, counted as "allocated" by PyTorch even
                                           # while asleep: the ledger takes it out of the trainer's figures
    build_s: float = 0.0


def resolve_engine(cfg: RolloutConfig, device: torch.device) -> str:
    if cfg.engine not in ("hf", "vllm", "auto"):
        raise ValueError(f"--rollout.engine={cfg.engine}: use vllm, hf or auto")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if cfg.engine == "vllm" and not (has_vllm and device.type == "cuda"):
        raise ValueError("--rollout.engine=vllm needs a CUDA GPU and vLLM installed "
                         "(README: vLLM on a GPU node); use --rollout.engine=hf")
    if cfg.engine == "auto":
        return "vllm" if has_vllm and device.type == "cuda" else "hf"
    return cfg.engine


def build(cfg: RolloutConfig, *, device: torch.device, model_path: str | None, config, out_dir: str,
          max_model_len: int, dtype: str, seed: int, rank: int = 0) -> Engine:
    """The engine `cfg.engine` resolves to: HF generate needs nothing built; vLLM gets one
    in-process engine on this rank, asleep when returned. `config`: the actor's HF config."""
    if resolve_engine(cfg, device) == "hf":
        return Engine("hf")
    return build_vllm(cfg, model_dir(model_path, config, out_dir, rank), max_model_len, dtype, seed)


def model_dir(model_path: str | None, config, out_dir: str, rank: int = 0) -> str:
    """What vLLM reads at build: only a config.json (the weights come from the first sync). A local
    checkpoint is used as it is; the built-in and random models get theirs written here."""
    if model_path is not None and not model_path.startswith("random:"):
        return model_path
    path = os.path.join(out_dir, "vllm_config", f"rank{rank}")
    config.save_pretrained(path)
    return path


# --------------------------------------------------------------------------- batch layout
def make_batch(prompts: list[list[int]], responses: list[list[int]], R: int, pad_id: int,
               eos_id: int, device) -> dict:
    """Left-pad prompts to the longest (P), right-pad responses to R; the response mask keeps
    tokens up to and including the first EOS. Position ids count only real tokens, so a
    left-padded row sees the same positions as it would alone."""
    P = max(len(p) for p in prompts)
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        r = list(r[:R])
        if eos_id in r:
            r = r[:r.index(eos_id) + 1]            # drop whatever follows the first EOS
        ids[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):P] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r)
            attn[i, P:P + len(r)] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
             "responses": ids[:, P:].clone(), "response_mask": attn[:, P:].clone()}
    return {k: v.to(device) for k, v in batch.items()}


# --------------------------------------------------------------------------- HF engine
@contextlib.contextmanager
def gathered(model):
    """All-gather every FSDP2 unit once and keep it gathered until the block ends."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()                              # frees the gathered copies
            m.set_reshard_after_forward(True, recurse=False)


@torch.no_grad()
def generate_hf(model, prompts: list[list[int]], cfg: RolloutConfig, pad_id: int, eos_id: int,
                device, seed: int) -> dict:
    """Each prompt n times in a row (a group per prompt), sampled with HF generate."""
    rows = [p for p in prompts for _ in range(cfg.n)]
    P = max(len(p) for p in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, P - len(p):] = torch.tensor(p)
        attn[i, P - len(p):] = 1
    torch.manual_seed(seed)                          # per rank and step: reproducible samples
    model.eval()
    with gathered(model):
        sample = cfg.temperature > 0                 # temperature 0: greedy
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=sample,
                             max_new_tokens=cfg.response_length, temperature=cfg.temperature if sample else None,
                             top_p=cfg.top_p if sample else None, top_k=(cfg.top_k or None) if sample else None,
                             pad_token_id=pad_id, eos_token_id=eos_id)
    responses = out[:, P:].tolist()
    return make_batch(rows, responses, cfg.response_length, pad_id, eos_id, device)


# --------------------------------------------------------------------------- vLLM engine
def _used_gb() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / offload.GB


def build_vllm(cfg: RolloutConfig, model_dir: str, max_model_len: int, dtype: str, seed: int) -> Engine:
    """One engine per rank, in this process, asleep when returned. `model_dir` needs only a
    config.json: the weights are random until the first sync (nothing is read from disk twice).
    `dtype`: "bfloat16" / "float32" (the actor's compute dtype unless cfg.dtype says otherwise)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # engine core in this process: GPU tensors pass by reference
    os.environ.setdefault("RANK", "0")                   # plain `python`: external_launcher reads these
    os.environ.setdefault("LOCAL_RANK", "0")
    if importlib.util.find_spec("flashinfer") is None:  # vLLM 0.26's sampler imports it unless told not to
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True conflicts with "
                         "vLLM's sleep pool; unset it")
    from vllm import LLM
    dtype = dtype if cfg.dtype == "auto" else cfg.dtype
    rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    torch.cuda.empty_cache()                 # vLLM counts cached-but-free blocks as taken
    before, alloc_before, t0 = _used_gb(), torch.cuda.memory_allocated(), time.perf_counter()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", enable_sleep_mode=True,
              distributed_executor_backend="external_launcher", tensor_parallel_size=cfg.tensor_parallel_size,
              dtype=dtype, gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
              max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs")
    torch.set_rng_state(rng[0]), torch.cuda.set_rng_state(rng[1])   # LLM() reseeds the global RNGs
    llm.sleep(level=cfg.sleep_level)
    torch.cuda.empty_cache()
    # vLLM's pool allocates through PyTorch's allocator and stays "allocated" while asleep
    return Engine("vllm", llm, getattr(torch, dtype), asleep_device_gb=_used_gb() - before,
                  pool_bytes=torch.cuda.memory_allocated() - alloc_before, build_s=time.perf_counter() - t0)


def vllm_model(llm):
    """The engine's nn.Module. Engine internals: checked on vLLM 0.26.0 (V1 engine, in-process)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def full_param(p: torch.Tensor, device) -> torch.Tensor:
    """The whole parameter on `device` (an all-gather: every rank calls it)."""
    if not hasattr(p, "full_tensor"):
        return p.detach().to(device)
    local = p.to_local()
    if local.device != device:                  # CPUOffloadPolicy: shards live on the host
        from torch.distributed.tensor import DTensor
        p = DTensor.from_local(local.to(device, non_blocking=True), p.device_mesh, p.placements,
                               shape=p.shape, stride=p.stride())
    return p.detach().full_tensor()


@torch.no_grad()
def sync_weights(llm, model, dtype: torch.dtype, bucket_mb: int, device) -> int:
    """Actor -> vLLM, one parameter at a time from named_parameters() (never a state dict), in
    buckets of at most `bucket_mb` plus one tensor: the transient is one bucket, not the model.
    HF names go straight into Qwen2/Llama `load_weights` (it fuses q/k/v and gate/up itself)."""
    target, bucket, size, sent = vllm_model(llm), [], 0, 0
    for name, p in model.named_parameters():
        full = full_param(p, device)
        t = full.to(dtype)
        del full                                  # the fp32 gather is gone before the next one
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_mb * 2 ** 20:
            target.load_weights(bucket)
            sent, bucket, size = sent + size, [], 0
    if bucket:
        target.load_weights(bucket)
        sent += size
    return sent


@contextlib.contextmanager
def _phase(name: str, metrics: dict):
    """One phase of the bracket: its seconds and the device's used memory after it."""
    t0 = time.perf_counter()
    yield
    metrics[f"rollout/{name}_s"] = time.perf_counter() - t0
    metrics[f"rollout/{name}_device_gb"] = _used_gb()


def generate_vllm(engine: Engine, model, prompts: list[list[int]], cfg: RolloutConfig, pad_id: int,
                  eos_id: int, device, seed: int, stashes: list, metrics: dict) -> dict:
    """The bracket (module docstring), then the batch with vLLM's sampled-token log-probs."""
    from vllm import SamplingParams
    llm = engine.llm

    with _phase("empty_cache", metrics):
        torch.cuda.empty_cache()
    with _phase("load_params", metrics):
        for s in stashes:
            metrics.update(offload.reload(s))
    with _phase("wake_weights", metrics):
        llm.wake_up(tags=["weights"])
    with _phase("sync", metrics):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        metrics["rollout/sync_gb"] = sync_weights(llm, model, engine.dtype, cfg.sync_bucket_mb, device) / offload.GB
        torch.cuda.synchronize()
        metrics["rollout/sync_transient_gb"] = (torch.cuda.max_memory_allocated() - base) / offload.GB
    with _phase("offload_params", metrics):
        for s in stashes:       # freed; copied out only if the last update left them here (defer_param_offload)
            metrics.update(offload.offload(s, modified=False))
        torch.cuda.empty_cache()
    with _phase("wake_kv", metrics):
        llm.wake_up(tags=["kv_cache"])
    with _phase("generate", metrics):
        greedy = cfg.temperature == 0       # vLLM samples greedily only with n=1: send n copies instead
        per_req, copies = (1, cfg.n) if greedy else (cfg.n, 1)
        reqs = [p for p in prompts for _ in range(copies)]
        params = [SamplingParams(n=per_req, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0,
                                 max_tokens=cfg.response_length, logprobs=0, stop_token_ids=[eos_id],
                                 detokenize=False, seed=seed * 10007 + i * cfg.n)
                  for i in range(len(reqs))]
        outs = llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)
    with _phase("sleep", metrics):
        llm.sleep(level=cfg.sleep_level)
        torch.cuda.empty_cache()

    rows, responses, logps = [], [], []
    for p, out in zip(reqs, outs):
        for o in out.outputs:                     # n samples of this prompt, kept together (a group)
            rows.append(p)
            responses.append(list(o.token_ids))
            logps.append([lp[tok].logprob for tok, lp in zip(o.token_ids, o.logprobs)])
    batch = make_batch(rows, responses, cfg.response_length, pad_id, eos_id, device)
    R = cfg.response_length
    rl = torch.zeros(len(rows), R)
    for i, lp in enumerate(logps):
        rl[i, :min(len(lp), R)] = torch.tensor(lp[:R])
    batch["rollout_log_probs"] = rl.to(device) * batch["response_mask"]
    return batch


def generate(engine: Engine, model, prompts, cfg: RolloutConfig, pad_id, eos_id, device, seed,
             stashes: list, metrics: dict) -> dict:
    """`stashes`: the actor's offloaded groups, loaded only while the engine needs the weights."""
    if engine.kind == "vllm":
        return generate_vllm(engine, model, prompts, cfg, pad_id, eos_id, device, seed, stashes, metrics)
    with offload.loaded(stashes, metrics):
        return generate_hf(model, prompts, cfg, pad_id, eos_id, device, seed)
