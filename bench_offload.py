"""Offload on/off table: what each flag saves and costs per stage, against the copy bandwidth limit.

    python bench_offload.py --model=random:qwen2.5-1.5b --out=offload_1.5b.json --plot=offload_1.5b.png
    python bench_offload.py --model=random:qwen2.5-7b --prompts=4 --n=4 --out=offload_7b.json

One process per model size: the host<->device copy bandwidth (pinned and pageable) is measured
first, then every configuration runs the same GRPO steps (fixed prompt and response lengths,
random Qwen2.5 weights, one shared vLLM engine) and reports, for its last step, each stage's
peak allocated / reserved memory and time, and the bytes and bandwidth of every offload copy.
Ratios are against the "none" configuration of the same run.
"""
import argparse
import gc
import json
import time

import torch

import rollout
import tiny
import train_grpo

STAGES = ("generate", "reward", "old_logp", "ref_logp", "advantage", "update")
CONFIGS = {  # name: overrides of the actor / ref configs
    "none": {},
    "param": {"actor.param_offload": True},
    "optim": {"actor.optimizer_offload": True},
    "both": {"actor.param_offload": True, "actor.optimizer_offload": True},
    "ref": {"ref.param_offload": True},
    "all": {"actor.param_offload": True, "actor.optimizer_offload": True, "ref.param_offload": True},
    "policy": {"actor.offload_policy": True, "ref.offload_policy": True},
    "partial": {"actor.param_offload": True},        # first half of the layers; set below
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


def run_config(name, args, engine, data, layers):
    cfg = train_grpo.parse_args([f"--model={args.model}", f"--train_batch_size={args.prompts}",
                                 f"--actor.ppo_mini_batch_size={args.prompts}", f"--rollout.n={args.n}",
                                 f"--rollout.response_length={args.response_len}", "--save=false",
                                 f"--actor.ppo_micro_batch_size_per_gpu={args.micro}",
                                 f"--actor.log_prob_micro_batch_size_per_gpu={args.micro}",
                                 f"--ref.log_prob_micro_batch_size_per_gpu={args.micro}",
                                 "--out_dir=/tmp/bench_offload", "--reward=bench_offload:zero_reward"])
    for key, value in CONFIGS[name].items():
        section, field = key.split(".")
        setattr(getattr(cfg, section), field, value)
    if name == "partial":
        cfg.actor.param_offload_layers = layers // 2
    try:
        t = train_grpo.setup(cfg, engine=engine, data=data)
        steps = [train_grpo.train_step(t, s) for s in range(args.steps)]
        m = steps[-1]
        m["ok"] = True
    except torch.OutOfMemoryError as e:
        m = {"ok": False, "error": f"OOM: {str(e).splitlines()[0][:160]}"}
    t = steps = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):   # the name moved across torch versions
            if hasattr(torch._C, name):    # pinned host blocks go back to the OS between configurations
                getattr(torch._C, name)()
                break
    return m


def zero_reward(response: str, answer: str) -> float:
    return float(len(response) % 2)                     # any score: only memory and time matter here


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--response_len", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.15)
    ap.add_argument("--engine", default="vllm", help="vllm, or hf (no engine build: quicker at 7B)")
    ap.add_argument("--out", default="bench_offload.json")
    ap.add_argument("--plot", default="")
    args = ap.parse_args()

    rank, world, device = train_grpo.init_distributed()
    cuda = device.type == "cuda"
    res = {"model": args.model, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "args": vars(args), "bandwidth": copy_bandwidth() if cuda else {},
           "configs": {}}
    hf = tiny.qwen25_config(args.model.split(":")[1])
    vdir = f"/tmp/bench_offload_cfg_{rank}"
    hf.architectures = ["Qwen2ForCausalLM"]
    hf.save_pretrained(vdir)
    rcfg = rollout.RolloutConfig(n=args.n, response_length=args.response_len, engine=args.engine,
                                 gpu_memory_utilization=args.gpu_memory_utilization)
    engine = rollout.build_vllm(rcfg, vdir, args.prompt_len + args.response_len, "bfloat16", rank) \
        if rollout.resolve_engine(rcfg, device) == "vllm" else rollout.Engine("hf")
    g = torch.Generator().manual_seed(0)
    data = ([torch.randint(2, hf.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
             for _ in range(64)], ["0"] * 64)
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        m = run_config(name, args, engine, data, hf.num_hidden_layers)
        res["configs"][name] = m
        if rank == 0:
            with open(args.out, "w") as f:           # after every configuration: a cut-off run keeps its rows
                json.dump(res, f, indent=1)
            line = {k: round(v, 4) for k, v in m.items() if isinstance(v, float) and
                    (k.startswith("time/") or k.endswith("peak_gb") or "gbps" in k)}
            print(f"[{name}] {time.perf_counter() - t0:.0f}s ok={m['ok']} {m.get('error', '')} {json.dumps(line)}",
                  flush=True)
    base = res["configs"].get("none", {})
    for name, m in res["configs"].items():
        if m.get("ok") and base.get("ok"):
            m["step_time_cost_pct"] = 100 * (m["time/step"] / base["time/step"] - 1)
            m["peak_saved_gb"] = max(base[f"mem/{s}/peak_gb"] for s in STAGES) - \
                max(m[f"mem/{s}/peak_gb"] for s in STAGES)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        if args.plot:
            plot(res, args.plot)
    torch.distributed.destroy_process_group()


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n, m in res["configs"].items() if m.get("ok")]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        m = res["configs"][n]
        ax.bar([s + i * w for s in range(len(STAGES))], [m[f"mem/{st}/peak_gb"] for st in STAGES], w, label=n)
    ax.set_xticks([s + 0.4 - w / 2 for s in range(len(STAGES))], STAGES)
    ax.set_ylabel("trainer peak allocated (GB)")
    ax.set_title(f"{res['model']} on {res['gpu']}: peak memory per stage")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
