"""Reliability on the CPU: one run per out_dir, a full disk and a damaged
checkpoint lose nothing, Ctrl-C is a clean stop, torchrun's restarts resume by themselves, and the
seq-mean loss denominators are verl's.

    python -m pytest tests/test_reliability.py -q      # launches 1- and 2-process gloo runs itself
"""
import json
import os
import shlex
import signal
import socket
import subprocess
import time

import pytest

import actor
import checkpoint
import options
import rundir
from dataclasses import asdict
from conftest import launches, metrics, run, start
from test_checkpoint import REFERENCE, SMALL, in_process, numbers, uninterrupted, wait_for_lines, workers  # noqa: F401


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- 1. one run per out_dir
HOLD = ("import sys, time, rundir; rundir.lock_out_dir(sys.argv[1], 0); print('held', flush=True); "
        "time.sleep(600)")


def _holder(out):
    """Another process that holds out's lock (as a running rank 0 does) until it is killed."""
    p = start(["-c", HOLD, out], script=None, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@launches
def test_a_second_run_on_one_out_dir_stops_at_once_naming_the_holder(tmp_path):
    """While another process holds out_dir's lock, a run there stops before it writes anything with
    one line naming the holder's pid, host and start; other ranks (rank != 0) never lock, so the
    ranks and nodes of one run do not lock each other out; kill -9 of the holder frees the out_dir
    (the kernel drops the flock) and the run goes ahead."""
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        r = run([f"--out_dir={out}", "--steps=1", "--save=false"] + SMALL)
        assert r.returncode == 2 and r.stdout == "", r.stderr[-3000:]
        line = r.stderr.strip().splitlines()
        assert len(line) == 1 and line[0].startswith(f"error: --out_dir={out} is in use by another run (pid "
                                                     f"{holder.pid} on host {socket.gethostname()} since "), line
        assert sorted(os.listdir(out)) == [rundir.LOCK]        # nothing written
        with pytest.raises(ValueError, match=f"pid {holder.pid}"):
            rundir.lock_out_dir(str(out), 0)
        rundir.lock_out_dir(str(out), 1)                       # another rank of a run: no lock taken
    finally:
        holder.kill()
        holder.wait()
    r = run([f"--out_dir={out}", "--steps=1", "--save=false"] + SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(open(out / rundir.LOCK).read())["host"] == socket.gethostname()


# --------------------------------------------------------------------------- 3, 4. damaged checkpoints, lost `latest`
CKPT = ["--save_freq=1", "--keep_checkpoints=3", "--save=false"] + SMALL


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A 3-step run with a checkpoint after every step (step 1, 2, 3 kept): copied by each test."""
    out = str(tmp_path_factory.mktemp("three") / "run")
    r = run([f"--out_dir={out}", "--steps=3"] + CKPT)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _copy(three, tmp_path) -> str:
    import shutil
    out = str(tmp_path / "run")
    shutil.copytree(three, out)
    os.remove(os.path.join(out, rundir.LOCK))
    return out


def _step(out, n):
    return os.path.join(out, "checkpoints", f"step_{n:06d}")


def _truncate(path, keep=None):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2 if keep is None else keep)


def _plan(out, *extra):
    """rundir.plan for the embedded task (what main's pre-flight runs) with --steps=4."""
    import data as data_io
    fp = data_io.fingerprint(*data_io.load_data(None, data_io.load_tokenizer(None))[:2])
    return rundir.plan(options.parse_args([f"--out_dir={out}", "--steps=4", *extra]), fp)


@launches
def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(tmp_path, three):
    """The newest checkpoint's actor/__0_0.distcp truncated and the one before it with one byte
    flipped (same size: only its checksum tells): --resume=auto passes over step 3 in the
    pre-flight (sizes), finds step 2's checksum wrong when it loads, names both files in a
    warning, resumes from step 1, and the finished run's metrics equal the uninterrupted run's;
    no traceback. The damaged step 3 is set aside as step_000003.damaged when the run replaces it."""
    out = _copy(three, tmp_path)
    _truncate(os.path.join(_step(out, 3), "actor", "__0_0.distcp"))
    name = os.path.join(_step(out, 2), "actor", "__0_0.distcp")
    with open(name, "r+b") as f:
        f.seek(os.path.getsize(name) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    r = run([f"--out_dir={out}", "--steps=4"] + CKPT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"[resume] warning: {_step(out, 3)}/actor/__0_0.distcp is damaged (" in r.stdout, r.stdout[-3000:]
    assert f"[resume] warning: {name} is damaged (its checksum differs" in r.stdout
    assert f"falling back to {_step(out, 1)}" in r.stdout and "step_000001: step 1" in r.stdout
    assert r.stdout.count(f"{_step(out, 3)}/actor/__0_0.distcp is damaged") == 1   # not again at the next save
    assert numbers(metrics(out))[:3] == numbers(metrics(three)) and [m["step"] for m in metrics(out)] == [0, 1, 2, 3]
    assert os.path.isdir(_step(out, 3) + ".damaged")


@launches
def test_damaged_metadata_or_meta_json_is_passed_over_or_one_line(tmp_path, three):
    """A truncated DCP .metadata or meta.json of the newest checkpoint: --resume=auto's pre-flight
    passes over it with a warning naming the file (no DCP traceback) and picks the one before; the
    same checkpoint given as --resume=<dir> stops with one line naming the damaged file."""
    out = _copy(three, tmp_path)
    _truncate(os.path.join(_step(out, 3), "actor", ".metadata"))
    assert _plan(out) == _step(out, 2)
    _truncate(os.path.join(_step(out, 2), "meta.json"))
    assert _plan(out) == _step(out, 1)
    with pytest.raises(ValueError, match=r"step_000002/meta.json is damaged \(not valid JSON"):
        _plan(tmp_path / "other", f"--resume={_step(out, 2)}")
    r = run([f"--out_dir={tmp_path / 'other2'}", "--steps=4", f"--resume={_step(out, 3)}"] + CKPT)
    was = checkpoint.read_meta(_step(out, 3))["files"]["actor/.metadata"]["size"]
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --resume={_step(out, 3)}: {_step(out, 3)}/actor/.metadata is damaged "
        f"({was // 2} bytes, meta.json records {was}: truncated?); pass an intact "
        f"checkpoint (another checkpoints/step_N), or an out_dir (its newest intact one is used)"], r.stderr[-3000:]


@launches
def test_lost_latest_and_own_checkpoint_resume_in_place(tmp_path, three):
    """checkpoints/latest deleted, or naming a checkpoint that is gone: the resume finds the newest
    complete one (step 3) with a warning; --resume=<this out_dir's own step_2> resumes in place
    instead of being refused as another run's."""
    out = _copy(three, tmp_path)
    pointer = os.path.join(out, "checkpoints", "latest")
    os.remove(pointer)
    assert _plan(out) == _step(out, 3)
    with open(pointer, "w") as f:
        f.write("step_000009")
    assert _plan(out) == _step(out, 3)
    assert _plan(out, f"--resume={_step(out, 2)}") == _step(out, 2)
    with pytest.raises(ValueError, match="holds another run"):     # another out_dir's checkpoint still is refused
        _plan(out, f"--resume={_step(three, 2)}")


# --------------------------------------------------------------------------- 2. a full disk
@launches
def test_a_full_disk_is_one_line_removes_partial_files_and_keeps_the_run_resumable(tmp_path, dist_env, monkeypatch,
                                                                                  capsys):
    """In this process (1 rank): the start check refuses an out_dir with too little space in one
    line; a checkpoint write whose disk fills (torch's zip writer's 'unexpected pos', as in the
    issue) is one OSError naming the path, the bytes needed and free, and leaves no .tmp-* behind;
    the check before a write refuses without writing; a final save whose disk fills (safetensors'
    I/O error) leaves no final/ and no final.tmp, and the same command then writes final/ from the
    newest checkpoint (in a subprocess, the disk freed)."""
    import safetensors.torch
    import torch
    import train_grpo
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=1", "--save_freq=1"] + SMALL
    cfg = options.parse_args(args)
    (data, val), _ = train_grpo.preflight(cfg)
    t = train_grpo.setup(cfg, data=data, val=val)
    disk = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[disk]")]
    assert len(disk) == 1 and disk[0].startswith("[disk] writes up to ~0.0") and "GB free" in disk[0]
    step0 = train_grpo.train_step(t, 0)
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "free_bytes", lambda path: 10 * 2**20)
        with pytest.raises(OSError, match=rf"{out} has 0.010 GB free but this run writes ~0.0\d\d GB there "
                                          r"\(1 checkpoint\(s\) of ~0.03\d GB \+ final/ ~0.01\d GB\): free space"):
            rundir.disk_report(t.cfg, train_grpo.trained(t.actor, t.critic), t.actor)
        with pytest.raises(OSError, match=r"writing the checkpoint .*/.tmp-step_000001 failed: no space left on "
                                          r"device \(it needs ~0.03\d GB, 0.010 GB free\); nothing was written"):
            train_grpo.save(t, 1)
    real_save = torch.save

    def full(obj, f, *a, **k):                  # DCP's files are written; then the disk is full
        real_save(obj, f, *a, **k)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    with monkeypatch.context() as m:
        m.setattr(torch, "save", full)
        with pytest.raises(OSError) as e:
            train_grpo.save(t, 1)
    tmp = os.path.join(out, "checkpoints", ".tmp-step_000001")
    assert str(e.value).startswith(f"writing the checkpoint {tmp}/actor failed: no space left on device (it needs "
                                   f"~0.03"), str(e.value)     # DCP's own torch.save (its .metadata) hit it
    assert "the partial" in str(e.value) and "no checkpoint is kept" in str(e.value)
    assert os.listdir(os.path.join(out, "checkpoints")) == []
    train_grpo.save(t, 1)                          # the disk freed: complete
    assert checkpoint.newest(out) == _step(out, 1)
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(step0) + "\n")

    class SafetensorError(Exception):
        pass

    def full_final(sd, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                              "message: \"No space left on device\" })")
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", full_final)
        with pytest.raises(OSError, match=rf"writing the final policy {out}/final.tmp failed: no space left on "
                                          rf"device \(it needs ~0.01\d GB, [\d.]+ GB free\); the partial .* "
                                          rf"removed; {_step(out, 1)} is kept: free space, then run the same "
                                          rf"command \(it writes final/ from it, without training\)"):
            checkpoint.save_final(out, t.actor, t.tokenizer, asdict(t.cfg), t.cfg.model, steps_done=1,
                                  save=actor.save)
    assert sorted(os.listdir(out)) == ["checkpoints", "metrics.jsonl", "val_samples.jsonl"]   # no final/, no final.tmp
    r = run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was never written (a final save that failed): writing it" in r.stdout
    assert os.path.isfile(os.path.join(out, "final", "model.safetensors"))


def _limited(disk) -> dict:
    """The writes a small_disk limits: {(module, name): what replaces it}, each passing through
    unchanged outside disk.root."""
    import builtins
    import errno
    import io
    import safetensors.torch
    root = disk.root + "/"
    real = {"write": os.write, "fallocate": os.posix_fallocate, "open": builtins.open,
            "save_file": safetensors.torch.save_file, "free_bytes": checkpoint.free_bytes}
    inside = lambda path: os.path.realpath(path).startswith(root)  # noqa: E731
    full = lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # noqa: E731

    def write(fd, data):
        room = disk.free() if inside(f"/proc/self/fd/{fd}") else len(data)
        if data and not room:
            raise full()
        return real["write"](fd, memoryview(data)[:room])   # what fits, as a filling disk takes it

    class Raw(io.FileIO):                  # what open() writes through, under root
        def write(self, data):
            return write(self.fileno(), data)

    def open_(file, mode="r", buffering=-1, encoding=None, *a, **k):
        if not isinstance(file, (str, os.PathLike)) or not inside(file) or not set(mode) & set("wax+"):
            return real["open"](file, mode, buffering, encoding, *a, **k)
        f = (io.BufferedRandom if "+" in mode else io.BufferedWriter)(Raw(file, mode.replace("b", "").replace("t", "")))
        return f if "b" in mode else io.TextIOWrapper(f, encoding or "utf-8")

    def fallocate(fd, offset, length):
        if inside(f"/proc/self/fd/{fd}") and offset + length - os.fstat(fd).st_size > disk.free():
            raise full()
        real["fallocate"](fd, offset, length)

    def save_file(sd, path, metadata=None):
        if inside(path) and sum(t.nbytes for t in sd.values()) > disk.free():
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device "
                                              "(os error 28)")
        real["save_file"](sd, path, metadata=metadata)
    return {(os, "write"): write, (builtins, "open"): open_, (os, "posix_fallocate"): fallocate,
            (safetensors.torch, "save_file"): save_file,
            (checkpoint, "free_bytes"): lambda path: disk.free() if inside(path) else real["free_bytes"](path)}


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A folder standing in for a filesystem of `disk.limit` bytes (a tmpfs needs root): free_bytes
    says what is left in it, and every write under it that Python makes (open(), os.write,
    os.posix_fallocate) or safetensors' save_file fails with ENOSPC past the limit, a write first
    taking what fits, as a full disk does. `disk.fill(n)` leaves n bytes, as another process
    filling the disk would. DCP's and torch.save's own writes are not limited (the test above)."""
    import types
    root = os.path.realpath(tmp_path / "disk")
    os.makedirs(root)
    disk = types.SimpleNamespace(root=root, limit=2**30)
    used = lambda: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)  # noqa: E731
    disk.free = lambda: max(disk.limit - used(), 0)

    def fill(n):
        with open(os.path.join(root, "filler"), "ab") as f:
            f.truncate(os.path.getsize(f.name) + disk.free() - n)
    disk.fill = fill
    for (module, name), f in _limited(disk).items():
        monkeypatch.setattr(module, name, f)
    return disk


def test_a_disk_too_small_stops_the_run_before_the_rollout_engine_is_built(tmp_path, dist_env, monkeypatch):
    """The disk check runs once the trained roles exist and before the engine is built (on a GPU that build
    is a minute or more): a run whose out_dir cannot hold its checkpoints stops with the one line at once."""
    import rollout
    import train_grpo
    cfg = options.parse_args([f"--out_dir={tmp_path / 'run'}", "--steps=1", "--save_freq=1"] + SMALL)
    (data, val), _ = train_grpo.preflight(cfg)
    built = []
    monkeypatch.setattr(rollout, "build", lambda *a, **k: built.append(1))
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 10 * 2**20)
    with pytest.raises(OSError, match=r"has 0.010 GB free but this run writes ~0.0\d\d GB there .*: free space"):
        train_grpo.setup(cfg, data=data, val=val)
    assert built == []


def _after(monkeypatch, module, name, calls, then):
    """module.name runs as before; after its `calls`-th call, then() (a disk filling up meanwhile)."""
    real, n = getattr(module, name), []

    def wrapped(*a, **k):
        out = real(*a, **k)
        n.append(1)
        if len(n) == calls:
            then()
        return out
    monkeypatch.setattr(module, name, wrapped)


TINY = ["--train_batch_size=2", "--rollout.n=2", "--actor.ppo_mini_batch_size=2", "--logger=none"]   # ~1 s a step


def test_save_freq_0_keeps_final_room_through_a_full_disk_and_says_true_advice(small_disk, in_process, monkeypatch,
                                                                                capsys):
    """--save_freq=0, where final/ is the only copy of the weights: the disk fills to 1 MB free after
    the first step (final/ needs ~13 MB), and final/ is still written, from the room set aside at
    the start, mode 0666 less the umask like any new file (not safetensors' 0600); a CPU run says
    how to draw memory.png. When another process takes that room as soon as it is freed, the line
    says the weights are lost and to start again elsewhere, and the same command is indeed refused;
    a disk without final/'s room at the start stops the run there."""
    out = os.path.join(small_disk.root, "run")
    args = [f"--out_dir={out}", "--steps=1", "--save_freq=0"] + TINY
    with monkeypatch.context() as m:
        _after(m, rundir, "write_step", 1, lambda: small_disk.fill(2**20))
        in_process(args)
    assert not os.path.exists(os.path.join(out, checkpoint.RESERVE))
    weights = os.path.join(out, "final", "model.safetensors")
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(weights).st_mode & 0o777 == 0o666 & ~umask
    from safetensors.torch import load_file
    assert "model.embed_tokens.weight" in load_file(weights)
    assert f"python plan.py --plot={out} draws it" in capsys.readouterr().out
    os.remove(os.path.join(small_disk.root, "filler"))
    lost = os.path.join(small_disk.root, "lost")
    args = [f"--out_dir={lost}", "--steps=1", "--save_freq=0"] + TINY
    real_remove = os.remove
    with monkeypatch.context() as m:          # the room freed for final/ goes to another process at once
        m.setattr(os, "remove", lambda p: (real_remove(p), p.endswith(checkpoint.RESERVE) and small_disk.fill(0)))
        with pytest.raises(SystemExit):
            in_process(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: writing the final policy {lost}/final.tmp failed: no space left on device (it needs "
                   f"~0.013 GB, 0 bytes free); no checkpoint is kept, so the trained steps are lost and the same "
                   f"command would be refused: free space, then start again in another --out_dir (or remove {lost})"]
    with pytest.raises(SystemExit):
        in_process(args)
    assert "holds an earlier run (metrics.jsonl) but no checkpoint" in capsys.readouterr().err
    import types
    import torch
    policy = types.SimpleNamespace(model=torch.nn.Linear(1024, 1024), lora=None)   # 4 MB of weights
    with pytest.raises(OSError, match=rf"^setting final/'s room aside in {lost}/.final.reserve failed: no space left "
                                      rf"on device \(it needs ~0.005 GB, 0 bytes free\); with --save_freq=0 final/ "
                                      rf"is the only copy of the trained weights: free space, or pass --save_freq=N"):
        rundir.reserve_final(options.parse_args([f"--out_dir={lost}", "--save_freq=0"]), policy, 0)


def test_an_earlier_attempts_reservation_goes_when_the_run_keeps_checkpoints(tmp_path):
    """out_dir/.final.reserve left by an earlier --save_freq=0 attempt is removed by a run that keeps
    checkpoints (or saves nothing): its bytes are no run's room now. A --save_freq=0 run reuses it; a rank
    other than 0 leaves it."""
    import types
    import torch
    policy = types.SimpleNamespace(model=torch.nn.Linear(64, 64), lora=None)
    leftover = tmp_path / checkpoint.RESERVE
    for args, kept in ((["--save_freq=5"], False), (["--save=false", "--save_freq=0"], False),
                       (["--save_freq=0"], True)):
        leftover.write_bytes(b"\0" * 4096)
        rundir.reserve_final(options.parse_args([f"--out_dir={tmp_path}", *args]), policy, 0)
        assert leftover.exists() == kept, args
        leftover.write_bytes(b"\0" * 4096)
        rundir.reserve_final(options.parse_args([f"--out_dir={tmp_path}", *args]), policy, 1)
        assert leftover.stat().st_size == 4096, args


def test_a_full_disk_mid_run_is_one_line_and_metrics_jsonl_keeps_whole_lines(small_disk, in_process, monkeypatch,
                                                                              capsys):
    """The disk fills to 1000 bytes free after step 0's checkpoint: step 1's metrics line (~2.4 KB)
    fails, every rank stops after that step, and the run ends in one line naming metrics.jsonl, the bytes
    needed and free, that the weights after step 2 found no room for their checkpoint (--save=false: no
    final/ either) and that step 1's checkpoint resumes; the file keeps whole lines only (the cut-off bytes
    are removed). A line cut by a kill is dropped by the resume, which then runs steps 1 and 2 once each."""
    out = os.path.join(small_disk.root, "run")
    args = [f"--out_dir={out}", "--steps=3", "--save_freq=1", "--keep_checkpoints=1", "--save=false"] + TINY
    with monkeypatch.context() as m:
        _after(m, checkpoint, "save", 1, lambda: small_disk.fill(1000))
        with pytest.raises(SystemExit):
            in_process(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: writing step 1's line to {out}/metrics.jsonl failed: no "
                                               f"space left on device (it needs ~2"), err
    assert err[0].endswith(" bytes, 1000 bytes free); the weights after step 2 are not kept (no room for their "
                           "checkpoint); the checkpoint of step 1 resumes"), err
    assert [m["step"] for m in metrics(out)] == [0]     # every line whole (json.loads of each)
    os.remove(os.path.join(small_disk.root, "filler"))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 1, "reward_mean": 0.')      # as a kill in the middle of a write leaves it
    in_process(args)
    assert [m["step"] for m in metrics(out)] == [0, 1, 2]


def test_a_logger_on_a_full_disk_is_one_line_without_its_thread_traceback(tmp_path, monkeypatch):
    """TensorBoard's writer thread hits the full disk: its error never reaches the hook that prints
    a thread's traceback ("Exception in thread ..."), and the step's record ends in one OSError
    naming the events folder and the bytes."""
    import errno
    import threading
    import tracker
    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)   # stands in for the printing default
    log = tracker.open("tensorboard", str(tmp_path), "{}", 0)

    def full(data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    log.writer.file_writer.event_writer._async_writer._writer.write = full
    with pytest.raises(OSError, match=rf"the logger's copy of step 0 to {log.path} failed: no space left on device "
                                      rf"\(it needs ~\d+ bytes, [\d.]+ GB free\); no checkpoint is kept"):
        rundir.write_step(str(tmp_path / "metrics.jsonl"), log, {"step": 0, "reward_mean": 0.5}, 0)
    log.writer.file_writer.event_writer._async_writer._worker.join()
    assert printed == []


# --------------------------------------------------------------------------- 5. Ctrl-C
@launches
@pytest.mark.parametrize("nproc", [0, 2])
def test_ctrl_c_checkpoints_and_a_second_one_stops_at_once(tmp_path, nproc):
    """The first SIGINT (to the process, or to torchrun, which forwards it to each worker) finishes
    the step, writes a checkpoint at it (none was due: save_freq=100) and exits 130 with one line
    saying how to resume; no KeyboardInterrupt or traceback from any rank. Then, resumed, two
    SIGINTs in a row (plain python) stop at once without a checkpoint, again without a traceback."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=200", "--save_freq=100", "--save=false"] + SMALL
    with open(tmp_path / "int.log", "w") as log:
        proc = start(args, nproc, log=log)
        wait_for_lines(out, 2, proc)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    text = open(tmp_path / "int.log").read()
    done = len(metrics(out))
    assert f"[preempt] SIGINT (Ctrl-C): stopped after step {done}; the weights after step {done} are in " \
           f"{_step(out, done)} (the same command resumes there)" in text and 2 <= done < 200, text[-3000:]
    assert "KeyboardInterrupt" not in text and "Traceback" not in text.split("[preempt]")[0], text[-3000:]
    if not nproc:
        assert proc.returncode == 130
    assert checkpoint.read_meta(checkpoint.checkpoint_dir(out))["step"] == done
    if nproc:
        return
    with open(tmp_path / "int2.log", "w") as log:
        proc = start(args, log=log)
        wait_for_lines(out, done + 1, proc)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    text = open(tmp_path / "int2.log").read()
    assert proc.returncode == 130 and "[interrupt] second Ctrl-C: stopped at once" in text, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert checkpoint.read_meta(checkpoint.checkpoint_dir(out))["step"] == done   # no new checkpoint


# --------------------------------------------------------------------------- 7. small ones
def test_reward_without_a_colon_says_module_function():
    import data as data_io
    with pytest.raises(ValueError, match=r"--reward mymod: give module:function \(e.g. --reward=mymod:reward\)"):
        data_io.load_reward("mymod", None)
    with pytest.raises(ValueError, match=r"--reward my.rewards.good: give module:function \(e.g. "
                                         r"--reward=my.rewards:good\)"):    # the import path written with a dot
        data_io.load_reward("my.rewards.good", None)


def test_a_picture_of_a_runs_metrics_file_names_its_folder(tmp_path):
    """plan.py --plot=<out_dir>/metrics.jsonl (the file, not the folder): one line naming the folder to pass."""
    import tracker
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=rf"^{tmp_path}/metrics.jsonl is a file: pass the run's folder, {tmp_path}$"):
        tracker.rows_of(str(tmp_path / "metrics.jsonl"))


def test_a_reward_module_that_fails_at_import_is_one_line_naming_it(tmp_path, monkeypatch):
    """--reward=badmod:fn where badmod raises at import (NameError, SyntaxError): one line naming the
    module, its error and what to do, not the import's 30-line traceback."""
    import data as data_io
    (tmp_path / "badname.py").write_text("x = undefined_name\ndef fn(r, a):\n    return 0.0\n")
    (tmp_path / "badsyntax.py").write_text("def fn(r, a)\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod, err in (("badname", "NameError: name 'undefined_name' is not defined"),
                     ("badsyntax", "SyntaxError: expected ':' (badsyntax.py, line 1)")):
        with pytest.raises(ValueError) as e:
            data_io.load_reward(f"{mod}:fn", None)
        assert str(e.value) == (f"--reward {mod}:fn: importing {mod} failed with {err}; fix {mod} "
                                f"(python -c 'import {mod}' shows the traceback)")
    with pytest.raises(ValueError, match=r"--reward badname_:fn: cannot load it \(No module named 'badname_'\)"):
        data_io.load_reward("badname_:fn", None)


def test_a_folder_as_data_or_val_data_says_so_and_what_to_pass(tmp_path):
    """--data=<a folder> said "no such file"; so did --val_data, naming --data."""
    import data as data_io
    (tmp_path / "train.parquet").write_bytes(b"")
    tokenizer = data_io.load_tokenizer(None)
    for option in ("--data", "--val_data"):
        with pytest.raises(ValueError) as e:
            data_io.run_data(options.parse_args([f"{option}={tmp_path}"]), tokenizer)
        assert str(e.value) == (f"{option} {tmp_path} is a folder; pass one .jsonl or .parquet file (it holds "
                                f"train.parquet)")


def test_hint_commands_paste_whole_when_the_path_has_spaces(tmp_path, capsys):
    """The commands a line advises (remove the out_dir, plan.py --plot, tensorboard --logdir) quote
    their paths: an out_dir with a space pasted back is one argument, not two."""
    import tracker
    out = tmp_path / "my runs" / "run 1"
    out.mkdir(parents=True)
    (out / "run_config.json").write_text('{"resolved_config": {}}')
    (out / "metrics.jsonl").write_text('{"step": 0}\n')     # an earlier run without a checkpoint
    with pytest.raises(ValueError) as e:
        rundir.plan(options.parse_args([f"--out_dir={out}"]), "abc")
    assert shlex.split(str(e.value).rpartition("or remove ")[2]) == [str(out)]
    assert str(e.value).startswith(f"--out_dir='{out}' holds an earlier run")
    tracker.picture_at_end(str(out), "cpu")
    line = capsys.readouterr().out.splitlines()[-1]
    assert shlex.split(line[line.index("python plan.py"):line.index(" draws")]) == ["python", "plan.py",
                                                                                   f"--plot={out}"]
    logger = tracker.open("tensorboard", str(out), "{}", 0)
    logger.close()
    line = capsys.readouterr().out.splitlines()[-1]
    assert shlex.split(line[line.index("(tensorboard") + 1:-1]) == ["tensorboard", "--logdir", str(out / "tensorboard")]


def test_a_refused_folder_keeps_no_lock_the_run_made(tmp_path, in_process):
    """The pre-flight refuses the out_dir (files no run wrote) or the input (--data a folder): the
    .run.lock that lock_out_dir made is gone, and a folder the run made is gone too; a lock file that
    was there before stays (an earlier run's)."""
    out = tmp_path / "nonrun"
    out.mkdir()
    (out / "run_config.json").write_text('{"mine":1}\n')
    fresh = tmp_path / "fresh"
    small = ["--steps=2", "--train_batch_size=4", "--rollout.n=4", "--actor.ppo_mini_batch_size=4"]
    for args in ([f"--out_dir={out}"], [f"--out_dir={fresh}", f"--data={tmp_path}"]):
        with pytest.raises(SystemExit) as e:
            in_process(args + small)
        assert e.value.code == 2
    assert sorted(os.listdir(out)) == ["run_config.json"] and not fresh.exists()
    (out / rundir.LOCK).write_text("an earlier run's\n")
    with pytest.raises(SystemExit):
        in_process([f"--out_dir={out}"] + small)
    assert sorted(os.listdir(out)) == [rundir.LOCK, "run_config.json"]


def test_a_run_refused_at_set_up_leaves_no_folder(tmp_path, in_process, monkeypatch, capsys):
    """The set-up's refusals (the host's RAM, the disk), after the pre-flight took the lock: the out_dir they
    made, .run.lock and all, is gone, as the pre-flight's refusals leave it."""
    import ledger
    with monkeypatch.context() as m:
        m.setattr(ledger, "host_available", lambda: 2 ** 20)
        with pytest.raises(SystemExit):
            in_process([f"--out_dir={tmp_path / 'ram'}", "--logger=none"])
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "free_bytes", lambda path: 10 * 2 ** 20)
        with pytest.raises(SystemExit):
            in_process([f"--out_dir={tmp_path / 'disk'}", "--logger=none", "--save_freq=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "GB of RAM free" in err[0] and "GB free but this run writes" in err[1], err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_help_entries_carry_only_their_own_comment():
    """A comment line at a field's indent heads the next group of fields (LoRA, packing, async
    rollout): --help gives it to none of them, while a field's own continuation lines stay its."""
    lines = {line.split("=")[0].strip(): line for line in options.usage(options.sections(options.Config())).splitlines()
             if line.startswith("  --")}
    assert lines["--actor.gradient_checkpointing"].endswith("--offload=auto turns it off where memory allows")
    assert lines["--actor.param_dtype"].endswith("master weights stay fp32 (CPU: fp32)")
    assert lines["--rollout.dtype"].endswith("auto = the actor's compute dtype")
    assert lines["--reward_error"].endswith("zero (it scores 0, counted)")     # a continuation line


@launches
def test_profile_steps_past_the_run_warn_and_lines_are_said_once_under_torchrun(tmp_path):
    """2 ranks under torchrun: --profile_steps=99 with --steps=1 warns at start (once), a prompt
    longer than max_prompt_length is dropped and said once (rank 0), and --help prints once."""
    rows = [{"prompt": f"what is {i} plus {i}", "answer": str(2 * i)} for i in range(8)]
    rows.append({"prompt": " ".join(["word"] * 200), "answer": "0"})
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run([f"--out_dir={tmp_path / 'o'}", "--steps=1", "--save=false", f"--data={path}", "--max_prompt_length=64",
             "--profile_steps=99", "--train_batch_size=4", "--actor.ppo_mini_batch_size=4", "--rollout.n=2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(f"[data] dropped 1 prompts of {path} longer than max_prompt_length=64") == 1, r.stdout[-3000:]
    assert r.stdout.count("[profile] warning: --profile_steps=99: step(s) 99 never run (--steps=1") == 1
    r = run(["--help"], nproc=2)
    assert r.returncode == 0 and r.stdout.count("--keep_checkpoints") == 1, r.stdout[-3000:]


# --------------------------------------------------------------------------- 8. torchrun's restarts
@launches
def test_torchrun_restart_after_a_dead_rank_resumes_by_itself(tmp_path, uninterrupted):
    """torchrun --max-restarts=2, 2 ranks: kill -9 rank 1 inside step 4 (the last checkpoint at step
    2). torchrun stops the other worker and starts both again with the same command line; they
    resume from the checkpoint by themselves (--resume=auto; the killed job's rank 0 released the
    out_dir lock when it died, the new rank 0 takes it) and the finished run's metrics equal an
    uninterrupted run's, each step once."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=6", "--save_freq=2", "--save=false"] + REFERENCE
    with open(tmp_path / "restart.log", "w") as log:
        proc = start(args, 2, torchrun=("--standalone", "--max-restarts=2"), log=log)
        try:
            wait_for_lines(out, 3, proc)
            first = workers(proc)
            os.kill(first[1], signal.SIGKILL)
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:               # stuck: its workers first (they are in sessions of their own)
                for pid in list(workers(proc).values()) + [proc.pid]:
                    os.kill(pid, signal.SIGKILL)
    text = open(tmp_path / "restart.log").read()
    assert proc.returncode == 0, text[-4000:]
    assert "[resume]" in text and "step_000002: step 2" in text, text[-4000:]
    resumed = metrics(out)
    assert [m["step"] for m in resumed] == list(range(6))
    assert numbers(resumed) == numbers(uninterrupted)


# --------------------------------------------------------------------------- 7. a run dropped beside an engine
def test_an_engine_built_in_this_process_leaves_the_heap_collectable(monkeypatch):
    """vLLM's engine core and worker gc.freeze() the whole heap once started. In this process the trainer
    built before the engine is on that heap: a cycle of it (a model and its hooks) would never be collected,
    and a dropped run kept its GPU params (measured: 1,889 MiB at 0.5B). A stand-in LLM freezes as vLLM
    0.26 does (gc_utils.freeze_gc_heap); after new_llm the trainer's cycle goes with its last reference."""
    import gc
    import sys
    import types
    import weakref

    import torch
    import vllm_engine

    def fake_llm(**kwargs):                # vLLM 0.26: EngineCore.__init__ -> freeze_gc_heap()
        gc.collect()
        gc.freeze()
        return types.SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=fake_llm))
    monkeypatch.setattr(os, "environ", dict(os.environ))    # new_llm sets RANK, LOCAL_RANK, vLLM's: not for later tests
    monkeypatch.setattr(vllm_engine, "start_share", lambda *a: 0.5)
    for name, value in [("get_rng_state", lambda: None), ("set_rng_state", lambda s: None),
                        ("empty_cache", lambda: None), ("mem_get_info", lambda: (80 * 2 ** 30, 80 * 2 ** 30))]:
        monkeypatch.setattr(torch.cuda, name, value)

    class Role:                            # a module and its hook point at each other: only gc frees them
        pass
    role = Role()
    role.hook = lambda: role
    gone = weakref.ref(role)
    cfg = types.SimpleNamespace(tensor_parallel_size=1, enforce_eager=True, kv_cache_dtype="auto", quantization="none")
    req = types.SimpleNamespace(dtype="bfloat16", length=32, seqs=4)
    try:
        vllm_engine.new_llm(cfg, model_dir="m", req=req, seed=0, kv=0, need={})
        assert gc.get_freeze_count() == 0, "the heap is still frozen after the engine was built"
        del role
        gc.collect()
        assert gone() is None, "the trainer's cycle outlived the run: the heap stayed frozen"
    finally:
        gc.unfreeze()


def test_a_runs_steps_skip_the_set_ups_objects_in_full_collections_and_a_dropped_run_still_goes(monkeypatch, tmp_path):
    """vLLM's sleep runs gc.collect() each step; over the set-up's ~1.1 M objects (trainer and engine, collectable
    since new_llm unfreezes them) that took 0.6 s a step, measured at 1.5B. train_grpo.run's steps run with
    them frozen (vllm_engine.frozen_heap): a cycle made by the set-up is not collected during the steps, the
    heap is thawed after them (and after a step that raised), and a run's cycle then goes with its reference."""
    import gc
    import weakref

    import train_grpo
    import vllm_engine
    seen = {}

    class Cycle:
        pass

    def steps(t, start):                   # the loop, as the set-up left it: its cycle frozen
        c = Cycle()
        c.me = c
        seen["frozen"], seen["during"] = gc.get_freeze_count(), weakref.ref(c)
        del c
        gc.collect()                       # made during the steps: not frozen, collected
        seen["collected"] = seen["during"]() is None
        open(os.path.join(t.cfg.out_dir, "metrics.jsonl"), "w").close()   # the end's summary reads it
        return True
    monkeypatch.setattr(train_grpo, "train", steps)
    train_grpo.main(["--steps=1", "--save=false", "--save_freq=0", f"--out_dir={tmp_path / 'run'}", "--logger=none"])
    assert seen["frozen"] > 10_000 and seen["collected"] and gc.get_freeze_count() == 0, seen
    with pytest.raises(RuntimeError, match="a step failed"):
        with vllm_engine.frozen_heap():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


def test_what_the_first_two_steps_keep_joins_the_frozen_heap(monkeypatch, tmp_path):
    """torch.compile's graphs and guards are made in a run's first steps, after the set-up's heap was frozen, and
    vLLM's collection in each sleep walked them (bench/gc_s 0.026 s a step at 1.5B with the head compiled, 0.012
    eager). vllm_engine.refreeze freezes what the first two steps kept, inside frozen_heap only (a heap nobody
    froze stays as it is), thawed with the rest at the run's end; train calls it after every step it runs."""
    import gc
    import weakref

    import train_grpo
    import vllm_engine

    class Cycle:
        pass
    vllm_engine.refreeze(0)                # outside frozen_heap: nothing is frozen
    assert gc.get_freeze_count() == 0
    with vllm_engine.frozen_heap():
        before, made = gc.get_freeze_count(), Cycle()
        made.me = made
        vllm_engine.refreeze(2)            # the third step on: nothing more
        assert gc.get_freeze_count() == before
        vllm_engine.refreeze(1)
        assert gc.get_freeze_count() > before
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is not None          # frozen: kept through the run's collections
    gc.collect()
    assert gone() is None and gc.get_freeze_count() == 0   # thawed at the end: collected
    calls = []
    monkeypatch.setattr(vllm_engine, "refreeze", calls.append)
    train_grpo.main(["--steps=3", "--save=false", "--save_freq=0", f"--out_dir={tmp_path / 'run'}", "--logger=none"])
    assert calls == [0, 1, 2]


def test_the_benchs_leak_listing_skips_the_engines_fake_tensors():
    """Once vLLM's heap is collectable, gc lists its compile's FakeTensors; bench_step's listing of what a dropped
    variant left asked each for its storage's address, which raises on torch 2.11 (measured: every variant of
    `one_gpu.sh logprobs` failed, the first with that error, the others building a second engine). A fake CUDA
    tensor of 32 MiB is neither an error nor counted."""
    import sys

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_step
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.empty(2 ** 23, device="cuda")
    assert fake.is_cuda
    lines = bench_step.left_models(engine=None)
    assert "python-visible CUDA storages of 16 MiB or more: 0.00 GB" in lines, lines


def test_the_benchs_profile_splits_a_step_by_stage_and_its_pseudo_flags_wrap_generation_only(tmp_path, monkeypatch):
    """bench_step's profile table (the awake engine's generation is read from it): a kernel counts in
    the stage it starts in, by kind; the host gap is the wall time no kernel covers (overlapping kernels
    once); the host's CUDA calls are summed by name per stage. The pseudo-flags wrap the sync and the sampling
    call only while a variant runs, `empty_after_sync` empties the cache after the sync, and are not options."""
    import sys

    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_step
    import vllm_engine
    x = lambda name, ts, dur, **k: {"ph": "X", "name": name, "ts": ts, "dur": dur, **k}   # noqa: E731
    events = [x("stage:generate", 0, 1000), x("stage:update", 1000, 2000),
              x("sm90_gemm", 100, 200, cat="kernel"), x("flash_fwd", 200, 200, cat="kernel"),
              x("ncclAllGather", 1500, 500, cat="kernel"),
              x("cudaGraphLaunch", 50, 20, cat="cuda_runtime"), x("cudaGraphLaunch", 500, 30, cat="cuda_runtime"),
              x("cudaLaunchKernel", 1200, 10, cat="cuda_runtime")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    table = bench_step.profile_table(str(path))
    gen, upd = table["generate"], table["update"]
    assert (gen["matmuls"], gen["attention"], gen["wall ms"], gen["host gap ms"]) == (0.2, 0.2, 1.0, 0.7)
    assert gen["host calls (ms, n)"] == {"cudaGraphLaunch": [0.05, 2]}
    assert upd["FSDP copies and collectives"] == 0.5 and upd["host gap ms"] == 1.5
    assert upd["host calls (ms, n)"] == {"cudaLaunchKernel": [0.01, 1]}
    sync, sample, emptied = (lambda *a: 7), (lambda *a: ["out"]), []
    monkeypatch.setattr(vllm_engine, "sync_weights", sync)
    monkeypatch.setattr(vllm_engine, "sample_vllm", sample)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    with bench_step.generation_as(["--rollout.sleep_level=0", "empty_after_sync"]):
        assert vllm_engine.sync_weights() == 7 and emptied == [1]
        assert vllm_engine.sample_vllm() == ["out"] and bench_step.GEN["gen_num_device_alloc"] == 0
    assert vllm_engine.sync_weights is sync and vllm_engine.sample_vllm is sample
    with bench_step.generation_as([]):
        vllm_engine.sync_weights()
    assert emptied == [1]
    assert set(bench_step.PSEUDO) >= {"gc_thawed", "empty_after_sync", "generate_pool"}


def test_options_a_run_reads_nowhere_are_said_at_set_up():
    """A critic's options under GRPO, LoRA's without its rank, the KL's without the KL loss, token budgets
    without dynamic batching, the async engine's options with a colocated one and a window of the streamed Adam
    without the stream: one warning line each in the set-up report, naming them; none at the defaults or
    where the part exists."""
    import options

    def said(*argv):
        return options.warnings(options.parse_args(list(argv)))
    assert said() == [] and said("--algorithm.adv_estimator=gae", "--critic.lr=1e-5") == []
    assert said("--actor.lora_rank=4", "--actor.lora_alpha=32") == []
    assert said("--critic.lr=1e-5", "--critic.mode=shared") == [
        "[options] warning: critic.mode=shared, critic.lr=1e-05 have no effect under GRPO, which has no critic "
        "(--algorithm.adv_estimator=gae)"]
    assert said("--actor.lora_alpha=32") == ["[options] warning: actor.lora_alpha=32 has no effect without "
                                             "actor.lora_rank"]
    assert said("--actor.use_kl_loss=false", "--actor.kl_loss_coef=0.1") == [
        "[options] warning: actor.kl_loss_coef=0.1 has no effect with actor.use_kl_loss=false"]
    assert said("--ref.log_prob_max_token_len_per_gpu=100") == [
        "[options] warning: ref.log_prob_max_token_len_per_gpu=100 has no effect without actor.use_dynamic_bsz=true "
        "(micro-batches count samples)"]
    assert said("--actor.use_dynamic_bsz=true", "--ref.log_prob_max_token_len_per_gpu=100") == []
    assert said("--rollout.max_staleness=2", "--rollout.buffer_limit=512") == [
        "[options] warning: rollout.max_staleness=2, rollout.buffer_limit=512 have no effect without "
        "rollout.mode=async"]
    assert said("--rollout.mode=async", "--rollout.max_staleness=2") == []
    assert said("--actor.optimizer_window_layers=2") == [   # as the stream's other options: said, not dropped
        "[options] warning: actor.optimizer_window_layers=2 has no effect without actor.optimizer_stream=true (Adam "
        "steps whole)"]
    assert said("--actor.optimizer_offload=true", "--actor.optimizer_stream=true",
                "--actor.optimizer_window_layers=2") == []


def test_held_out_words_are_refused_only_where_the_gsm8k_reward_reads_them(tmp_path):
    """--val_data answers that hold no number: refused with the built-in GSM8K reward (--data given), not with
    the embedded task's copy reward (no --data), which compares strings."""
    import data as data_io
    import options
    import tiny
    words = tmp_path / "words.jsonl"
    words.write_text("".join(json.dumps({"prompt": f"{c}=", "answer": f"City{c}"}) + "\n" for c in "12"))
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"prompt": f"{c}=", "answer": c}) + "\n" for c in "12"))
    tok = tiny.build_tokenizer()
    with pytest.raises(ValueError, match="--val_data .*words.jsonl: none of its 2 answers is a number"):
        data_io.run_data(options.parse_args([f"--data={numbers}", f"--val_data={words}"]), tok)
    _, val = data_io.run_data(options.parse_args([f"--val_data={words}"]), tok)
    assert val[1] == ["City1", "City2"]


def test_a_reward_module_that_calls_sys_exit_is_one_line_naming_it(tmp_path, monkeypatch, in_process, capsys):
    """sys.exit at the module's import, or inside the reward (after the set-up's lines): one line each naming
    the module, where the run once ended with no output at all."""
    import data as data_io
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\ndef fn(r, a):\n    return 0.0\n")
    (tmp_path / "exits_inside.py").write_text("import sys\ndef fn(r, a):\n    sys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^--reward exits_at_import:fn: importing exits_at_import called "
                                         r"sys.exit\(3\)"):
        data_io.load_reward("exits_at_import:fn", None)
    with pytest.raises(SystemExit) as stopped:
        in_process([f"--out_dir={tmp_path / 'run'}", "--steps=1", "--reward=exits_inside:fn", "--save=false",
                    "--train_batch_size=2", "--rollout.n=2", "--actor.ppo_mini_batch_size=2", "--logger=none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: reward exits_inside:fn called sys.exit(0) for the response "), err


def test_a_fresh_streamed_adam_state_leaves_the_weights_as_they_were():
    """The streamed optimizer's fresh state (a resume, or a first checkpoint: adam.born_on_host) comes from a step
    at learning rate 0; at the run's rate AdamW's decoupled weight decay (p -= lr x wd x p) would move each
    group's smallest param before the first update, on every resume. The rate is the run's again after."""
    import torch
    import adam
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    adam.born_on_host(opt, adam.optimizer_stash("adam", opt), adam.optimizer_windows(net, opt, 1))
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    assert opt.param_groups[0]["lr"] == 0.1 and all(s["step"] == 1 for s in opt.state.values())


def test_a_sleep_that_vllm_fails_because_another_process_took_memory_is_marked_asleep(capsys):
    """vLLM's worker releases its pool, then asserts the device's free memory did not fall; on a GPU another process
    allocates on meanwhile (seen: runs sharing an H100) that assertion used to end the run with a traceback from
    inside vLLM, the executor never marked asleep. vllm_engine.sleep marks it as vLLM's executor does (asleep, both
    tags to wake), says so once, and leaves any other assertion, and a sleep that passes, as vLLM's."""
    import types

    import vllm_engine

    class Engine:
        def __init__(self, error):
            self.error, self.levels = error, []
            self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(is_sleeping=False,
                                                                                          sleeping_tags=set()))

        def sleep(self, level):
            self.levels.append(level)
            if self.error:
                raise self.error

    fine = Engine(None)
    vllm_engine.sleep(fine, 2)
    assert fine.levels == [2] and not fine.llm_engine.model_executor.is_sleeping   # vLLM's own marking, untouched
    vllm_engine.SHARED_SLEEP_SAID.clear()
    for _ in range(2):
        shared = Engine(AssertionError("Memory usage increased after sleeping."))
        vllm_engine.sleep(shared, 1)
        executor = shared.llm_engine.model_executor
        assert executor.is_sleeping and executor.sleeping_tags == {"weights", "kv_cache"}
    assert capsys.readouterr().out.count("another process allocating on this GPU") == 1   # said once a process
    other = Engine(AssertionError("something else"))
    with pytest.raises(AssertionError, match="something else"):
        vllm_engine.sleep(other, 1)
    assert not other.llm_engine.model_executor.is_sleeping
