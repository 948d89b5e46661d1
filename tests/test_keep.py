"""Whatever stops a run, the weights trained so far are kept and its last line says where (CPU): a full
disk at a write other than the final save, SIGTERM and Ctrl-C, a reward that fails after the first update (on
several ranks too: the every-rank error), a plain error or a stage's OOM on one rank;
with --save_freq=0 in final/ (its room was set aside at the start), else in a checkpoint; and a finished or
stopped --save_freq=0 run is called what it is when the same command meets it again.

    python -m pytest -q tests/test_keep.py
"""
import json
import os
import signal

import pytest

import rundir
from conftest import launches, metrics, start
from test_checkpoint import in_process, wait_for_lines  # noqa: F401
from test_reliability import TINY, _after, small_disk  # noqa: F401


def _final_steps(out) -> int:
    with open(os.path.join(out, "final", "run_config.json")) as f:
        return json.load(f)["steps_done"]


def test_a_full_disk_at_a_metrics_line_keeps_the_weights_in_final(small_disk, in_process, monkeypatch, capsys):
    """--save_freq=0: the disk fills to 1000 bytes free after step 0's line, so step 1's line fails. Every
    rank stops after that step, final/ is written from the room set aside at the start, and the one error
    line names metrics.jsonl, the bytes, and that the weights after step 2 are in final/; the same command
    then says the folder holds a run stopped after 2 of 4 steps, and how to go on from its weights."""
    out = os.path.join(small_disk.root, "run")
    args = [f"--out_dir={out}", "--steps=4", "--save_freq=0"] + TINY
    with monkeypatch.context() as m:
        _after(m, rundir, "write_step", 1, lambda: small_disk.fill(1000))
        with pytest.raises(SystemExit) as stopped:
            in_process(args)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: writing step 1's line to {out}/metrics.jsonl failed: no "
                                               f"space left on device (it needs ~"), err
    assert err[0].endswith(f"the weights after step 2 are in {out}/final; --save_freq=0 keeps no checkpoint: train "
                           f"further with --model={out}/final in another --out_dir"), err
    assert "lost" not in err[0] and "is kept" not in err[0], err   # no advice from before the weights were kept
    assert _final_steps(out) == 2 and [x["step"] for x in metrics(out)] == [0]
    os.remove(os.path.join(small_disk.root, "filler"))
    with pytest.raises(SystemExit):
        in_process(args)
    assert f"holds a run stopped after 2 of 4 steps (the policy in {out}/final" in capsys.readouterr().err


def test_a_reward_that_fails_after_the_first_update_keeps_the_weights(tmp_path, in_process, monkeypatch, capsys):
    """A reward that raises in step 2 (--reward_error=stop): with --save_freq=0 the weights after step 2 go
    to final/; with checkpoints every 5 steps a checkpoint of step 2 is written and the same command
    resumes there. The error line says which."""
    (tmp_path / "flaky.py").write_text(
        "import tiny\ncalls = []\n\ndef reward(response, answer):\n    calls.append(1)\n"
        "    if len(calls) > 8:\n        raise RuntimeError('the grader went away')\n"
        "    return tiny.copy_reward(response, answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import flaky
    for save_freq, where in (("0", "final"), ("5", "checkpoints/step_000002")):
        flaky.calls.clear()
        out = str(tmp_path / f"run{save_freq}")
        with pytest.raises(SystemExit):
            in_process([f"--out_dir={out}", "--steps=4", f"--save_freq={save_freq}", "--reward=flaky:reward",
                        "--val_freq=0", "--val_before_train=false"] + TINY)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "raised RuntimeError: the grader went away" in err[0], err
        assert f"; the weights after step 2 are in {out}/{where}" in err[0], err
        assert os.path.isdir(os.path.join(out, where))
    assert _final_steps(str(tmp_path / "run0")) == 2


def test_a_finished_save_freq_0_run_is_called_finished(tmp_path, in_process, capsys):
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=2", "--save_freq=0"] + TINY
    in_process(args)
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"[done] finished: 2 steps; the policy in {out}/final"
    with pytest.raises(SystemExit):
        in_process(args)
    err = capsys.readouterr().err
    assert f"holds a finished run (2 steps, the policy in {out}/final; it kept no checkpoint" in err, err
    assert "no checkpoint to resume from" not in err


@pytest.mark.parametrize("save", ["--save=false", "--save=true"])
def test_a_stop_in_the_last_step_keeps_its_checkpoint(tmp_path, in_process, monkeypatch, capsys, save):
    """SIGTERM while the last step runs: the step ends and writes the checkpoint every run's last step writes
    (a stop used to skip it, and with --save=false the trained weights were lost), the run ends as finished and
    says where the weights are; the same command then finds a finished run."""
    import train_grpo
    out, real = str(tmp_path / "run"), train_grpo.train_step

    def step(t, k):                        # the signal arrives inside step 1, the last of 2
        if k == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(t, k)
    args = [f"--out_dir={out}", "--steps=2", save] + TINY
    with monkeypatch.context() as m:
        m.setattr(train_grpo, "train_step", step)
        in_process(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "[preempt] SIGTERM: finishing this step, then a checkpoint" in lines, lines[-20:]
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_000002")) and len(metrics(out)) == 2
    kept = f"its checkpoint in {out}/checkpoints/step_000002"
    policy = f"the policy in {out}/final, " if save == "--save=true" else ""
    assert lines[-1] == "[done] finished: 2 steps; " + policy + kept, lines[-1]
    with pytest.raises(SystemExit):
        in_process(args)
    assert f"{out} holds a finished run (2 steps done" in capsys.readouterr().err


@launches
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_of_a_save_freq_0_run_keep_the_weights_in_final(tmp_path, sig, code):
    """--save_freq=0 keeps no checkpoint: a SIGTERM or Ctrl-C lets the step finish, writes final/ with the
    weights of the steps done (Ctrl-C first says so) and ends on the line that says where they are."""
    out = str(tmp_path / "run")
    with open(tmp_path / "log", "w") as log:
        proc = start([f"--out_dir={out}", "--steps=200", "--save_freq=0"] + TINY, log=log)
        wait_for_lines(out, 2, proc)
        os.kill(proc.pid, sig)
        proc.wait(timeout=120)
    text = open(tmp_path / "log").read()
    done = len(metrics(out))
    assert proc.returncode == code and _final_steps(out) == done, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.endswith(f"stopped after step {done}; the weights after step {done} are in {out}/final; "
                         f"--save_freq=0 keeps no checkpoint: train further with --model={out}/final in another "
                         f"--out_dir"), last
    if sig == signal.SIGINT:
        assert "[interrupt] Ctrl-C: finishing this step, then the weights to final/ (--save_freq=0)" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("error,code", [(ValueError("a bad value"), 2), (OSError("a read failed"), 2),
                                        ("oom", 1)], ids=["ValueError", "OSError", "out of memory"])
def test_a_one_rank_run_that_stops_on_a_plain_error_keeps_its_weights(tmp_path, in_process, monkeypatch, capsys,
                                                                       error, code):
    """One rank, --save_freq=0: a plain error in step 2's advantage stage (a ValueError, an OSError, an OOM that
    the stage explains) stops the run with one line that ends saying the weights after step 2 are in final/,
    and they are (on several ranks only an every-rank error is kept: the others may be inside a collective)."""
    import losses
    import torch
    real, calls = losses.grpo_advantage, []

    def advantage(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)") if error == "oom" else error
        return real(*a, **k)
    monkeypatch.setattr(losses, "grpo_advantage", advantage)
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as stopped:
        in_process([f"--out_dir={out}", "--steps=4", "--save_freq=0", "--val_freq=0", "--val_before_train=false"]
                   + TINY)
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == code and len(err) == 1, err
    assert f"; the weights after step 2 are in {out}/final; --save_freq=0 keeps no checkpoint" in err[0], err
    assert _final_steps(out) == 2


def test_a_failed_reward_on_several_ranks_is_the_every_rank_error_that_keeps_the_weights(tmp_path, in_process,
                                                                                         monkeypatch, capsys):
    """On several ranks only an error that every rank raises at the same point keeps the weights (another rank
    may be inside a collective): a failed reward must be that one (data.EveryRank, after its all-reduce), not a
    plain ValueError. One rank that counts itself as two; the reward raises in step 2."""
    import data
    import train_grpo
    real = train_grpo.setup

    def two_ranks(*a, **k):
        t = real(*a, **k)
        t.world = 2
        return t
    monkeypatch.setattr(train_grpo, "setup", two_ranks)
    calls = []

    def flaky(response, answer):           # 4 responses a step: the 9th call is in step 2
        calls.append(1)
        if len(calls) > 8:
            raise RuntimeError("the grader went away")
        return 1.0
    monkeypatch.setattr(data, "load_reward", lambda *a, **k: flaky)
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit):
        in_process([f"--out_dir={out}", "--steps=4", "--save_freq=0", "--val_freq=0", "--val_before_train=false"]
                   + TINY)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "raised RuntimeError: the grader went away" in err[0], err
    assert f"; the weights after step 2 are in {out}/final" in err[0] and _final_steps(out) == 2, err
