"""Checkpoints, resume and the out_dir policy on the CPU: a killed run resumes bit-exactly, SIGTERM
saves first, a checkpoint loads at another world size, a half-written one is never used, a
stalled rank ends the job, an earlier run is never overwritten, and errors are one line.

    python -m pytest tests/test_checkpoint.py -q       # launches 1- and 2-process gloo runs itself
"""
import json
import os
import signal
import time

import pytest
import torch

import checkpoint
import rundir
import train_grpo
import options
from conftest import launches, metrics, run, start

# every manual offload flag on: the checkpoint brackets really copy and free the storages on CPU
OFFLOAD = ["--actor.param_offload=true", "--actor.optimizer_offload=true", "--ref.param_offload=true"]
SMALL = ["--train_batch_size=8", "--actor.ppo_mini_batch_size=4", "--rollout.n=4"]   # 2 optimizer steps a step
MIXED = ["--actor.shuffle=true"]           # the samples mixed across those steps: a resume mixes them alike
REFERENCE = OFFLOAD + SMALL + MIXED        # the uninterrupted run's flags: a run compared with it takes them too
# what a step computed (not how long it took or where its bytes were)
NUMBERS = ("reward_mean", "response_length", "pg_loss", "kl", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm",
           "optimizer_steps", "skipped_steps", "delta_w_abs_mean", "reward/equal_groups_frac", "critic/vf_loss",
           "critic/vf_clipfrac", "critic/grad_norm", "response/clipped_frac")


def numbers(rows):
    return [{k: r[k] for k in NUMBERS if k in r} for r in rows]


def wait_for_lines(out, n, proc, timeout=300):
    """Until metrics.jsonl has n lines (the run is then inside step n)."""
    path, t0 = os.path.join(out, "metrics.jsonl"), time.time()
    while time.time() - t0 < timeout:
        if os.path.isfile(path) and len(open(path).readlines()) >= n:
            return
        assert proc.poll() is None, "the run ended before it got there"
        time.sleep(0.05)
    raise AssertionError(f"no {n} metrics lines in {timeout} s")


def workers(proc) -> dict:
    """{rank: pid} of torchrun's worker processes (each in a session of its own)."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    out = {}
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        out[int(env[b"RANK"])] = pid
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 6 steps on 2 ranks (offload flags on, samples mixed, checkpoints every 2 steps), never stopped."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    r = run([f"--out_dir={out}", "--steps=6", "--save_freq=2", "--save=false"] + REFERENCE, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return metrics(out)


@pytest.fixture
def in_process(monkeypatch, dist_env):
    """train_grpo.main in this process: its signal handlers are put back after, and the process
    group it would destroy at the end is kept for the other tests."""
    import torch.distributed as dist
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: None)
    import train_grpo
    yield train_grpo.main
    for s, h in handlers.items():
        signal.signal(s, h)


@launches
def test_sigkill_mid_step_then_resume_equals_uninterrupted(tmp_path, uninterrupted):
    """SIGKILL the whole 2-rank job ~0.3 s into step 4 (3 metrics lines written, the last checkpoint
    at step 2); the same command resumes from that checkpoint, drops the line of step 2 written
    after it, and every step's metrics of the finished run equal the uninterrupted run's, bit for
    bit (fp32 on the CPU), each step exactly once."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=6", "--save_freq=2", "--save=false"] + REFERENCE
    with open(tmp_path / "killed.log", "w") as log:
        proc = start(args, 2, log=log)
        wait_for_lines(out, 3, proc)
        time.sleep(0.3)
        for pid in list(workers(proc).values()) + [proc.pid]:   # both ranks and torchrun: no handler runs
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    killed = metrics(out)
    assert len(killed) >= 3 and checkpoint.read_meta(checkpoint.checkpoint_dir(out))["step"] < len(killed)
    r = run(args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[resume]" in r.stdout
    resumed = metrics(out)
    assert [m["step"] for m in resumed] == list(range(6))
    assert numbers(resumed) == numbers(uninterrupted)


@launches
def test_sigterm_saves_a_checkpoint_then_resume_equals_uninterrupted(tmp_path, uninterrupted):
    """SIGTERM to torchrun (what a preemption sends; it forwards it to both ranks) during step 3:
    the ranks finish the step, write a checkpoint at the step they finished (no periodic
    checkpoint was due: save_freq=100) and exit with the [preempt] line; the same command resumes
    there and the run's metrics equal the uninterrupted run's."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--steps=6", "--save_freq=100", "--save=false"] + REFERENCE
    with open(tmp_path / "term.log", "w") as log:
        proc = start(args, 2, log=log)
        wait_for_lines(out, 2, proc)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    text = open(tmp_path / "term.log").read()
    done = len(metrics(out))
    assert "[preempt] SIGTERM" in text and 2 <= done < 6, text[-3000:]
    assert checkpoint.read_meta(checkpoint.checkpoint_dir(out))["step"] == done
    r = run(args, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert numbers(metrics(out)) == numbers(uninterrupted)


@launches
def test_resume_at_another_world_size(tmp_path, dist_env):
    """A checkpoint written by 2 ranks loads into 1 (DCP reshards): the 1-rank trainer's params
    equal the 2-rank run's final/ weights at that step, and its params and AdamW state equal the
    checkpoint read back independently (dcp_to_torch_save), bit for bit; it then trains on."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict
    out = str(tmp_path / "two")
    r = run([f"--out_dir={out}", "--steps=2", "--save_freq=2"] + SMALL, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = checkpoint.checkpoint_dir(out)
    cfg = options.parse_args([f"--out_dir={tmp_path / 'one'}", "--steps=3", f"--resume={ckpt}"] + SMALL)
    (data, val), resume = train_grpo.preflight(cfg)   # (training, held-out) prompts, the checkpoint to resume
    assert resume == ckpt
    t = train_grpo.setup(cfg, data=data, val=val)
    assert t.world == 1 and train_grpo.resume(t, resume) == 2
    model_sd, optim_sd = get_state_dict(t.actor.model, t.actor.optimizer)
    dcp_to_torch_save(os.path.join(ckpt, "actor"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    final = load_file(os.path.join(out, "final", "model.safetensors"))
    for name, p in model_sd.items():
        p = p.full_tensor()
        assert torch.equal(p, full["model"][name]), name
        assert torch.equal(p, final.get(name, final["model.embed_tokens.weight"])), name   # lm_head is tied
    states = 0
    for name, st in optim_sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            v = st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k]
            assert torch.equal(v, full["optim"]["state"][name][k].reshape(v.shape)), (name, k)
            states += 1
    assert states == 3 * len(list(t.actor.model.parameters()))
    m = train_grpo.train_step(t, 2)
    assert m["optimizer_steps"] == 2 and m["skipped_steps"] == 0 and m["delta_w_abs_mean"] > 0


@launches
def test_ppo_resume_with_offloaded_critic_is_bit_exact(tmp_path):
    """PPO with a separate critic, every offload flag on (actor, ref, critic params and Adam):
    2 steps, then the same out_dir with --steps=4 (a finished run extended) equals 4 steps in one
    go: the same metrics for every step, each step once, and bit-identical final/ weights."""
    from safetensors.torch import load_file
    flags = ["--algorithm.adv_estimator=gae", "--critic.param_offload=true", "--critic.optimizer_offload=true",
             "--save_freq=2"] + OFFLOAD + SMALL
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    r = run([f"--out_dir={one}", "--steps=4"] + flags)
    assert r.returncode == 0, r.stderr[-3000:]
    for steps in (2, 4):
        r = run([f"--out_dir={two}", f"--steps={steps}"] + flags)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "[resume]" in r.stdout and [m["step"] for m in metrics(two)] == [0, 1, 2, 3]
    assert numbers(metrics(two)) == numbers(metrics(one))
    assert all(k in metrics(two)[-1] for k in ("critic/vf_loss", "offload/critic_optimizer/offload_gb"))
    a, b = (load_file(os.path.join(d, "final", "model.safetensors")) for d in (one, two))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@launches
def test_half_written_checkpoints_are_never_used_and_only_k_are_kept(tmp_path):
    """--save_freq=1 --keep_checkpoints=2 over 3 steps leaves step 2 and 3, `latest` naming step 3.
    A save cut short (.tmp-step_4 without meta.json) and a later step dir without meta.json are
    never picked: the next run resumes at step 3, and its own save at step 4 replaces the first
    and removes the second (a step past it is a killed run's leftover)."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--save_freq=1", "--keep_checkpoints=2", "--save=false"] + SMALL
    r = run(args + ["--steps=3"])
    assert r.returncode == 0, r.stderr[-3000:]
    root = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(root)) == ["latest", "step_000002", "step_000003"]
    os.makedirs(os.path.join(root, ".tmp-step_000004", "actor"))
    os.makedirs(os.path.join(root, "step_000005", "actor"))
    assert checkpoint.checkpoint_dir(out) == os.path.join(root, "step_000003")
    r = run(args + ["--steps=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step_000003: step 3" in r.stdout
    assert sorted(os.listdir(root)) == ["latest", "step_000003", "step_000004"]
    assert open(os.path.join(root, "latest")).read() == "step_000004"


@launches
def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    """Resuming the embedded model's checkpoint with --model pointing at a wider Qwen2 (same
    tokenizer and data, so the pre-flight checks pass): the load stops the run with one `error:`
    line, the last on stderr, naming the checkpoint and the first tensor whose shape differs."""
    import tiny
    from transformers import Qwen2ForCausalLM
    config = tiny.tiny_config()
    config.hidden_size, config.intermediate_size = 128, 256
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "wide")
    tiny.build_tokenizer().save_pretrained(tmp_path / "wide")
    out = str(tmp_path / "run")
    assert run([f"--out_dir={out}", "--steps=1", "--save=false"] + SMALL).returncode == 0
    r = run([f"--out_dir={out}", "--steps=2", "--save=false", f"--model={tmp_path / 'wide'}"] + SMALL)
    mine = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(mine) == 1 and r.stderr.strip().splitlines()[-1] == mine[0], r.stderr[-3000:]
    assert "step_000001/actor does not fit this model (--model changed?): ValueError: Size mismatch" in mine[0]


def _fake_checkpoint(out, step, fingerprint, seed=0):
    path = os.path.join(out, "checkpoints", f"step_{step:06d}")
    os.makedirs(path)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": step, "data": fingerprint, "config": {"seed": seed}, "roles": ["actor"]}, f)
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write(f"step_{step:06d}")
    return path


def test_out_dir_policy(tmp_path):
    """rundir.plan, which main runs before any model: an empty or new out_dir, or one of a run
    that failed before its first step, starts fresh; an unfinished run resumes (auto), and a
    checkpoint path resumes into an empty out_dir; a finished run, metrics without a checkpoint,
    --resume=never on a used dir, a checkpoint from another out_dir into a used one, other data or
    seed, other roles (GRPO -> PPO), a file as out_dir or as final/, an unwritable out_dir are each
    refused with a line that says what to pass instead."""
    def plan(out, *extra, fp="abc"):
        return rundir.plan(options.parse_args([f"--out_dir={out}", "--steps=10", *extra]), fp)

    assert plan(tmp_path / "new") is None and os.path.isdir(tmp_path / "new")
    run_dir = tmp_path / "run"
    ckpt = _fake_checkpoint(str(run_dir), 4, "abc")
    (run_dir / "metrics.jsonl").write_text("")
    assert plan(run_dir) == ckpt
    with pytest.raises(ValueError, match=r"holds a finished run \(4 steps done\); to train it further pass --steps=N"):
        plan(run_dir, "--steps=4")
    with pytest.raises(ValueError, match=r"walked other data \(--data's file or the tokenizer changed\)"):
        plan(run_dir, fp="xyz")
    for other, said in (("--seed=1", "--seed=0 \\(now 1\\), the prompt order's seed 0 \\(now 1\\)"),
                        ("--data_seed=1", "the prompt order's seed 0 \\(now 1\\)")):
        with pytest.raises(ValueError, match=rf"walked other data \({said}\): its position would mean nothing"):
            plan(run_dir, other)
    assert plan(run_dir, "--data_seed=0") == ckpt      # seed 0's own order, named
    with pytest.raises(ValueError, match="holds actor but this run trains actor \\+ critic"):
        plan(run_dir, "--algorithm.adv_estimator=gae")
    with pytest.raises(ValueError, match="--resume=never starts only in an empty one"):
        plan(run_dir, "--resume=never")
    other = _fake_checkpoint(str(tmp_path / "other"), 2, "abc")
    assert plan(tmp_path / "fresh", f"--resume={other}") == other                 # into an empty out_dir
    assert plan(tmp_path / "fresh2", f"--resume={tmp_path / 'other'}") == other   # an out_dir names its latest
    with pytest.raises(ValueError, match="holds another run"):
        plan(run_dir, f"--resume={other}")
    with pytest.raises(ValueError, match="is at step 2, not before --steps=2: nothing to train"):
        plan(tmp_path / "fresh3", f"--resume={other}", "--steps=2")
    with pytest.raises(ValueError, match="no complete checkpoint there"):
        plan(tmp_path / "run4", f"--resume={tmp_path / 'nothing'}")
    (tmp_path / "failed").mkdir()                  # a run that failed before its first step's line
    (tmp_path / "failed" / "metrics.jsonl").write_text("")
    (tmp_path / "failed" / "run_config.json").write_text('{"resolved_config": {}}')   # as a run writes it
    assert plan(tmp_path / "failed") is None
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="but no checkpoint to resume from"):
        plan(tmp_path / "crashed")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        plan(tmp_path / "afile")
    with pytest.raises(ValueError, match="not a writable directory"):
        plan(tmp_path / "afile" / "sub")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "final").write_text("x")
    with pytest.raises(ValueError, match="final is a file"):
        plan(tmp_path / "f")


def test_a_folder_that_is_not_a_run_is_never_written_over(tmp_path, in_process):
    """The issue's `mkdir runs/nonrun; echo '{"mine":1}' > runs/nonrun/run_config.json`: the run stops
    in the pre-flight with one line naming the file, which keeps its bytes (a resume into such a
    folder too); on a fresh start the other names a run writes over (memory.png, final.tmp/, ...)
    are refused when no run's run_config.json vouches for them. A run's own run_config.json (one that
    failed before its first step) is no obstacle."""
    out = tmp_path / "nonrun"
    out.mkdir()
    (out / "run_config.json").write_text('{"mine":1}\n')
    with pytest.raises(SystemExit) as e:
        in_process([f"--out_dir={out}", "--steps=2", "--train_batch_size=4", "--rollout.n=4",
                         "--actor.ppo_mini_batch_size=4"])
    assert e.value.code == 2 and (out / "run_config.json").read_text() == '{"mine":1}\n'
    line = f"--out_dir={out} holds a run_config.json, which no run wrote, and a run writes there"
    other = _fake_checkpoint(str(tmp_path / "other"), 2, "abc")
    for extra in ([], [f"--resume={other}"]):
        with pytest.raises(ValueError, match=line):
            rundir.plan(options.parse_args([f"--out_dir={out}", "--steps=4", *extra]), "abc")
    (out / "run_config.json").write_text('{"resolved_config": {}}')
    (out / "memory.png").write_text("a picture of mine")
    assert rundir.plan(options.parse_args([f"--out_dir={out}", "--steps=4"]), "abc") is None
    (out / "run_config.json").unlink()
    (out / "final.tmp").mkdir()
    with pytest.raises(ValueError, match=r"holds final.tmp and memory.png, which no run wrote.*or move them"):
        rundir.plan(options.parse_args([f"--out_dir={out}", "--steps=4"]), "abc")


def _model_dir(tmp_path, name):
    """The embedded model saved as a user's checkpoint (safetensors, config, tokenizer files)."""
    import tiny
    d = tmp_path / name
    tiny.build_tiny_model().save_pretrained(d)
    tiny.build_tokenizer().save_pretrained(d)
    return d


def test_bad_model_folders_are_one_line_in_the_preflight(tmp_path):
    """A truncated model.safetensors, a folder without tokenizer files (transformers made an empty
    tokenizer and the data got the blame) and a cut tokenizer.json are each one line of the
    pre-flight that names the file or folder and what is wrong; an index naming a missing shard, a tensor
    missing from the weights and a config.json that is another model's (other shapes, or one transformers
    refuses) too."""
    import train_grpo
    d = _model_dir(tmp_path, "m")
    weights = d / "model.safetensors"
    size = weights.stat().st_size

    def preflight():
        return train_grpo.preflight(options.parse_args([f"--model={d}", f"--out_dir={tmp_path / 'o'}"]))
    assert preflight()[1] is None
    os.truncate(weights, size // 2)
    with pytest.raises(ValueError, match=rf"^--model {d}: {weights} is {size // 2} bytes but its header describes "
                                         rf"{size}: truncated; copy it again$"):
        preflight()
    os.truncate(weights, 5)
    with pytest.raises(ValueError, match=rf"{weights} is truncated or not a safetensors file \(5 bytes"):
        preflight()
    d = _model_dir(tmp_path, "sharded")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors is missing \(model.safetensors.index"):
        preflight()
    d = _model_dir(tmp_path, "lacks")       # a tensor gone: transformers would start it at random and say so once
    from safetensors.torch import load_file, save_file
    kept = load_file(d / "model.safetensors")
    del kept["model.layers.1.mlp.up_proj.weight"]
    save_file(kept, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"^--model {d}: its weights lack 1 of the model's tensors \(model.layers.1."
                                         rf"mlp.up_proj.weight\), which transformers would start at random; "):
        preflight()
    d = _model_dir(tmp_path, "other_config")   # another model's config.json: shapes differ, or it is not valid
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    with pytest.raises(ValueError, match=rf"^--model {d}: config.json does not describe these weights \(12 shapes "
                                         rf"differ: model.layers.0.mlp.gate_proj.weight is \[768, 256\], "
                                         rf"the config's "):
        preflight()
    (d / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))   # (transformers 5: 4 layer_types)
    with pytest.raises(ValueError, match=rf"^--model {d}: (transformers builds no causal LM from its config.json \(|"
                                         rf"its weights lack 24 of the model's tensors)"):
        preflight()
    d = _model_dir(tmp_path, "notok")
    for f in d.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=rf"^--model {d}: no tokenizer there \(none of tokenizer.json, "):
        preflight()
    d = _model_dir(tmp_path, "cut")
    os.truncate(d / "tokenizer.json", 300)
    with pytest.raises(ValueError, match=rf"^--model {d}: its tokenizer does not load \(JSONDecodeError: "):
        preflight()


def test_an_unwritable_logger_folder_is_one_line_in_the_preflight(tmp_path, monkeypatch):
    """<out_dir>/tensorboard that cannot take the events (a file of that name; a folder without
    write permission: as root, whom the OS lets write anywhere, the probe is refused as it would be) stops the
    pre-flight with one line naming --logger=none, not a writer thread's traceback after the models are
    built; --logger=none then runs."""
    import train_grpo
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("x")
    cfg = lambda *a: options.parse_args([f"--out_dir={out}", "--logger=tensorboard", *a])  # noqa: E731
    with pytest.raises(ValueError, match=rf"^--logger=tensorboard: {out}/tensorboard is not a writable folder "
                                         rf"\(it is a file\); fix it, or pass --logger=none"):
        train_grpo.preflight(cfg())
    assert train_grpo.preflight(cfg("--logger=none"))[1] is None
    (out / "tensorboard").unlink()
    (out / "tensorboard").mkdir(mode=0o500)
    if os.geteuid() == 0:                  # root writes anywhere: the folder answers as it would anyone else
        import tracker
        mkstemp = tracker.tempfile.mkstemp

        def denied(dir, **kw):             # (the out_dir's own probe, in launch.py, still writes)
            if dir.endswith("tensorboard"):
                raise PermissionError(13, "Permission denied")
            return mkstemp(dir=dir, **kw)
        monkeypatch.setattr(tracker.tempfile, "mkstemp", denied)
    with pytest.raises(ValueError,
                       match=r"is not a writable folder \(Permission denied\); fix it, or pass --logger=none"):
        train_grpo.preflight(cfg())


@launches
def test_readme_command_twice_is_refused_before_any_model(tmp_path):
    """The README's `python train_grpo.py`, run a second time in the same out_dir: one line on
    stderr that names the finished run and how to extend it or start another, exit 2, nothing
    built (no set-up report on stdout), and the first run's metrics and final/ untouched."""
    out = str(tmp_path / "out")
    r = run([f"--out_dir={out}", "--steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    before = open(os.path.join(out, "metrics.jsonl")).read()
    weights = os.path.getmtime(os.path.join(out, "final", "model.safetensors"))
    r = run([f"--out_dir={out}", "--steps=2"])
    assert r.returncode == 2 and r.stdout == ""
    line = (f"error: {out} holds a finished run (2 steps done, the policy in {out}/final); to train it further "
            f"pass --steps=N with N > 2 (it resumes there); to start a new run pass another --out_dir, or remove {out}")
    assert r.stderr.strip().splitlines() == [line]
    # README: under torchrun the line comes first, then torchrun's report of a failed job (its traceback and
    # a summary whose Root Cause is the line), exit code 1; no rank's traceback, no second rank's line
    r = run([f"--out_dir={out}", "--steps=2"], 2)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and r.stdout == "" and lines[0] == line, r.stderr[-3000:]
    assert [x for x in lines if "error:" in x] == [line, f"  traceback : {line}"], r.stderr[-3000:]
    assert "ChildFailedError" in r.stderr and 'train_grpo.py", line' not in r.stderr and 30 <= len(lines) <= 50
    assert open(os.path.join(out, "metrics.jsonl")).read() == before
    assert os.path.getmtime(os.path.join(out, "final", "model.safetensors")) == weights


@launches
def test_stalled_rank_ends_the_job_with_one_line(tmp_path):
    """SIGSTOP rank 1 in the middle of a 2-rank run with --dist_timeout_s=10: rank 0's next
    collective gives up after 10 s and the job ends (torchrun then kills the stopped rank after
    its 30 s grace) with one `error:` line naming the timeout, instead of hanging for 30 minutes."""
    out = str(tmp_path / "run")
    with open(tmp_path / "stall.log", "w") as log:
        proc = start([f"--out_dir={out}", "--steps=200", "--save_freq=0", "--save=false",
                      "--dist_timeout_s=10"] + SMALL, 2, log=log)
        try:
            wait_for_lines(out, 1, proc)
            os.kill(workers(proc)[1], signal.SIGSTOP)
            t0 = time.time()
            proc.wait(timeout=150)
            took = time.time() - t0
        finally:
            if proc.poll() is None:
                for pid in list(workers(proc).values()) + [proc.pid]:
                    os.kill(pid, signal.SIGKILL)
    text = open(tmp_path / "stall.log").read()
    mine = [line for line in text.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and took < 120, (took, text[-3000:])
    assert len(mine) == 1 and "waited more than --dist_timeout_s=10 s for the other ranks" in mine[0], text[-3000:]


@launches
def test_errors_under_torchrun_are_one_line_from_rank_0(tmp_path):
    """Under torchrun with 2 ranks: a bad option (found by every rank before the process group)
    and a reward that raises only on rank 1's samples (found mid-run) each print exactly one
    `error:` line, from rank 0, and that line is torchrun's Root Cause; no worker traceback."""
    reward = tmp_path / "rank_reward.py"
    reward.write_text("import os\n\ndef reward(response, answer):\n"
                      "    if os.environ['RANK'] == '1':\n        raise KeyError('only on rank 1')\n    return 0.5\n")
    cases = [(["--rollout.n=0"], "error: --rollout.n=0: must be >= 1"),
             (["--reward=rank_reward:reward"], "error: reward rank_reward:reward raised KeyError: 'only on rank 1' "
                                               "for the response")]
    for args, expect in cases:
        r = run([f"--out_dir={tmp_path / 'o'}", "--steps=2", "--save=false"] + args, nproc=2,
                env={"PYTHONPATH": str(tmp_path)})
        mine = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode != 0 and len(mine) == 1 and mine[0].startswith(expect), r.stderr[-3000:]
        root = r.stderr.split("Root Cause")[1]
        assert f"traceback : {mine[0]}" in root and "train_grpo.py\", line" not in r.stderr
