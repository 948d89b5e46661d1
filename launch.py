"""The process around the roles: the process group from torchrun's environment (or a 1-process
group under plain `python`, no port), a fresh store for workers torchrun restarted, one run per out_dir
(global rank 0's flock on out_dir/.run.lock for the run's life: a second run stopped at once naming the
holder, a run the pre-flight refuses leaving the folder as it found it), and a clean exit. Every
entry point uses it: train_grpo.py, the benches, the tests' torchrun workers.

    rank, world, device = launch.init_distributed(timeout_s=600)
    ...
    launch.leave(0)      # barrier, destroy the groups, exit without the interpreter's teardown
"""
import contextlib
import datetime
import errno
import fcntl
import json
import os
import shlex
import signal
import socket
import sys
import tempfile
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
            store = restart_store(timeout_s, world_size)   # torchrun restarted us: a fresh store
            dist.init_process_group(backend, device_id=device if cuda else None, **wait, **{**ranks, **store})
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


# --------------------------------------------------------------------------- one run per out_dir
LOCK = ".run.lock"
_held: dict = {}                               # realpath of a locked out_dir -> its open lock file
_made: dict = {}                               # realpath of a locked out_dir -> what this process made there


def check_writable(out: str):
    """out_dir exists (made here) and a file can be created in it, before anything else runs."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out_dir={shlex.quote(out)} is a file; pass a directory")
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out_dir={shlex.quote(out)} is not a writable directory ({e.strerror}); "
                         f"pass another") from None


def lock_out_dir(out: str, rank: int):
    """Make `out` this run's: an exclusive flock on out/.run.lock, held until the process ends (the
    kernel drops it when the process dies, kill -9 included, so a killed run never leaves a stale
    lock and torchrun's restarted workers take it again). Taken before anything else is written.
    One run is one lock holder: only the global rank 0 (RANK) locks; every other rank, on this node
    or another that shares the folder, does not, so the nodes of one run never lock each other out.
    On NFS, Linux implements flock with byte-range locks that every client sees; a filesystem
    without locks (e.g. Lustre mounted without -o flock) gets a warning and no lock.
    Raises ValueError naming the holder (pid, host, since when) when another run holds it. Returns
    whether this call took the lock (not: another rank, an earlier call of this process, no locks)."""
    if rank != 0 or os.path.realpath(out) in _held:
        return False
    folder = [] if os.path.exists(out) else [out]   # what this run makes, a refused run takes away (`release_refused`)
    check_writable(out)
    path = os.path.join(out, LOCK)
    while True:
        new = not os.path.exists(path)
        f = open(path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                print(f"[lock] warning: {path} cannot be locked on this filesystem ({e.strerror}): nothing "
                      f"stops a second run from using --out_dir={shlex.quote(out)} at the same time", flush=True)
                f.close()
                return False
            raise ValueError(f"--out_dir={shlex.quote(out)} is in use by another run ({_holder(f)}; lock {path}): "
                             f"wait for it to end or stop it, or pass another --out_dir") from None
        if _same_file(f, path):
            break
        f.close()                          # a refused run removed the file we opened (`release_refused`): again
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "since": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
    f.flush()
    _held[os.path.realpath(out)] = f            # kept open (never closed): the lock lives as long as the process
    _made[os.path.realpath(out)] = ([path] if new else []) + folder
    return True


def _holder(f) -> str:
    """Who holds the lock file `f` (open, not locked by us), from what it wrote; closes f."""
    f.seek(0)
    holder = f.read().strip()
    f.close()
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on host {h['host']} since {h['since']}"
    except (ValueError, KeyError, TypeError):   # the holder is between its lock and its write
        return "a process that is just starting"


def _same_file(f, path: str) -> bool:
    """The open lock file is still the one at `path` (a lock on a removed file would lock nothing)."""
    try:
        return os.path.samestat(os.fstat(f.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def claimed(out: str, rank: int):
    """`lock_out_dir` for the pre-flight's length: the lock stays for the run, unless the block raises
    (the out_dir refused, bad input, Ctrl-C), which leaves the folder as it was found. A lock this
    process took before (an earlier run in it) is not this block's to release."""
    took = lock_out_dir(out, rank)
    try:
        yield
    except BaseException:
        if took:
            release_refused(out)
        raise


def release_refused(out: str):
    """A refused run leaves `out` as it was found: the lock file goes if this run made it (removed
    while still locked, so no other run can take the file in between: one that opened it finds it
    gone, `_same_file`), and so does the folder if this run made it and it is empty; a lock file
    that was there before (an earlier run's) stays."""
    real = os.path.realpath(out)
    f = _held.pop(real, None)
    if f is None:                          # not rank 0, or no lock on this filesystem
        return
    for path in _made.pop(real, []):       # the lock file, then the folder
        with contextlib.suppress(OSError):   # a folder something else wrote into stays
            os.rmdir(path) if path == out else os.remove(path)
    f.close()
