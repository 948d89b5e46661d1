"""Adam stepped a window of layers at a time from the host (actor/critic.optimizer_stream, CPU): the same
weights and the same Adam state as the whole-state step, bit for bit, from the first step (its lazily made
state) on, with LoRA and with a critic, through a skipped non-finite step, and across a resume in either
direction; the planner counts a few windows at the step instead of all of Adam.

    python -m pytest -q tests/test_stream.py
"""
import pytest
import torch

import adam
import offload
import options
import plan
import predict
import train_grpo
from conftest import launches, metrics, run

SMALL = ["--rollout.engine=hf", "--save=false", "--logger=none", "--val_freq=0", "--val_before_train=false",
         "--train_batch_size=4", "--rollout.n=4", "--actor.ppo_mini_batch_size=2", "--actor.optimizer_offload=true"]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _trained(tmp_path, name, extra, steps=3):
    """`steps` steps in this process: (each step's metrics, the actor's weights, its Adam state after the last
    offload, the critic's (PPO) weights and state), the state read through adam.holding."""
    t = train_grpo.setup(options.parse_args(SMALL + [f"--out_dir={tmp_path / name}", *extra]))
    rows = [train_grpo.train_step(t, s) for s in range(steps)]

    def state(role):
        with adam.holding([role.adam], loading=False):
            return [_full(v).clone() for g in role.optimizer.param_groups for p in g["params"]   # in the params' order
                    for v in role.optimizer.state[p].values() if torch.is_tensor(v)]
    out = rows, [_full(p).clone() for p in t.actor.model.parameters()], state(t.actor)
    if t.critic is not None:
        out += ([_full(p).clone() for p in t.critic.model.parameters()], state(t.critic))
    return out


KEYS = ["reward_mean", "pg_loss", "kl", "grad_norm", "delta_w_abs_mean", "critic/vf_loss", "critic/grad_norm"]


@pytest.mark.parametrize("extra", [
    [],
    ["--actor.optimizer_window_layers=3"],
    ["--actor.lora_rank=4", "--actor.lr=1e-3"],
    ["--algorithm.adv_estimator=gae", "--critic.optimizer_offload=true", "--critic.optimizer_stream=true"],
    ["--algorithm.adv_estimator=gae", "--critic.mode=shared"],
], ids=["one layer a window", "three layers a window", "lora", "ppo, the critic streamed too", "ppo, shared critic"])
def test_the_streamed_step_equals_the_whole_step(tmp_path, dist_env, extra):
    """Two optimizer steps a training step over three steps: the streamed run's metrics, weights and Adam
    state (both moments and the step counts) equal the whole-state run's exactly; its update reports the
    bytes it moved, their GB/s and the window's peak."""
    whole = _trained(tmp_path, "whole", extra)
    streamed = _trained(tmp_path, "stream", extra + ["--actor.optimizer_stream=true"])
    for a, b in zip(whole[0], streamed[0]):
        assert [a.get(k) for k in KEYS] == [b.get(k) for k in KEYS]
    for x, y in zip(whole[1:], streamed[1:]):
        assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))
    m = streamed[0][-1]
    assert m["offload/actor_optimizer/stream_gb"] > 0 and m["offload/actor_optimizer/stream_gbps"] > 0
    assert 0 < m["offload/actor_optimizer/stream_window_peak_gb"] < m["offload/actor_optimizer/stream_gb"] / 2
    assert "offload/actor_optimizer/reload_gb" not in m     # never the whole state at once


class _Tiny(torch.nn.Module):
    """An embedding table larger than a decoder layer, two layers, an untied head as large (a 7B's shape, small)."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed = torch.nn.Embedding(50, 16)
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.head = torch.nn.Linear(16, 50, bias=False)

    def forward(self, x):
        h = self.model.embed(x)
        for layer in self.model.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


@pytest.mark.parametrize("sharded", [False, True], ids=["tensors", "fsdp2 dtensors"])
def test_row_windows_step_as_the_whole_tensor_and_the_plain_step(request, sharded):
    """optimizer_row_windows: the embeddings and the head (50 x 16, more than a layer's 272 params) step in three
    row slices of at most 17 rows; over four steps (the first makes the state) the weights and Adam's state (both
    moments, the step count, its keys) equal the whole-tensor streamed step's and the plain AdamW step's bit for
    bit, with weight decay on the embeddings' group only; the state stays on the host between steps. Plain
    tensors, and FSDP2's DTensors (a row-windowed param's state is a DTensor over an emptied storage)."""
    if sharded:
        request.getfixturevalue("dist_env")
        from torch.distributed.fsdp import fully_shard

    def build(stream, rows):
        torch.manual_seed(0)
        net = _Tiny()
        if sharded:
            for layer in net.model.layers:
                fully_shard(layer)
            fully_shard(net)
        table = [net.model.embed.weight, net.head.weight]
        groups = [{"params": table, "weight_decay": 0.1},
                  {"params": [p for p in net.parameters() if all(p is not q for q in table)], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=0.05, fused=True)
        windows = adam.optimizer_windows(net, opt, 1, rows) if stream else None
        return net, opt, adam.optimizer_stash("adam", opt), windows
    runs = [build(True, True), build(True, False), build(False, False)]
    rows = [w for w in runs[0][3] if isinstance(w, adam.Rows)]
    assert [w.bounds for w in rows] == [[(0, 17), (17, 34), (34, 50)]] * 2 and len(runs[0][3]) == len(runs[1][3])
    assert adam.window_sizes(runs[0][3])[:3] == [17 * 16, 17 * 16, 16 * 16]
    for step in range(4):
        for net, opt, stash, windows in runs:
            net.zero_grad()
            net(torch.arange(40).view(4, 10) * (step + 1) % 50).pow(2).mean().backward()
            adam.clipped_step(net, opt, 1.0, stash if windows else None, {}, "test", windows)
    (a, a_opt, a_adam, _), (b, b_opt, b_adam, _), (c, c_opt, _, _) = runs
    assert all(torch.equal(_full(x), _full(y)) and torch.equal(_full(x), _full(z))
               for x, y, z in zip(a.parameters(), b.parameters(), c.parameters()))
    assert all(st.nbytes() == 0 for st in a_adam.storages) and len(a_adam.host) == len(b_adam.host)
    with adam.holding([a_adam, b_adam], loading=False):
        for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
            assert list(a_opt.state[p]) == list(c_opt.state[r]) == list(b_opt.state[q])
            assert all(torch.equal(_full(x), _full(z)) and torch.equal(_full(y), _full(z)) for x, y, z in zip(
                a_opt.state[p].values(), b_opt.state[q].values(), c_opt.state[r].values()))

def test_a_non_finite_norm_skips_the_streamed_step_and_the_host_state_stays():
    """A non-finite grad norm: no window steps, the weights and the host's Adam state stay as they were;
    then a finite one steps as optimizer.step() over every param does."""
    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
        return net, opt, adam.optimizer_stash("adam", opt)
    a, a_opt, a_adam = build()
    b, b_opt, _ = build()
    windows = adam.optimizer_windows(a, a_opt, 1)
    assert [len(w) for w in windows] == [1, 1, 1, 1]          # no decoder layers: a param a window
    for step, bad in enumerate([False, True, False]):
        for net in (a, b):
            net.zero_grad()
            net(torch.ones(3, 8) * (step + 1)).sum().backward()
            if bad:
                next(net.parameters()).grad[0, 0] = float("inf")
        before = [h.clone() for h in a_adam.host]
        adam.clipped_step(a, a_opt, 1.0, a_adam, {}, "test", windows)
        adam.clipped_step(b, b_opt, 1.0, None, {}, "test")
        if bad:
            assert all(torch.equal(x, y) for x, y in zip(before, a_adam.host))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        assert all(st.nbytes() == 0 for st in a_adam.storages)   # the state is on the host between steps
    with adam.holding([a_adam], loading=False):
        assert all(torch.equal(x, y) for p, q in zip(a.parameters(), b.parameters())
                   for x, y in zip(a_opt.state[p].values(), b_opt.state[q].values()))


def test_a_fresh_state_born_a_window_at_a_time_is_torchs_and_holds_no_grads(monkeypatch):
    """A resume's fresh Adam state made a window at a time (adam.born_on_host) is what torch's zero-grad
    step at lr 0 over every param makes (keys, step, zero moments, every param group), and no window's params
    get a grad on the way: only each group's smallest param does, once (a window holds its moments only)."""
    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        groups = [{"params": [net[0].weight, net[2].weight]},
                  {"params": [net[0].bias, net[1].weight, net[1].bias, net[2].bias], "weight_decay": 0.0}]
        return net, torch.optim.AdamW(groups, lr=0.1, fused=True)
    net, opt = build()
    ref_net, ref_opt = build()
    for p in ref_net.parameters():         # torch's way, all at once
        p.grad = torch.zeros_like(p)
    lr = [g["lr"] for g in ref_opt.param_groups]
    for g in ref_opt.param_groups:
        g["lr"] = 0.0
    ref_opt.step()
    stash = adam.optimizer_stash("adam", opt)
    windows = adam.optimizer_windows(net, opt, 1)
    grads, real_step = [], opt.step        # the params with a grad at each step taken on the way
    monkeypatch.setattr(opt, "step", lambda *a, **k: grads.append([tuple(p.shape) for g in opt.param_groups
                                                                   for p in g["params"] if p.grad is not None])
                        or real_step(*a, **k))
    adam.born_on_host(opt, stash, windows)
    assert grads == [[(4, 16)], [(4,)]]    # one step a group, on its smallest param
    assert [g["lr"] for g in opt.param_groups] == lr and all(p.grad is None for p in net.parameters())
    with adam.holding([stash], loading=False):
        for p, q in zip(net.parameters(), ref_net.parameters()):
            assert opt.state[p].keys() == ref_opt.state[q].keys()
            assert all(torch.equal(x, y) for x, y in zip(opt.state[p].values(), ref_opt.state[q].values()))
    assert all(st.nbytes() == 0 for st in stash.storages)


def test_a_fresh_row_windowed_state_is_torchs_and_never_on_the_device(monkeypatch):
    """A resume's fresh state (adam.born_on_host) with row windows: the embeddings' and the head's moments are
    zeros on the host only, and every param's state (keys, step, moments) is torch's zero-grad step at lr 0."""
    def build():
        torch.manual_seed(0)
        net = _Tiny()
        return net, torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    (net, opt), (ref, ref_opt) = build(), build()
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    ref_opt.param_groups[0]["lr"] = 0.0
    ref_opt.step()
    stash, windows = adam.optimizer_stash("adam", opt), adam.optimizer_windows(net, opt, 1, True)
    hollow, real = [], adam._hollow_state
    monkeypatch.setattr(adam, "_hollow_state", lambda o, st, p, made: hollow.append(p.shape) or real(o, st, p, made))
    adam.born_on_host(opt, stash, windows)
    assert hollow == [(50, 16)] * 2          # the embeddings and the head: never made whole
    assert all(st.nbytes() == 0 for st in stash.storages) and len(stash.host) == 2 * len(list(net.parameters()))
    with adam.holding([stash], loading=False):
        for p, q in zip(net.parameters(), ref.parameters()):
            assert list(opt.state[p]) == list(ref_opt.state[q])
            assert all(torch.equal(x, y) for x, y in zip(opt.state[p].values(), ref_opt.state[q].values()))

def test_a_streamed_checkpoint_leaves_adam_on_the_host(tmp_path, dist_env, monkeypatch):
    """A streamed role's checkpoint writes Adam from its host mirrors and a resume loads it into them (a fresh
    optimizer's state made a window at a time), never bringing the whole state in: no device storage of
    Adam is refilled during the save or the load, and the loaded host state equals the saved one."""
    import checkpoint
    from dataclasses import asdict
    t = train_grpo.setup(options.parse_args(SMALL + [f"--out_dir={tmp_path / 'a'}", "--actor.optimizer_stream=true",
                                                      "--save_freq=1"]))
    for s in range(2):
        train_grpo.train_step(t, s)
    saved = [h.clone() for h in t.actor.adam.host]
    filled = []
    monkeypatch.setattr(offload, "reload", lambda stash, background=False: filled.append(stash.name) or {})
    train_grpo.save(t, 2)
    u = train_grpo.setup(options.parse_args(SMALL + [f"--out_dir={tmp_path / 'b'}", "--actor.optimizer_stream=true"]))
    checkpoint.load(checkpoint.newest(t.cfg.out_dir), train_grpo.trained(u.actor, u.critic), asdict(u.cfg), 1)
    assert "actor_optimizer" not in filled and all(st.nbytes() == 0 for st in u.actor.adam.storages)
    assert len(u.actor.adam.host) == len(saved) and all(torch.equal(x, y) for x, y in zip(saved, u.actor.adam.host))


@pytest.mark.parametrize("stream", ["false", "true"], ids=["whole", "streamed"])
def test_a_load_takes_this_runs_lr_and_weight_decay(tmp_path, dist_env, stream):
    """A resume keeps the checkpoint's Adam state but this run's lr and weight decay (checkpoint.load sets them
    on every trained role's param groups after DCP wrote the checkpoint's), whole or streamed, critic too."""
    import checkpoint
    from dataclasses import asdict
    ppo = ["--algorithm.adv_estimator=gae", "--critic.optimizer_offload=true", f"--critic.optimizer_stream={stream}",
           f"--actor.optimizer_stream={stream}"]
    t = train_grpo.setup(options.parse_args(SMALL + ppo + [f"--out_dir={tmp_path / 'a'}", "--save_freq=1"]))
    train_grpo.train_step(t, 0)
    train_grpo.save(t, 1)
    u = train_grpo.setup(options.parse_args(SMALL + ppo + [f"--out_dir={tmp_path / 'b'}", "--actor.lr=1e-5",
                                                            "--actor.weight_decay=0.01", "--critic.lr=2e-5"]))
    checkpoint.load(checkpoint.newest(t.cfg.out_dir), train_grpo.trained(u.actor, u.critic), asdict(u.cfg), 1)
    for role, lr, wd in ((u.actor, 1e-5, 0.01), (u.critic, 2e-5, 0.0)):
        assert [(g["lr"], g["weight_decay"]) for g in role.optimizer.param_groups] == [(lr, wd)]
        assert role.optimizer.state                # the checkpoint's state came in with them


@launches
@pytest.mark.parametrize("first,then", [("false", "true"), ("true", "false")], ids=["whole then streamed",
                                                                                   "streamed then whole"])
def test_a_resume_across_the_two_modes_equals_an_uninterrupted_run(tmp_path, first, then):
    """A checkpoint written by either mode resumes in the other, and the run's metrics equal a run that
    never stopped."""
    base = ["--steps=4", "--save_freq=2", "--train_batch_size=4", "--rollout.n=4", "--actor.ppo_mini_batch_size=2",
            "--actor.optimizer_offload=true", "--save=false", "--logger=none", "--val_freq=0",
            "--val_before_train=false"]
    whole = str(tmp_path / "whole")
    assert run([f"--out_dir={whole}", *base]).returncode == 0
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", *base[1:], "--steps=2", f"--actor.optimizer_stream={first}"])
    assert r.returncode == 0, r.stderr[-2000:]
    r = run([f"--out_dir={out}", *base, f"--actor.optimizer_stream={then}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [[x[k] for k in KEYS[:5]] for x in metrics(out)] == [[x[k] for k in KEYS[:5]] for x in metrics(whole)]


def test_the_planner_counts_windows_and_7b_full_fine_tuning_fits_80_gb():
    """7B full fine-tuning, GRPO, one 80 GB GPU, every offload flag: the update's planned allocator peak
    drops by more than 45 GB with the stream (Adam's 56.7 GB become three windows), and --offload=auto
    finds a fit only with it, checkpoints included (Adam is written and read on the host, a fresh state made
    a window at a time: adam.born_on_host), where the whole state's checkpoint cannot fit at all. The fit keeps
    10 % of the GPU free with the embeddings and the head FSDP2 units of their own (the streamed 7B update's device
    level measured 66.1 GB on an H100), 5 % with one root group for them (76.1 GB measured on an H200)."""
    args = ["--model=random:qwen2.5-7b", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8", "--rollout.n=4",
            "--rollout.response_length=256", "--actor.param_offload=true", "--actor.optimizer_offload=true",
            "--ref.param_offload=true", "--actor.gradient_checkpointing=true"]
    whole = predict.predict(options.parse_args(args), 1, 128)
    stream = predict.predict(options.parse_args(args + ["--actor.optimizer_stream=true"]), 1, 128)
    assert whole.stage("update").total - stream.stage("update").total > 45 * 2 ** 30
    assert "Adam windows (in, stepping, out)" in stream.stage("update").terms
    assert "actor_optimizer" not in stream.stage("update").terms
    assert whole.checkpoint > 80 * 2 ** 30 > 2 * stream.checkpoint           # --save_freq=50
    t = plan.Target(1, 128, 80 * 2 ** 30, 0.05)
    best, p = plan.choose(options.parse_args(args[:-4]), t)
    assert best is not None and best.actor.optimizer_stream and best.actor.optimizer_offload and best.save_freq
    assert p.device_peak <= 0.95 * 80 * 2 ** 30 and p.checkpoint < max(s.total for s in p.stages)
    ten = plan.Target(1, 128, 80 * 2 ** 30, 0.1)
    assert plan.choose(options.parse_args(args[:-4]), ten)[0].actor.optimizer_stream
    assert plan.choose(options.parse_args(args[:-4] + ["--actor.embeddings_apart=false"]), ten) == (None, None)


def test_stream_needs_optimizer_offload():
    with pytest.raises(ValueError, match="actor.optimizer_stream .* needs --actor.optimizer_offload=true"):
        options.check_sizes(options.parse_args(["--actor.optimizer_stream=true"]), 1)
