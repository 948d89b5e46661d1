"""The process around the roles: the process group from torchrun's environment (or a 1-process
group under plain `python`, no port), a fresh store for workers torchrun restarted, and a clean
exit. Every entry point uses it: train_grpo.py, the benches, the tests' torchrun workers.

    rank, world, device = launch.init_distributed(timeout_s=600)
    ...
    launch.leave(0)      # barrier, destroy the groups, exit without the interpreter's teardown
"""
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from model import one_process_group


def init_distributed(timeout_s: float | None = None, world_size: int | None = None):
    """torchrun sets RANK/WORLD_SIZE; plain `python` gets a 1-process group with no port at all.
    On GPUs the group has two backends: NCCL for CUDA tensors and gloo for CPU tensors, which
    CPUOffloadPolicy's shards, grads and grad-norm reduction are (an NCCL-only group fails there
    with "No backend type associated with device type cpu"). CPU runs: gloo alone.
    `timeout_s`: how long a collective (and the start-up rendezvous) may wait for the other ranks
    before it raises: a stalled rank then ends the run instead of hanging it (None: torch's default).
    `world_size`: fewer ranks than torchrun started (async rollout: the last ranks run engines and
    never join the trainer's group); the trainer's ranks are the first ones."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        wait = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        if "RANK" in os.environ:
            ranks = {"rank": int(os.environ["RANK"]), "world_size": world_size} if world_size else {}
            dist.init_process_group(backend, device_id=device if cuda else None, **wait,
                                    **{**ranks, **restart_store(timeout_s, world_size)})   # torchrun restarted us: a fresh store
        else:
            one_process_group(device, **wait)
    return dist.get_rank(), dist.get_world_size(), device


def restart_store(timeout_s: float | None, world_size: int | None = None) -> dict:
    """init_process_group's store for a worker that torchrun restarted (--max-restarts, after a rank
    died): the agent's store under a prefix of this attempt. Without it the new workers can read
    the previous attempt's addresses from the store and gloo's (or NCCL's) connect is refused, or
    waits (pytorch#167288). {} on a first attempt or outside torchrun: the usual env:// set-up."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world = world_size or int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s or 1800))
    return {"store": dist.PrefixStore(f"/restart_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": world}


def leave(code: int = 0):
    """End this worker process once everything it writes is written: on success every rank waits for
    the others and the process groups are destroyed; then the process exits with `code` without the
    interpreter's teardown. Why not a plain return: DTensor's sharding caches keep the DeviceMesh (and
    its gloo group's threads) alive after destroy_process_group; torn down at interpreter exit while a
    peer closes its sockets, they can abort a finished run (SIGABRT, once in a 2-rank CPU CI run).
    os._exit skips the teardown; the OS takes back memory, sockets and GPU contexts."""
    if code == 0 and dist.is_initialized():
        dist.barrier()                     # no rank tears gloo down while another still talks
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail(message: str, rank: int, code: int = 2):
    """A failed run's one line, printed once and last. Rank 0 says it at once; another rank first waits 5 s, since the
    same error on rank 0 ends the job sooner (torchrun then stops this rank before it repeats it), and speaks
    only if that did not happen (an error of its own). Under torchrun the speaking rank also writes the line to
    its error file, so that torchrun's closing summary shows it as the "Root Cause" rather than a traceback."""
    if rank > 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # torchrun's stop ends the wait (no checkpoint now)
        time.sleep(5)
        message = message.replace("error: ", f"error: [rank {rank}] ", 1)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:                               # the format torchrun's @record writes, with our line as the "traceback"
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)
