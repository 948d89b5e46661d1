"""vLLM in this process: building an engine, the few of its internals this project touches (checked on
vLLM 0.26.0 with torch 2.11, V1 engine, in-process), the weight sync into it (FP8 weights re-quantized
at each), and sampling with the sampled tokens' log-probs. rollout.py runs the colocated bracket around
these; rollout_engine.py's engine process calls them too. Nothing here imports vLLM until it is used.

    python -m pytest -q tests/test_vllm.py          # GPU + vLLM: parity after a sync, FP8, sleep/wake, memory
"""
import contextlib
import gc
import importlib.util
import os

import torch

import weights


def new_llm(cfg, *, model_dir: str, req, seed: int, kv: int, need: dict, core_process: bool = False, **engine_args):
    """A vllm.LLM in this process. `model_dir` needs only a config.json: the weights are random until
    the first sync (nothing is read from disk twice). `kv` > 0: vLLM's KV cache on each GPU is exactly
    that, and the share passed beside it is `need` (engine_bytes) over the GPU, checked here first
    against what is free (one line naming the numbers, not a failure inside vLLM); `kv` == 0:
    cfg.gpu_memory_utilization sizes weights + KV. FP8 (rollout.kv_cache_dtype, rollout.quantization):
    vLLM's own online FP8, from the random bf16 weights at build, again at each sync (`sync_weights`).
    `engine_args`: the launcher and sleep mode (colocated), nothing for the async engine's process.
    `core_process`: vLLM's engine core in a process of its own, its output processing beside the GPU's work
    (bench_engine.py --engine_core=process measures it); the weight sync and `loading` reach into this one's."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if core_process else "0"   # "0": GPU tensors pass by reference
    os.environ.setdefault("RANK", "0")                   # plain `python`: external_launcher reads these
    os.environ.setdefault("LOCAL_RANK", "0")
    if importlib.util.find_spec("flashinfer") is None:  # vLLM 0.26's sampler imports it unless told not to
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    check_allocator()
    from vllm import LLM
    rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    torch.cuda.empty_cache()                 # vLLM counts cached-but-free blocks as taken
    share = start_share(cfg, kv, need, *torch.cuda.mem_get_info())
    budget = {"kv_cache_memory_bytes": kv} if kv else {}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy",
              tensor_parallel_size=cfg.tensor_parallel_size, dtype=req.dtype, enforce_eager=cfg.enforce_eager,
              max_model_len=req.length, max_num_seqs=req.seqs, seed=seed, logprobs_mode="processed_logprobs",
              gpu_memory_utilization=share, kv_cache_dtype=cfg.kv_cache_dtype,
              quantization=None if cfg.quantization == "none" else cfg.quantization, **budget, **engine_args)
    torch.set_rng_state(rng[0]), torch.cuda.set_rng_state(rng[1])   # LLM() reseeds the global RNGs
    # vLLM's engine core and worker gc.freeze() the whole heap once started (a server's start-up objects are
    # never scanned again). In this process that heap holds the trainer built before the engine: a cycle
    # in it (modules, FSDP state, offload stashes) would never be collected, and a dropped run would keep
    # its GPU params (measured: the actor's 1,889 MiB at 0.5B, allocated by its last reload). Unfrozen here.
    gc.unfreeze()
    return llm


def check_allocator():
    """vLLM's sleep pool cannot share a process with expandable segments (vLLM refuses them at its build): said
    before anything is built (`rollout.resolve_engine`, the pre-flight of a colocated run) and at the build."""
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True conflicts with vLLM's sleep pool in this "
                         "process: unset it (--rollout.mode=async sets it for the trainer, whose process holds no "
                         "engine)")


@contextlib.contextmanager
def frozen_heap():
    """The steps of a run with the objects its set-up made frozen (gc.freeze), as vLLM freezes its own after
    start-up, and thawed after (a run dropped in a notebook is then collected: `new_llm`). vLLM's sleep runs a
    full collection each step (its cumem allocator calls gc.collect()); over the ~1.1 M objects of a 1.5B run
    with the engine in this process that took 0.6 s a step, frozen 0.02 s (bench/README.md)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def refreeze(steps_run: int):
    """After each of a run's first two steps, inside `frozen_heap`: what they made and kept (torch.compile's graphs
    and guards: the LM head compiled at the first update, again with dynamic shapes at the second) frozen beside
    the set-up's. Unfrozen, vLLM's collection in each sleep walked them: 0.026 s a step at 1.5B with the head
    compiled against 0.012 eager (bench/gc_s). What a later step drops is freed by its count as before."""
    if steps_run < 2 and gc.get_freeze_count():
        gc.collect()
        gc.freeze()


def start_share(cfg, kv_bytes: int, need: dict, free: int, total: int) -> float:
    """The gpu_memory_utilization to build the engine with, or a ValueError that says what to change
    when the engine cannot fit in the `free` bytes of this GPU (of `total`)."""
    gib = lambda b: f"{b / 2 ** 30:.1f} GiB"  # noqa: E731
    held = f"the trainer's states and the CUDA contexts take {gib(total - free)} of {gib(total)}"
    if not kv_bytes:                           # the user's share sizes weights + KV: that much must be free
        if cfg.gpu_memory_utilization * total > free:
            raise ValueError(f"--rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} asks vLLM for "
                             f"{gib(cfg.gpu_memory_utilization * total)} but {gib(free)} is free when the engine is "
                             f"built ({held}); use at most {max(free / total - 0.01, 0):.2f}, or 0 to size the "
                             f"KV cache from the batch")
        return cfg.gpu_memory_utilization
    want = sum(need.values())
    if want > free:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in need.items())
        raise ValueError(f"the vLLM engine needs {gib(want)} on each GPU ({parts}) but {gib(free)} is free when "
                         f"it is built ({held}); free the GPU with --actor.param_offload=true / "
                         f"--ref.param_offload=true / --critic.param_offload=true, or shrink the KV cache with fewer "
                         f"prompts per GPU, a shorter --rollout.response_length or a larger "
                         f"--rollout.tensor_parallel_size")
    return want / total


SHARED_SLEEP_SAID = []                     # the note below, printed once a process


def sleep(llm, level: int) -> None:
    """llm.sleep, kept going where its self-check fails only because another process allocated on the GPU. vLLM's
    worker releases its pool, then reads the device's free memory and asserts it did not fall since before the
    release (gpu_worker.sleep, vLLM 0.26.0): it checks the whole device, not its pool, so a second run on the GPU
    waking its own engine meanwhile fails a sleep that did release everything, and the executor's two lines after
    the worker's call (the engine marked asleep, both tags to wake) never run: a wake would then bring nothing back.
    Those two lines are done here, as vLLM's executor does them; any other assertion is vLLM's as it was."""
    try:
        llm.sleep(level=level)
    except AssertionError as e:
        if "increased after sleeping" not in str(e):
            raise
        executor = llm.llm_engine.model_executor   # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        executor.sleeping_tags, executor.is_sleeping = {"weights", "kv_cache"}, True
        if not SHARED_SLEEP_SAID:
            SHARED_SLEEP_SAID.append(True)
            print("[rollout] note: vLLM's sleep released its pool but saw the GPU's free memory fall meanwhile "
                  "(another process allocating on this GPU); the engine is marked asleep as vLLM marks it, and "
                  "this run's device figures include the other process's", flush=True)


def vllm_model(llm):
    """The engine's nn.Module. Engine internals: checked on vLLM 0.26.0 (V1 engine, in-process)."""
    return vllm_runner(llm).model


def vllm_runner(llm):
    """The engine's GPU model runner (its model_config, its reload). Internals: vLLM 0.26.0, in-process."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def loading(llm):
    """The engine's model while new weights go in (HF names, bf16, any number of `load_weights` calls). With
    FP8 weights (rollout.quantization=fp8) through vLLM's layerwise reload: each layer, once all of its
    tensors have come, is quantized again by vLLM's own online FP8 (a layer's bf16 weights are the
    transient) and its FP8 weights and scales are copied into the engine's tensors (CUDA graphs keep
    pointing at them): what a fresh FP8 engine makes of the same bf16 weights. Then an engine that is awake
    (async, or rollout.sleep_level=0) forgets its prefix cache: its cached blocks hold the old weights' keys and
    values, and vLLM would reuse them for the next prompts' shared prefix (a sleeping engine's were dropped)."""
    target, config = vllm_model(llm), vllm_runner(llm).model_config
    if config.quantization is None:
        yield target
    else:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        initialize_layerwise_reload(target)
        yield target
        finalize_layerwise_reload(target, config)
    if not llm.llm_engine.is_sleeping() and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM kept its prefix cache after new weights (requests still hold blocks)")


@torch.no_grad()
def sync_weights(llm, model, dtype: torch.dtype, bucket_mb: int, device) -> int:
    """Actor -> vLLM, one parameter at a time from named_parameters() (never a state dict), in
    buckets of at most `bucket_mb` plus one tensor: the transient is one bucket, not the model.
    HF names go straight into Qwen2/Llama `load_weights` (it fuses q/k/v and gate/up itself).
    Tensor parallel: every rank sends the whole tensor; each parameter's vLLM weight_loader keeps
    this rank's slice (`narrow` by its TP rank), as when it reads a full checkpoint.
    With LoRA every step sends the whole merged model, W + scale x B @ A per target weight, merged
    on the way (`weights.hf_weights`): vLLM holds plain weights and decodes without LoRA kernels.
    (vLLM's own adapters would send MBs instead; not measured here, and at sleep level 2 the base
    weights it drops must be re-sent anyway.) FP8 weights: `loading`."""
    bucket, size, sent = [], 0, 0
    with loading(llm) as target:
        for name, t in weights.hf_weights(model, device, dtype):   # gathered in vLLM's dtype (bf16), one at a time
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_mb * 2 ** 20:
                target.load_weights(bucket)
                sent, bucket, size = sent + size, [], 0
        if bucket:
            target.load_weights(bucket)
            sent += size
    return sent


def sample_vllm(engine, reqs: list[list[int]], seeds: list, logprobs: bool = True) -> list:
    """vLLM's outputs for the requests (tensor_parallel.requests: n samples each, or one when greedy),
    each sampled token with its log-prob under the processed distribution (`logprobs`; validation
    needs none), returned flat (one float a position in a few lists, not a dict of a Logprob object a
    token: the same numbers without 131k Python objects a rollout for the garbage collector)."""
    from vllm import SamplingParams
    cfg = engine.cfg
    params = [SamplingParams(n=1 if cfg.temperature == 0 else cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                             top_k=cfg.top_k or 0, max_tokens=cfg.response_length, logprobs=0 if logprobs else None,
                             stop_token_ids=[engine.eos_id], detokenize=False, seed=s, flat_logprobs=True)
              for s in seeds]
    return engine.llm.generate([{"prompt_token_ids": p} for p in reqs], params, use_tqdm=False)


def vllm_samples(mine: list) -> tuple[list, list, list | None]:
    """(rows, responses, log-probs) from (prompt ids, vLLM output) pairs: a prompt's n samples in a row;
    the log-probs None when the call asked for none."""
    rows, responses, logps = [], [], []
    for p, out in mine:
        for o in out.outputs:                     # n samples of this prompt, kept together (a group)
            rows.append(p)
            responses.append(list(o.token_ids))
            if o.logprobs is not None:
                logps.append(sampled_logprobs(o.token_ids, o.logprobs))
    return rows, responses, logps if len(logps) == len(rows) else None


def sampled_logprobs(tokens: list, lp) -> list[float]:
    """Each sampled token's log-prob from vLLM's `logprobs=0` output: flat (FlatLogprobs, `flat_logprobs=True`:
    a position's first entry is its sampled token) or a dict of Logprob objects a position."""
    if hasattr(lp, "start_indices"):
        if len(lp.token_ids) == len(tokens):   # one entry a position (logprobs=0): the lists are the answer
            first, logps = list(lp.token_ids), list(lp.logprobs)
        else:
            first, logps = [lp.token_ids[i] for i in lp.start_indices], [lp.logprobs[i] for i in lp.start_indices]
        if first != list(tokens):
            raise RuntimeError("vLLM's flat log-probs do not start with the sampled token at each position "
                               "(their layout, checked on vLLM 0.26.0, changed)")
        return logps
    return [pos[t].logprob for t, pos in zip(tokens, lp)]
