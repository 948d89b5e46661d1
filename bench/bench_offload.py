"""Offload on/off table: what each flag saves and costs per stage, against the copy bandwidth limit.

    python bench/bench_offload.py --model=random:qwen2.5-1.5b --levers --out=offload_1.5b.json --plot=offload_1.5b.png
    python bench/bench_offload.py --model=random:qwen2.5-7b --configs=none,param,optim,ref,all \
        --actor.gradient_checkpointing=true --out=offload_7b.json      # other options go to train_grpo
    python bench/bench_offload.py --model=random:qwen2.5-1.5b --configs=none,rm,rm_offload,all,rm_all --out=rm_1.5b.json
    torchrun --nproc_per_node=2 bench/bench_offload.py --prompts=32 --configs=none,all \
        --rollout.tensor_parallel_size=2 --out=tp2_1.5b.json     # --prompts counts all ranks' prompts
    python bench/bench_offload.py --model=random:qwen2.5-7b --configs=ref,lora,lora_all --steps=3 --prompts=8 --n=8 \
        --prompt_len=256 --response_len=256 --micro=4 --gpu_memory_utilization=0.16 \
        --actor.gradient_checkpointing=true --out=lora_7b.json       # LoRA vs full fine-tuning

One process per model size: the host<->device copy bandwidth (pinned and pageable) is measured
first, then every configuration runs the same GRPO (or PPO) steps (fixed prompt and response
lengths, random Qwen2.5 weights, one shared vLLM engine) and reports each stage's peak
allocated / reserved memory and time (medians over the steps after a warm-up), and the bytes and
bandwidth of every offload copy. Ratios are against the "none" (PPO: "ppo_none") configuration
of the same run. `--levers` adds the copy levers one by one: pageable vs pinned, new vs
persistent buffers, a synchronize per copy vs per bracket, and where the Adam state comes in.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root: the roles

import actor
import adam
import launch
import ledger
import offload
import options
import rollout
import train_grpo
from model import hf_config
from launch import init_distributed

STAGES = ledger.STAGES
ALL = {"actor.param_offload": True, "actor.optimizer_offload": True, "ref.param_offload": True}
NO_LEVERS = {"actor.prefetch_update": False, "actor.defer_param_offload": False}
PPO = {"algorithm.adv_estimator": "gae"}
LORA = 64                                  # verl's GRPO-LoRA examples use rank 64 on all linear layers
CONFIGS = {  # name: overrides of the role configs (the copy levers are on unless a name says otherwise)
    "none": {},
    "param": {"actor.param_offload": True},
    "optim": {"actor.optimizer_offload": True},
    "both": {"actor.param_offload": True, "actor.optimizer_offload": True},
    "ref": {"ref.param_offload": True},
    "ref_param": {"ref.param_offload": True, "actor.param_offload": True},     # 7B: "ref" is the base
    "ref_optim": {"ref.param_offload": True, "actor.optimizer_offload": True},
    "ref_optim_at_step": {"ref.param_offload": True, "actor.optimizer_offload": True,
                          "actor.optimizer_load_at_step": True},   # Adam in after the backward: lower peak
    "optim_stream": {"actor.optimizer_offload": True, "actor.optimizer_stream": True},   # Adam a window at a time
    "ref_optim_stream": {"ref.param_offload": True, "actor.optimizer_offload": True, "actor.optimizer_stream": True},
    "all": ALL,
    "all_stream": {**ALL, "actor.optimizer_stream": True},
    "all_no_prefetch": {**ALL, "actor.prefetch_update": False},   # what the prefetch lever buys
    "all_no_levers": {**ALL, **NO_LEVERS},                          # ... and the deferred offload
    "param_no_levers": {"actor.param_offload": True, **NO_LEVERS},
    "optim_no_levers": {"actor.optimizer_offload": True, **NO_LEVERS},
    "policy": {"actor.offload_policy": True, "ref.offload_policy": True},
    "partial": {"actor.param_offload": True},        # first half of the layers; set below
    "ppo_none": PPO,                                 # separate critic
    "ppo_all": {**PPO, **ALL, "critic.param_offload": True, "critic.optimizer_offload": True},
    "ppo_shared": {**PPO, "critic.mode": "shared"},  # value head on the actor's trunk
    "ppo_shared_all": {**PPO, **ALL, "critic.mode": "shared"},
    "ckpt": {"actor.gradient_checkpointing": True},
    "all_ckpt": {**ALL, "actor.gradient_checkpointing": True},
    "padded": {"actor.remove_padding": False},      # the packing and logits levers, one by one
    "chunk0": {"actor.logits_chunk_tokens": 0},      # the LM head over all response tokens at once
    "chunk512": {"actor.logits_chunk_tokens": 512},
    "chunk2048": {"actor.logits_chunk_tokens": 2048},
    "before": {"actor.logits_chunk_tokens": 0, "actor.remove_padding": False},   # neither lever
    "budget": {"actor.use_dynamic_bsz": True},       # token-budget micro-batches (the *_max_token_len_per_gpu)
    "rm": {},                                        # + a reward model of the policy's size (set below)
    "rm_offload": {"reward_model.param_offload": True},
    "rm_all": {**ALL, "reward_model.param_offload": True},
    # LoRA (rank 64, all-linear): no ref model (ref.* has no effect), grads and Adam for the adapters only
    "lora": {"actor.lora_rank": LORA},
    "lora_param": {"actor.lora_rank": LORA, "actor.param_offload": True},
    "lora_all": {"actor.lora_rank": LORA, "actor.param_offload": True, "actor.optimizer_offload": True},
}


def copy_bandwidth(nbytes: int = 2 ** 30) -> dict:
    """GB/s of one host<->device copy of `nbytes`, pinned and pageable (mean of 5 after a warm-up)."""
    out = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            out[f"{'pinned' if pinned else 'pageable'}_{name}_gbps"] = 5 * nbytes / 1e9 / (time.perf_counter() - t)
    return out


def bench_cfg(name, args, extra):
    cfg = options.parse_args([f"--model={args.model}", f"--train_batch_size={args.prompts}",
                                 f"--actor.ppo_mini_batch_size={args.prompts}", f"--rollout.n={args.n}",
                                 f"--rollout.response_length={args.response_len}", "--save=false", "--save_freq=0",
                                 f"--actor.ppo_micro_batch_size_per_gpu={args.micro}",
                                 f"--actor.log_prob_micro_batch_size_per_gpu={args.micro}",
                                 f"--ref.log_prob_micro_batch_size_per_gpu={args.micro}",
                                 f"--critic.ppo_micro_batch_size_per_gpu={args.micro}",
                                 f"--critic.forward_micro_batch_size_per_gpu={args.micro}",
                                 f"--reward_model.micro_batch_size_per_gpu={args.micro}",
                                 "--out_dir=/tmp/bench_offload", "--reward=bench.bench_offload:zero_reward"] + extra)
    for key, value in CONFIGS[name].items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    return cfg


def median_of_steps(steps: list) -> dict:
    """Each number's median over the measured steps (the first is a warm-up: Adam state is born
    there, and the caches fill); everything else from the last step."""
    m = dict(steps[-1])
    for k, v in m.items():
        if isinstance(v, float) and len(steps) > 1:
            m[k] = statistics.median(s[k] for s in steps[1:] if k in s)
    return m


def release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        offload.empty_host_cache()         # pinned host blocks go back to the OS between configurations


def run_config(name, args, extra, engine, data, layers):
    cfg = bench_cfg(name, args, extra)
    if name == "partial":
        cfg.actor.param_offload_layers = layers // 2
    if name.startswith("rm"):              # random weights of the policy's shape, scoring in bf16
        cfg.reward_model.path = args.model
    try:
        t = train_grpo.setup(cfg, engine=engine, data=data)
        m = median_of_steps([train_grpo.train_step(t, s) for s in range(args.steps)])
        m["ok"] = True
    except (torch.OutOfMemoryError, train_grpo.StageOutOfMemory) as e:   # a stage's OOM comes explained
        m = {"ok": False, "error": f"OOM: {str(e).splitlines()[0][:300]}"}
    t = None
    release()
    return m


# --------------------------------------------------------------------------- levers one by one
def synthetic_batch(args, vocab, device, seed=0):
    """A rollout batch of the benchmark's shape (random tokens), with advantages and ref log-probs."""
    g = torch.Generator().manual_seed(seed)
    B = args.prompts * args.n
    prompts = torch.randint(2, vocab - 1, (B, args.prompt_len), generator=g).tolist()
    responses = torch.randint(2, vocab - 1, (B, args.response_len), generator=g).tolist()
    batch = rollout.make_batch(prompts, responses, args.response_len, 0, 1, device)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(B, 1, generator=g).to(device) * mask
    batch["ref_log_probs"] = torch.zeros_like(mask)
    return batch


def timed(fn, device):
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated(device) / offload.GB


def copy_levers(stash, device) -> dict:
    """The actor's param shards out and back in four ways: what pinned, persistent buffers and one
    synchronize per bracket each buy. Copies only (the device storages stay allocated)."""
    views, gb, out = stash.views, stash.nbytes / offload.GB, {}
    persistent = [torch.empty(v.numel(), dtype=torch.uint8, pin_memory=True) for v in views]
    fresh = []

    def ways():
        yield "pageable_new_buffers_blocking", (lambda: fresh.extend(v.cpu() for v in views)), \
            (lambda: [v.copy_(h) for v, h in zip(views, fresh)])
        yield "pinned_new_buffers_one_sync", (lambda: fresh.extend(
            torch.empty(v.numel(), dtype=torch.uint8, pin_memory=True).copy_(v, non_blocking=True) for v in views)), \
            (lambda: [v.copy_(h, non_blocking=True) for v, h in zip(views, fresh)])
        yield "pinned_persistent_sync_per_copy", (lambda: [h.copy_(v) for v, h in zip(views, persistent)]), \
            (lambda: [v.copy_(h) for v, h in zip(views, persistent)])
        yield "pinned_persistent_one_sync", \
            (lambda: [h.copy_(v, non_blocking=True) for v, h in zip(views, persistent)]), \
            (lambda: [v.copy_(h, non_blocking=True) for v, h in zip(views, persistent)])

    for name, d2h, h2d in ways():
        for _ in range(2):                              # the second pass is reported
            fresh.clear()
            release()                                   # "new" buffers: not from torch's pinned cache
            s_out, _ = timed(d2h, device)
            s_in, _ = timed(h2d, device)
        out[name] = {"out_s": s_out, "in_s": s_in, "out_gbps": gb * offload.GB / 1e9 / s_out,
                     "in_gbps": gb * offload.GB / 1e9 / s_in}
        fresh.clear()
        release()
    return out


def adam_placement(t, batch) -> dict:
    """The update stage with the Adam state on the host before it, three ways, all through the
    production `actor.update`: copied in blocking before the update; on a side stream overlapped
    with the forward/backward (the default); blocking just before optimizer.step
    (actor.optimizer_load_at_step, verl issue #5282: lower peak, exposed copy)."""
    a, out = t.actor, {}
    a.cfg.optimizer_offload = a.adam.enabled = True     # the flag, and the stash that knows it
    offload.offload(a.adam)
    ways = {"blocking_before_update": (True, False), "side_stream_during_forward": (False, False),
            "blocking_at_step": (False, True)}
    for name, (before, at_step) in ways.items():
        a.cfg.optimizer_load_at_step = at_step

        def fn():
            if before:
                offload.reload(a.adam)
            actor.update(a, batch, t.mini_size, 1.0, {})    # Adam leaves again at its end

        runs = [timed(fn, t.device) for _ in range(2)]
        out[name] = {"update_s": runs[-1][0], "peak_gb": runs[-1][1], "adam_gb": a.adam.nbytes / offload.GB}
    offload.reload(a.adam)
    return out


def levers(args, extra, engine, data) -> dict:
    cfg = bench_cfg("none", args, extra)
    t = train_grpo.setup(cfg, engine=engine, data=data)
    for s in range(2):
        train_grpo.train_step(t, s)                  # Adam state exists after the first
    res = {"copy": copy_levers(offload.param_stash("actor_params", t.actor.model), t.device),
           "adam": adam_placement(t, synthetic_batch(args, t.actor.model.config.vocab_size, t.device))}
    t = None
    release()
    return res


def zero_reward(response: str, answer: str) -> float:
    return float(len(response) % 2)                     # any score: only memory and time matter here


def parse_args():
    """The benchmark's options, and the rest (they go to train_grpo's options)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--response_len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="the first is a warm-up; medians of the rest")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.0, help="0: vLLM's KV cache sized from the batch")
    ap.add_argument("--engine", default="vllm", help="vllm, or hf (no engine build: quicker at 7B)")
    ap.add_argument("--levers", action="store_true", help="also time the copy levers one by one")
    ap.add_argument("--expandable", action="store_true",
                    help="expandable segments for the trainer once the engine is built (vLLM's sleep pool stays "
                         "as it was made): the allocator's reserve against its allocated peak, an experiment")
    ap.add_argument("--empty_before_step", action="store_true",
                    help="give the allocator's cache back right before a streamed Adam step (the backward's freed "
                         "blocks): whether the window the plan counts beyond the update's slack goes, an experiment")
    ap.add_argument("--out", default="bench_offload.json")
    ap.add_argument("--plot", default="")
    return ap.parse_known_args()            # the rest goes to train_grpo (--actor.gradient_checkpointing=true)


def build_engine(args, extra, hf, rank, world, device):
    """The one rollout engine every configuration shares, sized for this rank's share of the batch."""
    rcfg = rollout.RolloutConfig(n=args.n, response_length=args.response_len, engine=args.engine,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 tensor_parallel_size=options.parse_args(extra).rollout.tensor_parallel_size)
    return rollout.build(rcfg, device=device, model_path=args.model, config=hf, out_dir="/tmp/bench_offload",
                         req=rollout.request(rcfg, prompts=args.prompts // world, prompt_len=args.prompt_len,
                                             param_dtype="bfloat16"), seed=rank,
                         pad_id=0, eos_id=1, rank=rank)    # the tiny tokenizer's: random models use it


def bench_data(args, vocab: int):
    """64 prompts of `prompt_len` random tokens (fixed seed) with answers, as train_grpo.setup takes them."""
    g = torch.Generator().manual_seed(0)
    return ([torch.randint(2, vocab - 1, (args.prompt_len,), generator=g).tolist()
             for _ in range(64)], ["0"] * 64, None)


def write_results(res: dict, path: str):
    """The whole table so far, as JSON (rank 0 calls it)."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def print_row(name: str, m: dict, seconds: float):
    """One configuration's line: its times, peaks, allocations and bandwidths."""
    line = {k: round(v, 4) for k, v in m.items() if isinstance(v, float) and
            (k.startswith("time/") or k.endswith("peak_gb") or "gbps" in k or "alloc" in k)}
    print(f"[{name}] {seconds:.0f}s ok={m['ok']} {m.get('error', '')} {json.dumps(line)}",
          flush=True)


def add_costs(configs: dict):
    """Every row's step-time cost and peak saving against its base row (both must have run)."""
    for name, m in configs.items():
        # each against its own base: PPO against PPO, the reward model's offload against the reward model's run
        base = configs.get("ppo_none" if name.startswith("ppo") else "rm" if name.startswith("rm_") else "none", {})
        if name.startswith("lora") and not base.get("ok"):   # 7B: full fine-tuning's base row is "ref"
            base = configs.get("ref", {})
        if m.get("ok") and base.get("ok"):
            m["step_time_cost_pct"] = 100 * (m["time/step"] / base["time/step"] - 1)
            # vLLM's sampling phase is the same work under every flag but varies run to run by
            # +-30 % at these sizes: the cost without it is the steadier figure
            ex = lambda x: x["time/step"] - x.get("rollout/generate_s", 0)  # noqa: E731
            m["step_ex_sampling_cost_pct"] = 100 * (ex(m) / ex(base) - 1)
            m["peak_saved_gb"] = peak(base) - peak(m)


def main():
    args, extra = parse_args()
    rank, world, device = init_distributed()
    cuda = device.type == "cuda"
    res = {"model": args.model, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "args": vars(args), "bandwidth": copy_bandwidth() if cuda else {},
           "configs": {}}
    hf = hf_config(args.model)
    engine = build_engine(args, extra, hf, rank, world, device)
    if args.expandable and cuda:           # new segments grow in place: fragmentation leaves no stranded blocks
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if args.empty_before_step:             # adam.clipped_step calls adam.streamed_step through the module
        stream = adam.streamed_step
        adam.streamed_step = lambda *a, **k: (torch.cuda.empty_cache(), stream(*a, **k))[1]
    data = bench_data(args, hf.vocab_size)
    if args.levers:                                # first: a cut-off run keeps them
        res["levers"] = levers(args, extra, engine, data)
        if rank == 0:
            print("[levers]", json.dumps(res["levers"]), flush=True)
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        m = run_config(name, args, extra, engine, data, hf.num_hidden_layers)
        res["configs"][name] = m
        if rank == 0:
            write_results(res, args.out)           # after every configuration: a cut-off run keeps its rows
            print_row(name, m, time.perf_counter() - t0)
    add_costs(res["configs"])
    if rank == 0:
        write_results(res, args.out)
        if args.plot:
            plot(res, args.plot)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


def peak(m: dict) -> float:
    return max(m[f"mem/{s}/peak_gb"] for s in STAGES if f"mem/{s}/peak_gb" in m)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n, m in res["configs"].items() if m.get("ok")]
    stages = [s for s in STAGES if any(f"mem/{s}/peak_gb" in res["configs"][n] for n in names)]
    fig, ax = plt.subplots(figsize=(13, 4.5))
    w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        m = res["configs"][n]
        ax.bar([s + i * w for s in range(len(stages))], [m.get(f"mem/{st}/peak_gb", 0) for st in stages], w, label=n)
    ax.set_xticks([s + 0.4 - w / 2 for s in range(len(stages))], stages)
    ax.set_ylabel("trainer peak allocated (GB)")
    ax.set_title(f"{res['model']} on {res['gpu']}: peak memory per stage")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
