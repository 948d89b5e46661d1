"""What a run keeps in its out_dir, around the checkpoints themselves (checkpoint.py): the out_dir
policy, one run per out_dir, the disk it will need, metrics.jsonl with each step once, the end-of-run
lines, and how a run stops on a preemption or Ctrl-C.

    python train_grpo.py --steps=20 --save_freq=5 --out_dir=out_ckpt   # out_ckpt/checkpoints/step_000005, ... 20
    python train_grpo.py --steps=40 --out_dir=out_ckpt                 # the same out_dir: resumes at step 20
    python -m pytest tests/test_reliability.py tests/test_checkpoint.py -q

- The out_dir policy (`plan`, checked before any model is built): an out_dir with an unfinished
  run resumes it (`--resume=auto`, the default); one with a finished run, or with files of a run that
  left no checkpoint, is refused with a line that says what to pass instead. Nothing of an earlier
  run is overwritten except by resuming it, and nothing that no run wrote (a foreign
  run_config.json). A run's own checkpoint resumes in place.
- One run per out_dir (launch.py, `claimed`): global rank 0 holds an flock on out_dir/.run.lock for
  the run's life; a second run stops at once naming the holder (pid, host, since when).
- Disk (`disk_report`): what the run writes (checkpoints x keep + final, from the shapes) against
  what is free, said at start; a run that cannot fit is refused. With --save_freq=0 final/'s room
  is set aside for the run's length (`reserve_final`). metrics.jsonl holds whole lines only
  (`write_step`), and a full disk anywhere is one line with the path, the bytes and the way on.
- Stopping: SIGTERM (a preemption) and a first Ctrl-C finish the step, checkpoint and exit with one
  line; a second Ctrl-C stops at once.
"""
import contextlib
import errno
import json
import os
import shlex
import signal
import sys
import types

import torch
import torch.distributed as dist

import checkpoint
import data
import losses
import weights
from launch import LOCK, check_writable, lock_out_dir  # noqa: F401 - one run per out_dir, launch.py's

GB = 2**30


# --------------------------------------------------------------------------- the out_dir policy
def plan(cfg, data_fingerprint: str) -> str | None:
    """Where this run starts, decided before the process group and the models: the checkpoint to
    resume from, or None for a fresh start. Raises (one line, what to pass instead) for an
    out_dir that would have to be overwritten."""
    out = cfg.out_dir
    q = shlex.quote(out)                   # in the advice: pasteable whatever the path holds
    check_writable(out)
    final = os.path.join(out, "final")
    if os.path.exists(final) and not os.path.isdir(final):
        raise ValueError(f"{final} is a file; the policy is saved there at the end: move it")
    latest = checkpoint.newest(out)
    earlier = checkpoint.earlier_run(out)   # a run that failed before its first step leaves none of these
    foreign = _foreign(out, fresh=latest is None and not earlier)
    if foreign:
        raise ValueError(f"--out_dir={q} holds {' and '.join(foreign)}, which no run wrote, and a run writes "
                         f"there: pass another --out_dir, or move {'it' if len(foreign) == 1 else 'them'}")
    if cfg.resume == "never" and earlier:
        raise ValueError(f"--out_dir={q} holds an earlier run ({', '.join(earlier)}) and --resume=never "
                         f"starts only in an empty one: pass another --out_dir, or remove {q}")
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        path = latest
        if path is None and earlier:
            raise ValueError(_without_checkpoint(out, earlier))
        if path is None:
            return None
    else:
        path = checkpoint.checkpoint_dir(cfg.resume)
        if path is None:
            raise ValueError(f"--resume={cfg.resume}: no complete checkpoint there (a step_N directory "
                             f"with meta.json, or an out_dir with checkpoints/latest)")
        err = checkpoint.damage(path, checksums=False)
        if err:
            raise ValueError(f"--resume={cfg.resume}: {err}; pass an intact checkpoint (another "
                             f"checkpoints/step_N), or an out_dir (its newest intact one is used)")
        # a checkpoint of this out_dir's own run resumes in place (from an older step too)
        own = os.path.realpath(os.path.dirname(path)) == os.path.realpath(os.path.join(out, "checkpoints"))
        if earlier and not own and (latest is None or os.path.realpath(path) != os.path.realpath(latest)):
            raise ValueError(f"--out_dir={q} holds another run ({', '.join(earlier)}); resume "
                             f"{cfg.resume} into an empty --out_dir")
    _check_resumable(cfg, path, latest, data_fingerprint)
    return path


def _without_checkpoint(out: str, earlier: list) -> str:
    """What an out_dir holding a run but no checkpoint is, and what to pass: with --save_freq=0 final/ holds
    the weights (its run_config.json the steps it trained: a finished run, or one stopped early)."""
    q = shlex.quote(out)                   # in the advice: pasteable whatever the path holds
    try:
        with open(os.path.join(out, "final", "run_config.json")) as f:
            meta = json.load(f)
        done, steps = int(meta["steps_done"]), int(meta["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return (f"--out_dir={q} holds an earlier run ({', '.join(earlier)}) but no checkpoint to resume from: "
                f"pass another --out_dir, or remove {q}")
    what = f"a finished run ({done} steps" if done >= steps else f"a run stopped after {done} of {steps} steps ("
    return (f"--out_dir={q} holds {what}{', ' if done >= steps else ''}the policy in {out}/final; "
            f"it kept no checkpoint, --save_freq=0): to train it further start from it, "
            f"--model={shlex.quote(os.path.join(out, 'final'))} with another --out_dir; "
            f"to start anew pass another --out_dir, or remove {q}")


# what a run writes over in out_dir after run_config.json, besides metrics.jsonl, checkpoints/ and final/
# (the loggers' folders are not here: a logger adds files of its own, it never replaces one)
WRITES = ("memory.png", "final.tmp", "final.old", "val_samples.jsonl")


def run_config(out: str) -> str | None:
    """out/run_config.json when a run wrote it (a JSON object with the run's resolved_config), else None."""
    path = os.path.join(out, "run_config.json")
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return path if isinstance(obj, dict) and "resolved_config" in obj else None


def _foreign(out: str, fresh: bool) -> list[str]:
    """What in `out` a run would write over though no run wrote it: a run_config.json that is not a
    run's; on a fresh start without a run's run_config.json (which every later file of a run
    follows), any of the other names a run writes (WRITES, OOM snapshots)."""
    if os.path.exists(os.path.join(out, "run_config.json")):
        return [] if run_config(out) else ["a run_config.json"]
    if not fresh:
        return []                          # a checkpoint or metrics vouch for the run
    return [n for n in sorted(os.listdir(out)) if n in WRITES
            or (n.startswith("oom_snapshot.rank") and n.endswith(".pickle"))]


def write_run_config(out: str, resolved: dict):
    """out/run_config.json (the pre-flight refused one that a run did not write), whole or not there."""
    path = os.path.join(out, "run_config.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(resolved, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as e:
        _remove(path + ".tmp")
        raise _failed(e, "writing", path, len(json.dumps(resolved, indent=1)), out) from None


def _check_resumable(cfg, path: str, latest: str | None, data_fingerprint: str):
    """The checkpoint at `path` has steps left to train (or a final save to redo), the roles this run
    trains, and this data."""
    meta, out, final = checkpoint.read_meta(path), cfg.out_dir, os.path.join(cfg.out_dir, "final")
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
                         f"a new run pass another --out_dir, or remove {shlex.quote(out)}")
    roles = ["actor"] + (["critic"] if cfg.algorithm.adv_estimator == "gae" else [])
    if meta.get("roles", roles) != roles:
        raise ValueError(f"{path} holds {' + '.join(meta['roles'])} but this run trains {' + '.join(roles)} "
                         f"(algorithm.adv_estimator changed?); resume with the checkpoint's settings")
    saved = types.SimpleNamespace(seed=meta["config"]["seed"], data_seed=meta["config"].get("data_seed", -1))
    if meta["data"] != data_fingerprint or (saved.seed, data.data_seed(saved)) != (cfg.seed, data.data_seed(cfg)):
        was = [f"--{k}={meta['config'][k]} (now {getattr(cfg, k)})" for k in (
            "data", "model", "max_prompt_length", "instruction", "seed") if meta["config"].get(k, getattr(cfg, k)) !=
            getattr(cfg, k)] + [f"the prompt order's seed {data.data_seed(saved)} (now {data.data_seed(cfg)})"] * (
            data.data_seed(saved) != data.data_seed(cfg))
        raise ValueError(f"{path} walked other data (" + (", ".join(was) or "--data's file or the tokenizer "
                         "changed") + "): its position would mean nothing; resume with the same ones, or start a "
                         "new run in another --out_dir")
    if export:
        checkpoint.say_once(f"[resume] {path} is at --steps={cfg.steps} but {final} was never written "
                            f"(a final save that failed): writing it from the checkpoint")


# --------------------------------------------------------------------------- disk space
def disk_report(cfg, roles: list, policy) -> str:
    """The set-up report's line on disk space: what the run will write into out_dir at most (the
    newest keep_checkpoints, one more while a new one is written, and final/) against what is
    free. Raises OSError (one line, what to change) when it cannot fit."""
    ckpt = checkpoint.write_bytes(roles, cfg.save_optimizer)   # --save_optimizer=false: params, RNG and meta alone
    final = weights.final_bytes(policy, cfg.actor.save_merged, cfg.model)
    saves = len({s for s in range(1, cfg.steps + 1) if s % cfg.save_freq == 0} | {cfg.steps}) if cfg.save_freq else 0
    n = min(cfg.keep_checkpoints + 1, saves)
    root = os.path.join(cfg.out_dir, "checkpoints")
    kept = sum(os.path.getsize(os.path.join(d, f)) for n_ in checkpoint.step_dirs(root)
               for d, _, fs in os.walk(os.path.join(root, n_)) for f in fs)   # replaced as new ones come
    reserve = os.path.join(cfg.out_dir, checkpoint.RESERVE)
    if cfg.save and not cfg.save_freq and os.path.isfile(reserve):
        kept += os.path.getsize(reserve)   # an earlier attempt's, reused by reserve_final
    need = max(n * ckpt + (final if cfg.save else 0) - kept, 0)
    lean = max(n * checkpoint.write_bytes(roles, False) + (final if cfg.save else 0) - kept, 0)   # without Adam
    free = checkpoint.free_bytes(cfg.out_dir)
    what = (f"{n} checkpoint(s) of ~{ckpt / GB:.3f} GB" if n else "no checkpoints") + \
        (f" + final/ ~{final / GB:.3f} GB" if cfg.save else "") + \
        (f", set aside now in {checkpoint.RESERVE}: with --save_freq=0 it is the only copy of the weights"
         if cfg.save and not cfg.save_freq else "")
    if need > free:
        raise OSError(f"{cfg.out_dir} has {free / GB:.3f} GB free but this run writes ~{need / GB:.3f} GB there "
                      f"({what}): free space, pass an --out_dir on a larger disk, or lower --keep_checkpoints "
                      f"(or --save_freq=0, --save=false)" + (
                          f"; --save_optimizer=false would fit (~{lean / GB:.3f} GB: checkpoints without AdamW's "
                          f"state, so a resume starts AdamW afresh)" if lean < need and lean <= free else ""))
    return f"[disk] writes up to ~{need / GB:.3f} GB to {cfg.out_dir} ({what}); {free / GB:.3f} GB free"


def reserve_final(cfg, policy, rank: int):
    """With --save_freq=0 final/ is the only copy of the trained weights, so rank 0 sets its bytes
    aside before the first step: out_dir/.final.reserve, allocated (not sparse), which save_final
    frees just before it writes. A disk that fills during the run then cannot take final/'s room;
    one without that room stops the run here, with one line. Any other run only drops a leftover."""
    path = os.path.join(cfg.out_dir, checkpoint.RESERVE)
    if rank == 0 and (not cfg.save or cfg.save_freq):
        _remove(path)                      # an earlier --save_freq=0 attempt's: checkpoints keep this run
    if rank != 0 or not cfg.save or cfg.save_freq:
        return
    need = weights.final_bytes(policy, cfg.actor.save_merged, cfg.model)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)   # an earlier attempt's is reused; not O_APPEND,
        try:                                                # which glibc's fallback for fallocate refuses
            os.posix_fallocate(fd, 0, need)
        finally:
            os.close(fd)
    except OSError as e:
        _remove(path)
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            print(f"[disk] warning: {path} cannot be allocated ahead on this filesystem ({e.strerror}): final/'s "
                  f"room is not set aside, and a disk that fills during this --save_freq=0 run loses the weights",
                  flush=True)
            return
        if checkpoint.no_space(e):
            raise checkpoint.space_error("setting final/'s room aside in", path, need,
                                         "with --save_freq=0 final/ is the only copy of the trained weights: free "
                                         "space, or pass --save_freq=N to keep checkpoints instead") from None
        raise OSError(f"setting final/'s room aside in {path} failed: {e.strerror or e}") from None


def _remove(path: str):
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _failed(e: OSError, what: str, path: str, need: int, out: str) -> OSError:
    """A failed write's one line: on a full disk the path, the bytes needed and free, and what the
    same command then does (checkpoint.after_failure); otherwise the path and the reason. A write
    `on_rank0` defers says neither: the run keeps its weights first, then says where (train_grpo.run)."""
    if _deferring:
        free = checkpoint.size(checkpoint.free_bytes(out)) if checkpoint.no_space(e) else ""
        return OSError(f"{what} {path} failed: " + (f"no space left on device (it needs ~{checkpoint.size(need)}, "
                                                    f"{free} free)" if free else f"{e.strerror or e}"))
    if checkpoint.no_space(e):
        return checkpoint.space_error(what, path, need, checkpoint.after_failure(out))
    return OSError(f"{what} {path} failed ({e.strerror or e}); " + checkpoint.after_failure(out, "fix that"))


# --------------------------------------------------------------------------- metrics.jsonl and the end of a run
LINES = ("metrics.jsonl", "val_samples.jsonl")   # a line per step (per held-out sample), each with its "step"


def keep_metrics(out_dir: str, step: int, rank: int) -> str:
    """metrics.jsonl and val_samples.jsonl with each step once: a resume at `step` keeps the lines of the
    steps before it (a line cut by a kill is dropped); a fresh run leaves metrics.jsonl to its first step
    to create (and drops a val_samples.jsonl its run_config.json vouched for: a run stopped in its first
    validation). Returns metrics.jsonl's path."""
    for name in LINES:
        path = os.path.join(out_dir, name)
        if rank != 0 or not os.path.isfile(path) or not step and name == LINES[0]:
            continue
        kept = []
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] < step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass
        try:
            with open(path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)
        except OSError as e:
            _remove(path + ".tmp")
            raise _failed(e, "rewriting", path, sum(map(len, kept)), out_dir) from None
    return os.path.join(out_dir, LINES[0])


def append_whole(path: str, text: str, what: str):
    """`text` appended to `path` whole or not at all (a write cut short by a full disk is cut back off);
    a failure is one line naming the path, with the bytes needed and free on a full disk."""
    line = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size, rest = os.fstat(fd).st_size, memoryview(line)
        try:
            while rest:                    # a full disk first takes what fits, then refuses the rest
                rest = rest[os.write(fd, rest):]
        except OSError as e:
            os.ftruncate(fd, size)         # no partial line stays behind
            raise _failed(e, what, path, len(line), os.path.dirname(path)) from None
    finally:
        os.close(fd)


def write_step(path: str, log, m: dict, step: int):
    """Rank 0's record of a step: its line appended to metrics.jsonl whole or not at all, then the
    logger's copy (tracker.open). Either failing is one line naming the path, with the bytes needed
    and free on a full disk."""
    line = json.dumps(m) + "\n"
    append_whole(path, line, f"writing step {step}'s line to")
    try:
        log.log(m, step)
    except Exception as e:                 # noqa: BLE001 - a logger's own errors (tensorboard's thread) are any kind
        out = os.path.dirname(path)
        if not checkpoint.no_space(e):
            fix = f"fix {log.path} (or add --logger=none: metrics.jsonl holds every step)"
            raise OSError(f"the logger's copy of step {step} to {log.path} failed ({type(e).__name__}: {e}); " +
                          (fix if _deferring else checkpoint.after_failure(out, fix))) from None
        err = checkpoint.space_error(f"the logger's copy of step {step} to", log.path, len(line),
                                     "" if _deferring else checkpoint.after_failure(out))
        raise OSError(str(err).rstrip("; ")) from None


def write_val_samples(out_dir: str, samples: list, step: int):
    """Rank 0: a validation's first held-out samples, a line each (with its step), to val_samples.jsonl."""
    if samples:
        text = "".join(json.dumps({"step": step, **s}) + "\n" for s in samples)
        append_whole(os.path.join(out_dir, LINES[1]), text, f"writing step {step}'s held-out samples to")


def summary(metrics_path: str) -> list[str]:
    """The end-of-run lines, from metrics.jsonl (the whole run, across resumes): did it train, and did
    the held-out score move?"""
    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f]
    rows = [r for r in lines if "optimizer_steps" in r]   # the training steps (not the last validation's line)
    n = sum(r["optimizer_steps"] for r in rows)
    applied = n - sum(r["skipped_steps"] for r in rows)
    dw = sum(r["delta_w_abs_mean"] for r in rows) / max(len(rows), 1)
    equal = sum(r["reward/equal_groups_frac"] == 1 for r in rows)
    failed = sum(r["reward/errors"] for r in rows)
    out = [f"[done] {applied} of {n} optimizer steps applied; mean |delta w| {dw:.3g} per step (the first "
           f"{losses.PROBE} weights of each parameter shard); {equal} of {len(rows)} steps had equal rewards "
           f"in every group" + (f"; {failed} rewards failed and scored 0" if failed else "")]
    val = [r for r in lines if "val/reward_mean" in r]
    if val:
        extra = "".join(f", {k[4:]} {val[0][k]:.3f} -> {val[-1][k]:.3f}" for k in ("val/strict", "val/flexible")
                        if k in val[0] and k in val[-1])
        out.append(f"[done] held-out val/reward_mean {val[0]['val/reward_mean']:.3f} after {val[0]['step']} steps -> "
                   f"{val[-1]['val/reward_mean']:.3f} after {val[-1]['step']}{extra} ({len(val)} validations)")
    if dw == 0:
        out.append("[warn] the weights never moved: this run trained nothing")
    return out


def keep(cfg, n: int, saved: int, updating: bool, *, checkpoint_at, final_at) -> str:
    """After a stop or an error, the weights of the `n` steps trained so far kept, and where (the run's last
    line says it): a checkpoint of step n (`checkpoint_at(n)`; not when an update was cut short: `updating`),
    else, or when that write fails, final/ (`final_at(n)`; with --save_freq=0 the only copy, its room set
    aside at the start: reserve_final). `saved`: the step of the newest checkpoint (-1: none)."""
    if n == saved or n == 0:
        return f"the weights after step {n} are in {checkpoint.newest(cfg.out_dir)} (the same command resumes " \
               f"there)" if n else "nothing was trained yet"
    why = f" (the update of step {n + 1} was cut short)" if updating else ""
    if cfg.save_freq and not updating:
        try:
            checkpoint_at(n)
            return f"the weights after step {n} are in {checkpoint.newest(cfg.out_dir)} " \
                   f"(the same command resumes there)"
        except OSError as e:
            why = " (no room for their checkpoint)" if checkpoint.no_space(e) or "no space left" in str(e) \
                else f" (no checkpoint: {e})"
    final = shlex.quote(os.path.join(cfg.out_dir, "final"))   # in a command: pasteable whatever the path holds
    resumes = f"; the checkpoint of step {saved} resumes" if saved > 0 else \
        (f"; --save_freq=0 keeps no checkpoint: train further with --model={final} in another --out_dir"
         if not cfg.save_freq else "")
    if not cfg.save:
        return f"the weights after step {n} are not kept{why}{' (--save=false)' if not why else ''}{resumes}"
    try:
        final_at(n)
        return f"the weights after step {n} are in {cfg.out_dir}/final{why}{resumes}"
    except OSError as e:
        return f"the weights after step {n} are lost: writing final/ failed too ({e}){resumes}"


def finished_line(cfg, steps: int) -> str:
    """A finished run's last line: that it finished, and where its weights are."""
    where = [f"the policy in {cfg.out_dir}/final" if cfg.save else "",
             f"its checkpoint in {checkpoint.newest(cfg.out_dir)}" if cfg.save_freq else ""]
    return f"[done] finished: {steps} steps; " + (", ".join(w for w in where if w) or "nothing saved (--save=false)")


# --------------------------------------------------------------------------- preemption, Ctrl-C, a failed write
_signals: list = []
_failure: list = []                        # rank 0's failed write (an OSError), said once the weights are kept
_deferring = False                         # inside on_rank0: a failed write's line leaves out what comes next
_run: dict = {}                            # what the signal handlers say: --save_freq and out_dir (stop_on_sigterm)
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT (Ctrl-C)"}


def _rank0() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def _on_stop(signum, frame):
    """Noted, and acted on at the end of the step; a second SIGINT ends the process at once (no
    checkpoint, no traceback: os._exit skips the unwinding that would print one per rank)."""
    if signum == signal.SIGINT and signal.SIGINT in _signals:
        if _rank0():
            last = checkpoint.newest(_run["out_dir"]) if _run else None
            print("[interrupt] second Ctrl-C: stopped at once; " + (
                f"the same command resumes from {last}" if last else "no checkpoint was written: the steps "
                "trained are lost"), file=sys.stderr, flush=True)
        os._exit(130)
    if signum not in _signals and _rank0():
        then = "a checkpoint" if _run.get("save_freq") else "the weights to final/ (--save_freq=0)" \
            if _run.get("save") else "the end (--save_freq=0 --save=false: nothing is saved)"
        print(f"[{'interrupt] Ctrl-C' if signum == signal.SIGINT else 'preempt] SIGTERM'}: finishing this step, "
              f"then {then}" + (" (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""), flush=True)
    _signals.append(signum)


def exit_on_sigint():
    """Before the first step (options, models, engine): Ctrl-C ends the run at once with one line
    instead of a KeyboardInterrupt traceback from every rank; nothing is lost yet."""
    def stop(signum, frame):
        if _rank0():
            print("[interrupt] Ctrl-C during set-up: stopped (nothing to save yet)", file=sys.stderr, flush=True)
        os._exit(130)
    signal.signal(signal.SIGINT, stop)


def stop_on_sigterm(cfg):
    """SIGTERM (a preemption; torchrun forwards it to every rank and waits 30 s before SIGKILL) and
    SIGINT (Ctrl-C; torchrun forwards that too, so each worker handles it): the current step
    finishes, the weights are kept (a checkpoint, or final/ with --save_freq=0), the run exits; a
    second SIGINT stops at once."""
    _run.update(save_freq=cfg.save_freq, save=cfg.save, out_dir=cfg.out_dir)
    _signals.clear()                       # an earlier run's in this process (a notebook, the tests)
    _failure.clear()
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)


def on_rank0(write, *args):
    """A write rank 0 alone makes (a metrics line, the logger's copy, held-out samples): a failure (a full
    disk) does not end rank 0 at once, which would strand the others in a collective and lose the weights:
    every rank stops after this step (stop_requested), the weights are kept, then it is said (`failure`)."""
    global _deferring
    _deferring = True
    try:
        write(*args)
    except OSError as e:
        _failure.append(e)
    finally:
        _deferring = False


def stop_line(cfg, steps: int, where: str) -> tuple[str, int]:
    """The stopped run's last line (after which step, where the weights are) and its exit code: 130 for
    Ctrl-C, 143 for SIGTERM (the signal this rank got; a rank that got none was stopped by another's)."""
    sig = _signals[0] if _signals else signal.SIGTERM
    return f"[preempt] {NAMES.get(sig, 'SIGTERM')}: stopped after step {steps}; {where}", \
        130 if sig == signal.SIGINT else 143


def stop_requested(device) -> bool:
    """Did any rank get SIGTERM or SIGINT, or fail a write (`on_rank0`)? One all-reduce per step, so every
    rank stops after the same step."""
    flag = torch.tensor([float(bool(_signals or _failure))], device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def failure(device) -> str | None:
    """Rank 0's failed write, as one line on every rank (None: none). Collective."""
    said = [str(_failure[0]) if _failure else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(said, src=0)
    return said[0]
