"""Async rollout on the CPU (HF generate in the engine process): the buffer's bound, staleness,
each batch consumed once, the push's parity, learning, a dead engine, the truncated weights.

    python -m pytest -q test_async.py
"""
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

import actor
import rollout_async
from conftest import launches, metrics, run, start
from rollout import RolloutConfig


def test_buffer_reserves_up_to_its_bound_and_hands_each_step_once():
    b = rollout_async.Buffer(limit=16)
    assert b.reserve(8) and b.reserve(8) and not b.reserve(1)       # ordered samples count against the bound
    b.put(0, 0, {"responses": [[1]] * 8, "nbytes": 80})
    assert (b.ordered, b.waiting, b.nbytes) == (8, 8, 80)
    assert not b.reserve(1)                                         # waiting samples count too
    assert b.take(0, 1)[0]["nbytes"] == 80
    assert (b.waiting, b.nbytes) == (0, 0) and 0 not in b.parts     # taken once: gone
    assert b.reserve(8)
    got = []
    threading.Thread(target=lambda: got.append(b.take(1, 2)), daemon=True).start()
    b.put(1, 1, {"responses": [[1]] * 4, "nbytes": 40})
    time.sleep(0.2)
    assert not got                                                  # waits for every engine's part
    b.put(1, 0, {"responses": [[1]] * 4, "nbytes": 40})
    time.sleep(0.2)
    assert [len(p["responses"]) for p in got[0]] == [4, 4]          # in engine order
    b.fail("rollout engine 0 exited")
    with pytest.raises(rollout_async.EngineDied, match="engine 0 exited"):
        b.take(2, 1)


def test_buffer_limit_defaults_to_staleness_steps_and_gpus_leave_a_trainer():
    cfg = RolloutConfig(mode="async", n=8, max_staleness=2)
    assert rollout_async.buffer_limit(cfg, 16) == 2 * 16 * 8
    cfg.buffer_limit = 10                  # below one step: one step's worth (a step must fit)
    assert rollout_async.buffer_limit(cfg, 16) == 16 * 8
    assert rollout_async.trainer_world(RolloutConfig(mode="async", gpus=1), 3) == 2
    with pytest.raises(ValueError, match="leaves no trainer"):
        rollout_async.check(RolloutConfig(mode="async", gpus=2), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        rollout_async.check(RolloutConfig(mode="async", tensor_parallel_size=2), 4)


def test_truncated_importance_weights():
    old = torch.tensor([[0.0, -1.0, -3.0]])
    behaviour = torch.tensor([[0.0, -2.0, -0.5]])
    w = actor.truncated_is(old, behaviour, 2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, torch.exp(torch.tensor(-2.5)).item()]]))   # e^1 truncated at 2


@launches
@pytest.mark.timeout(900)                # 50 steps: 166 s on 2 busy cores
def test_async_run_bounds_buffer_and_staleness_over_50_steps(tmp_path):
    """max_staleness 3 but a buffer of one step: the bound binds, the engine waits (idle), host memory is flat."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=50", "--save=false", "--rollout.mode=async", "--rollout.max_staleness=3",
             "--rollout.buffer_limit=128", "--logger=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert len(m) == 50 and [x["step"] for x in m] == list(range(50))
    assert all(x["rollout/buffer_samples"] + x["rollout/buffer_ordered"] <= 128 for x in m)
    assert all(x["rollout/staleness_max"] <= 1 for x in m)         # one step in flight at most: the buffer binds
    assert max(x["rollout/staleness_max"] for x in m) == 1         # ... and the engine does run ahead
    assert sum(x["rollout/engine_idle_s"] for x in m[1:]) > 0      # it waited for room
    rss = [x["host_rss_gb"] for x in m]
    assert max(rss[10:]) - min(rss[10:]) < 0.1, rss                # flat: nothing accumulates
    assert "[rollout] async: 1 engine(s)" in r.stdout


@launches
@pytest.mark.timeout(900)                # 80 steps: 171 s on 2 busy cores
def test_async_learns_and_first_batch_matches_the_trainer(tmp_path):
    """The embedded default learns one step off-policy; at step 0 the engine holds the trainer's
    weights (the first push), so its log-probs equal the trainer's (fp32, HF on both sides)."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=80", "--save=false", "--rollout.mode=async", "--logger=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert m[0]["rollout/staleness_max"] == 0 and m[0]["rollout/logp_diff_max"] < 1e-4
    assert all(x["rollout/staleness_max"] == 1 for x in m[1:])
    assert all(0.5 < x["rollout_is/weight_mean"] < 1.5 for x in m)
    assert all(x["rollout/push_gb"] > 0 and x["time/push"] > 0 for x in m)
    first = sum(x["reward_mean"] for x in m[:10]) / 10
    last = sum(x["reward_mean"] for x in m[-10:]) / 10
    assert last > first + 0.1, (first, last)


@launches
def test_async_on_a_rank_of_its_own_under_torchrun(tmp_path):
    """--rollout.gpus=1 of 3 ranks: 2 trainers (their own group), 1 engine rank; weights by broadcast."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=4", "--save=false", "--rollout.mode=async", "--rollout.gpus=1",
             "--logger=none"], nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert len(m) == 4 and m[0]["rollout/logp_diff_max"] < 1e-4
    assert '"world_size": 2' in r.stdout


@launches
def test_dead_engine_stops_the_run_with_one_line(tmp_path):
    out = str(tmp_path / "run")
    p = start([f"--out_dir={out}", "--steps=200", "--save=false", "--rollout.mode=async", "--logger=none"],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 300
    while not (os.path.exists(path) and len(open(path).readlines()) >= 2):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.5)
    engine = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "spawn_main"], capture_output=True, text=True)
    pids = engine.stdout.split()
    assert len(pids) == 1, engine                                   # the engine process (not the resource tracker)
    os.kill(int(pids[0]), signal.SIGKILL)
    _, err = p.communicate(timeout=120)                             # no hang
    assert p.returncode == 1
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "rollout engine 0" in lines[0] and "exited" in lines[0], err[-2000:]
    assert "Traceback" not in err
