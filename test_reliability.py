"""Reliability on the CPU, second round (issue 24): one run per out_dir, a full disk and a damaged
checkpoint lose nothing, Ctrl-C is a clean stop, torchrun's restarts resume by themselves, and the
seq-mean loss denominators are verl's.

    python -m pytest test_reliability.py -q      # launches 1- and 2-process gloo runs itself
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import checkpoint
from test_checkpoint import OFFLOAD, SMALL, launch, numbers, uninterrupted, wait_for_lines, workers  # noqa: F401
from test_train import HERE, metrics, run


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- 1. one run per out_dir
HOLD = "import sys, time, checkpoint; checkpoint.lock_out_dir(sys.argv[1], 0); print('held', flush=True); time.sleep(600)"


def _holder(out):
    """Another process that holds out's lock (as a running rank 0 does) until it is killed."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=HERE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


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
        assert sorted(os.listdir(out)) == [checkpoint.LOCK]        # nothing written
        with pytest.raises(ValueError, match=f"pid {holder.pid}"):
            checkpoint.lock_out_dir(str(out), 0)
        checkpoint.lock_out_dir(str(out), 1)                       # another rank of a run: no lock taken
    finally:
        holder.kill()
        holder.wait()
    r = run([f"--out_dir={out}", "--steps=1", "--save=false"] + SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(open(out / checkpoint.LOCK).read())["host"] == socket.gethostname()
