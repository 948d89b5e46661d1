"""The rollout engine alone at a Qwen2.5 shape (random weights, load_format=dummy), one mode per process:
its device memory awake, its KV budget, and the time and tokens/s of one batch's generation (the second of
two: the first warms the graphs). What FP8 (rollout.kv_cache_dtype, rollout.quantization) changes.

    source .vllm/env.sh && python bench/bench_engine.py auto none out/engine_bf16.json     # bf16
    python bench/bench_engine.py fp8 fp8 out/engine_fp8.json                               # FP8 weights + KV
    python bench/bench_engine.py fp8 none out/engine_fp8kv.json --model=qwen2.5-1.5b        # FP8 KV only
    python bench/bench_engine.py auto none out/sampler.json --model=qwen2.5-0.5b --sampler   # the sampler's costs
    python bench/bench_engine.py auto none out/decode.json --model=qwen2.5-0.5b --decode     # where a decode step goes
    ... --decode --async_scheduling=0                          # the same with vLLM's async scheduling off
    ... --decode --engine_core=inline|process   # built as the async engine's process builds it (no sleep mode), its
                                                # engine core in this process or in one of its own: the step only

Workload: 32 prompts of 128 tokens x 8 samples, 512 tokens each (ignore_eos: every response at full
length), temperature 1.
"""
import gzip
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root

import launch
import ledger
import model as M
import rollout


def main():
    kv, quant, out = sys.argv[1], sys.argv[2], sys.argv[3]
    size = next((a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--model=")), "qwen2.5-7b")
    _, _, device = launch.init_distributed()
    if "--async_scheduling=0" in sys.argv:   # vLLM turns it on where it can; this engine is built without it
        import vllm_engine
        new_llm = vllm_engine.new_llm
        vllm_engine.new_llm = lambda *a, **k: new_llm(*a, async_scheduling=False, **k)
    cfg = rollout.RolloutConfig(engine="vllm", n=8, response_length=512, kv_cache_dtype=kv, quantization=quant)
    req = rollout.request(cfg, prompts=32, prompt_len=128, param_dtype="bfloat16")
    core = next((a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--engine_core=")), "")
    llm, kv_bytes = build(cfg, req, M.size_config(size), core, device)
    free, total = torch.cuda.mem_get_info()
    prompts = [torch.randint(2, 150000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(32)]
    from vllm import SamplingParams
    params = [SamplingParams(n=8, temperature=1.0, max_tokens=512, ignore_eos=True, seed=1, detokenize=False)] * 32
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
    res = {"model": size, "kv": kv, "quant": quant, "device_gb_awake": (total - free) / 2 ** 30,
           "kv_gb": kv_bytes / 2 ** 30, "engine_core": core or "colocated", "generate_s": seconds, "tokens": tokens,
           "tokens_per_s": tokens / seconds}
    if "--sampler" in sys.argv:
        res["sampler"] = sampler(llm, prompts, size)
    if "--decode" in sys.argv:
        res["decode"] = decode(llm, prompts, size, os.path.dirname(os.path.abspath(out)), profile=core != "process")
        res["decode"]["async_scheduling"] = "--async_scheduling=0" not in sys.argv
    with open(out, "w") as f:
        json.dump(res, f)
    print(res, flush=True)
    launch.leave(0)


def sampler(llm, prompts: list, size: str) -> dict:
    """The sampling call's costs on one engine, side by side (issue 42's decode profile): a seed for every
    request (what the rollout asks today: samples independent of how requests share a batch) against one
    seed for the call (vLLM's own generator), each with and without the sampled token's log-prob (a dict of
    Logprob objects a position, or flat lists: `flat_logprobs`, what the rollout asks), twice in
    alternation; the decode step against the weight-read bound (bf16 params / the H200's 4.8 TB/s); and
    whether the one-seed call gives the same samples twice from the same CUDA RNG state, and whether asking
    for log-probs changes a seeded request's samples."""
    import vllm_engine
    from vllm import SamplingParams

    def params(seeded: bool, logprobs: str):           # logprobs: "" (none), "dict" or "flat"
        return [SamplingParams(n=8, temperature=1.0, max_tokens=512, ignore_eos=True, detokenize=False,
                               seed=i if seeded else None, logprobs=0 if logprobs else None,
                               flat_logprobs=logprobs == "flat") for i in range(len(prompts))]

    def timed(seeded: bool, logprobs: str):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(seeded, logprobs), use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        lps = ([vllm_engine.sampled_logprobs(o.token_ids, o.logprobs) for r in outs for o in r.outputs]
               if logprobs else None)
        return seconds, [list(o.token_ids) for r in outs for o in r.outputs], lps

    variants = {"seed a request, log-probs": (True, "dict"), "seed a request, flat log-probs": (True, "flat"),
                "seed a request, no log-probs": (True, ""), "one seed a call, log-probs": (False, "dict"),
                "one seed a call, no log-probs": (False, "")}
    times, samples, lps = {k: [] for k in variants}, {}, {}
    for _ in range(2):
        for k, v in variants.items():
            seconds, samples[k], lps[k] = timed(*v)
            times[k].append(seconds)
    torch.cuda.manual_seed(1)
    first = timed(False, "dict")[1]
    torch.cuda.manual_seed(1)
    again = timed(False, "dict")[1]
    dicts, flat, none = "seed a request, log-probs", "seed a request, flat log-probs", "seed a request, no log-probs"
    return {"decode_step_ms": {k: min(t) / 512 * 1e3 for k, t in times.items()}, "generate_s": times,
            "weight_read_bound_ms": weight_read_bound_ms(llm), "one_seed_reproducible": first == again, "model": size,
            "log_probs_change_no_sample": samples[dicts] == samples[none],
            "flat_log_probs_are_the_same": (samples[dicts], lps[dicts]) == (samples[flat], lps[flat])}


def build(cfg, req, config, core: str, device) -> tuple:
    """(the vllm.LLM awake, its KV cache bytes): the colocated build (core ""), or the async engine's process's
    (no launcher, no sleep pool) with vLLM's engine core in this process ("inline") or its own ("process")."""
    if not core:
        engine = rollout.build(cfg, device=device, model_path=None, config=config, out_dir="/tmp/bench_engine",
                               req=req, seed=0, pad_id=0, eos_id=151935)
        engine.llm.wake_up(tags=["weights"])
        engine.llm.wake_up(tags=["kv_cache"])
        return engine.llm, engine.kv_cache_bytes
    import rollout_engine
    import vllm_engine
    assert core in ("inline", "process"), f"--engine_core={core}: inline or process"
    kv = rollout.kv_bytes(cfg, config, req)
    return vllm_engine.new_llm(cfg, model_dir=rollout.model_dir(None, config, "/tmp/bench_engine"), req=req, seed=0,
                               kv=kv, need=rollout_engine.predicted(cfg, config, req),
                               core_process=core == "process"), kv


def decode(llm, prompts: list, size: str, out_dir: str, profile: bool = True) -> dict:
    """Where the decode step's time goes: the step at 64 and at 256 sequences (what grows
    with the batch; 512 tokens each, no log-probs), then 256 sequences x 64 tokens under torch.profiler without
    and with the sampled tokens' flat log-probs: the GPU's busy time a step (the union of its kernels'
    intervals) against the wall time a step, the kernels that take it, and the host's launches a step. Bounds:
    the weights read once a step, and the KV cache read at the mean context (prompt + half the response).
    `profile` False (an engine core in another process, whose kernels this profiler cannot see): the steps only."""
    from vllm import SamplingParams
    shapes = M.shapes(M.size_config(size))

    def call(k: int, tokens: int, logprobs: bool):
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False, seed=i,
                                 logprobs=0 if logprobs else None, flat_logprobs=True) for i in range(k)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts[:k]], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    step_ms = {}
    for k in (8, 32, 8, 32):                          # in alternation; the faster of two
        step_ms[k * 8] = min(step_ms.get(k * 8, 1e9), call(k, 512, False) / 512 * 1e3)
    res = {"model": size, "step_ms_by_sequences": step_ms, "profiled": {}}
    for logprobs in (False, True) if profile else ():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            wall = call(32, 64, logprobs)
        path = os.path.join(out_dir, f"decode_trace_{size}_{'logprobs' if logprobs else 'none'}.json.gz")
        prof.export_chrome_trace(path)                # gzipped by its suffix
        res["profiled"]["flat log-probs" if logprobs else "no log-probs"] = trace_summary(path, wall, steps=64)
    kv_token = 2 * shapes.layers * shapes.kv_dim * 2  # K and V, bf16, every layer
    res["weight_read_bound_ms"] = weight_read_bound_ms(llm) if profile else \
        rollout.weight_count(M.size_config(size)) * 2 / ledger.HBM["H200"] * 1e3   # the model's count: no reach inside
    res["kv_read_bound_ms_256"] = kv_token * 256 * (128 + 256) / ledger.HBM["H200"] * 1e3
    return res


def weight_read_bound_ms(llm) -> float:
    """The engine's bf16 weights read once, at the H200's HBM bandwidth: a decode step's floor."""
    return sum(p.numel() for p in rollout_model(llm).parameters()) * 2 / ledger.HBM["H200"] * 1e3


def trace_summary(path: str, wall: float, steps: int) -> dict:
    """A chrome trace's GPU side a step: busy ms (the union of kernel, copy and set intervals), the ten kernels
    with the most time, and the host's CUDA-graph and kernel launches a step."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    busy, end, by_name = 0.0, -1.0, {}
    for start, stop, name in gpu:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + stop - start
    launches = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("name") in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cudaMemcpyAsync", "cudaStreamSynchronize"):
            launches[e["name"]] = launches.get(e["name"], 0) + 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"wall_ms_a_step": wall / steps * 1e3, "gpu_busy_ms_a_step": busy / steps / 1e3,
            "gpu_busy_share": busy / 1e6 / wall, "kernels_a_step": len(gpu) / steps,
            "host_calls_a_step": {k: v / steps for k, v in launches.items()},
            "top_kernels_ms_a_step": {k: v / steps / 1e3 for k, v in top}}


def rollout_model(llm):
    import vllm_engine
    return vllm_engine.vllm_model(llm)


if __name__ == "__main__":
    main()
