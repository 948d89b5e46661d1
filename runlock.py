"""One run per out_dir: global rank 0's flock on out_dir/.run.lock for the run's life, a second run
stopped at once naming the holder, and a run the pre-flight refuses leaving the folder as it found it.

    python -m pytest -q tests/test_reliability.py -k "out_dir or lock"
"""
import contextlib
import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import tempfile

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
