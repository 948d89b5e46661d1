"""The memory ledger: each stage's seconds and memory (allocated, peak, reserved, the device's use),
host RSS, the allocator's retries, and the snapshot an OOM leaves. It measures; the moves it measures
are offload.py's (and each role's brackets).

    python -m pytest test_memory.py -q            # on a GPU: the ledger sees each flag's bytes
"""
import contextlib
import os
import resource
import threading
import time

import torch
import torch.distributed as dist

GB = 1024 ** 3


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t   # DTensor -> this rank's shard


# The stages of one step, in the order train_grpo.py runs them: the names of the ledger's figures
# (`time/<stage>`, `mem/<stage>/...`). val (validation, on the steps its schedule names) comes first: the
# policy after the last update answers the held-out prompts. reward_model sits before old_logp and ref_logp: the actor's
# offloaded params have left after the sync and nothing is prefetched yet, so its shards and
# activations meet the fewest trainer bytes of the step.
STAGES = ("val", "generate", "rollout_wait", "reward", "reward_model", "old_logp", "ref_logp", "values", "advantage",
          "critic_update", "update", "push")   # rollout_wait and push: async rollout (generate: colocated)


def host_rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / GB


def gpu_capacity(device) -> int:
    """The GPU's total memory (what the plan is measured against; 80 GB stands in on a CPU run)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 * GB


def others_on_gpu(device) -> int:
    """What other processes hold on this GPU as the run sets up (a second run, a notebook sharing the card), the
    most any rank sees, so every rank plans the same config; 0 below 2 GB (this process's CUDA context and the
    driver's own reserve) and on a CPU run."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    held = torch.tensor([total - free - torch.cuda.memory_reserved(device)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(held, op=dist.ReduceOp.MAX)   # a CPU tensor: the group's gloo backend
    return int(held) if held > 2 * GB else 0


def host_bytes_per_rank() -> int:
    """This node's RAM shared by its ranks (the x2 machines grow MemTotal lazily: a lower bound there)."""
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks


def host_available() -> int:
    """The node's RAM that is free to take now (MemAvailable: free plus what the kernel can reclaim)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory(device: torch.device, external: int = 0) -> dict:
    """Allocated / peak / reserved by PyTorch's allocator for the trainer, and the whole device's
    use from `mem_get_info` (the only figure that sees vLLM's mapped pool). `external`: bytes of
    the allocator's count that belong to another engine's pool (vLLM's sleep-mode pool stays
    "allocated" for PyTorch while it sleeps; its Engine reports the figure), taken out.
    On CPU: host figures (RSS, and the process's lifetime peak RSS: a per-stage peak cannot be
    reset there)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        ext = external
        return {"allocated_gb": (torch.cuda.memory_allocated(device) - ext) / GB,
                "peak_gb": (torch.cuda.max_memory_allocated(device) - ext) / GB,
                "reserved_gb": (torch.cuda.memory_reserved(device) - ext) / GB,
                "device_used_gb": (total - free) / GB}
    rss = host_rss_gb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    return {"allocated_gb": rss, "peak_gb": peak, "reserved_gb": rss, "device_used_gb": rss}


PROGRESS_S = 60.0                          # a stage running longer says so this often (rank 0)
_now: dict = {}                            # the stage running now and when it began (for `_watch`)


def _watch():
    """Rank 0's thread: a stage that runs past PROGRESS_S says so, and again each PROGRESS_S after, so a
    long step (a large batch, long responses, a slow engine) is never silent."""
    said = None
    while True:
        time.sleep(PROGRESS_S / 4)
        name, t0, step = _now.get("name"), _now.get("t0", 0.0), _now.get("step")
        now = (name, t0, int((time.perf_counter() - t0) // PROGRESS_S))   # one line each PROGRESS_S
        if name and time.perf_counter() - t0 >= PROGRESS_S and said != now:
            said = now
            print(f"[progress] step {step}: {name} has run {time.perf_counter() - t0:.0f} s", flush=True)


@contextlib.contextmanager
def stage(name: str, metrics: dict, device: torch.device, external: int = 0):
    """Time a stage and record memory at its end, with the peak reached inside it (`external`: see memory).
    In a profiler trace (--profile_steps) the stage is one span named `stage:<name>`; without a
    profiler running the label costs a few microseconds."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = _allocator_counts(device)
    t0 = time.perf_counter()
    if not _now and int(os.environ.get("RANK", 0)) == 0:
        threading.Thread(target=_watch, daemon=True, name="stage-progress").start()
    _now.update(name=name, t0=t0, step=metrics.get("step"))
    with torch.profiler.record_function(f"stage:{name}"):
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # so the time covers the stage's kernels
    metrics[f"time/{name}"] = time.perf_counter() - t0
    _now["name"] = None
    if device.type == "cuda":              # near the memory limit a stage slows down here, not in a copy
        for k, v in _allocator_counts(device).items():
            metrics[f"mem/{name}/{k}"] = float(v - before[k])
    for k, v in memory(device, external).items():
        metrics[f"mem/{name}/{k}"] = v


def _allocator_counts(device) -> dict:
    """cudaMalloc calls, and retries: a failed cudaMalloc that made the allocator free its whole
    cache (synchronizing the device) and try again: the cost of running close to the limit."""
    s = torch.cuda.memory_stats(device)
    return {"cuda_mallocs": s.get("num_device_alloc", 0), "alloc_retries": s.get("num_alloc_retries", 0)}


def gpu_bytes(*objs) -> int:
    """Bytes of GPU storage held by these modules (params, grads, buffers) and optimizers (state):
    what the trainer really keeps on the device, whatever the allocator has cached."""
    tensors = []
    for o in objs:
        if isinstance(o, torch.nn.Module):
            tensors += [_local(p) for p in o.parameters()] + [_local(p.grad) for p in o.parameters()
                                                              if p.grad is not None]
            tensors += list(o.buffers())
        elif isinstance(o, torch.optim.Optimizer):
            tensors += [_local(v) for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        if t.device.type == "cuda" and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _site(frames: list) -> str:
    """Where a CUDA block was made, from its allocation's stack (innermost first): the innermost frame, then the
    first two of this project or of vLLM ("" without a stack)."""
    root = os.path.dirname(os.path.abspath(__file__))
    def where(f):
        path = f["filename"]
        return os.path.relpath(path, root) if path.startswith(root) else path.split("site-packages/")[-1]
    ours = [f"{where(f)}:{f['line']}" for f in frames if f["filename"].startswith(root) or "/vllm/" in f["filename"]]
    return " < ".join([f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames[:1]] + ours[:2])


def held_blocks(top: int = 8) -> list[str]:
    """What the CUDA allocator holds now, by where it was made: the live blocks of its snapshot summed by
    pool (the default one, or a private one: vLLM's sleep pool, CUDA graphs) and by the allocating line
    (`_site`), after a line of each pool's total. Stacks exist only for blocks made while
    torch.cuda.memory._record_memory_history was on (--memory_history): how a leak names its line."""
    sums = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = "default pool" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else \
            f"pool {tuple(seg['segment_pool_id'])}"
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                key = (pool, _site(b.get("frames", [])) or "no stack")
                sums[key] = sums.get(key, 0) + b["size"]
    pools = {}
    for (pool, _), n in sums.items():
        pools[pool] = pools.get(pool, 0) + n
    return [", ".join(f"{n / 2 ** 20:.0f} MiB in the {pool}" for pool, n in sorted(pools.items()))] + \
        [f"{n / 2 ** 20:.0f} MiB in the {pool}: {site}"
         for (pool, site), n in sorted(sums.items(), key=lambda kv: -kv[1])[:top]]


def peak_blocks(snapshot: dict, before: int, top: int = 12) -> dict:
    """What was live at the highest point of a recorded stretch: `snapshot` is torch.cuda.memory._snapshot()
    taken at its end with the history recorded from its start (_record_memory_history), `before` the bytes
    allocated when recording began. Replays the trace (alloc +, free_completed -) to its peak and sums the
    blocks live there by allocating site (`_site`; a backward's blocks, made on autograd's thread without a
    Python stack, by size); blocks older than the recording are one line, less what the stretch freed of them
    before its peak."""
    events = [e for t in snapshot["device_traces"] for e in t]
    now, peak, top_at = 0, 0, -1               # the start is the peak until passed
    for i, e in enumerate(events):
        now += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        if now > peak:
            peak, top_at = now, i
    at, old_gone = {}, 0                       # replayed again to the peak: what was live there
    for e in events[:top_at + 1]:
        if e["action"] == "alloc":
            at[e["addr"]] = e
        elif e["action"] == "free_completed" and at.pop(e["addr"], None) is None:
            old_gone += e["size"]
    sums = {}
    for e in at.values():
        site = _site(e.get("frames", [])) or \
            f"no Python stack (autograd's thread): blocks of {e['size'] / 2 ** 20:.1f} MiB"
        sums[site] = sums.get(site, 0) + e["size"]
    rows = [(n, "allocated before the stretch, still live at its peak")] if (n := before - old_gone) else []
    rows += sorted(((n, s) for s, n in sums.items()), reverse=True)[:top]
    return {"peak_gb": (before + peak) / GB, "before_gb": before / GB,
            "live_at_peak": [f"{n / GB:.3f} GB {s}" for n, s in rows]}


def memory_watch(out_dir: str, rank: int, device: torch.device, history: bool = False):
    """On a GPU: an OOM leaves a memory snapshot in out_dir (viewable at pytorch.org/memory_viz);
    with `history` (--memory_history), every allocation's stack is recorded into it as well."""
    if device.type != "cuda":
        return
    if history:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    path = os.path.join(out_dir, f"oom_snapshot.rank{rank}.pickle")

    def dump(*_):                          # called by the allocator at the moment it gives up
        torch.cuda.memory._dump_snapshot(path)
    torch._C._cuda_attach_out_of_memory_observer(dump)


def reduce(m: dict, device) -> dict:
    """Stage times, memory and offload figures: the max over ranks (the slowest / fullest rank).
    Several ranks: also `time_min/<stage>`, the fastest rank's time. A rank that finishes a stage
    early waits for the others in the next stage's first collective, so a stage's time can hold
    the previous stage's imbalance: max - min shows where the ranks drift apart."""
    keys = sorted(k for k in m if k.split("/")[0] in ("time", "mem", "offload", "rollout") or k == "host_rss_gb")
    if dist.get_world_size() > 1 and keys:
        times = [k for k in keys if k.startswith("time/")]
        t = torch.tensor([float(m[k]) for k in keys] + [-float(m[k]) for k in times], device=device,
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)            # one collective: max, and min as -max(-x)
        t = t.tolist()
        m.update(zip(keys, t))
        m.update({"time_min/" + k[5:]: -v for k, v in zip(times, t[len(keys):])})
    return m


# --------------------------------------------------------------------------- throughput
HBM = {"H200": 4.8e12, "H100": 3.35e12, "H20": 4.0e12, "A100": 2.0e12, "B200": 8.0e12}   # bytes/s, the vendor's
_PEAK: dict = {}


def matmul_peak(device) -> float:
    """The bf16 FLOP/s a dense 8192^3 matmul reaches on this GPU, measured once (the MFU's denominator; the
    H200 here: ~742e12, 75 % of its 989e12 spec)."""
    if device.type != "cuda":
        return 0.0
    if device not in _PEAK:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        for _ in range(3):                     # warm-up: cuBLAS's heuristics, the clocks
            a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        torch.cuda.synchronize(device)
        _PEAK[device] = 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3)
        del a
    return _PEAK[device]


def throughput(m: dict, flops: dict, peak: float, decode: tuple | None = None) -> dict:
    """perf/<stage>_tflops and perf/<stage>_mfu of each stage that computed (`flops`: its model FLOPs on
    this GPU; `m`: the step's times), and the decode's figures when `decode` = (response tokens this GPU
    sampled, decoding steps, the engine's weight bytes per GPU, the device's name): tokens/s, the step's
    time and its weight-read bound (the weights read once per step at the HBM's bandwidth)."""
    out = {}
    for stage, f in flops.items():
        seconds = m.get(f"time/{stage}", 0)
        if f and seconds > 0:
            out[f"perf/{stage}_tflops"] = f / seconds / 1e12
            if peak:
                out[f"perf/{stage}_mfu"] = f / seconds / peak
    gen = m.get("rollout/generate_s") or m.get("rollout/engine_generate_s")   # colocated; the async engine's own
    if decode and gen:
        tokens, steps, weight_bytes, name = decode
        out.update({"perf/generate_tokens_per_s": tokens / gen, "perf/decode_step_ms": 1e3 * gen / max(steps, 1)})
        if m.get("rollout/generate_s") and m.get("time/generate"):     # async rollout has no bracket
            out["perf/bracket_frac"] = 1 - gen / m["time/generate"]
        bw = next((v for k, v in HBM.items() if k in name), 0)
        if bw:
            out["perf/decode_bound_ms"] = 1e3 * weight_bytes / bw
    return out


def perf_line(m: dict, peak: float) -> str | None:
    """The step's throughput in one line (the set-up report's, after the first step)."""
    stages = [f"{k[5:-7]} {m[k]:.3g} TFLOP/s" + (f" ({100 * m[k[:-7] + '_mfu']:.0f} % MFU)"
                                                 if k[:-7] + "_mfu" in m else "")
              for k in m if k.startswith("perf/") and k.endswith("_tflops")]
    if "perf/generate_tokens_per_s" in m:
        bound = f", weight-read bound {m['perf/decode_bound_ms']:.2f} ms" if "perf/decode_bound_ms" in m else ""
        bracket = f", the bracket {100 * m['perf/bracket_frac']:.0f} % of the stage" \
            if "perf/bracket_frac" in m else ""
        stages.append(f"generate {m['perf/generate_tokens_per_s'] / 1e3:.1f}k tokens/s, decode step "
                      f"{m['perf/decode_step_ms']:.2f} ms{bound}{bracket}")
    return ("[perf] " + "; ".join(stages) + (f" (MFU against the measured bf16 matmul peak, {peak / 1e12:.0f} TFLOP/s; "
                                             f"model FLOPs: 6 x params a token trained, 2 forward)" if peak else "")) \
        if stages else None
