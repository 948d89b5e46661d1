"""The real step at a Qwen2.5 shape, stage by stage: times, throughput (the run's perf/ figures), memory, and
where the GPU's time goes (torch.profiler), for variants side by side in one process; and the rollout
engine's modes (bf16, FP8 KV cache, FP8 weights + KV) each with the engine it needs.

    python bench/bench_step.py --model=random:qwen2.5-0.5b --variants="default;--actor.gradient_checkpointing=false" \
        --profile --out=bench/results/step_0.5b.json  # TRL's GRPO workload: 16 prompts x 8, 64 + 256 tokens
    python bench/bench_step.py --model=random:qwen2.5-7b --modes=bf16,fp8kv,fp8 --variants="--actor.lora_rank=16" \
        --out=bench/results/fp8_7b.json               # the engine's device GB, generate time, mismatch per mode

Every variant of a mode shares that mode's engine (train_grpo.setup with `engine=`); its steps are the loop's
own (train_grpo.train_step), the first `--warmup` not counted: medians of the rest. The profile is of the
last step: per stage, the GPU's busy time by kind (matmuls, attention, LM head and softmax, norms and
elementwise, FSDP copies and collectives, the rest) and the host gap (the stage's wall time the GPU was idle).
"""
import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root: the roles

import launch
import ledger
import offload
import options
import train_grpo
import vllm_engine

SHARED = {}                                    # the mode's engine once a variant has built it
PSEUDO = ("gc_thawed", "empty_after_sync", "generate_pool")   # a variant's flags that are the bench's, not the run's
MODES = {"bf16": [], "fp8kv": ["--rollout.kv_cache_dtype=fp8"],
         "fp8": ["--rollout.kv_cache_dtype=fp8", "--rollout.quantization=fp8"]}
KINDS = [  # kernel name -> kind, first match wins
    ("FSDP copies and collectives", r"nccl|allgather|reducescatter|all_gather|reduce_scatter|chunk_cat|split_with_sizes"
                                    r"|foreach_copy|memcpy|memset"),
    ("attention", r"flash|fmha|attention|attn|paged"),
    ("LM head and softmax", r"softmax|logsumexp|cross_entropy|log_softmax|argmax|sampl|topk|top_k"),
    ("matmuls", r"gemm|cutlass|sm90|sm100|xmma|cublas|nvjet|splitk|matmul|scaled_mm|wgmma"),
    ("norms and elementwise", r"elementwise|vectorized|reduce|norm|silu|act_and_mul|mul|add|pow|mean|rsqrt|copy|cat"
                              r"|index|scatter|gather|fill|where|exp|clamp|rotary|rope|cast|to_"),
]


def workload(args, extra: list) -> list:
    micro = [f"--actor.ppo_micro_batch_size_per_gpu={args.micro}",
             f"--actor.log_prob_micro_batch_size_per_gpu={args.micro}",
             f"--ref.log_prob_micro_batch_size_per_gpu={args.micro}"] if args.micro else []   # 0: plan.relax picks
    return [f"--model={args.model}", f"--train_batch_size={args.prompts}",
            f"--actor.ppo_mini_batch_size={args.prompts}",
            f"--rollout.n={args.n}", f"--rollout.response_length={args.response_len}", "--logger=none",
            "--save=false", "--save_freq=0",       # timed steps only: no checkpoint, and no disk check refuses it
            *micro, "--actor.kl_loss_coef=0.04",
            f"--out_dir={tempfile.mkdtemp(prefix='bench_step_')}", "--reward=bench.bench_step:length_reward"] + extra


def length_reward(response: str, answer: str) -> float:
    return float(len(response) % 3)             # any spread of scores: only time and memory matter here


def profile_table(trace: str) -> dict:
    """stage -> {kind: GPU ms, "host gap ms": ..., "wall ms": ...} from a Chrome trace of one step."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    stages = [(e["name"][6:], e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("ph") == "X" and str(e.get("name", "")).startswith("stage:")]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = {}
    for name, t0, t1 in stages:
        row, busy = {k: 0.0 for k, _ in KINDS + [("other", "")]}, []
        for e in gpu:
            if t0 <= e["ts"] < t1:
                kind = next((k for k, pat in KINDS if re.search(pat, e["name"], re.I)), "other")
                row[kind] += e["dur"] / 1e3
                busy.append((e["ts"], min(e["ts"] + e["dur"], t1)))
        covered, end = 0.0, t0
        for a, b in sorted(busy):                # the union of the kernels' intervals
            if b > end:
                covered += b - max(a, end)
                end = b
        row.update({"wall ms": (t1 - t0) / 1e3, "host gap ms": (t1 - t0 - covered) / 1e3})
        out[name] = {k: round(v, 2) for k, v in row.items()}
        calls = {}                               # the host's CUDA runtime and driver calls: ms and count by name
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] < t1:
                ms, n = calls.get(e["name"], (0.0, 0))
                calls[e["name"]] = (ms + e["dur"] / 1e3, n + 1)
        top = sorted(calls.items(), key=lambda kv: -kv[1][0])[:8]
        out[name]["host calls (ms, n)"] = {k: [round(ms, 2), n] for k, (ms, n) in top}
    return out


GEN = {}                                       # the last generation's allocator figures (bench/gen_*)


@contextlib.contextmanager
def generation_as(flags: list):
    """Pseudo-flags (not train_grpo options) around the colocated engine's generation, to see why an awake
    engine generates slower beside the trainer's cached blocks: `empty_after_sync` gives those blocks back after
    the sync (inside the bracket), `generate_pool` allocates generation's tensors from a pool of their own. Every
    variant: the allocator's device allocations, frees and retries during generation, and its reserve before."""
    real_sample, real_sync = vllm_engine.sample_vllm, vllm_engine.sync_weights
    pool = torch.cuda.MemPool() if "generate_pool" in flags else None

    def sync(*a, **k):
        sent = real_sync(*a, **k)
        if "empty_after_sync" in flags:
            torch.cuda.empty_cache()
        return sent

    def sample(*a, **k):
        s0 = torch.cuda.memory_stats()
        with torch.cuda.use_mem_pool(pool) if pool is not None else contextlib.nullcontext():
            out = real_sample(*a, **k)
        s1 = torch.cuda.memory_stats()
        GEN.update({f"gen_{k}": s1.get(k, 0) - s0.get(k, 0) for k in
                    ("num_device_alloc", "num_device_free", "num_alloc_retries", "allocation.all.allocated")})
        GEN["gen_reserved_before_gb"] = s0.get("reserved_bytes.all.current", 0) / 2 ** 30
        return out
    vllm_engine.sample_vllm, vllm_engine.sync_weights = sample, sync
    try:
        yield
    finally:
        vllm_engine.sample_vllm, vllm_engine.sync_weights = real_sample, real_sync


GC = {"s": 0.0, "full": 0, "t0": 0.0}         # the garbage collector's time and full (generation 2) passes


def on_gc(phase: str, info: dict):
    if phase == "start":
        GC["t0"] = time.perf_counter()
        return
    GC["s"] += time.perf_counter() - GC["t0"]
    GC["full"] += info["generation"] == 2


@contextlib.contextmanager
def recorded(stage_name: str, out: dict):
    """The loop's stages as they are, but inside the one named `stage_name` the CUDA allocator records every
    allocation (Python stacks); at its end `out` gets what was live at its peak (ledger.peak_blocks)."""
    real = ledger.stage

    @contextlib.contextmanager
    def stage(name, metrics, device, external=0):
        with real(name, metrics, device, external):
            if name != stage_name:
                yield
                return
            before = torch.cuda.memory_allocated(device) - external
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            try:
                yield
            finally:
                torch.cuda.synchronize(device)
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                out.update(ledger.peak_blocks(snapshot, before))
    ledger.stage = stage
    try:
        yield
    finally:
        ledger.stage = real


def one_step(t, s: int, last: bool, args, profile: bool, peak: dict) -> tuple:
    """(the loop's step s with the collector's figures, its profile table or None): the variant's last step is
    profiled (`profile`), or its --peak_stage recorded (`peak` gets what was live at the stage's peak)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    GC.update(s=0.0, full=0)
    prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if last and profile else None
    with prof or (recorded(args.peak_stage, peak) if last and args.peak_stage else contextlib.nullcontext()):
        m = train_grpo.train_step(t, s)
    m.update({"bench/gc_s": GC["s"], "bench/gc_full": GC["full"], "bench/gc_frozen": gc.get_freeze_count()})
    m.update({f"bench/{k}": v for k, v in GEN.items()})
    if prof is None:
        return m, None
    path = os.path.join(tempfile.mkdtemp(), "step.json")
    prof.export_chrome_trace(path)
    return m, profile_table(path)


def run_variant(args, flags: list, engine, profile: bool) -> tuple:
    """(medians of the measured steps' figures, the profile or None, the engine) for one variant. Its steps run
    with the set-up's objects frozen, as train_grpo.run's do (vllm_engine.frozen_heap); the flag `gc_thawed`
    (not a train_grpo option): without, the heap thawed; the others in PSEUDO: `generation_as`."""
    thawed = "gc_thawed" in flags
    cfg = options.parse_args(workload(args, [f for f in flags if f not in PSEUDO]))
    vocab = 151936 if cfg.model and cfg.model.startswith("random:qwen") else 16
    g = torch.Generator().manual_seed(0)       # the prompts: prompt_len random tokens each (the copy task's are 4)
    data = ([torch.randint(2, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(64)], ["0"] * 64,
            None) if args.prompt_len else None
    t = train_grpo.setup(cfg, engine=engine, data=data)
    SHARED["engine"] = t.engine                # a variant that fails later leaves the mode's engine to the next
    steps, table, peak = [], None, {}
    GEN.clear()
    heap = contextlib.nullcontext() if thawed else vllm_engine.frozen_heap()   # thawed before the variant is dropped
    with heap, generation_as(flags):
        for s in range(args.warmup + args.steps):
            m, tab = one_step(t, s, s == args.warmup + args.steps - 1, args, profile, peak)
            vllm_engine.refreeze(s)            # as train_grpo.train does (a no-op thawed)
            steps.append(m)
            table = tab or table
    measured = steps[args.warmup:] or steps
    m = {k: statistics.median(x[k] for x in measured if k in x) for k, v in measured[-1].items()
         if isinstance(v, (int, float))}
    m["bench/step_s_all"] = [x["time/step"] for x in measured]
    m.update({f"plan/{k}": v for k, v in predicted(t).items()})
    if peak:                                   # beside it, the plan's terms at the stage's peak moment
        st = t.plan.stage(args.peak_stage)
        m["bench/peak"] = {**peak, "plan_terms": {k: round(v / 2 ** 30, 3) for k, v in st.terms.items()}}
    engine, t = t.engine, None
    gc.collect()
    torch.cuda.empty_cache()
    offload.empty_host_cache()
    m["bench/left_allocated_gb"] = (torch.cuda.memory_allocated() - engine.pool_bytes) / 2 ** 30
    m["bench/left_models"] = left_models(engine)
    return m, (table if profile else None), engine


def left_models(engine) -> list:
    """What of the trainer is still alive after a variant was dropped (what would inflate the next variant's
    memory): its models with the types of what holds them, then the CUDA storages Python can still see
    (GB, and the holders of the largest). A gap between those GB and `left_allocated_gb` is held on the
    C++ side. A bench that compares variants must start each clean."""
    out, storages, big = [], {}, []
    for t in engine_tensors(engine):       # the engine's own weights and KV cache are not the trainer's
        storages[t.untyped_storage().data_ptr()] = 0
    for o in gc.get_objects():
        if isinstance(o, torch.nn.Module) and type(o).__name__.endswith(("ForCausalLM", "ForTokenClassification")) \
                and not type(o).__module__.startswith("vllm"):
            out.append(f"{type(o).__name__} held by {holders(o)}")
        elif isinstance(o, torch.Tensor) and o.is_cuda and not is_fake(o):
            st = o.untyped_storage()
            if st.nbytes() >= 2 ** 24 and st.data_ptr() not in storages:
                storages[st.data_ptr()] = st.nbytes()
                big.append((st.nbytes(), o))
    big.sort(key=lambda x: -x[0])
    out.append(f"python-visible CUDA storages of 16 MiB or more: {sum(storages.values()) / 2 ** 30:.2f} GB")
    out += [f"{n / 2 ** 20:.0f} MiB {tuple(t.shape)} {t.dtype} held by {holders(t)}" for n, t in big[:5]]
    if torch.cuda.is_available():          # every live block by pool and allocating line (--memory_history=true)
        out += ledger.held_blocks()
    return out


def is_fake(t) -> bool:
    """A tensor with no memory behind it: vLLM's compile leaves FakeTensors in the heap (collectable since
    vllm_engine unfreezes it), and asking one for its storage's address raises (torch 2.11) or warns."""
    from torch._subclasses.fake_tensor import FakeTensor
    if isinstance(t, FakeTensor):
        return True
    try:
        t.untyped_storage().data_ptr()
        return False
    except RuntimeError:
        return True


def engine_tensors(engine) -> list:
    try:
        import vllm_engine
        model = vllm_engine.vllm_model(engine.llm)
        worker = engine.llm.llm_engine.model_executor.driver_worker.worker
        return [*model.parameters(), *model.buffers(), *worker.model_runner.kv_caches]
    except Exception:                      # not a vLLM engine, or its internals moved: count everything
        return []


def holders(o) -> list:
    return [type(r).__name__ + (":" + ",".join(map(str, list(r)[:6])) if isinstance(r, dict) else "")
            for r in gc.get_referrers(o)][:8]


def predicted(t) -> dict:
    """The plan's step estimate and the engine's predicted device parts, beside the measurement."""
    return {"step_s": t.plan.seconds, **{f"vllm/{k}_gb": v / 2 ** 30 for k, v in t.plan.vllm_device.items()}}


def parse():
    """The command line; a --peak_stage that cannot run is one line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--variants", default="default", help="';'-separated sets of train_grpo flags ('default': none)")
    ap.add_argument("--modes", default="bf16", help=f"the rollout engine's modes, comma-separated: {', '.join(MODES)}")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=64, help="0: the copy task's 4-token prompts")
    ap.add_argument("--response_len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=32, help="samples per micro-batch (TRL's); 0: the run's own choice")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", action="store_true", help="profile each variant's last step")
    ap.add_argument("--peak_stage", default="", help="a stage (update, ref_logp, ...): in each variant's last step, "
                    "what was live at its peak by allocating site, beside the plan's terms (slower: a recorded step)")
    ap.add_argument("--out", default="bench_step.json")
    args = ap.parse_args()
    if args.peak_stage and args.profile:
        ap.error("--peak_stage and --profile both take each variant's last step: pass one")
    if args.peak_stage and any("--head_kernel=eager" not in v for v in args.variants.split(";")):
        ap.error("--peak_stage records every allocation, and while it does the LM head runs eager (torch's compiled "
                 "head fails there: kernel_choice._padded), so the plan's terms would be another head's: add "
                 "--head_kernel=eager to each variant")
    return args


KEEP = ("time/step", "time/generate", "time/ref_logp", "time/update", "perf/update_mfu", "perf/ref_logp_mfu",
        "mem/update/peak_gb", "plan/update/predicted_gb", "mem/ref_logp/peak_gb", "plan/ref_logp/predicted_gb",
        "bench/left_allocated_gb", "perf/generate_tokens_per_s", "rollout/generate_device_gb", "rollout/logp_diff_mean",
        "bench/gc_s", "bench/gc_full", "rollout/generate_s", "perf/decode_step_ms", "perf/bracket_frac",
        "bench/gen_num_device_alloc", "bench/gen_num_alloc_retries",
        "bench/gen_reserved_before_gb")   # a variant's line


def say(name: str, run: dict, stage: str):
    """A variant's line (KEEP's figures, or its error), and with --peak_stage what was live at the stage's peak."""
    m = run.get("metrics", {})
    print(f"[{name}]", json.dumps({k: round(v, 4) for k, v in m.items() if k in KEEP}), run.get("error", ""),
          flush=True)
    if peak := m.get("bench/peak"):
        print(f"[{name}] {stage}: {peak['peak_gb']:.3f} GB at its peak ({peak['before_gb']:.3f} at its start):\n  "
              + "\n  ".join(peak["live_at_peak"]) + f"\n  the plan's terms (GB): {json.dumps(peak['plan_terms'])}",
              flush=True)


def main():
    args = parse()
    _, _, device = launch.init_distributed()
    gc.callbacks.append(on_gc)
    res = {"model": args.model, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "args": vars(args), "peak_tflops": ledger.matmul_peak(device) / 1e12, "runs": {}}
    for mode in args.modes.split(","):
        engine = None                          # built by the mode's first variant, shared by the others
        for variant in args.variants.split(";"):
            flags = MODES[mode] + ([] if variant == "default" else variant.split())
            name = f"{mode} {variant}"
            repeat = sum(k.startswith(name) for k in res["runs"]) + 1
            name += f" #{repeat}" if name in res["runs"] else ""   # repeats kept
            try:
                m, table, engine = run_variant(args, flags, engine, args.profile)
                res["runs"][name] = {"ok": True, "metrics": m, "profile": table}
            except Exception as e:         # an OOM, a refused setting, a compiler failure: the row says which
                res["runs"][name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
                engine = SHARED.get("engine")  # vLLM's sleep allocator allows one engine a process: keep it
            with open(args.out, "w") as f:    # after every variant: a cut-off run keeps its rows
                json.dump(res, f, indent=1)
            say(name, res["runs"][name], args.peak_stage)
        engine = SHARED["engine"] = None
        gc.collect()
        torch.cuda.empty_cache()
    launch.leave()


if __name__ == "__main__":
    main()
