"""Rollout benchmark: vLLM (with the full offload bracket) against HF generate on the same batch.

    python bench/bench_rollout.py --model=random:qwen2.5-0.5b --prompts=16 --n=8 --prompt_len=128 \
        --response_len=256 --out=bench_rollout.json

Both engines run in this one process on the same prompts and the same FSDP2 actor; the figures
are ratios measured side by side. Bracket overhead = everything in the bracket but `generate`
(empty_cache, load/offload params, wake weights, sync, wake KV, sleep) over the generate time.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root: the roles

import launch
import ledger
import offload
import rollout
from model import build_mesh, load_model, shard
from launch import init_distributed

PHASES = ("empty_cache", "wake_weights", "load_params", "sync", "offload_params", "wake_kv", "sleep")


def parse_args():
    """The benchmark's options (the batch's shape, the repetitions, the offload flag, the output)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--response_len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--param_offload", type=int, default=1)
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.0, help="0: KV cache sized from the batch")
    ap.add_argument("--out", default="bench_rollout.json")
    return ap.parse_args()


def build_engine(args, model, rank, device):
    """The vLLM engine for the benchmark's batch, built next to the FSDP2 actor; returns it with its
    rollout config and the EOS id both engines sample with."""
    cfg = rollout.RolloutConfig(n=args.n, response_length=args.response_len, engine="vllm",
                                gpu_memory_utilization=args.gpu_memory_utilization)
    eos = model.config.vocab_size - 1                  # rarely sampled: responses run to full length
    engine = rollout.build(cfg, device=device, model_path=args.model, config=model.config,
                           out_dir="/tmp/bench_rollout", req=rollout.request(cfg, prompts=args.prompts,
                                                                             prompt_len=args.prompt_len,
                                                                             param_dtype="bfloat16"),
                           seed=rank, pad_id=0, eos_id=eos, rank=rank)
    return engine, cfg, eos


def time_vllm(engine, model, prompts, stashes, reps: int) -> dict:
    """The full vLLM bracket (offloaded params in, generate, out again), each figure averaged over
    `reps` runs after a warm-up; plus the tokens and the trainer's GPU GB during it."""
    def run_vllm():
        m = {}
        b = rollout.generate(engine, model, prompts, 1, stashes, m)
        m["tokens"] = b["response_mask"].sum().item()
        m["trainer_gpu_gb"] = ledger.gpu_bytes(model) / offload.GB
        return m

    run_vllm()                                          # warm-up (first wake, allocator, graphs)
    runs = [run_vllm() for _ in range(reps)]
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def time_hf(model, prompts, cfg, eos, device, stashes) -> float:
    """HF generate's tokens per second on the same prompts."""
    # HF generate on the same prompts (the actor gathered once, sampled token by token)
    with offload.loaded(stashes, {}):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hb = rollout.generate_hf(model, prompts, cfg, 0, eos, device, 1)
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - t
    hf_tokens = hb["response_mask"].sum().item()
    return hf_tokens / hf_s


def results(args, world, engine, v, hf_tokens_per_s) -> dict:
    """The report: throughput of both engines, the bracket's overhead and its phases, memory during generate."""
    overhead = sum(v[f"rollout/{p}_s"] for p in PHASES)
    res = {
        "model": args.model, "world": world, "prompts": args.prompts, "n": args.n,
        "prompt_len": args.prompt_len, "response_len": args.response_len, "engine_build_s": engine.build_s,
        "asleep_device_gb": engine.asleep_device_gb,
        "vllm_tokens_per_s": v["tokens"] / v["rollout/generate_s"], "hf_tokens_per_s": hf_tokens_per_s,
        "sync_s": v["rollout/sync_s"], "sync_transient_gb": v["rollout/sync_transient_gb"],
        "bracket_overhead_s": overhead, "generate_s": v["rollout/generate_s"],
        "bracket_overhead_frac": overhead / v["rollout/generate_s"],
        "trainer_gpu_gb_during_generate": v["trainer_gpu_gb"],
        "device_used_gb_during_generate": v["rollout/generate_device_gb"],
        "phases_s": {p: v[f"rollout/{p}_s"] for p in PHASES},
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
    }
    res["vllm_over_hf"] = res["vllm_tokens_per_s"] / res["hf_tokens_per_s"]
    return res


def write_results(res: dict, path: str):
    """The report printed and written as JSON (rank 0 calls it)."""
    print(json.dumps(res, indent=1))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main():
    args = parse_args()
    rank, world, device = init_distributed()
    model = shard(load_model(args.model), build_mesh(device, world, -1), device)
    stash = offload.param_stash("actor_params", model)
    g = torch.Generator().manual_seed(rank)
    V = model.config.vocab_size
    prompts = [torch.randint(2, V - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    engine, cfg, eos = build_engine(args, model, rank, device)
    stashes = [stash] if args.param_offload else []
    if args.param_offload:
        offload.offload(stash)
    v = time_vllm(engine, model, prompts, stashes, args.reps)
    res = results(args, world, engine, v, time_hf(model, prompts, cfg, eos, device, stashes))
    if rank == 0:
        write_results(res, args.out)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


if __name__ == "__main__":
    main()
