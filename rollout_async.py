"""Async rollout, the trainer's side: the orders into the bounded host buffer (rollout_buffer.py), the weight push.

    python train_grpo.py --rollout.mode=async                  # CPU: HF generate in a child process
    torchrun --nproc_per_node=2 train_grpo.py --rollout.mode=async --rollout.gpus=1 --model=/models/Qwen2.5-1.5B
    python -m pytest -q tests/test_async.py

Colocated (rollout.py), every step generates and then trains on the same GPUs, and each waits for
the other. Here engine processes (rollout_engine.py: where they run, what they do) generate batch t+1
while the trainer trains on batch t:
    trainer rank 0    keeps the host buffer. It orders batches (the step's prompts, a seed and the
                      oldest policy version allowed to sample them); a thread per engine receives
                      the finished samples into the buffer; `take` hands each trainer rank its rows.
    every trainer rank  after each update gathers the new weights (FSDP2, one tensor at a time) and
                      rank 0 pushes them to the engines in buckets (`push`): NCCL broadcast to
                      engines on their own GPUs, CUDA IPC to an engine sharing rank 0's GPU, gloo on
                      the CPU. Each push carries its version; an engine switches between requests.
Staleness: batch j may be sampled by any policy version >= j - max_staleness; the trainer at step j
holds version j (one update per step), so a batch is at most max_staleness updates old. The update
corrects the lag with truncated importance weights against the engine's log-probs
(actor.rollout_is). Memory: the buffer (rollout_buffer.py) holds at most buffer_limit samples, ordered
or waiting (the engine has no order beyond it: it waits, `rollout/engine_idle_s`); its bytes, the
samples waiting and the engine's device use are in the metrics. Faults: an engine that dies stops the run with one
line; a resume pushes the checkpoint's weights and samples its batches again (the buffer is not
saved: a checkpoint records the policy version, and buffered samples are regenerated).
"""
import datetime
import os
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Listener

import torch
import torch.distributed as dist

import offload
import rollout
import rollout_buffer
import rollout_engine
import weights
from rollout import RolloutConfig

ALIGN = 64                                  # bytes: every tensor in a bucket starts at a multiple


def weight_layout(model, dtype: torch.dtype, bucket_bytes: int) -> tuple[list, int]:
    """The pushed tensors in `weights.hf_weights` order, packed into buckets of at most bucket_bytes
    (a larger tensor gets one of its own). Returns (buckets, the largest bucket's bytes): one buffer of
    that size carries every push."""
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    buckets, cur, off = [], [], 0
    for name, shape in weights.hf_shapes(model):
        nbytes = size * int(torch.Size(shape).numel())
        if cur and off + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, off = [], 0
        cur.append((name, tuple(shape), off, nbytes))
        off += -(-nbytes // ALIGN) * ALIGN
    buckets.append(cur)
    return buckets, max(b[-1][2] + b[-1][3] for b in buckets)


# --------------------------------------------------------------------------- the trainer's side
@dataclass
class Stream:
    """The trainer's side of async rollout (made by `start`). Rank 0 holds the connections, the
    buffer and the weights group; every trainer rank gathers the weights of a push."""
    cfg: RolloutConfig
    rank: int
    device: torch.device
    dtype: torch.dtype
    layout: list
    engines: int
    limit: int                              # samples (buffer_limit)
    step_samples: int                       # a step's samples, all ranks
    dp: int                                 # data-parallel groups: take() splits a step's samples in this many
    dp_rank: int
    prompt_len: int
    conns: list = field(default_factory=list)
    procs: list = field(default_factory=list)   # the engine processes rank 0 started (k=0)
    buffer: rollout_buffer.Buffer | None = None
    acks: list = field(default_factory=list)    # per engine: a queue of ("ack", bucket) from its thread
    vals: list = field(default_factory=list)    # per engine: a queue of its held-out answers (`greedy`)
    pg: object = None                       # the weights group: rank 0 and the engines (nccl / gloo)
    bucket: torch.Tensor | None = None      # ipc: the buffer shared with the engine, held for the run
    next_order: int = 0                     # the first step not ordered yet
    seed: int = 0
    version: int = 0                        # the policy version the engines hold (pushed last)
    engine_stats: dict = field(default_factory=dict)   # what each engine said at start
    pad_id: int = 0                         # the batch's padding and end (rollout.make_batch)
    eos_id: int = 1


def start(run, engine: rollout.Engine, *, model, prompt_len: int, dp: int, dp_rank: int, version: int,
          stashes: list) -> Stream:
    """Start (k=0) or reach (k >= 1) the engines, give them the spec, push the current weights as
    `version` (`stashes`: the actor's params, in for that push). `run`: the run's options (options.Config:
    its rollout section, batch, seed, model, out_dir, timeout); `engine`: the trainer's (rollout.build's,
    unbuilt in async mode: its device, pad and eos ids). Collective over the trainer ranks (they take part
    in the first push)."""
    cfg, device, config, pad_id, eos_id = run.rollout, engine.device, model.config, engine.pad_id, engine.eos_id
    dtype, train_batch_size = run.actor.param_dtype, run.train_batch_size
    rank = dist.get_rank() if dist.is_initialized() else 0
    k = rollout_engine.engines(cfg)
    req = rollout_engine.request(cfg, train_batch_size, prompt_len, dtype if device.type == "cuda" else "float32")
    torch_dtype = getattr(torch, req.dtype)  # on the CPU, fp32: as the trainer computes there
    layout, bucket_bytes = weight_layout(model, torch_dtype, cfg.sync_bucket_mb * 2 ** 20)
    step_samples = train_batch_size * cfg.n
    limit = rollout_buffer.buffer_limit(cfg, train_batch_size)
    s = Stream(cfg, rank, device, torch_dtype, layout, k, limit, step_samples, dp, dp_rank, prompt_len,
               seed=run.seed, version=version, next_order=version, pad_id=pad_id, eos_id=eos_id)
    if rank == 0:
        transport = "gloo" if device.type == "cpu" else "ipc" if cfg.gpus == 0 else "nccl"
        engine_dir = os.path.join(run.out_dir, "vllm_config", "engine")
        where = rollout.model_dir(run.model, config, engine_dir) if device.type == "cuda" else None
        spec = rollout_engine.Spec(cfg, config, where, req, pad_id, eos_id, layout, bucket_bytes, transport,
                                   (_host(), 0), run.dist_timeout_s)
        _connect(s, spec)
    push(s, model, stashes, version, {})
    return s


def describe(s: Stream) -> list[str]:
    """The set-up report's lines: where the engines are, the bound, what each engine took."""
    c, where = s.cfg, (f"on {s.cfg.gpus} GPU(s) of their own" if s.cfg.gpus else "one process beside rank 0")
    built = "; ".join(f"engine {i}: built in {v['build_s']:.1f} s, device {v['device_gb']:.2f} GB"
                      for i, v in sorted(s.engine_stats.items()))
    mb = s.limit * rollout_buffer.sample_bytes(s.prompt_len, c.response_length) / 2 ** 20
    return [f"[rollout] async: {s.engines} engine(s) {where}; a batch at most {c.max_staleness} update(s) older "
            f"than the policy it trains; the host buffer holds at most {s.limit} samples (ordered or waiting, "
            f"{mb:.1f} MB); weights pushed after each "
            f"update in {len(s.layout)} bucket(s) of up to {c.sync_bucket_mb} MB; {built}; the trainer's allocator: "
            f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'PyTorch default'} (rollout_engine.trainer_allocator)"]


def _host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _connect(s: Stream, spec: rollout_engine.Spec):
    """Rank 0: listen, start or wait for the k engines, send each its spec, build the weights group."""
    authkey = secrets.token_bytes(16)
    listener = Listener((_host(), 0), authkey=authkey)
    store = None
    if spec.transport != "ipc":            # the weights group's rendezvous, hosted here
        store = dist.TCPStore(_host(), 0, s.engines + 1, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        spec.store = (_host(), store.port)
    if s.cfg.gpus == 0:                    # one engine beside rank 0, on its GPU
        s.procs.append(rollout_engine.spawn(listener.address, authkey, 0, s.device))
    else:                                  # the engine ranks read where to connect from torchrun's store
        rollout_engine.torchrun_store().set("rollout_async/address", repr((listener.address, authkey.hex())))
    s.conns = [None] * s.engines
    accepted = _accept(listener, s.engines, spec.timeout_s, s.procs)
    for conn in accepted:
        index = conn.recv()[1]
        s.conns[index] = conn
    for i, conn in enumerate(s.conns):
        conn.send(("spec", spec, i))
    if spec.transport == "ipc":            # one buffer in this GPU's memory, mapped by the engine once
        s.bucket = torch.empty(spec.bucket_bytes, dtype=torch.uint8, device=s.device)
        s.conns[0].send(("bucket", s.bucket))
    else:
        s.pg = rollout_engine.group(spec, 0, s.engines + 1, store)
    s.buffer = rollout_buffer.Buffer(s.limit)
    s.acks = [queue.Queue() for _ in range(s.engines)]
    s.vals = [queue.Queue() for _ in range(s.engines)]
    for i, conn in enumerate(s.conns):     # "ready" (or an error) comes back after each engine is built
        msg = conn.recv()
        if msg[0] == "error":
            raise rollout_engine.EngineDied(f"rollout engine {i} failed to start: {msg[1]}")
        s.engine_stats[i] = msg[1]
    for i in range(s.engines):
        threading.Thread(target=_receive, args=(s, i), daemon=True, name=f"rollout-engine-{i}").start()


def _accept(listener, k: int, timeout_s: float, procs: list) -> list:
    """k connections, or one line when an engine process dies before it connects."""
    done, conns = threading.Event(), []

    def run():
        for _ in range(k):
            conns.append(listener.accept())
        done.set()
    threading.Thread(target=run, daemon=True).start()
    t0 = time.time()
    while not done.wait(0.5):
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise rollout_engine.EngineDied(f"rollout engine process {dead[0].pid} exited with code "
                                            f"{dead[0].exitcode} before it connected (its output above says why)")
        if time.time() - t0 > timeout_s:
            raise rollout_engine.EngineDied(f"{k - len(conns)} rollout engine(s) did not connect within "
                                            f"--dist_timeout_s={timeout_s:g} s")
    return conns


def _receive(s: Stream, i: int):
    """Rank 0's thread for engine i: samples into the buffer, acks to `push`; a failure or a closed
    connection marks the buffer failed. If the trainer does not say it within a minute (it is stuck
    in a transfer to the dead engine), this thread says it and ends the process."""
    conn = s.conns[i]
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "samples":
                p = msg[2]
                p["nbytes"] = sum(rollout_buffer.sample_bytes(len(x), len(r))
                                  for x, r in zip(p["prompts"], p["responses"]))
                s.buffer.put(msg[1], i, p)
            elif msg[0] == "ack":
                s.acks[i].put(msg[1])
            elif msg[0] == "val":
                s.vals[i].put(msg[1])
            elif msg[0] == "error":
                s.buffer.fail(f"rollout engine {i} failed: {msg[1]}")
                break
    except (EOFError, OSError):
        proc = s.procs[i] if i < len(s.procs) else None
        if proc is not None:
            proc.join(5)
        code = f" with code {proc.exitcode}" if proc is not None and proc.exitcode is not None else ""
        s.buffer.fail(f"rollout engine {i} ({'pid ' + str(proc.pid) if proc else 'its rank'}) exited{code}: "
                      f"its connection closed")
    for q in s.acks + s.vals:
        q.put(None)                        # a push waiting for an ack (a validation for answers) stops waiting
    if not s.buffer.handled.wait(60):
        print(f"error: {s.buffer.error}", flush=True)
        os._exit(1)


def _send(s: Stream, i: int, msg: tuple):
    """One message to engine i; a closed connection (an engine killed: EPIPE, ECONNRESET) stops the
    run with the line the receiver thread writes for it."""
    try:
        s.conns[i].send(msg)
    except OSError as e:
        raise s.buffer.died(f"rollout engine {i} exited: its connection closed ({e.strerror})") from None


def _order(s: Stream, step: int, prompts_of):
    """Send step `step`'s prompts to the engines (a contiguous part each)."""
    prompts = prompts_of(step)
    per = rollout_engine.prompts_per_engine(s.cfg, len(prompts))
    for i in range(s.engines):
        _send(s, i, ("order", {"step": step, "prompts": prompts[i * per:(i + 1) * per],
                               "seed": rollout.sample_seed(s.seed, step, i, s.engines),
                               "min_version": step - s.cfg.max_staleness}))


def take(s: Stream, step: int, prompts_of, metrics: dict) -> list:
    """This rank's samples of `step` as (prompt, response, log-probs, version) per sample, a prompt's
    n in a row. Rank 0 first orders what the bound allows (this step's if not yet ordered, then the
    next ones up to step + max_staleness), waits for this step's parts and scatters them.
    `prompts_of(j)`: step j's prompts, all data-parallel groups in order. A dead engine reaches every
    rank through the same broadcast: each stops with rank 0's line, none waits in a collective."""
    scatter = [None]
    if s.rank == 0:
        try:
            scatter = [_taken(s, step, prompts_of)]
        except rollout_engine.EngineDied as e:
            scatter = [str(e)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(scatter, src=0)    # token ids only: a few MB
    if isinstance(scatter[0], str):
        raise rollout_engine.EngineDied(scatter[0])
    shares, stats = scatter[0]
    metrics.update(stats)
    return shares[s.dp_rank]


def _taken(s: Stream, step: int, prompts_of) -> tuple:
    """Rank 0: (each data-parallel group's samples of `step`, the step's rollout figures)."""
    t0 = time.perf_counter()
    fill(s, step, prompts_of)
    parts = s.buffer.take(step, s.engines)
    waited = time.perf_counter() - t0
    fill(s, step, prompts_of)              # the room this step freed: the engines start the next batch now
    samples = [smp for p in parts for smp in zip(p["prompts"], p["responses"], p["logps"],
                                                 [p["version"]] * len(p["responses"]))]
    per = len(samples) // s.dp
    staleness = [step - p["version"] for p in parts]
    engine = {k: max(p["stats"][k] for p in parts) for k in parts[0]["stats"]}
    return [samples[r * per:(r + 1) * per] for r in range(s.dp)], {
        "rollout/staleness_max": max(staleness), "rollout/staleness_mean": sum(staleness) / len(staleness),
        "rollout/wait_s": waited, "rollout/buffer_samples": s.buffer.waiting,
        "rollout/buffer_ordered": s.buffer.ordered,
        "rollout/buffer_gb": s.buffer.nbytes / offload.GB, **{f"rollout/engine_{k}": v for k, v in engine.items()}}


def greedy(s: Stream, prompts: list, response_length: int) -> list:
    """Validation (validate.py): the engines' greedy answers to every held-out prompt, with the weights
    they hold (the trainer's newest: each push goes before the request), on every trainer rank. Rank 0
    sends each engine a contiguous part and waits for the answers; its orders of training batches go on
    around it. Collective over the trainer ranks."""
    out = [None]
    if s.rank == 0:
        try:
            per = -(-len(prompts) // s.engines)
            for i in range(s.engines):
                _send(s, i, ("validate", {"prompts": prompts[i * per:(i + 1) * per], "max_tokens": response_length}))
            out = [[r for i in range(s.engines) for r in _answers(s, i)]]
        except rollout_engine.EngineDied as e:
            out = [str(e)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)    # token ids only
    if isinstance(out[0], str):
        raise rollout_engine.EngineDied(out[0])
    return out[0]


def _answers(s: Stream, i: int) -> list:
    got = s.vals[i].get()
    if got is None:
        raise s.buffer.died(f"rollout engine {i} exited during a validation")
    return got


def fill(s: Stream, step: int, prompts_of):
    """Order steps from the first not ordered up to step + max_staleness, while the buffer has room."""
    while s.next_order <= step + s.cfg.max_staleness and s.buffer.reserve(s.step_samples):
        _order(s, s.next_order, prompts_of)
        s.next_order += 1


def batch(s: Stream, samples: list) -> dict:
    """The trainer's batch (rollout.make_batch's layout) with the engine's log-probs and each sample's version."""
    rows, responses, logps, versions = zip(*samples)
    b = rollout.samples_batch(list(rows), list(responses), list(logps), s.cfg.response_length, s.pad_id, s.eos_id,
                              s.device)
    b["policy_version"] = torch.tensor(versions, device=s.device)
    return b


@torch.no_grad()
def push(s: Stream, model, stashes: list, version: int, metrics: dict):
    """The new weights to the engines as `version`: every trainer rank gathers each tensor (FSDP2
    all-gathers in `weights.hf_weights` order), rank 0 packs them into a bucket and sends each full
    bucket. The actor's `stashes` are in for the gather (a no-op when the update left them there). An
    engine that died stops rank 0's sends, not the gathers (the other ranks are in them); then every
    rank stops with rank 0's line."""
    t0, cuda, died, wait = time.perf_counter(), s.device.type == "cuda", [None], 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    died[0] = _each(s, lambda i: _send(s, i, ("weights", version))) if s.rank == 0 else None
    with offload.loaded(stashes, metrics):
        it = weights.hf_weights(model, s.device, s.dtype)
        for b, entries in enumerate(s.layout):
            buf = s.bucket if s.bucket is not None else (
                torch.empty(entries[-1][2] + entries[-1][3], dtype=torch.uint8, device=s.device) if s.rank == 0
                else None)
            for name, shape, off, nbytes in entries:
                got, t = next(it)
                assert got == name, (got, name)
                if s.rank == 0:
                    buf[off:off + nbytes].copy_(t.reshape(-1).view(torch.uint8))
                del t
            if s.rank == 0 and died[0] is None:   # an engine takes a push between two generate calls: one
                t1 = time.perf_counter()            # mid-generate holds the trainer here (push_wait_s)
                died[0] = _each(s, lambda i: _send_bucket(s, b, buf[:entries[-1][2] + entries[-1][3]]), once=True)
                wait += time.perf_counter() - t1
        assert next(it, None) is None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(died, src=0)
    if died[0] is not None:
        raise rollout_engine.EngineDied(died[0])
    s.version = version
    metrics["rollout/push_s"] = time.perf_counter() - t0
    metrics["rollout/push_wait_s"] = wait       # of it, handing buckets over (rank 0; 0 on the others)
    metrics["rollout/push_gb"] = sum(e[3] for bk in s.layout for e in bk) / offload.GB
    if cuda:
        metrics["rollout/push_transient_gb"] = (torch.cuda.max_memory_allocated() - base) / offload.GB


def _each(s: Stream, send, once: bool = False) -> str | None:
    """Run `send(i)` for every engine (or once, for a bucket every engine takes together); the line of
    the first engine found dead, or None."""
    try:
        for i in range(1 if once else s.engines):
            send(i)
    except rollout_engine.EngineDied as e:
        return str(e)
    return None


def _send_bucket(s: Stream, b: int, buf: torch.Tensor):
    if s.bucket is not None:               # ipc: the engine reads the shared buffer, then says so
        torch.cuda.synchronize(s.device)
        _send(s, 0, ("bucket_ready", b))
        if s.acks[0].get() is None:
            raise s.buffer.died("rollout engine 0 exited during a weight push")
        return
    try:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = s.pg.broadcast([buf], opts)
        while not work.is_completed():     # a killed engine rank can leave the send waiting (gloo, a loaded
            if s.buffer.error:             # host: past the receiver's 60 s): its thread's line stops it
                raise s.buffer.died("")
            time.sleep(0.005)
        work.wait()
    except RuntimeError as e:
        raise s.buffer.died(f"weights to the rollout engines failed: {str(e).splitlines()[0]}") from e


def close(s: Stream):
    """Tell the engines to stop, and wait for those this rank started."""
    for conn in s.conns:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    for p in s.procs:
        p.join(30)


# --------------------------------------------------------------------------- predicted
# The trainer's side in the planner's terms (predict.py composes them): per rank, `z` a model.Sizes,
# `req` the engine's rollout.Request (its dtype is the push's).
RELIEF = {"push bucket": "a smaller rollout.sync_bucket_mb"}


def bucket_bytes(cfg: RolloutConfig, z, req) -> int:
    """The push's largest bucket (`weight_layout`): sync_bucket_mb, or the whole model when it is
    smaller, or the largest tensor when that is larger."""
    s, w = z.shapes, req.dtype_bytes
    return max(min(cfg.sync_bucket_mb * 2 ** 20, w * s.params), w * s.largest)


def predicted_states(cfg: RolloutConfig, z, req) -> dict:
    """rollout.gpus=0: the bucket CUDA IPC shares with the engine, on rank 0's GPU all run."""
    b = bucket_bytes(cfg, z, req)
    return {"push bucket": (b, b, 0)} if cfg.gpus == 0 else {}


def predicted_push(cfg: RolloutConfig, z, policy: dict, req, lora: bool) -> list:
    """The actor's params in (`policy`), one tensor gathered at a time in the engine's dtype and copied
    into the bucket (allocated for the push with engines on their own GPUs); LoRA merges each target
    in fp32 on the way."""
    s, w = z.shapes, req.dtype_bytes
    bucket = {"push bucket": bucket_bytes(cfg, z, req)} if cfg.gpus else {}
    merge = {"LoRA merge (fp32)": 4 * s.hidden * s.ffn} if lora else {}
    return [{**policy, **bucket, "gathered tensor": w * s.largest, **merge}]
