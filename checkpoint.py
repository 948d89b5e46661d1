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
The loop hands in the trained roles and the run's figures; `load` returns the checkpoint's meta
(the step, the data position): nothing here reads or writes the loop's own state.

The out_dir policy (checked before any model is built, `plan`): an out_dir with an unfinished
run resumes it (`--resume=auto`, the default); one with a finished run, or with files of a run
that left no checkpoint, is refused with a line that says what to pass instead. Nothing of an
earlier run is overwritten except by resuming it.
"""
import datetime
import json
import os
import random
import shutil
import signal
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import actor
import offload

# --------------------------------------------------------------------------- the out_dir policy


def checkpoint_dir(path: str) -> str | None:
    """A complete checkpoint at `path` (a step_N dir, or an out_dir whose `latest` names one), or None."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    pointer = os.path.join(path, "checkpoints", "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            target = os.path.join(path, "checkpoints", f.read().strip())
        if not os.path.isfile(os.path.join(target, "meta.json")):
            raise ValueError(f"{pointer} names {target}, which is not a complete checkpoint; "
                             f"point it at one of {path}/checkpoints/step_* or remove it")
        return target
    return None


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


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
    latest = checkpoint_dir(out)
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
        if earlier and (latest is None or os.path.realpath(path) != os.path.realpath(latest)):
            raise ValueError(f"--out_dir={out} holds another run ({', '.join(earlier)}); resume "
                             f"{cfg.resume} into an empty --out_dir")
    _check_resumable(cfg, path, data_fingerprint)
    return path


def _check_resumable(cfg, path: str, data_fingerprint: str):
    """The checkpoint at `path` has steps left to train, the roles this run trains, and this data."""
    meta, out, final = read_meta(path), cfg.out_dir, os.path.join(cfg.out_dir, "final")
    if meta["step"] >= cfg.steps and cfg.resume != "auto":
        raise ValueError(f"--resume={cfg.resume} is at step {meta['step']}, not before --steps={cfg.steps}: "
                         f"nothing to train; pass --steps=N with N > {meta['step']}")
    if meta["step"] >= cfg.steps:
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


def save(out_dir: str, step: int, roles: list, keep: int, meta: dict):
    """A checkpoint after `step` steps (module docstring), on every rank. `roles`: (name, state, its
    checkpoint bracket) of each trained role, one resident at a time; `meta`: the run's figures for
    meta.json (prompts_seen, data, world_size, config), step, roles and time added here."""
    root, rank = os.path.join(out_dir, "checkpoints"), dist.get_rank()
    name = f"step_{step:06d}"
    tmp = os.path.join(root, f".tmp-{name}")   # never read by a resume until renamed
    t0 = time.perf_counter()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)    # a save cut short by a kill
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    for role, state, state_in in roles:
        with state_in(state):
            model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
            try:
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, role))
            except CheckpointException as e:   # a BaseException: what failed on which rank, with tracebacks
                raise OSError(f"writing the checkpoint {tmp}/{role} failed: {_cause(e)}") from None
            del model_sd, optim_sd                # views of the live tensors: gone before the bracket ends
    offload.empty_host_cache()                    # DCP staged each tensor in cached pinned host memory
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{rank}.pt"))
    dist.barrier()                                # every rank's files are on disk
    if rank == 0:
        _write_json(os.path.join(tmp, "meta.json"), {"step": step, **meta, "roles": [r[0] for r in roles],
                                                     "time": datetime.datetime.now().isoformat(timespec="seconds")})
        _publish(root, name, tmp, step, keep, t0)
    dist.barrier()                                # no rank goes on, or exits, before it is complete


def _publish(root: str, name: str, tmp: str, step: int, keep: int, t0: float):
    """The written checkpoint renamed into place, then `latest` moved to it, older ones pruned."""
    target = os.path.join(root, name)
    shutil.rmtree(target, ignore_errors=True)  # left by a run killed before `latest` reached it
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
    for s in [s for s in steps if s > step] + [s for s in steps if s <= step][:-keep]:
        shutil.rmtree(os.path.join(root, f"step_{s:06d}"), ignore_errors=True)


def load(path: str, roles: list, config: dict, world: int) -> dict:
    """Load a checkpoint into freshly built roles (any world size: DCP reshards; `roles` as for
    `save`); returns its meta.json (step, prompts_seen, ...). Prints how this run's `config` differs
    from the checkpoint's."""
    meta, rank = read_meta(path), dist.get_rank()
    for role, state, state_in in roles:
        with state_in(state, loading=True):
            # on a fresh optimizer this makes AdamW's state (a step with zero grads and lr 0: the
            # weights do not move), which DCP then overwrites in place
            model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
            try:
                dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, role))
            except CheckpointException as e:
                raise ValueError(f"{path}/{role} does not fit this model (--model changed?): {_cause(e)}") from None
            set_state_dict(state.model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
            del model_sd, optim_sd
    offload.empty_host_cache()
    rng = os.path.join(path, "rng", f"rank{rank}.pt")
    if os.path.isfile(rng):                       # a rank the saving run did not have keeps its seed
        set_rng_state(torch.load(rng, weights_only=True))
    if rank == 0:
        old, new = _flat(meta["config"]), _flat(config)
        changed = [f"{k} {old.get(k)} -> {new[k]}" for k in sorted(new) if old.get(k) != new[k]
                   and k not in ("resume", "steps")]
        print(f"[resume] {path}: step {meta['step']}, saved by {meta['world_size']} rank(s), now {world}"
              + (f"; config changed: {', '.join(changed)}" if changed else ""), flush=True)
    return meta


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


def summary(metrics_path: str) -> list[str]:
    """The end-of-run lines, from metrics.jsonl (the whole run, across resumes): did it train?"""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    n = sum(r["optimizer_steps"] for r in rows)
    applied = n - sum(r["skipped_steps"] for r in rows)
    dw = sum(r["delta_w_abs_mean"] for r in rows) / max(len(rows), 1)
    equal = sum(r["reward/equal_groups_frac"] == 1 for r in rows)
    failed = sum(r["reward/errors"] for r in rows)
    lines = [f"[done] {applied} of {n} optimizer steps applied; mean |delta w| {dw:.3g} per step (the first "
             f"{actor.PROBE} weights of each parameter shard); {equal} of {len(rows)} steps had equal rewards "
             f"in every group" + (f"; {failed} rewards failed and scored 0" if failed else "")]
    if dw == 0:
        lines.append("[warn] the weights never moved: this run trained nothing")
    return lines


def save_final(out_dir: str, policy, tokenizer, config: dict, model_path: str | None):
    """The Hugging Face policy (an actor.Actor) to out_dir/final, written aside and swapped in whole
    (a resumed, longer run replaces the earlier final/), with this run's `config` beside it."""
    final, rank = os.path.join(out_dir, "final"), dist.get_rank()
    tmp, old = final + ".tmp", final + ".old"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    what = actor.save(policy, tokenizer, tmp, rank, model_path)   # gathers: every rank
    if rank == 0:
        _write_json(os.path.join(tmp, "run_config.json"), config)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        print(f"[save] {final} ({what})", flush=True)
    dist.barrier()


# --------------------------------------------------------------------------- preemption
_signals: list = []


def _on_sigterm(signum, frame):
    _signals.append(signum)                       # acted on at the end of the step


def stop_on_sigterm():
    """SIGTERM (a preemption; torchrun forwards it to every rank and waits 30 s before SIGKILL):
    the current step finishes, a checkpoint is written, the run exits."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def stop_requested(device) -> bool:
    """Did any rank get SIGTERM? One all-reduce per step, so every rank stops after the same step."""
    flag = torch.tensor([float(bool(_signals))], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
