"""The rollout engine alone at a Qwen2.5 shape (random weights, load_format=dummy), one mode per process:
its device memory awake, its KV budget, and the time and tokens/s of one batch's generation (the second of
two: the first warms the graphs). What FP8 (rollout.kv_cache_dtype, rollout.quantization) changes.

    source .vllm/env.sh && python bench/bench_engine.py auto none out/engine_bf16.json     # bf16
    python bench/bench_engine.py fp8 fp8 out/engine_fp8.json                               # FP8 weights + KV
    python bench/bench_engine.py fp8 none out/engine_fp8kv.json --model=qwen2.5-1.5b        # FP8 KV only

Workload: 32 prompts of 128 tokens x 8 samples, 512 tokens each (ignore_eos: every response at full
length), temperature 1.
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root

import launch
import model as M
import rollout


def main():
    kv, quant, out = sys.argv[1], sys.argv[2], sys.argv[3]
    size = next((a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--model=")), "qwen2.5-7b")
    _, _, device = launch.init_distributed()
    cfg = rollout.RolloutConfig(engine="vllm", n=8, response_length=512, kv_cache_dtype=kv, quantization=quant)
    req = rollout.request(cfg, prompts=32, prompt_len=128, param_dtype="bfloat16")
    engine = rollout.build(cfg, device=device, model_path=None, config=M.size_config(size), out_dir="/tmp/bench_engine",
                           req=req, seed=0, pad_id=0, eos_id=151935)
    llm = engine.llm
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
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
           "kv_gb": engine.kv_cache_bytes / 2 ** 30, "generate_s": seconds, "tokens": tokens,
           "tokens_per_s": tokens / seconds}
    with open(out, "w") as f:
        json.dump(res, f)
    print(res, flush=True)
    launch.leave(0)


if __name__ == "__main__":
    main()
