"""--save_optimizer=false: checkpoints of the params, the RNG states and meta.json without AdamW's moments; a
resume from one loads the params bit-exactly and starts AdamW afresh; the disk report and the planner count
what is written and brought in.

    python -m pytest tests/test_save_optimizer.py -q    # in this process (1 rank) and one 2-process gloo run
"""
import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import checkpoint
import critic
import offload
import options
import predict
import rundir
import train_grpo
import weights
from conftest import launches, metrics, run

SMALL = ["--rollout.engine=hf", "--save=false", "--logger=none", "--val_freq=0", "--val_before_train=false",
         "--train_batch_size=4", "--rollout.n=4", "--actor.ppo_mini_batch_size=2", "--save_freq=1"]
FLAGS = {"whole": ["--actor.optimizer_offload=true"],
         "streamed": ["--actor.optimizer_offload=true", "--actor.optimizer_stream=true"],
         "critic": ["--algorithm.adv_estimator=gae", "--critic.optimizer_offload=true"]}
GB = 2**30


def _roles(t) -> list:
    return [r for r in (t.actor, t.critic) if r is not None]


def _params(role) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for k, v in get_model_state_dict(role.model).items()}


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("kind", list(FLAGS))
def test_a_checkpoint_without_adam_resumes_with_adam_afresh(tmp_path, dist_env, monkeypatch, capsys, kind):
    """The same trained roles saved with and without AdamW's state: the one without records optimizer false in
    meta.json, holds no optim entry in any role's DCP metadata, is smaller by about Adam's 8 bytes a trained
    param, and its save's bracket never brings Adam in. A resume from it (this run would save Adam: fine) loads
    every role's params bit for bit and the RNG, leaves AdamW unmade (as a fresh run's, streamed too: born on the
    host at the step), says so once, and trains on: each step count is the resumed step's alone."""
    t = train_grpo.setup(options.parse_args(SMALL + FLAGS[kind] + [f"--out_dir={tmp_path / 'a'}"]))
    train_grpo.train_step(t, 0)
    counts = [{float(st["step"]) for st in r.optimizer.state.values()} for r in _roles(t)]   # one step's, from 0
    t.cfg.out_dir = str(tmp_path / "full")
    os.makedirs(t.cfg.out_dir)
    train_grpo.save(t, 1)
    filled = []
    reload = offload.reload
    monkeypatch.setattr(offload, "reload", lambda stash, **kw: filled.append(stash.name) or reload(stash, **kw))
    t.cfg.out_dir, t.cfg.save_optimizer = str(tmp_path / "a"), False
    os.makedirs(t.cfg.out_dir, exist_ok=True)
    train_grpo.save(t, 1)
    assert not any(name.endswith("_optimizer") for name in filled), filled
    lean, full = checkpoint.newest(str(tmp_path / "a")), checkpoint.newest(str(tmp_path / "full"))
    meta = checkpoint.read_meta(lean)
    assert meta["optimizer"] is False and checkpoint.read_meta(full)["optimizer"] is True
    for role in meta["roles"]:
        keys = dcp.FileSystemReader(os.path.join(lean, role)).read_metadata().state_dict_metadata
        assert keys and not any(k.startswith("optim") for k in keys), role
    trained = sum(p.numel() for r in _roles(t) for p in r.model.parameters() if p.requires_grad)
    assert 0.95 * 8 * trained < _bytes(full) - _bytes(lean) < 1.05 * 8 * trained
    saved, rng = [_params(r) for r in _roles(t)], torch.load(os.path.join(lean, "rng", "rank0.pt"))
    u = train_grpo.setup(options.parse_args(SMALL + FLAGS[kind] + [f"--out_dir={tmp_path / 'b'}"]))
    capsys.readouterr()
    filled.clear()
    assert checkpoint.load(lean, train_grpo.trained(u.actor, u.critic), asdict(u.cfg), 1)["step"] == 1
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[resume]")]
    assert len(said) == 1 and said[0].endswith("; AdamW starts afresh: the checkpoint holds no optimizer state "
                                               "(--save_optimizer=false)"), said
    assert not any(name.endswith("_optimizer") for name in filled), filled
    assert torch.equal(torch.get_rng_state(), rng["torch"])
    for role, before in zip(_roles(u), saved):
        after = _params(role)
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert not role.optimizer.state and not role.adam.storages and not role.adam.host   # as a fresh run's
    m = train_grpo.train_step(u, 1)
    assert m["optimizer_steps"] == 2 and m["skipped_steps"] == 0
    assert [{float(st["step"]) for st in r.optimizer.state.values()} for r in _roles(u)] == counts   # from 0 again


def test_a_checkpoint_with_adam_loads_it_whatever_save_optimizer_says_now(tmp_path, dist_env, capsys):
    """A run with --save_optimizer=false resuming a checkpoint written with Adam loads Adam as before."""
    t = train_grpo.setup(options.parse_args(SMALL + FLAGS["whole"] + [f"--out_dir={tmp_path / 'a'}"]))
    train_grpo.train_step(t, 0)
    train_grpo.save(t, 1)
    u = train_grpo.setup(options.parse_args(SMALL + FLAGS["whole"] + [f"--out_dir={tmp_path / 'b'}",
                                                                      "--save_optimizer=false"]))
    capsys.readouterr()
    checkpoint.load(checkpoint.newest(t.cfg.out_dir), train_grpo.trained(u.actor, u.critic), asdict(u.cfg), 1)
    assert "AdamW starts afresh" not in capsys.readouterr().out
    assert {float(st["step"]) for st in u.actor.optimizer.state.values()} == {2.0}


def test_the_disk_refusal_names_save_optimizer_only_where_it_fits(tmp_path, dist_env, monkeypatch):
    """A disk with room for the run's checkpoints without Adam (and final/) but not with: the refusal names
    --save_optimizer=false and what it costs; a disk too small for either: not named; the same run with
    --save_optimizer=false fits the first disk and reports the smaller figure."""
    t = train_grpo.setup(options.parse_args(SMALL + [f"--out_dir={tmp_path / 'a'}", "--steps=1", "--save=true"]))
    roles = train_grpo.trained(t.actor, t.critic)
    final = weights.final_bytes(t.actor, False, t.cfg.model)
    full, lean = checkpoint.write_bytes(roles) + final, checkpoint.write_bytes(roles, False) + final   # 1 checkpoint
    assert lean < full
    named = r"; --save_optimizer=false would fit \(~0.0\d\d GB: checkpoints without AdamW's state, so a resume " \
            r"starts AdamW afresh\)$"
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: (lean + full) // 2)
    with pytest.raises(OSError, match=r"\(or --save_freq=0, --save=false\)" + named):
        rundir.disk_report(t.cfg, roles, t.actor)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: lean - 2**20)
    with pytest.raises(OSError, match=r"\(or --save_freq=0, --save=false\)$"):
        rundir.disk_report(t.cfg, roles, t.actor)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: (lean + full) // 2)
    t.cfg.save_optimizer = False
    assert rundir.disk_report(t.cfg, roles, t.actor).startswith(f"[disk] writes up to ~{lean / GB:.3f} GB")


def test_the_planned_checkpoint_without_adam_is_the_params_alone():
    """The whole optimizer's checkpoint bracket (fp32 params, Adam's 8 bytes a param and a load's 4 bytes of zero
    grads, which exist only to make Adam's state) loses exactly Adam and those grads without Adam; streamed and
    the critic's alike are the params alone."""
    args = ["--model=random:qwen2.5-7b", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8",
            "--actor.optimizer_offload=true", "--ref.param_offload=true"]
    params = predict.shapes("random:qwen2.5-7b").params
    with_adam = predict.predict(options.parse_args(args), 1, 256).checkpoint
    without = predict.predict(options.parse_args(args + ["--save_optimizer=false"]), 1, 256).checkpoint
    assert with_adam - without == pytest.approx(12 * params * predict.ALLOC_SLACK, rel=1e-6)
    assert without == pytest.approx((4 * params + predict.CUBLAS) * predict.ALLOC_SLACK, rel=1e-6)
    streamed = predict.predict(options.parse_args(args + ["--actor.optimizer_stream=true", "--save_optimizer=false"]),
                               1, 256).checkpoint
    assert streamed == without
    cfg = options.parse_args(args + ["--algorithm.adv_estimator=gae"])   # the critic's bracket: as the actor's
    r = predict.run(cfg, 1, 256)
    st = predict.states(r)
    (adam,), (alone,) = (critic.predicted_checkpoint(cfg.critic, r.z, st, saved) for saved in (True, False))
    assert alone == {"critic_params": st["critic_params"][0]}
    assert sum(adam.values()) - sum(alone.values()) == 3 * st["critic_params"][0]   # Adam 8 + zero grads 4 a param


@launches
def test_two_ranks_resume_a_checkpoint_without_adam(tmp_path):
    """2-process gloo: 2 steps with --save_optimizer=false, then the same out_dir to 3 steps: rank 0 alone says
    AdamW starts afresh, and the run trains its third step."""
    out = str(tmp_path / "run")
    args = [f"--out_dir={out}", "--save_optimizer=false", "--train_batch_size=8", "--actor.ppo_mini_batch_size=4",
            "--rollout.n=4", "--save=false", "--save_freq=2"]
    r = run(args + ["--steps=2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert checkpoint.read_meta(checkpoint.newest(out))["optimizer"] is False
    r = run(args + ["--steps=3"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("AdamW starts afresh: the checkpoint holds no optimizer state") == 1, r.stdout[-3000:]
    assert [m["step"] for m in metrics(out)] == [0, 1, 2] and metrics(out)[-1]["optimizer_steps"] == 2
