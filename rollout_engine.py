"""Async rollout, the engine's side: where the engines run, the trainer's share of torchrun's ranks,
and the engine process itself (rollout_async.py is the trainer's side: orders, the push; rollout_buffer.py the
buffer between them).

    torchrun --nproc_per_node=2 train_grpo.py --rollout.mode=async --rollout.gpus=1 --model=/models/Qwen2.5-1.5B
    python -m pytest -q tests/test_async.py

Where the engines run: --rollout.gpus=k: the last k of the ranks torchrun starts each start one engine
process on their GPU and wait for it (`engine_rank`; the trainer is the first N - k ranks,
`trainer_world`); k=0: trainer rank 0 spawns one beside itself on its GPU. An engine process (`serve`)
builds vLLM awake for the whole run (no sleep: nothing else is on its GPU, or its KV budget is fixed
beside the trainer's), or HF generate on the CPU, then loops: a push of weights is loaded between
orders, an order is generated once the weights it needs have come (the staleness bound), its samples
go back with the policy version that made them. What its GPU holds all run: `predicted`.
The prompts of a step split over the engines in contiguous parts of `prompts_per_engine` each (the
last may be shorter): one rule for the orders, each engine's request and the planner.
"""
import ast
import contextlib
import datetime
import multiprocessing
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Client

import torch
import torch.distributed as dist

import hf_engine
import ledger
import rollout
import tensor_parallel
import vllm_engine
from rollout import RolloutConfig


class EngineDied(RuntimeError):
    """An engine process failed or exited: the run stops with this line."""


def check(cfg: RolloutConfig, nproc: int, train_batch_size: int):
    """The rollout layouts a run cannot have (`nproc`: the ranks torchrun starts, or plan.py's --nproc),
    said before any rank leaves to become an engine."""
    k = cfg.gpus
    if cfg.mode != "async":
        if k:
            raise ValueError(f"--rollout.gpus={k} is for --rollout.mode=async (colocated, the engine shares every "
                             f"GPU with the trainer); add --rollout.mode=async or leave rollout.gpus at 0")
        return
    if k >= nproc:                         # plain python is one rank: "at most 0" alone would not say how
        fewer = f"--rollout.gpus={nproc - 1} (at most), or " if nproc > 1 else ""
        raise ValueError(f"--rollout.gpus={k} leaves no trainer among the {nproc} rank(s) started (plain python is "
                         f"one; torchrun's --nproc_per_node, plan.py's --nproc): the last rollout.gpus ranks are "
                         f"engines; start them beside the trainer's ranks (torchrun --nproc_per_node={nproc + k} "
                         f"train_grpo.py ...: {nproc} trainer rank(s) and {k} engine(s)), or pass {fewer}"
                         f"--rollout.gpus=0 (one engine process beside rank 0, sharing its GPU)")
    if cfg.tensor_parallel_size != 1:
        raise ValueError("--rollout.mode=async runs one engine per rollout GPU: use --rollout.tensor_parallel_size=1")
    step = train_batch_size * cfg.n
    if 0 < cfg.buffer_limit < step:
        raise ValueError(f"--rollout.buffer_limit={cfg.buffer_limit} is below one step's {step} samples "
                         f"(train_batch_size x rollout.n): the trainer could never take a step; use at least {step}, "
                         f"or 0 (max_staleness steps' worth)")


def engines(cfg: RolloutConfig) -> int:
    return max(cfg.gpus, 1) if cfg.mode == "async" else 0


def trainer_world(cfg: RolloutConfig, nproc: int) -> int:
    """The ranks that train: all but the engine ranks."""
    return nproc - (cfg.gpus if cfg.mode == "async" else 0)


def is_engine_rank(cfg: RolloutConfig) -> bool:
    nproc, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    return cfg.mode == "async" and rank >= trainer_world(cfg, nproc)


def prompts_per_engine(cfg: RolloutConfig, train_batch_size: int) -> int:
    """Each engine's part of a step's prompts (contiguous; the last part may be shorter)."""
    return -(-train_batch_size // engines(cfg))


def request(cfg: RolloutConfig, train_batch_size: int, prompt_len: int, dtype: str) -> rollout.Request:
    """What one engine holds at once: its part of a step's prompts, n sequences each."""
    return rollout.request(cfg, prompts=prompts_per_engine(cfg, train_batch_size), prompt_len=prompt_len,
                           param_dtype=dtype)


def predicted(cfg: RolloutConfig, config, req: rollout.Request) -> dict:
    """What an engine's GPU holds all run (it never sleeps), by part: its weights, the KV budget of its
    request, the workspace (rollout.engine_bytes; its CUDA context is the planner's)."""
    return rollout.engine_bytes(config, kv_bytes=rollout.kv_bytes(cfg, config, req), req=req, tp=1)


# --------------------------------------------------------------------------- what an engine is told
@dataclass
class Spec:
    """Everything an engine process needs, sent once when it connects (pickled)."""
    cfg: RolloutConfig
    config: object                          # the policy's HF config
    model_dir: str | None                   # vLLM reads its config.json (the weights come from the first push)
    req: rollout.Request                    # its sequences, their length, its weights' dtype
    pad_id: int
    eos_id: int
    layout: list                            # buckets: [(name, shape, offset, nbytes), ...] each
    bucket_bytes: int
    transport: str                          # nccl | gloo | ipc
    store: tuple                            # (host, port) of rank 0's store for the weights group
    timeout_s: float


def torchrun_store():
    return dist.PrefixStore(f"/async_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=datetime.timedelta(seconds=1800)))



def group(spec: Spec, rank: int, size: int, store=None):
    """The weights group (rank 0: the trainer; 1..k: the engines), outside torch's default group (the
    engines are not in the trainer's): NCCL between GPUs, gloo on the CPU."""
    store = store or dist.TCPStore(spec.store[0], spec.store[1], is_master=False,
                                   timeout=datetime.timedelta(seconds=spec.timeout_s))
    store = dist.PrefixStore("weights", store)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.transport == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# --------------------------------------------------------------------------- the trainer's allocator
# Async rollout, 0.5B on one H200 (bench/README.md): with PyTorch's default allocator the trainer reserved
# 97-131 GB for an update whose allocated peak was 59-62 GB (six runs; the device at 103-137 GB of 140 with the
# engine beside it, against a 113 GB plan). With expandable segments: 63 GB reserved, the device at 70 GB, the
# engine-trainer log-prob gap the same (0.012; 0.011-0.015); set here, measured: 60-66 GB for a 56-63 GB peak
TRAINER_ALLOC_CONF = "expandable_segments:True"


def trainer_allocator(cfg: RolloutConfig) -> str | None:
    """Async rollout puts no vLLM pool in the trainer's process, so its allocator may grow segments in place
    instead of caching blocks that the update's changing shapes fragment (vLLM's sleep pool refuses this,
    so colocated runs keep the default). Set before the first CUDA allocation, and only where the launcher
    set no allocator settings (PYTORCH_CUDA_ALLOC_CONF, any value, keeps its own); the engine processes start
    without it (`spawn`). The setting made, or None."""
    if cfg.mode != "async" or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = TRAINER_ALLOC_CONF
    return TRAINER_ALLOC_CONF


# --------------------------------------------------------------------------- engine processes
def spawn(address, authkey: bytes, index: int, device: torch.device):
    """A fresh Python process (spawn: no CUDA state inherited) running `serve` on `device` alone: it
    sees that GPU as its only one, so vLLM's own executor takes it."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    # torchrun's variables would make the engine's own process group (vLLM's, on a free port) look
    # for torchrun's agent store instead (TORCHELASTIC_USE_AGENT_STORE): the child starts without them;
    # and without the trainer's allocator settings (expandable segments: the trainer's, which vLLM refuses)
    launcher = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TORCHELASTIC_") or k in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTORCH_CUDA_ALLOC_CONF")}
    if device.type == "cuda":
        visible = env.split(",") if env else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[device.index or 0]
    # ignored signals stay ignored across exec: the engine ignores Ctrl-C and SIGTERM from its first
    # instruction (a Ctrl-C during its imports, before `_deaf`, would print a KeyboardInterrupt traceback)
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        p = multiprocessing.get_context("spawn").Process(target=serve, args=(address, authkey, index, os.getpid()),
                                                         name=f"rollout-engine-{index}", daemon=False)
        p.start()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        os.environ.update(launcher)
        if env is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env
    return p


def engine_rank(cfg: RolloutConfig) -> int:
    """What an engine rank of torchrun does: start its engine process on its GPU and wait for it; 0 whatever
    became of it, since the trainer's rank 0 says how an engine ended (its one line, torchrun's "Root
    Cause") and a failed engine rank would be seen first. It holds no GPU memory (its engine has the GPU)."""
    nproc, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    index = rank - trainer_world(cfg, nproc)
    try:
        address, key = ast.literal_eval(_address(torchrun_store()).decode())
    except KeyboardInterrupt:              # torchrun's Ctrl-C during the trainer's set-up: the trainer says it
        return 130
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    _deaf()                                # the trainer decides when the engine stops (its "stop")
    p = spawn(address, bytes.fromhex(key), index, device)
    p.join()
    return 0


def _address(store, timeout_s: float = 1800.0) -> bytes:
    """Where the trainer listens, once its set-up publishes it. Polled, not one blocking get: a signal (torchrun's
    Ctrl-C) reaches Python only between calls, and a get inside C++ would hold this rank until torchrun's SIGKILL,
    30 s after the others had gone."""
    deadline = time.time() + timeout_s
    while not store.check(["rollout_async/address"]) and time.time() < deadline:
        time.sleep(0.2)
    return store.get("rollout_async/address")


def _die_with_parent(parent: int):
    """Linux: the kernel ends this process when the one that started it (`parent`) ends (a trainer stopped
    by a Ctrl-C in its set-up, or killed), rather than let it build an engine nobody will use and hold its
    GPU."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):      # not Linux: the closed connection ends it, later
        return
    if os.getppid() != parent:             # it was gone before the line above (during this process's imports)
        os._exit(0)


def _deaf():
    """Ctrl-C and SIGTERM are the trainer's to handle: the terminal sends Ctrl-C to the whole process group
    (with plain python the engine process is in it), torchrun forwards both to each worker's group (the
    engine process is in its rank's). The trainer finishes its step, checkpoints and sends "stop"; an
    engine whose trainer is gone sees its connection close and ends (torchrun's SIGKILL, 30 s on, too)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def serve(address, authkey: bytes, index: int, parent: int):
    """An engine process: connect to trainer rank 0, build the engine, then in order: receive
    weights, take orders, generate each order once its weights are new enough, send the samples.
    `parent`: the process that started it (it ends with it)."""
    _deaf()
    _die_with_parent(parent)
    try:
        conn = Client(address, authkey=authkey)
        conn.send(("hello", index, os.getpid()))
    except (EOFError, ConnectionError):    # the trainer stopped before the engine reached it (Ctrl-C in its set-up)
        return
    try:
        _serve(conn, index)
    except (EOFError, ConnectionError):    # the trainer is gone: nothing to report to
        pass
    except BaseException as e:              # noqa: BLE001 (said to the trainer, then the process ends)
        if _trainer_gone(conn):            # e.g. the weights group's store, closed with it: no one to tell
            return
        traceback.print_exc()              # the whole story on this process's stderr, one line to the trainer
        line = (traceback.format_exception_only(type(e), e)[-1].strip())[:500]
        try:
            conn.send(("error", line))
        except OSError:
            pass
        raise SystemExit(1)


def _trainer_gone(conn) -> bool:
    """The trainer closed its end of the connection (it stopped: a Ctrl-C in its set-up, an error)."""
    try:
        if conn.poll():
            conn.recv()
        return False
    except (EOFError, OSError):
        return True


@contextlib.contextmanager
def _ending_with_trainer(conn):
    """Around the engine's build (vLLM's: a minute), when the trainer sends nothing: a connection that becomes
    readable is a closed one, and the process ends at once rather than build an engine nobody will use (its
    rank would hold torchrun's shutdown until the SIGKILL)."""
    done = threading.Event()

    def watch():
        while not done.wait(0.5):
            if conn.poll():
                os._exit(0)
    watcher = threading.Thread(target=watch, daemon=True, name="trainer-watch")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()                     # gone before "ready": what the trainer sends next is no close


def _serve(conn, index: int):
    _, spec, _ = conn.recv()
    spec.config._attn_implementation = "sdpa"   # the trainer's copy names its packed attention (packing.py)
    device = torch.device("cuda", 0) if spec.transport != "gloo" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shared = conn.recv()[1] if spec.transport == "ipc" else None   # the trainer's bucket, mapped here once
    pg = group(spec, index + 1, engines(spec.cfg) + 1) if spec.transport != "ipc" else None
    t0 = time.perf_counter()
    with _ending_with_trainer(conn):
        eng = _build(spec, device)
    buf = shared if shared is not None else torch.empty(spec.bucket_bytes, dtype=torch.uint8, device=device)
    conn.send(("ready", {"build_s": time.perf_counter() - t0, "device_gb": _device_gb(device)}))
    version, pending, idle, weight_wait = -1, [], 0.0, 0.0
    while True:
        t_wait = time.perf_counter()
        msg = conn.recv()
        waited = time.perf_counter() - t_wait
        if pending:
            weight_wait += waited          # an order waits for newer weights (the staleness bound)
        else:
            idle += waited                 # no order: the buffer is full or the trainer is behind
        if msg[0] == "stop":
            return
        if msg[0] == "weights":
            _load_weights(eng, spec, conn, pg, buf)
            version = msg[1]
        elif msg[0] == "order":
            pending.append(msg[1])
        elif msg[0] == "validate":         # greedy answers with the weights held now (the trainer's newest)
            v = msg[1]
            greedy = rollout.greedy_config(spec.cfg, v["max_tokens"])
            conn.send(("val", _generate(eng, spec, {"prompts": v["prompts"], "seed": 0}, device, greedy)[1]
                       if v["prompts"] else []))
        while pending and pending[0]["min_version"] <= version:
            order = pending.pop(0)
            t1 = time.perf_counter()
            rows, responses, logps = _generate(eng, spec, order, device)
            payload = {"prompts": rows, "responses": responses, "logps": logps, "version": version,
                       "stats": {"generate_s": time.perf_counter() - t1, "idle_s": idle,
                                 "weight_wait_s": weight_wait, "device_gb": _device_gb(device)}}
            conn.send(("samples", order["step"], payload))
            idle = weight_wait = 0.0


def _device_gb(device) -> float:
    if device.type != "cuda":
        return ledger.host_rss_gb()       # the engine process's memory on the CPU
    free, total = torch.cuda.mem_get_info()
    return (total - free) / ledger.GB


def _build(spec: Spec, device: torch.device):
    """vLLM awake for the whole run on vLLM's own one-GPU executor (its KV cache sized from its request),
    or the HF model."""
    cfg, req = spec.cfg, spec.req
    if rollout.resolve_engine(cfg, device) == "hf":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(spec.config, dtype=getattr(torch, req.dtype))
        return model.to(device).eval()
    kv = rollout.kv_bytes(cfg, spec.config, req)
    need = predicted(cfg, spec.config, req)
    llm = vllm_engine.new_llm(cfg, model_dir=spec.model_dir, req=req, seed=0, kv=kv, need=need)
    return rollout.Engine("vllm", cfg, spec.pad_id, spec.eos_id, device, llm=llm, dtype=getattr(torch, req.dtype),
                          kv_cache_bytes=kv)


def _load_weights(eng, spec: Spec, conn, pg, buf: torch.Tensor):
    """One push: each bucket into `buf` (broadcast) or read from the shared one (ipc), then into the engine
    (vLLM: `vllm_engine.loading`, which re-quantizes FP8 weights; HF: its state dict)."""
    with vllm_engine.loading(eng.llm) if isinstance(eng, rollout.Engine) else contextlib.nullcontext(eng) as target:
        for b, entries in enumerate(spec.layout):
            size = entries[-1][2] + entries[-1][3]
            if pg is not None:
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                pg.broadcast([buf[:size]], opts).wait()
            else:
                msg = conn.recv()
                assert msg == ("bucket_ready", b), msg
            dtype = getattr(torch, spec.req.dtype)
            tensors = [(name, buf[off:off + nbytes].view(dtype).view(shape)) for name, shape, off, nbytes in entries]
            if isinstance(eng, rollout.Engine):
                target.load_weights(tensors)
            else:
                target.load_state_dict(dict(tensors), strict=False)
            if pg is None:
                torch.cuda.synchronize()
                conn.send(("ack", b))


def _generate(eng, spec: Spec, order: dict, device, cfg=None) -> tuple[list, list, list]:
    """(rows, responses, log-probs) of the order's prompts, n samples each, a prompt's in a row (`cfg`: another
    sampling than the spec's, validation's)."""
    cfg = cfg or spec.cfg
    if not isinstance(eng, rollout.Engine):
        return hf_engine.sample_hf(eng, order["prompts"], cfg, spec.pad_id, spec.eos_id, device, order["seed"],
                                   logprobs=True)
    reqs, seeds, _ = tensor_parallel.requests([(order["prompts"], order["seed"])], cfg.n, cfg.temperature == 0)
    outs = vllm_engine.sample_vllm(replace(eng, cfg=cfg), reqs, seeds)
    return vllm_engine.vllm_samples(list(zip(reqs, outs)))

