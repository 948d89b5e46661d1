"""Async rollout's faults and the settings a run cannot honour (CPU): Ctrl-C in every layout, a killed engine,
layouts refused before a rank leaves, a resume that takes each step's own prompts, the correction's top-p
refusal, the set-up's verdict near the GPU, no negative budget.

    python -m pytest -q tests/test_faults.py
"""
import os
import re
import signal
import time

import pytest
import torch

import checkpoint
import options
import plan
import predict
from conftest import descendants, launches, metrics, run, start, stop
from test_checkpoint import in_process  # noqa: F401

S = ["--train_batch_size=4", "--rollout.n=4", "--actor.ppo_mini_batch_size=4", "--logger=none", "--save=false"]
ASYNC = ["--rollout.mode=async"]


def _wait_for_steps(out: str, n: int, proc, limit: float = 300):
    path, t0 = os.path.join(out, "metrics.jsonl"), time.time()
    while not (os.path.exists(path) and len(open(path).readlines()) >= n):
        assert proc.poll() is None and time.time() - t0 < limit, \
            open(os.path.join(os.path.dirname(out), "log")).read()[-3000:]
        time.sleep(0.3)


def _engines(pid: int) -> list[int]:
    """The engine processes below pid (multiprocessing's spawned children; not its resource tracker)."""
    out = []
    for d in descendants(pid):
        try:
            cmd = open(f"/proc/{d}/cmdline").read()
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            out.append(d)
    return out


@launches
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [0, 3])
def test_ctrl_c_of_an_async_run_checkpoints_stops_the_engines_and_resumes(tmp_path, nproc):
    """Ctrl-C as a terminal sends it: to the run's whole process group with plain python (the engine beside
    rank 0 is in it), to torchrun, which forwards it to each worker's group (2 trainers, an engine rank and
    its engine process). The step finishes, a checkpoint with its policy version is written, the engines
    stop, one line says how to resume and no rank prints a traceback; the same command then resumes."""
    out, extra = str(tmp_path / "run"), (["--rollout.gpus=1"] if nproc else [])
    args = [f"--out_dir={out}", "--steps=60", "--save_freq=50", *S, *ASYNC, *extra]
    with open(tmp_path / "log", "w") as log:
        proc = start(args, nproc, log=log, start_new_session=True)
        _wait_for_steps(out, 2, proc)
        engines = _engines(proc.pid)
        assert len(engines) == 1, engines
        os.killpg(proc.pid, signal.SIGINT) if not nproc else os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
    text = open(tmp_path / "log").read()
    done = len(metrics(out))
    step = os.path.join(out, "checkpoints", f"step_{done:06d}")
    assert f"[preempt] SIGINT (Ctrl-C): stopped after step {done}; the weights after step {done} are in {step} (the " \
           f"same command resumes there)" in text and 2 <= done < 60, text[-3000:]
    before = text.split("[preempt]")[0]
    assert "Traceback" not in before and "KeyboardInterrupt" not in before and "error:" not in before, text[-3000:]
    meta = checkpoint.read_meta(checkpoint.checkpoint_dir(out))
    assert meta["step"] == done and meta["policy_version"] == done
    time.sleep(1)
    assert not any(os.path.exists(f"/proc/{e}") and "zombie" not in open(f"/proc/{e}/status").read().lower()
                   for e in engines), "the engine outlived its run"
    r = run([f"--out_dir={out}", f"--steps={done + 2}", "--save_freq=50", *S, *ASYNC, *extra], nproc)
    assert r.returncode == 0 and len(metrics(out)) == done + 2, r.stderr[-3000:]


@launches
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [0, 3])
def test_a_killed_engine_is_the_documented_line_once(tmp_path, nproc):
    """kill -9 of the engine process mid-run: one `error:` line, the one docs/rollout.md documents (which engine,
    its pid, its exit code), from rank 0 alone, ending with where the weights trained so far are (a checkpoint
    of the last finished step, every rank in its save); no traceback from any rank, and nothing hangs."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=200", *S, *ASYNC] + (["--rollout.gpus=1"] if nproc else [])
    with open(tmp_path / "log", "w") as log:
        proc = start(args, nproc, log=log)
        _wait_for_steps(out, 2, proc)
        (engine,) = _engines(proc.pid)
        os.kill(engine, signal.SIGKILL)
        proc.wait(timeout=180)
    text = open(tmp_path / "log").read()
    lines = [x for x in text.splitlines() if x.startswith("error:")]   # (torchrun's summary quotes it: its root cause)
    assert proc.returncode != 0 and len(lines) == 1, text[-3000:]
    assert re.search(rf"error: rollout engine 0 \(pid {engine}\) exited with code -9: "
                     rf"its connection closed", lines[0]) \
        or (nproc and re.search(r"error: rollout engine 0 \(its rank\) exited: its connection closed", lines[0])), lines
    kept = re.search(r"; the weights after step (\d+) are in (\S+) \(the same command resumes there\)$", lines[0])
    assert kept, text[-4000:]
    n = int(kept[1])
    assert n >= 2 and checkpoint.newest(out).endswith(f"step_{n:06d}"), (lines[0], checkpoint.newest(out))
    assert 'train_grpo.py", line' not in text and ".py\", line" not in text.split("torch/distributed/run.py")[0], \
        text[-3000:]                           # no rank's traceback (torchrun's own summary follows a failed job)
    if nproc:
        assert f"traceback : {lines[0]}" in text.split("Root Cause")[1]   # torchrun's root cause: our line


@launches
@pytest.mark.timeout(600)
def test_layouts_that_cannot_run_are_one_line_before_any_rank_leaves(tmp_path):
    """Every rank an engine (torchrun 2, rollout.gpus=2: it hung, nothing printed), an engine rank in one
    process (it was KeyError: 'WORLD_SIZE'), rollout.gpus without async (it was ignored), a buffer below
    one step: each one `error:` line, exit 2, within seconds."""
    cases = [(2, ASYNC + ["--rollout.gpus=2"], "--rollout.gpus=2 leaves no trainer among the 2 rank(s)"),
             (0, ASYNC + ["--rollout.gpus=1"],
              "--rollout.gpus=1 leaves no trainer among the 1 rank(s) started (plain python is one"),
             (0, ["--rollout.gpus=1"], "--rollout.gpus=1 is for --rollout.mode=async"),
             (0, ASYNC + ["--rollout.buffer_limit=5"], "--rollout.buffer_limit=5 is below one step's 16 samples")]
    for nproc, extra, expect in cases:
        t0 = time.time()
        r = run([f"--out_dir={tmp_path / 'o'}", "--steps=2", *S, *extra], nproc, timeout=120)
        mine = [x for x in r.stderr.splitlines() if x.startswith("error:")]
        assert r.returncode != 0 and len(mine) == 1 and expect in mine[0], r.stderr[-2000:]
        assert time.time() - t0 < 100 and 'train_grpo.py", line' not in r.stderr   # no rank's traceback


@launches
@pytest.mark.timeout(900)
def test_an_async_run_killed_and_resumed_trains_each_steps_own_prompts(tmp_path):
    """A kill -9 of the whole run after step 4 (checkpoints every 2 steps) and the same command again: every
    step trains the prompts an uninterrupted run trains at that step (data/prompt_crc), none skipped or
    repeated."""
    args = ["--steps=7", "--save_freq=2", *S, *ASYNC]
    r = run([f"--out_dir={tmp_path / 'whole'}", *args])
    assert r.returncode == 0, r.stderr[-3000:]
    whole = {x["step"]: x["data/prompt_crc"] for x in metrics(tmp_path / "whole")}
    out = str(tmp_path / "cut")
    with open(tmp_path / "log", "w") as log:
        proc = start([f"--out_dir={out}", *args], log=log)
        _wait_for_steps(out, 5, proc)
        stop(proc)                             # SIGKILL the run and its engine
    r = run([f"--out_dir={out}", *args])
    assert r.returncode == 0, r.stderr[-3000:]
    cut = metrics(out)
    assert [x["step"] for x in cut] == list(range(7))
    assert {x["step"]: x["data/prompt_crc"] for x in cut} == whole and len(set(whole.values())) == 7


def test_the_rollout_correction_refuses_a_truncated_sampler():
    """vLLM's log-probs under top-p / top-k are the renormalised truncated distribution's: with the
    correction on (async, FP8, or asked for) such a sampler is one line; without it, allowed."""
    for extra in (["--rollout.mode=async", "--rollout.top_p=0.8"],
                  ["--rollout.kv_cache_dtype=fp8", "--rollout.top_k=20"],
                  ["--actor.rollout_is=token", "--rollout.top_p=0.9"]):
        with pytest.raises(ValueError, match=r"with the rollout correction .* off by the kept probability mass"):
            options.parse_args(extra)
    assert options.parse_args(["--rollout.top_p=0.8"]).actor.rollout_is == "none"


def test_rollout_is_help_says_when_auto_turns_the_correction_on():
    """--help's "auto" for actor.rollout_is names both cases options.check_config turns it on for."""
    help_line = next(line for line in options.usage(options.sections(options.Config())).splitlines()
                     if line.startswith("  --actor.rollout_is="))
    assert help_line.endswith("auto: token with rollout.mode=async or an FP8 engine")
    for extra in (["--rollout.mode=async"], ["--rollout.kv_cache_dtype=fp8"], ["--rollout.quantization=fp8"]):
        assert options.parse_args(extra).actor.rollout_is == "token", extra


def test_fp8_on_hf_generate_is_refused_at_start_in_one_line(tmp_path, in_process, capsys):
    """FP8 is vLLM's: on HF generate (given, or auto without vLLM or a GPU) the flags would change nothing but
    turn the rollout correction on. The run stops before anything is built, with one line naming the flag, the
    engine and what to change; no step runs, so no correction without a quantizing engine."""
    import importlib.util
    auto_is_hf = not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None
    for extra in ([["--rollout.engine=hf", "--rollout.quantization=fp8"]]
                  + [["--rollout.kv_cache_dtype=fp8"]] * auto_is_hf):
        out = tmp_path / extra[-1].split("=")[0][2:]
        with pytest.raises(SystemExit) as e:
            in_process([f"--out_dir={out}", "--steps=1", *S, *extra])
        err = capsys.readouterr().err.strip().splitlines()
        how = "--rollout.engine=hf" if "--rollout.engine=hf" in extra else "--rollout.engine=auto found no vLLM"
        assert e.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: {extra[-1]} needs the vLLM engine, and this run generates with HF generate "
                                 f"({how}") \
            and err[0].endswith("use --rollout.engine=vllm on a GPU with vLLM, or drop the flag")
        assert not os.path.exists(out / "metrics.jsonl")


def test_the_set_up_says_when_a_stage_is_inside_the_margin(monkeypatch):
    """7B full fine-tuning on one H200 with the reference offloaded: the plan's update sits inside the 10 %
    margin, and the set-up's line says so with what --offload=auto would do; a run well inside gets none."""
    import ledger
    monkeypatch.setattr(ledger, "gpu_capacity", lambda device: int(139.8 * 2 ** 30))   # an H200
    monkeypatch.setattr(ledger, "host_bytes_per_rank", lambda: 2 ** 40)   # its node's RAM, not this host's
    cfg = options.parse_args(["--model=random:qwen2.5-7b", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8",
                              "--rollout.response_length=128", "--ref.param_offload=true"])
    p = predict.predict(cfg, 1, 128)
    assert 0.9 * 139.8 < p.device_peak / 2 ** 30 <= 139.8      # this configuration's update: inside the margin
    line = plan.verdict(cfg, p, 1, 128, "vllm", torch.device("cuda"))
    assert line and "inside the 10% margin of the GPU's 139.8 GB" in line and "--offload=auto would " in line
    assert re.search(r"--offload=auto would [^:]*: --\w+\.\w+=", line), line   # it names the flags
    small = options.parse_args(["--model=random:qwen2.5-0.5b", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8"])
    assert plan.verdict(small, predict.predict(small, 1, 128), 1, 128, "vllm", torch.device("cuda")) is None


def test_no_negative_budget_on_a_gpu_too_small(capsys):
    """plan.py on a GPU smaller than its margin, CUDA context and a sleeping vLLM: no negative GB anywhere."""
    plan.main(["--gpu_gb=1", "--model=random:qwen2.5-0.5b"])
    text = capsys.readouterr().out
    assert "leave it no room" in text and not re.search(r"(?<![\w.])-\d", text), text[-600:]   # (not qwen2.5-0.5b)
