"""No input without a bound, and Ctrl-C at any moment (CPU): what the run cannot do in the host's memory is
refused at start in one line (the planner's sizes against the RAM free now), and so is a step no rank could
finish (rollout.n=100000), an --instruction longer than any prompt may be, and text the embedded tokenizer
cannot read; a huge data line is dropped without tokenizing it whole, a long stage says it is still running,
SIGTERM is answered at once, and a Ctrl-C during the async engine's start-up (plain python, or torchrun with an
engine rank) is one line with no traceback from any process, every process gone at once. Beside them: the step
line's numbers, copy_set.py's command line, and the planner on a folder with config.json alone.

    python -m pytest -q tests/test_bounds.py
"""
import json
import os
import signal
import time

import pytest

import data
import ledger
import tiny
from conftest import descendants, launches, start
from test_checkpoint import in_process  # noqa: F401
from test_faults import _engines

GB = 2 ** 30


@pytest.mark.parametrize("args,expect", [
    (["--rollout.n=4096", "--rollout.response_length=32"], "the step's largest stage (on the CPU, host memory)"),
    (["--model=random:qwen2.5-7b"], "the model read in fp32 28."),
], ids=["a huge group", "7B on a small host"])
def test_what_the_host_cannot_hold_is_refused_before_any_model(tmp_path, in_process, monkeypatch, capsys, args,
                                                                expect):
    """A node with 4 GB of RAM free: 4,096 samples a prompt of 32 tokens (the HF engine's KV cache for 65,536
    rows) or a 7B model (read in fp32 on the host) is one line naming the RAM, what needs it and what to change,
    and no model is built (the 7B would take a minute and 28 GB)."""
    monkeypatch.setattr(ledger, "host_available", lambda: 4 * GB)
    built = []
    import actor, critic, model, ref, reward_model   # noqa: E401 (each role imports load_model by name)
    for m in (model, actor, critic, ref, reward_model):
        monkeypatch.setattr(m, "load_model", lambda *a, **k: built.append(1))
    with pytest.raises(SystemExit) as stopped:
        in_process([f"--out_dir={tmp_path / 'run'}", "--logger=none", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and not built, err
    assert err[0].startswith("error: this node has 4.0 GB of RAM free but the run needs ~") and expect in err[0], err


def test_a_huge_data_line_is_dropped_without_tokenizing_it_whole(tmp_path):
    """A 20 MB prompt beside a normal one: it is dropped and counted, and the tokenizer never sees more than
    a bounded prefix of it (the whole line once cost 15 GB of RAM and minutes)."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "12=" * 7_000_000, "answer": "1"}) + "\n" +
                    json.dumps({"prompt": "34=", "answer": "34"}) + "\n")
    tok, seen = tiny.build_tokenizer(), []
    real = type(tok).__call__

    class Counting(type(tok)):
        def __call__(self, text, **kw):
            seen.append(len(text))
            return real(self, text, **kw)
    tok.__class__ = Counting
    t0 = time.time()
    prompts, answers, _ = data.load_data(str(path), tok, max_prompt_length=64)
    assert answers == ["34"] and time.time() - t0 < 30
    assert max(seen) <= 66 * data.CHARS_PER_TOKEN, max(seen)
    # a prompt under the limit whose prefix is cut (runs of one character) is still read whole
    assert data.tokens(tok, "1" * 100, 100) == [3] * 100 and data.tokens(tok, "1" * 101, 100) is None


def test_a_long_stage_says_it_is_running(monkeypatch, capsys):
    monkeypatch.setattr(ledger, "PROGRESS_S", 0.2)
    monkeypatch.setattr(ledger, "_now", {})   # a watcher an earlier test started sleeps its own period: a new one
    m = {"step": 7}
    import torch
    with ledger.stage("generate", m, torch.device("cpu")):
        time.sleep(0.7)
    time.sleep(0.1)
    out = capsys.readouterr().out
    assert out.count("[progress] step 7: generate has run") >= 2, out   # and again while it goes on


@launches
def test_sigterm_is_answered_at_once(tmp_path):
    """A SIGTERM in the middle of a long step (eight PPO epochs: seconds) is said when it comes, before that
    step's line, not only when the step ends; the step then finishes and the run stops (143)."""
    out, path = str(tmp_path / "run"), tmp_path / "log"
    with open(path, "w") as log:
        proc = start([f"--out_dir={out}", "--steps=100", "--save=false", "--logger=none", "--actor.ppo_epochs=8"],
                     log=log)
        deadline = time.time() + 300
        while not _steps(path.read_text()) and time.time() < deadline:
            time.sleep(0.2)
        done = _steps(path.read_text())
        assert done, "no step ended in 300 s"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=300)
    text = path.read_text()
    said = text.find("[preempt] SIGTERM: finishing this step, then a checkpoint")
    assert said > 0 and proc.returncode == 143, text[-2000:]
    assert _steps(text[:said]) == done and _steps(text) == done + 1, text[-3000:]


def _steps(log: str) -> int:
    """The step lines a run has printed (one at the end of each step)."""
    return sum(line.startswith("step ") for line in log.splitlines())


@launches
@pytest.mark.timeout(600)
def test_ctrl_c_during_the_async_engines_start_up_is_one_line(tmp_path):
    """Ctrl-C (to the whole process group, as a terminal sends it) while the engine process is starting:
    the run stops with set-up's one line and exit code 130; the engine, which ignores Ctrl-C from its first
    instruction, prints no KeyboardInterrupt traceback and ends with its trainer."""
    out = str(tmp_path / "run")
    with open(tmp_path / "log", "w") as log:
        proc = start([f"--out_dir={out}", "--steps=5", "--save=false", "--logger=none", "--rollout.mode=async"],
                     log=log, start_new_session=True)
        deadline = time.time() + 300
        while not _engines(proc.pid) and time.time() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        engines = _engines(proc.pid)
        assert len(engines) == 1, engines      # else the checks below would have no engine to check
        time.sleep(0.5)                    # inside the engine's imports or its model's build
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    deadline = time.time() + 120               # an engine still importing ends when it starts to run
    while time.time() < deadline and any(map(_alive, engines)):
        time.sleep(0.5)
    text = open(tmp_path / "log").read()
    assert proc.returncode == 130 and "[interrupt] Ctrl-C during set-up: stopped" in text, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert not any(map(_alive, engines)), "the engine outlived its run"


@launches
@pytest.mark.timeout(600)
@pytest.mark.parametrize("moment", ["waiting", "engine"])
def test_ctrl_c_during_the_async_set_up_under_torchrun_ends_every_process_at_once(tmp_path, moment):
    """torchrun with an engine rank (--rollout.gpus=1), Ctrl-C to torchrun while that rank waits for the trainer's
    address (`waiting`) or once its engine process runs (`engine`): the trainer's one line, no traceback from
    the engine's side (a ConnectionRefusedError once), and every worker gone well before torchrun's SIGKILL,
    30 s after its Ctrl-C (the engine rank once sat in a blocking store get until then)."""
    with open(tmp_path / "log", "w") as log:
        proc = start([f"--out_dir={tmp_path / 'run'}", "--steps=5", "--save=false", "--logger=none",
                      "--rollout.mode=async", "--rollout.gpus=1"], 2, log=log)
        deadline, ready = time.time() + 300, (lambda: _engines(proc.pid) if moment == "engine" else   # the set-up's
                                              "[data] " in open(tmp_path / "log").read())   # report, before the address
        while not ready() and time.time() < deadline:
            assert proc.poll() is None, open(tmp_path / "log").read()[-3000:]
            time.sleep(0.05)
        workers = descendants(proc.pid)
        # `waiting`: rank 0's report says the set-up ran; 2 s more let the engine rank end its imports on a busy host
        # (a Ctrl-C inside Python's import machinery is a KeyboardInterrupt traceback: not the wait this case checks)
        time.sleep(0.3 if moment == "engine" else 2)
        os.kill(proc.pid, signal.SIGINT)
        t0 = time.time()
        proc.wait(timeout=120)
    text = open(tmp_path / "log").read()
    assert time.time() - t0 < 20 and not any(map(_alive, workers)), text[-3000:]
    assert "[interrupt] Ctrl-C during set-up: stopped" in text, text[-3000:]
    assert "ConnectionRefusedError" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "rollout_engine.py" not in text, text[-3000:]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read().lower()
    except OSError:
        return False


def test_a_step_no_rank_can_finish_is_refused_with_the_n_that_fits(tmp_path, in_process, monkeypatch, capsys):
    """--rollout.n=100000 (1.6M samples a step: a host with the RAM for them samples for days) is one line before
    any model, naming the largest rollout.n that fits; that one is accepted, on 2 ranks twice as many."""
    import options
    monkeypatch.setattr(ledger, "host_available", lambda: 2 ** 50)    # the RAM check passes: the bound stops it
    import actor, critic, model, ref, reward_model   # noqa: E401 (without the bound: no model, a quick failure)
    for m in (model, actor, critic, ref, reward_model):
        monkeypatch.setattr(m, "load_model", lambda *a, **k: 1 / 0)
    with pytest.raises(SystemExit) as stopped:
        in_process([f"--out_dir={tmp_path / 'run'}", "--logger=none", "--rollout.n=100000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --rollout.n=100000 x train_batch_size=16 is 1,600,000 samples a step") and \
        "use at most --rollout.n=4096 here" in err[0], err
    assert options.check_sizes(options.parse_args(["--rollout.n=4096"]), 1) == 65536   # a mini-batch: all of it
    options.check_sizes(options.parse_args(["--rollout.n=8192"]), 2)
    with pytest.raises(ValueError, match="use at most --rollout.n=512 here"):   # 2^26 tokens: 8,192 x 8,192
        options.check_sizes(options.parse_args(["--rollout.n=1024", "--rollout.response_length=8192"]), 1)


def test_an_instruction_longer_than_any_prompt_may_be_blames_itself():
    """A 5,000-character --instruction: the line names the instruction and the limit, not the data file."""
    import options
    with pytest.raises(ValueError, match=r"^--instruction \(5,000 characters\) is longer than max_prompt_length=1024 "
                                         r"tokens by itself"):
        data.run_data(options.parse_args(["--instruction=" + "x" * 5000]), tiny.build_tokenizer())
    with pytest.raises(ValueError, match=r"fits max_prompt_length=6 with --instruction \(3 characters\) appended"):
        data.run_data(options.parse_args(["--instruction=123", "--max_prompt_length=6"]), tiny.build_tokenizer())


def test_the_step_line_counts_steps_from_0_like_metrics_jsonl():
    import tracker
    assert tracker.log_line({"reward_mean": 0.5}, 0, 150, time.time()).startswith("step 0 (1/150) [")
    assert tracker.log_line({}, 149, 150, time.time() - 1, 140).startswith("step 149 (150/150) [####")


def test_copy_set_takes_roles_as_readme_writes_them_and_says_what_it_knows(capsys):
    """`ref.py` as README's table writes it, a misspelt role (one line listing the roles) and --help (usage)."""
    import copy_set
    assert copy_set.main(["ref.py"]) == 0 and capsys.readouterr().out.startswith("ref.py: 5 files")
    assert copy_set.main(["reff"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: copy_set.py: no project file reff; roles: {', '.join(copy_set.ROLES)} (or any other "
                   f"file here, e.g. model)"]
    assert copy_set.main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: python copy_set.py [ROLE")


def test_the_planner_takes_a_folder_with_config_json_alone_and_the_run_does_not(tmp_path, capsys):
    """README: the planner predicts from the options and config.json before anything is built, so a folder with
    only config.json is planned (no tokenizer: at --max_prompt_length); the run's pre-flight still wants weights."""
    import checks
    import plan
    tiny.tiny_config().save_pretrained(tmp_path)
    plan.main([f"--model={tmp_path}", "--nproc=1", "--gpu_gb=80", "--max_prompt_length=32"])
    out = capsys.readouterr().out
    assert "has no tokenizer to measure the prompts: planned at --max_prompt_length=32 tokens" in out, out
    assert f"[plan] {tmp_path} on 1 x 80 GB, vllm rollout, prompt 32 + response 4 tokens" in out, out
    with pytest.raises(FileNotFoundError, match="no weights there"):
        checks.check_model(str(tmp_path), 4)


GSM8K_ROW = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. How many clips did Natalia sell altogether in April and May?", "answer": "#### 72"}


def test_text_the_embedded_tokenizer_cannot_read_is_said_or_refused(tmp_path, capsys):
    """The embedded model's tokenizer knows 14 characters: a GSM8K file (98 % of its characters lost: it reads
    '    48      ') is refused with what to pass; an --instruction in words is said once with its share; the
    built-in task says nothing."""
    import options
    tok, path = tiny.build_tokenizer(), tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps(GSM8K_ROW) + "\n")
    cfg = options.parse_args([f"--data={path}"])
    with pytest.raises(ValueError, match=r"98% of the prompts' characters are none of them and vanish \(the first "
                                         r"reads '    48   .*pass --model=<a Hugging Face model folder>"):
        tiny.check_text(cfg.model, cfg.instruction, data.run_data(cfg, tok))
    capsys.readouterr()
    for argv in ([], ["--instruction=Copy the digits"]):
        cfg = options.parse_args(argv)
        tiny.check_text(cfg.model, cfg.instruction, data.run_data(cfg, tok))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("[data] warning: the embedded default model has a tokenizer of 14 "
                                               "characters (digits, '=+#' and space): 13 of --instruction's 13 "), out


def test_the_pre_flight_refuses_text_the_embedded_tokenizer_cannot_read(tmp_path, in_process, capsys):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps(GSM8K_ROW) + "\n")
    with pytest.raises(SystemExit) as stopped:
        in_process([f"--out_dir={tmp_path / 'run'}", f"--data={path}", "--logger=none", "--steps=1", "--save=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and "98% of the prompts' characters" in err[0], err
