"""Checkpoints and resume: what a run keeps so that it survives a kill, a preemption or a dead
rank (the out_dir around them, the lock, the disk and the stop signals: rundir.py).

    python train_grpo.py --steps=20 --save_freq=5 --out_dir=out_ckpt   # out_ckpt/checkpoints/step_000005, ... 20
    python train_grpo.py --steps=40 --out_dir=out_ckpt                 # the same out_dir: resumes at step 20
    torchrun --nproc_per_node=2 train_grpo.py --steps=40 --resume=out_ckpt/checkpoints/step_000020 --out_dir=out2
    python -m pytest tests/test_checkpoint.py -q

A checkpoint, checkpoints/step_000020/: meta.json (written last: its presence marks a complete
checkpoint; it records every file's size and crc32, and whether AdamW's state is in it), actor/ and critic/
(torch.distributed.checkpoint: params + AdamW state, one file per rank, reshardable to another world size;
--save_optimizer=false: params alone, and a resume starts AdamW afresh), rng/rank<r>.pt.
checkpoints/latest names the newest complete one (an index: the step dirs are the truth); final/
is the Hugging Face policy, swapped in whole at the end.

A checkpoint is written into checkpoints/.tmp-step_N/ and renamed when every rank's files and
meta.json are in it, then `latest` moves: a kill at any moment leaves the last complete one in
use. Only the newest `keep_checkpoints` stay. What a save moves: each role brings its params and
Adam (when saved) to the device through its own bracket (`actor.state_in`, `critic.state_in`: the update
stage's bytes without grads and activations), one role at a time, and drops them again after.
The loop hands in the trained roles and the run's figures; `load` returns the checkpoint's meta
(the step, the data position): nothing here reads or writes the loop's own state.
A resume verifies the recorded sizes and checksums: a damaged checkpoint is named, and with
--resume=auto the newest intact one is used instead (the damaged one is left for inspection).
Free space is checked before each write; a full disk is one line that says what the same command
then does (`after_failure`), and no partial files are left.
"""
import datetime
import errno
import json
import os
import random
import shlex
import shutil
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

import adam
import offload
import weights

GB = 2**30
FIX = "free space (or lower --keep_checkpoints)"   # what a full disk at a checkpoint asks for
RESERVE = ".final.reserve"                # final/'s room, set aside while a --save_freq=0 run trains


# --------------------------------------------------------------------------- finding checkpoints
_said: set = set()                        # say_once's lines already printed by this process


def say_once(line: str):
    """A warning from code that runs on every rank before the process group: said once, by rank 0,
    and once per process (a later look for the newest checkpoint, at a save, passes the same
    damaged one again)."""
    if int(os.environ.get("RANK", 0)) == 0 and line not in _said:
        _said.add(line)
        print(line, flush=True)


def step_dirs(root: str) -> list[str]:
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
    names = step_dirs(root)
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
            say_once(f"[resume] warning: {err}; passing over {path} (left in place for inspection)")
            passed.add(n)
            continue
        if below is None and n != named and named not in passed:
            say_once(f"[resume] warning: {pointer} " + ("names " + repr(named) if named else "is missing")
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


# --------------------------------------------------------------------------- save and load
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


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of `path` (for this user); tests replace it to stand in for a full disk."""
    return shutil.disk_usage(path).free


def _agree(ok: bool) -> bool:
    """True on every rank when it is true on every rank (one all-reduce, on the host: gloo)."""
    flag = torch.tensor([float(ok)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def no_space(e: BaseException) -> bool:
    """ENOSPC (or EDQUOT), as an OSError or inside a message (DCP's CheckpointException, safetensors'
    I/O error, torch's zip writer 'unexpected pos' when the disk filled under it)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return any(w in text for w in ("No space left", "Disk quota exceeded", "unexpected pos", "os error 28"))


def size(n: int) -> str:
    """Bytes as the error lines say them: GB from 1 MiB up, bytes below."""
    return f"{n / GB:.3f} GB" if n >= 2**20 else f"{n} bytes"


def space_error(what: str, path: str, need: int, kept: str) -> OSError:
    """A full disk's one line: what failed at `path`, the bytes it needs and those free, then `kept`
    (what survived and what to do next: `after_failure`)."""
    where = os.path.dirname(path.rstrip("/")) or "."
    while not os.path.isdir(where):               # the partial files are gone by now
        where = os.path.dirname(where) or "."
    return OSError(f"{what} {path} failed: no space left on device (it needs ~{size(need)}, "
                   f"{size(free_bytes(where))} free); {kept}")


def earlier_run(out: str) -> list[str]:
    """What an earlier run left in `out` that a fresh start would write over (metrics.jsonl with a
    line in it, final/, checkpoints/): a run that failed before its first step leaves none."""
    return [n for n in ("metrics.jsonl", "final", "checkpoints") if os.path.exists(os.path.join(out, n))
            and not (n == "metrics.jsonl" and os.path.getsize(os.path.join(out, n)) == 0)]


def after_failure(out_dir: str, fix: str = "free space", steps: int | None = None) -> str:
    """The end of a failed write's line: what survived and what the same command then does (the
    out_dir policy's answer, rundir.plan), so that the advice is true. `fix`: what to do first;
    `steps`: --steps, from the final save (a checkpoint there is exported without training)."""
    last = newest(out_dir)
    if last is not None and steps is not None and read_meta(last)["step"] >= steps:
        return f"{last} is kept: {fix}, then run the same command (it writes final/ from it, without training)"
    if last is not None:
        return f"{last} is kept: {fix}, then run the same command (it resumes there)"
    if not earlier_run(out_dir):
        return f"nothing was trained yet: {fix}, then run the same command"
    return (f"no checkpoint is kept, so the trained steps are lost and the same command would be refused: "
            f"{fix}, then start again in another --out_dir (or remove {shlex.quote(out_dir)})")


def save(out_dir: str, step: int, roles: list, keep: int, meta: dict, optimizer: bool = True):
    """A checkpoint after `step` steps (module docstring), on every rank. `roles`: (name, state, its
    checkpoint bracket) of each trained role, one resident at a time; `meta`: the run's figures for
    meta.json (prompts_seen, data, world_size, config), step, roles, optimizer, files and time added here.
    `optimizer` (--save_optimizer): AdamW's state too; off, the brackets leave it where it is.
    Free space is checked first on every rank; a full disk (before or during) is one OSError line
    naming the path, the bytes needed and free, with the partial files removed."""
    root = os.path.join(out_dir, "checkpoints")
    name = f"step_{step:06d}"
    tmp = os.path.join(root, f".tmp-{name}")   # never read by a resume until renamed
    t0 = time.perf_counter()
    need = write_bytes(roles, optimizer)
    if not _agree(free_bytes(out_dir) >= need):   # checked before each write, on every rank
        raise space_error("writing the checkpoint", tmp, need, "nothing was written; " + after_failure(out_dir, FIX))
    try:
        _write(tmp, roles, {"step": step, **meta, "roles": [r[0] for r in roles], "optimizer": optimizer})
        if dist.get_rank() == 0:
            _publish(root, name, tmp, step, keep, t0)
        dist.barrier()                            # no rank goes on, or exits, before it is complete
    except BaseException as e:                    # a full disk on any rank: one line, no partial files
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not (isinstance(e, OSError) or no_space(e)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)    # any rank may: the folder is shared
        if no_space(e):
            raise space_error("writing the checkpoint", getattr(e, "filename", None) or tmp, need,
                              f"the partial {tmp} was removed; " + after_failure(out_dir, FIX)) from None
        raise


def write_bytes(roles: list, optimizer: bool = True) -> int:
    """One checkpoint's bytes, from the shapes: each role's params in fp32 and (`optimizer`) AdamW's two
    fp32 moments of what trains, plus DCP's .metadata, the RNG states and meta.json."""
    n = sum(p.numel() * 4 + (8 * p.numel() if p.requires_grad and optimizer else 0)
            for _, state, _ in roles for p in state.model.parameters())
    return int(n * 1.02) + 2**20


def _write(tmp: str, roles: list, meta: dict):
    """Every rank's files into `tmp`, then (rank 0) meta.json with their sizes and checksums."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)    # a save cut short by a kill
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    for role, state, state_in in roles:           # one role resident at a time
        with state_in(state, optimizer=meta["optimizer"]):
            sd = _state_dicts(state, meta["optimizer"])
            try:
                dcp.save(sd, checkpoint_id=os.path.join(tmp, role), planner=adam.HostSave(adam.on_host(state.adam)))
            except CheckpointException as e:   # a BaseException: what failed on which rank, with tracebacks
                if no_space(e):
                    raise OSError(errno.ENOSPC, _cause(e), os.path.join(tmp, role)) from None
                raise OSError(f"writing the checkpoint {tmp}/{role} failed: {_cause(e)}") from None
            del sd                                # views of the live tensors: gone before the bracket ends
    offload.empty_host_cache()                    # DCP staged each tensor in cached pinned host memory
    rng = os.path.join(tmp, "rng", f"rank{rank}.pt")
    try:
        torch.save(rng_state(), rng)
    except RuntimeError as e:                     # the zip writer's report of a full disk names no file
        if no_space(e):
            raise OSError(errno.ENOSPC, str(e), rng) from None
        raise
    dist.barrier()                                # every rank's files are on disk
    files = _record(tmp, rank, world)             # sizes and checksums: a resume verifies them
    if rank == 0:
        _write_json(os.path.join(tmp, "meta.json"), {
            "files": files, **meta, "time": datetime.datetime.now().isoformat(timespec="seconds")})


def _state_dicts(state, optimizer: bool) -> dict:
    """What DCP reads or writes of a trained role: its params' state dict and (`optimizer`) AdamW's. On a fresh
    optimizer torch's helper makes AdamW's state first (a step with zero grads and lr 0: the weights do not
    move), which a load then overwrites in place; without it the optimizer is left untouched."""
    if not optimizer:
        return {"model": get_model_state_dict(state.model)}
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _publish(root: str, name: str, tmp: str, step: int, keep: int, t0: float):
    """The written checkpoint renamed into place, then `latest` moved to it, older ones pruned."""
    target = os.path.join(root, name)
    _discard(target)                              # left by a run killed before `latest` reached it
    os.replace(tmp, target)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))   # moves last
    _prune(root, step, keep)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(target) for f in fs)
    print(f"[checkpoint] step {step} -> {target} ({size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)


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


def load(path: str, roles: list, config: dict, world: int) -> dict:
    """Load a checkpoint into freshly built roles (any world size: DCP reshards; `roles` as for
    `save`) once its checksums check out (`intact`); returns its meta.json (step, prompts_seen, ...).
    Prints how this run's `config` (asdict of the run's Config) differs from the checkpoint's."""
    rank = dist.get_rank()
    path = intact(path, config["out_dir"], config["resume"])
    meta = read_meta(path)
    optimizer = meta.get("optimizer", True)      # --save_optimizer=false: AdamW starts afresh (at the first step)
    for role, state, state_in in roles:
        with state_in(state, loading=True, optimizer=optimizer):
            sd = _state_dicts(state, optimizer)
            try:
                dcp.load(sd, checkpoint_id=os.path.join(path, role), planner=adam.HostLoad(adam.on_host(state.adam)))
            except CheckpointException as e:   # verified intact (or written before checksums): the model differs
                raise ValueError(f"{path}/{role} does not fit this model (--model changed?): {_cause(e)}") from None
            if optimizer:
                set_state_dict(state.model, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            else:
                set_model_state_dict(state.model, sd["model"])
            del sd
            for group in state.optimizer.param_groups:   # this run's lr and weight decay, not the checkpoint's
                group.update(lr=state.cfg.lr, weight_decay=state.cfg.weight_decay)
    offload.empty_host_cache()
    rng = os.path.join(path, "rng", f"rank{rank}.pt")
    if os.path.isfile(rng):                       # a rank the saving run did not have keeps its seed
        set_rng_state(torch.load(rng, weights_only=True))
    if rank == 0:
        old, new = _flat(meta["config"]), _flat(config)
        changed = [f"{k} {old.get(k)} -> {new[k]}" for k in sorted(new) if old.get(k) != new[k]
                   and k not in ("resume", "steps")]
        print(f"[resume] {path}: step {meta['step']}, saved by {meta['world_size']} rank(s), now {world}"
              + (f"; config changed: {', '.join(changed)}" if changed else "") + ("" if optimizer else
              "; AdamW starts afresh: the checkpoint holds no optimizer state (--save_optimizer=false)"), flush=True)
    return meta


def intact(path: str, out_dir: str, resume: str) -> str:
    """`path` once its checksums check out (verified by all ranks, each its share); a damaged one
    stops an explicit --resume with the file named, and with --resume=auto the next older intact
    checkpoint of out_dir is tried instead, with a warning (the damaged one is left in place)."""
    while True:
        err = verify(path, dist.get_rank(), dist.get_world_size())
        if err is None:
            return path
        older = newest(out_dir, below=read_meta(path)["step"]) if resume == "auto" else None
        if older is None:
            raise ValueError(f"{err}; " + ("no older intact checkpoint in " + os.path.join(out_dir, "checkpoints")
                                           + ": start anew in another --out_dir" if resume == "auto"
                                           else "pass an intact checkpoint, or --resume=auto"))
        if dist.get_rank() == 0:
            print(f"[resume] warning: {err}; falling back to {older} (the damaged one is left in place "
                  f"for inspection)", flush=True)
        path = older


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def save_final(out_dir: str, policy, tokenizer, config: dict, model_path: str | None, *, steps_done: int, save):
    """The Hugging Face policy to out_dir/final, written by the caller's `save` (actor.save), aside and swapped in
    whole (a resumed, longer run replaces the earlier final/), with this run's `config` beside it and the steps it
    trained (`steps_done`: a stopped --save_freq=0 run saves before --steps; rundir.plan reads it). Rank 0 first
    frees the room set aside at the start (--save_freq=0: rundir.reserve_final), so a disk that filled during the
    run still holds final/. A full disk leaves no half-written final/, and its line says what the same command then
    does (after_failure)."""
    final, rank = os.path.join(out_dir, "final"), dist.get_rank()
    tmp, old = final + ".tmp", final + ".old"
    need = weights.final_bytes(policy, config["actor"]["save_merged"], model_path)
    if rank == 0 and os.path.exists(os.path.join(out_dir, RESERVE)):
        os.remove(os.path.join(out_dir, RESERVE))   # its bytes are this save's room
    kept = (f"{final} is untouched; " if os.path.isdir(final) else "") + after_failure(out_dir, steps=config["steps"])
    if not _agree(rank != 0 or free_bytes(out_dir) >= need):   # rank 0 alone writes final/
        raise space_error("writing the final policy", tmp, need, kept)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        what = save(policy, tokenizer, tmp, rank, model_path)   # gathers: every rank
        if rank == 0:
            _write_json(os.path.join(tmp, "run_config.json"), {**config, "steps_done": steps_done})
    except Exception as e:                    # never a half-written final/: it is swapped in only when whole
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if no_space(e):
            raise space_error("writing the final policy", tmp, need, f"the partial {tmp} was removed; {kept}") from None
        raise
    if rank == 0:
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        print(f"[save] {final} ({what})", flush=True)
    dist.barrier()
