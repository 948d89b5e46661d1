"""Checkpoints and resume: what a run keeps in its out_dir so that it survives a kill, a
preemption or a dead rank, and so that a new run never destroys an earlier one.

    python train_grpo.py --steps=20 --save_freq=5        # out/checkpoints/step_000005, ... step_000020
    python train_grpo.py --steps=40                      # the same out_dir: resumes at step 20
    torchrun --nproc_per_node=2 train_grpo.py --steps=40 --resume=out/checkpoints/step_000020 --out_dir=out2
    python -m pytest test_checkpoint.py -q

out_dir holds:
    metrics.jsonl            one line per step; a resume drops the lines after its checkpoint's step
    run_config.json          this launch's resolved config
    checkpoints/step_000020/ meta.json (written last: its presence marks a complete checkpoint),
                             actor/ and critic/ (torch.distributed.checkpoint: params + AdamW state,
                             one file per rank, reshardable to another world size), rng/rank<r>.pt
    checkpoints/latest       the newest complete checkpoint's name, replaced after it is complete
    final/                   the Hugging Face policy (swapped in whole at the end)

A checkpoint is written into checkpoints/.tmp-step_N/ and renamed when every rank's files and
meta.json are in it, then `latest` moves: a kill at any moment leaves the last complete one in
use. Only the newest `keep_checkpoints` stay. What a save moves: each role brings its params and
Adam to the device through its own bracket (`actor.state_in`, `critic.state_in`: the update
stage's bytes without grads and activations), one role at a time, and drops them again after.

Reliability (issue 24): global rank 0 holds an flock on out_dir/.run.lock for the run's life (one
run per out_dir); meta.json records each file's size and crc32, checked at resume (a damaged
checkpoint is named, and --resume=auto falls back to the newest intact one; `latest` is only an
index); free space is checked at start and before each write, and a full disk is one line with
no partial files left; SIGINT does what SIGTERM does, a second one stops at once; a worker that
torchrun restarted joins through a store of its own attempt (`restart_store`).

The out_dir policy (checked before any model is built, `plan`): an out_dir with an unfinished
run resumes it (`--resume=auto`, the default); one with a finished run, or with files of a run
that left no checkpoint, is refused with a line that says what to pass instead. Nothing of an
earlier run is overwritten except by resuming it.
"""
import datetime
import errno
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import zlib
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import actor
import critic
import offload

# --------------------------------------------------------------------------- one run per out_dir
LOCK = ".run.lock"
_held: dict = {}                               # realpath of a locked out_dir -> its open lock file


def lock_out_dir(out: str, rank: int):
    """Make `out` this run's: an exclusive flock on out/.run.lock, held until the process ends (the
    kernel drops it when the process dies, kill -9 included, so a killed run never leaves a stale
    lock and torchrun's restarted workers take it again). Taken before anything else is written.
    One run is one lock holder: only the global rank 0 (RANK) locks; every other rank, on this node
    or another that shares the folder, does not, so the nodes of one run never lock each other out.
    On NFS, Linux implements flock with byte-range locks that every client sees; a filesystem
    without locks (e.g. Lustre mounted without -o flock) gets a warning and no lock.
    Raises ValueError naming the holder (pid, host, since when) when another run holds it."""
    if rank != 0 or os.path.realpath(out) in _held:
        return
    _check_writable(out)
    path = os.path.join(out, LOCK)
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            print(f"[lock] warning: {path} cannot be locked on this filesystem ({e.strerror}): nothing "
                  f"stops a second run from using --out_dir={out} at the same time", flush=True)
            f.close()
            return
        f.seek(0)
        holder = f.read().strip()
        f.close()
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on host {h['host']} since {h['since']}"
        except (ValueError, KeyError, TypeError):   # the holder is between its lock and its write
            who = "a process that is just starting"
        raise ValueError(f"--out_dir={out} is in use by another run ({who}; lock {path}): wait for it "
                         f"to end or stop it, or pass another --out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "since": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
    f.flush()
    _held[os.path.realpath(out)] = f            # kept open (never closed): the lock lives as long as the process


# --------------------------------------------------------------------------- the out_dir policy


def _say(line: str):
    """A warning from code that runs on every rank before the process group: said once, by rank 0."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(line, flush=True)


def _step_dirs(root: str) -> list[str]:
    """The step_N directories under checkpoints/, newest first (a `.damaged` one set aside is not one)."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()]
    return sorted(names, key=lambda n: int(n[5:]), reverse=True)


def newest(out: str, below: int | None = None) -> str | None:
    """The checkpoint a resume of out_dir starts from: the one checkpoints/latest names when it is
    complete and intact, else the newest complete and intact one (a `latest` that was deleted or
    names nothing usable is only an index: the step dirs are the truth). A damaged one (meta.json
    unreadable, a file missing or of another size than recorded) is passed over with a warning and
    left in place for inspection. `below`: only those before that step (a fallback). None: none."""
    root = os.path.join(out, "checkpoints")
    names = _step_dirs(root)
    pointer, named = os.path.join(root, "latest"), None
    if below is None and os.path.isfile(pointer):
        try:
            with open(pointer) as f:
                named = f.read().strip()
        except OSError:
            pass
    order = [n for n in names if below is None or int(n[5:]) < below]
    if named in order:
        order = [named] + [n for n in order if n != named]
    passed = set()
    for n in order:
        path = os.path.join(root, n)
        if not os.path.exists(os.path.join(path, "meta.json")):
            continue                               # a save that never finished (or a killed run's leftover)
        err = damage(path, checksums=False)
        if err:
            _say(f"[resume] warning: {err}; passing over {path} (left in place for inspection)")
            passed.add(n)
            continue
        if below is None and n != named and named not in passed:
            _say(f"[resume] warning: {pointer} " + ("names " + repr(named) if named else "is missing")
                 + f", not an intact checkpoint; resuming from the newest intact one, {path}")
        return path
    return None


def checkpoint_dir(path: str) -> str | None:
    """A complete checkpoint at `path` (a step_N dir, or an out_dir: its newest intact one), or None."""
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    return newest(path)


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json; a damaged one raises ValueError naming the file."""
    name = os.path.join(path, "meta.json")
    try:
        with open(name) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is damaged (not valid JSON: {e.msg}, line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{name} is damaged (not UTF-8 text)") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise ValueError(f"{name} is damaged (no step number in it)")
    return meta


# --------------------------------------------------------------------------- integrity
def _crc(path: str) -> int:
    """zlib.crc32 of a file, read in 16 MiB chunks (~GB/s: a checksum costs less than the write)."""
    c = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            c = zlib.crc32(chunk, c)
    return c


def _files(path: str) -> list[str]:
    """A checkpoint's files (relative paths, sorted: every rank lists the same), meta.json aside."""
    out = [os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs]
    return sorted(f for f in out if not f.startswith("meta.json"))


def _record(path: str, rank: int, world: int) -> dict:
    """{file: {size, crc32}} of every file of the checkpoint at `path`, each rank checksumming its
    share (ranks read in parallel), gathered on every rank."""
    share = {f: {"size": os.path.getsize(os.path.join(path, f)), "crc32": _crc(os.path.join(path, f))}
             for f in _files(path)[rank::world]}
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, share)
        share = {k: v for part in parts for k, v in part.items()}
    return share


def damage(path: str, checksums: bool = True, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the checkpoint at `path`, naming the file, or None when it is intact:
    meta.json readable, every file it records there with the recorded size and (`checksums`) crc32.
    Sizes are checked for every file (cheap: the pre-flight does it on every rank); checksums for
    this rank's share (`rank` of `world`). A checkpoint written before files were recorded has
    nothing to check beyond its meta.json."""
    try:
        files = read_meta(path).get("files")
    except (OSError, ValueError) as e:
        return str(e)
    for i, (name, rec) in enumerate(sorted((files or {}).items())):
        full = os.path.join(path, name)
        try:
            size = os.path.getsize(full)
        except OSError:
            return f"{full} is missing (meta.json records it)"
        if size != rec["size"]:
            return f"{full} is damaged ({size} bytes, meta.json records {rec['size']}: truncated?)"
        if checksums and i % world == rank and _crc(full) != rec["crc32"]:
            return f"{full} is damaged (its checksum differs from the one meta.json records)"
    return None


def verify(path: str, rank: int, world: int) -> str | None:
    """damage() with checksums, the files split over the ranks, the answer the same on every rank."""
    err = damage(path, True, rank, world)
    if world > 1:
        errs = [None] * world
        dist.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
    return err


def _check_writable(out: str):
    """out_dir exists (made here) and a file can be created in it, before anything else runs."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out_dir={out} is a file; pass a directory")
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--out_dir={out} is not a writable directory ({e.strerror}); pass another") from None


def plan(cfg, data_fingerprint: str) -> str | None:
    """Where this run starts, decided before the process group and the models: the checkpoint to
    resume from, or None for a fresh start. Raises (one line, what to pass instead) for an
    out_dir that would have to be overwritten."""
    out = cfg.out_dir
    _check_writable(out)
    final = os.path.join(out, "final")
    if os.path.exists(final) and not os.path.isdir(final):
        raise ValueError(f"{final} is a file; the policy is saved there at the end: move it")
    latest = newest(out)
    # what an earlier run leaves (a run that failed before its first step leaves none of these)
    earlier = [n for n in ("metrics.jsonl", "final", "checkpoints") if os.path.exists(os.path.join(out, n))
               and not (n == "metrics.jsonl" and os.path.getsize(os.path.join(out, n)) == 0)]
    if cfg.resume == "never" and earlier:
        raise ValueError(f"--out_dir={out} holds an earlier run ({', '.join(earlier)}) and --resume=never "
                         f"starts only in an empty one: pass another --out_dir, or remove {out}")
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        path = latest
        if path is None and earlier:
            raise ValueError(f"--out_dir={out} holds an earlier run ({', '.join(earlier)}) but no checkpoint "
                             f"to resume from: pass another --out_dir, or remove {out}")
        if path is None:
            return None
    else:
        path = checkpoint_dir(cfg.resume)
        if path is None:
            raise ValueError(f"--resume={cfg.resume}: no complete checkpoint there (a step_N directory "
                             f"with meta.json, or an out_dir with checkpoints/latest)")
        err = damage(path, checksums=False)
        if err:
            raise ValueError(f"--resume={cfg.resume}: {err}; pass an intact checkpoint (another "
                             f"checkpoints/step_N), or an out_dir (its newest intact one is used)")
        # a checkpoint of this out_dir's own run resumes in place (from an older step too)
        own = os.path.realpath(os.path.dirname(path)) == os.path.realpath(os.path.join(out, "checkpoints"))
        if earlier and not own and (latest is None or os.path.realpath(path) != os.path.realpath(latest)):
            raise ValueError(f"--out_dir={out} holds another run ({', '.join(earlier)}); resume "
                             f"{cfg.resume} into an empty --out_dir")
    meta = read_meta(path)
    if meta["step"] >= cfg.steps and cfg.resume != "auto":
        raise ValueError(f"--resume={cfg.resume} is at step {meta['step']}, not before --steps={cfg.steps}: "
                         f"nothing to train; pass --steps=N with N > {meta['step']}")
    # a run whose final save failed (a full disk): the same command writes final/ from its last checkpoint
    export = (meta["step"] == cfg.steps and cfg.save and meta["config"].get("save") is True
              and not os.path.exists(final) and path == latest)
    if meta["step"] >= cfg.steps and not export:
        saved = f", the policy in {final}" if os.path.isdir(final) else ""
        raise ValueError(f"{out} holds a finished run ({meta['step']} steps done{saved}); to train it "
                         f"further pass --steps=N with N > {meta['step']} (it resumes there); to start "
                         f"a new run pass another --out_dir, or remove {out}")
    roles = ["actor"] + (["critic"] if cfg.algorithm.adv_estimator == "gae" else [])
    if meta.get("roles", roles) != roles:
        raise ValueError(f"{path} holds {' + '.join(meta['roles'])} but this run trains {' + '.join(roles)} "
                         f"(algorithm.adv_estimator changed?); resume with the checkpoint's settings")
    if meta["data"] != data_fingerprint or meta["config"]["seed"] != cfg.seed:
        raise ValueError(f"{path} walked other data (--data, the tokenizer, max_prompt_length or --seed "
                         f"changed): its position would mean nothing; resume with the same ones, or "
                         f"start a new run in another --out_dir")
    if export:
        _say(f"[resume] {path} is at --steps={cfg.steps} but {final} was never written (a final save that "
             f"failed): writing it from the checkpoint")
    return path


# --------------------------------------------------------------------------- save and load
def _roles(t) -> list:
    """(name, model, optimizer, its checkpoint bracket, its state) of each trained role; the frozen
    reference is not saved (it is rebuilt from --model)."""
    roles = [("actor", t.actor.model, t.actor.optimizer, actor.state_in, t.actor)]
    if t.critic is not None:
        roles.append(("critic", t.critic.model, t.critic.optimizer, critic.state_in, t.critic))
    return roles


def rng_state() -> dict:
    """This rank's RNG states. The rollout reseeds from (seed, step, rank) every step, so samples do
    not depend on them; they are kept for everything else that draws (a user's reward)."""
    np_state = np.random.get_state()
    # CUDA: this rank's device only (get_rng_state_all would make a context on every visible GPU)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])}


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), *rest))


def _write_json(path: str, obj):
    """Written to a temporary name, flushed to disk, then renamed: whole or not there."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# --------------------------------------------------------------------------- disk space
GB = 2**30


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of `path` (for this user); tests replace it to stand in for a full disk."""
    return shutil.disk_usage(path).free


def write_sizes(t) -> tuple[int, int]:
    """(one checkpoint, the final save) in bytes, from the shapes: each trained role's params in
    fp32 plus AdamW's two fp32 moments of what trains; the final save: the policy's params in
    their own dtype (LoRA: the adapter, and the merged model with save_merged)."""
    ckpt = 0
    for _, model, *_ in _roles(t):
        for p in model.parameters():
            ckpt += p.numel() * 4 + (8 * p.numel() if p.requires_grad else 0)
    ckpt = int(ckpt * 1.02) + 2**20            # DCP's .metadata, the RNG states, meta.json
    params = list(t.actor.model.parameters())
    if t.actor.lora is None:
        final = sum(p.numel() * p.element_size() for p in params)
    else:
        final = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        if t.cfg.actor.save_merged:
            final += sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    return ckpt, final


def disk_report(t) -> str:
    """The set-up report's line on disk space: what the run will write into out_dir at most (the
    newest keep_checkpoints, one more while a new one is written, and final/) against what is
    free. Raises OSError (one line, what to change) when it cannot fit."""
    cfg = t.cfg
    ckpt, final = write_sizes(t)
    saves = len({s for s in range(1, cfg.steps + 1) if s % cfg.save_freq == 0} | {cfg.steps}) if cfg.save_freq else 0
    n = min(cfg.keep_checkpoints + 1, saves)
    root = os.path.join(cfg.out_dir, "checkpoints")
    kept = sum(os.path.getsize(os.path.join(d, f)) for n_ in _step_dirs(root)
               for d, _, fs in os.walk(os.path.join(root, n_)) for f in fs)   # replaced as new ones come
    need = max(n * ckpt + (final if cfg.save else 0) - kept, 0)
    free = free_bytes(cfg.out_dir)
    what = (f"{n} checkpoint(s) of ~{ckpt / GB:.3f} GB" if n else "no checkpoints") + \
        (f" + final/ ~{final / GB:.3f} GB" if cfg.save else "")
    if need > free:
        raise OSError(f"{cfg.out_dir} has {free / GB:.3f} GB free but this run writes ~{need / GB:.3f} GB there "
                      f"({what}): free space, pass an --out_dir on a larger disk, or lower --keep_checkpoints "
                      f"(or --save_freq=0, --save=false)")
    return f"[disk] writes up to ~{need / GB:.3f} GB to {cfg.out_dir} ({what}); {free / GB:.3f} GB free"


def _agree(ok: bool, device) -> bool:
    """True on every rank when it is true on every rank (one all-reduce)."""
    flag = torch.tensor([float(ok)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _no_space(e: BaseException) -> bool:
    """ENOSPC (or EDQUOT), as an OSError or inside a message (DCP's CheckpointException, safetensors'
    I/O error, torch's zip writer 'unexpected pos' when the disk filled under it)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return any(w in text for w in ("No space left", "Disk quota exceeded", "unexpected pos", "os error 28"))


def _space_error(what: str, path: str, need: int, kept: str) -> OSError:
    where = os.path.dirname(path.rstrip("/")) or "."
    while not os.path.isdir(where):               # the partial files are gone by now
        where = os.path.dirname(where) or "."
    free = free_bytes(where)
    return OSError(f"{what} {path} failed: no space left on device (it needs ~{need / GB:.3f} GB, "
                   f"{free / GB:.3f} GB free); {kept}: free space (or lower --keep_checkpoints), "
                   f"then run the same command")


def save(t, step: int):
    """A checkpoint after `step` steps (module docstring), on every rank; `t` is train_grpo's Trainer."""
    root = os.path.join(t.cfg.out_dir, "checkpoints")
    name = f"step_{step:06d}"
    tmp = os.path.join(root, f".tmp-{name}")   # never read by a resume until renamed
    t0 = time.perf_counter()
    need, last = write_sizes(t)[0], newest(t.cfg.out_dir) or "no earlier checkpoint"
    if not _agree(free_bytes(t.cfg.out_dir) >= need, t.device):   # checked before each write, on every rank
        raise _space_error("writing the checkpoint", tmp, need, f"nothing was written and {last} is kept")
    kept = f"the partial {tmp} was removed and {last} is kept"
    try:
        _write(t, step, root, name, tmp, t0)
    except BaseException as e:                    # a full disk on any rank: one line, no partial files
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not (isinstance(e, OSError) or _no_space(e)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)    # any rank may: the folder is shared
        if _no_space(e):
            raise _space_error("writing the checkpoint", getattr(e, "filename", None) or tmp, need, kept) from None
        raise


def _write(t, step: int, root: str, name: str, tmp: str, t0: float):
    """save()'s body: every rank's files into `tmp`, then meta.json, the rename and `latest`."""
    if t.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)    # a save cut short by a kill
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    for role, model, optimizer, state_in, obj in _roles(t):   # one role resident at a time
        with state_in(obj):
            model_sd, optim_sd = get_state_dict(model, optimizer)
            try:
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, role))
            except CheckpointException as e:   # a BaseException: what failed on which rank, with tracebacks
                if _no_space(e):
                    raise OSError(errno.ENOSPC, _cause(e), os.path.join(tmp, role)) from None
                raise OSError(f"writing the checkpoint {tmp}/{role} failed: {_cause(e)}") from None
            del model_sd, optim_sd                # views of the live tensors: gone before the bracket ends
    offload.empty_host_cache()                    # DCP staged each tensor in cached pinned host memory
    rng = os.path.join(tmp, "rng", f"rank{t.rank}.pt")
    try:
        torch.save(rng_state(), rng)
    except RuntimeError as e:                     # the zip writer's report of a full disk names no file
        if _no_space(e):
            raise OSError(errno.ENOSPC, str(e), rng) from None
        raise
    dist.barrier()                                # every rank's files are on disk
    files = _record(tmp, t.rank, t.world)         # sizes and checksums: a resume verifies them
    if t.rank == 0:
        _write_json(os.path.join(tmp, "meta.json"), {"files": files,
            "step": step, "prompts_seen": t.data_offset + step * t.cfg.train_batch_size,
            "data": t.fingerprint, "world_size": t.world, "roles": [r[0] for r in _roles(t)],
            "config": asdict(t.cfg), "time": datetime.datetime.now().isoformat(timespec="seconds")})
        target = os.path.join(root, name)
        _discard(target)                          # left by a run killed before `latest` reached it
        os.replace(tmp, target)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))   # moves last
        _prune(root, step, t.cfg.keep_checkpoints)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(target) for f in fs)
        print(f"[checkpoint] step {step} -> {target} ({size / 2**20:.1f} MiB, "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    dist.barrier()                                # no rank goes on, or exits, before it is complete


def _cause(e: CheckpointException) -> str:
    """The last line of DCP's report (the exception raised on the first failing rank)."""
    return str(e).strip().splitlines()[-1][:300]


def _prune(root: str, step: int, keep: int):
    """Keep the newest `keep` checkpoints up to `step`; later ones are a killed run's leftovers."""
    steps = sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())
    for s in [s for s in steps if s > step]:
        _discard(os.path.join(root, f"step_{s:06d}"))
    for s in [s for s in steps if s <= step][:-keep]:
        shutil.rmtree(os.path.join(root, f"step_{s:06d}"), ignore_errors=True)


def _discard(path: str):
    """Remove a checkpoint dir this run replaces (a later step: a killed run's leftover, or a resume
    from an older one); a damaged one that a resume passed over is set aside as <dir>.damaged
    instead, for inspection (resume and pruning ignore that name)."""
    if os.path.exists(os.path.join(path, "meta.json")) and damage(path):
        aside = f"{path}.damaged"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        print(f"[checkpoint] set the damaged {path} aside as {aside} (remove it when inspected)", flush=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def load(t, path: str) -> int:
    """Load a checkpoint into a freshly built trainer (any world size: DCP reshards); returns
    the step to start at. Prints how this run's config differs from the checkpoint's."""
    path = _intact(t, path)
    meta = read_meta(path)
    for role, model, optimizer, state_in, obj in _roles(t):
        with state_in(obj, loading=True):
            # on a fresh optimizer this makes AdamW's state (a step with zero grads and lr 0: the
            # weights do not move), which DCP then overwrites in place
            model_sd, optim_sd = get_state_dict(model, optimizer)
            try:
                dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, role))
            except CheckpointException as e:   # verified intact (or written before checksums): the model differs
                raise ValueError(f"{path}/{role} does not fit this model (--model changed?): {_cause(e)}") from None
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            del model_sd, optim_sd
    offload.empty_host_cache()
    rng = os.path.join(path, "rng", f"rank{t.rank}.pt")
    if os.path.isfile(rng):                       # a rank the saving run did not have keeps its seed
        set_rng_state(torch.load(rng, weights_only=True))
    step = meta["step"]
    t.data_offset = meta["prompts_seen"] - step * t.cfg.train_batch_size   # 0 unless the batch size changed
    if t.rank == 0:
        old, new = _flat(meta["config"]), _flat(asdict(t.cfg))
        changed = [f"{k} {old.get(k)} -> {new[k]}" for k in sorted(new) if old.get(k) != new[k]
                   and k not in ("resume", "steps")]
        print(f"[resume] {path}: step {step}, saved by {meta['world_size']} rank(s), now {t.world}"
              + (f"; config changed: {', '.join(changed)}" if changed else ""), flush=True)
    return step


def _intact(t, path: str) -> str:
    """`path` once its checksums check out (verified by all ranks, each its share); a damaged one
    stops an explicit --resume with the file named, and with --resume=auto the next older intact
    checkpoint of out_dir is tried instead, with a warning (the damaged one is left in place)."""
    while True:
        err = verify(path, t.rank, t.world)
        if err is None:
            return path
        step = read_meta(path)["step"]
        older = newest(t.cfg.out_dir, below=step) if t.cfg.resume == "auto" else None
        if older is None:
            raise ValueError(f"{err}; " + ("no older intact checkpoint in " + os.path.join(t.cfg.out_dir, "checkpoints")
                                           + ": start anew in another --out_dir" if t.cfg.resume == "auto"
                                           else "pass an intact checkpoint, or --resume=auto"))
        if t.rank == 0:
            print(f"[resume] warning: {err}; falling back to {older} (the damaged one is left in place "
                  f"for inspection)", flush=True)
        path = older


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def keep_metrics(out_dir: str, step: int, rank: int) -> str:
    """metrics.jsonl with each step once: a resume at `step` keeps the lines before it (a line cut
    by a kill is dropped); a fresh run leaves it to its first step to create. Returns its path."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if rank == 0 and step:
        kept = []
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] < step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (json.JSONDecodeError, KeyError):
                        pass
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return path


def save_final(t):
    """The Hugging Face policy to out_dir/final, written aside and swapped in whole (a resumed,
    longer run replaces the earlier final/), with this run's config beside it."""
    final = os.path.join(t.cfg.out_dir, "final")
    tmp, old = final + ".tmp", final + ".old"
    need, last = write_sizes(t)[1], newest(t.cfg.out_dir)
    kept = (f"{final} is untouched and " if os.path.isdir(final) else "") + \
        (f"the checkpoint {last} is kept (the same command writes final/ from it)" if last
         else "no checkpoint was written (--save_freq=0): the weights are lost")
    if not _agree(free_bytes(t.cfg.out_dir) >= need, t.device):
        raise _space_error("writing the final policy", tmp, need, kept)
    if t.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        what = actor.save(t.actor, t.tokenizer, tmp, t.rank, t.cfg.model)   # gathers: every rank
        if t.rank == 0:
            _write_json(os.path.join(tmp, "run_config.json"), asdict(t.cfg))
    except Exception as e:                    # never a half-written final/: it is swapped in only when whole
        if t.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _no_space(e):
            raise _space_error("writing the final policy", tmp, need,
                               f"the partial {tmp} was removed, {kept}") from None
        raise
    if t.rank == 0:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        print(f"[save] {final} ({what})", flush=True)
    dist.barrier()


# --------------------------------------------------------------------------- torchrun's restarts
def restart_store(timeout_s: float | None) -> dict:
    """init_process_group's store for a worker that torchrun restarted (--max-restarts, after a rank
    died): the agent's store under a prefix of this attempt. Without it the new workers can read
    the previous attempt's addresses from the store and gloo's (or NCCL's) connect is refused, or
    waits (pytorch#167288). {} on a first attempt or outside torchrun: the usual env:// set-up."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not attempt or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s or 1800))
    return {"store": dist.PrefixStore(f"/restart_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": world}


# --------------------------------------------------------------------------- preemption, Ctrl-C
_signals: list = []
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT (Ctrl-C)"}


def _rank0() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def _on_stop(signum, frame):
    """Noted, and acted on at the end of the step; a second SIGINT ends the process at once (no
    checkpoint, no traceback: os._exit skips the unwinding that would print one per rank)."""
    if signum == signal.SIGINT and signal.SIGINT in _signals:
        if _rank0():
            print("[interrupt] second Ctrl-C: stopped at once, without a checkpoint; the same command resumes "
                  "from the last one", file=sys.stderr, flush=True)
        os._exit(130)
    if signum == signal.SIGINT and signal.SIGINT not in _signals and _rank0():
        print("[interrupt] Ctrl-C: finishing this step, then a checkpoint (Ctrl-C again stops at once)", flush=True)
    _signals.append(signum)


def exit_on_sigint():
    """Before the first step (options, models, engine): Ctrl-C ends the run at once with one line
    instead of a KeyboardInterrupt traceback from every rank; nothing is lost yet."""
    def stop(signum, frame):
        if _rank0():
            print("[interrupt] Ctrl-C during set-up: stopped (nothing to save yet)", file=sys.stderr, flush=True)
        os._exit(130)
    signal.signal(signal.SIGINT, stop)


def stop_on_sigterm():
    """SIGTERM (a preemption; torchrun forwards it to every rank and waits 30 s before SIGKILL) and
    SIGINT (Ctrl-C; torchrun forwards that too, so each worker handles it): the current step
    finishes, a checkpoint is written, the run exits; a second SIGINT stops at once."""
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)


def stop_line(cfg) -> tuple[str, int]:
    """The stopped run's one line (how to resume) and its exit code: 130 for Ctrl-C, 143 for SIGTERM
    (the signal this rank got; a rank that got none was stopped by another's: SIGTERM)."""
    sig = _signals[0] if _signals else signal.SIGTERM
    line = f"[preempt] {NAMES.get(sig, 'SIGTERM')}: stopped " + (
        f"after a checkpoint in {cfg.out_dir}/checkpoints; the same command resumes there" if cfg.save_freq
        else "without a checkpoint (--save_freq=0)")
    return line, 130 if sig == signal.SIGINT else 143


def stop_requested(device) -> bool:
    """Did any rank get SIGTERM or SIGINT? One all-reduce per step, so every rank stops after the same step."""
    flag = torch.tensor([float(bool(_signals))], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
