"""The critic: GAE and value-loss math by hand, offload round trip, the shared head, PPO learns.

    python -m pytest tests/test_critic.py -q
"""
import warnings

import pytest
import torch

import actor
import critic
import offload
from model import build_mesh, load_model, shard
from conftest import launches, layout, metrics, run, tiny_batch


def test_gae_hand_values():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = critic.gae(r, v, m, 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.8, 0.3]])) and torch.allclose(ret, torch.ones(1, 3))
    adv, _ = critic.gae(r, v, m, 0.9, 0.5)
    assert torch.allclose(adv, torch.tensor([[-0.06575, 0.565, 0.3]]), atol=1e-6)


def test_gae_skips_masked_positions():
    r = torch.tensor([[0.0, 5.0, 1.0]])             # the masked reward and value must not count
    v = torch.tensor([[0.5, 9.9, 0.7]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = critic.gae(r, v, m, 1.0, 1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, 0.3]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 0.0, 1.0]]))


def test_whiten_over_valid_tokens(dist_env):
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.allclose(critic.whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-4)


def test_whiten_keeps_a_small_spread_around_a_large_mean(dist_env):
    """4096 +- 0.5 (exact in fp32): mean 4096, unbiased std 0.5, so [-1, 0, 1]. One fp32 pass of
    E[x^2] - mean^2 cannot see a variance of 0.25 next to x^2 ~ 1.7e7 (fp32 spacing 2 there)."""
    x = torch.tensor([[4095.5, 4096.0, 4096.5, 7.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.allclose(critic.whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6)


def test_value_loss_clipping():
    cfg = critic.CriticConfig(cliprange_value=0.5)
    v, old, ret = torch.tensor([[1.0, 0.0, 0.2]]), torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.0, 1.0, 0.0]])
    loss, clipped = critic.value_loss(v, old, ret, torch.ones(1, 3), cfg)
    # per token max((v-R)^2, (clip(v)-R)^2): 1 (unclipped is worse), 1, 0.25 (the clip binds)
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 0.25) / 3)
    assert clipped.tolist() == [[0.0, 0.0, 1.0]]


def test_vf_clipfrac_counts_only_where_the_clip_binds():
    """Token 1 lies inside old +- 0.6, but old + (v - old) is not v in fp32 (-0.19999999 for
    -0.2, whose square distance to R = -0.25 then comes out larger): clamping v itself keeps it
    exactly, so it is not counted as clipped. Token 2 is clipped to 0.6 but the unclipped loss is
    larger; token 3's clip binds. Loss: 0.5 x mean of max((v-R)^2, (clip(v)-R)^2)
    = 0.5 x (0.0025 + 1 + 1.96) / 3 = 0.49375; vf_clipfrac 1/3."""
    cfg = critic.CriticConfig(cliprange_value=0.6)
    old, v, ret = (torch.tensor([[-0.7, 0.0, 0.0]]), torch.tensor([[-0.2, 1.0, 1.0]]),
                   torch.tensor([[-0.25, 0.0, 2.0]]))
    assert (old + (v - old))[0, 0] != v[0, 0]             # the fp32 trap the old formula fell into
    loss, clipped = critic.value_loss(v, old, ret, torch.ones(1, 3), cfg)
    assert clipped.tolist() == [[0.0, 0.0, 1.0]]
    assert loss.item() == pytest.approx(0.49375, rel=1e-6)


def test_value_loss_seq_mean_skips_empty_rows():
    """seq-mean-token-sum without global counts: the all-padding second row is not a sequence."""
    cfg = critic.CriticConfig(loss_agg_mode="seq-mean-token-sum")
    v, ret = torch.tensor([[1.0, 2.0], [5.0, 5.0]]), torch.zeros(2, 2)
    loss, _ = critic.value_loss(v, v, ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), cfg)
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 1)


def _critic(dist_env, mode="separate", **flags):
    _, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    act = shard(load_model(None, 0), mesh, device)
    cfg = critic.CriticConfig(mode=mode, **flags)
    c = critic.build(cfg, model_path=None, mesh=mesh, device=device, actor_cfg=actor.ActorConfig(), actor_model=act)
    return act, c, cfg, device


def _update(c, batch):
    return critic.update_critic(c, batch, 8, 1)


def _ppo_batch(act, c, device, seed):
    batch = tiny_batch(8, 5, device, seed=seed)
    with offload.loaded([c.params], {}):  # the values stage's bracket (a no-op when the flag is off)
        batch["values"], feats = critic.values(c.model, batch, c.cfg, c.forward_layout, act)
    if feats is not None:
        batch["features"] = feats
    batch["returns"] = torch.rand(8, 5, generator=torch.Generator().manual_seed(seed)).to(device)
    return batch


def test_critic_offload_round_trip_is_bit_exact(dist_env):
    """Two updates through critic.update of a critic built with param and optimizer offload equal
    two of its twin built without; between them its params and Adam state hold no device bytes."""
    runs = []
    for on in (False, True):
        act, c, cfg, device = _critic(dist_env, param_offload=on, optimizer_offload=on)
        stats = []
        for seed in range(2):
            m = {}
            stats.append(critic.update(c, _ppo_batch(act, c, device, seed), 8, 1, m))
            if on:
                assert all(st.nbytes() == 0 for st in c.params.storages + c.adam.storages)
                assert m["offload/critic_params/offload_gb"] > 0 and m["offload/critic_optimizer/offload_gb"] > 0
        runs.append(stats)
    assert runs[0] == runs[1]


def test_critic_update_independent_of_micro_batch(dist_env):
    results = []
    for micro in (2, 8):
        act, c, cfg, device = _critic(dist_env)
        c.update_layout = layout(micro)
        results.append(_update(c, _ppo_batch(act, c, device, 2)))
    assert results[0]["critic/vf_loss"] == pytest.approx(results[1]["critic/vf_loss"], rel=1e-5)
    assert results[0]["critic/grad_norm"] == pytest.approx(results[1]["critic/grad_norm"], rel=1e-4)


def test_shared_head_trains_and_leaves_the_trunk_alone(dist_env):
    act, c, cfg, device = _critic(dist_env, "shared")
    trunk = [p.detach().full_tensor().clone() for p in act.parameters()]
    batch = _ppo_batch(act, c, device, 3)
    assert batch["features"].shape == (8, 5, act.config.hidden_size)
    before = [p.detach().full_tensor().clone() for p in c.model.parameters()]
    _update(c, batch)
    assert any(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, c.model.parameters()))
    assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(trunk, act.parameters()))
    separate = offload.param_stash("s", _critic(dist_env)[1].model).nbytes
    shared = offload.param_stash("h", c.model).nbytes
    assert shared == (act.config.hidden_size + 1) * 4 and separate > 1000 * shared


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_a_ppo_step_warns_nothing_and_the_separate_critic_needs_no_actor(dist_env, mode):
    """The values stage and the critic update as train_grpo runs them (compute_values, update): FSDP2's
    "returned a view tensor" warning came at every update (the value head, a Linear to one output,
    returns a view of its product: critic.own_output); and the separate critic's values stage takes
    no actor (it read the actor's model though it never used it), while the shared one still asks
    for it in one line."""
    _, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    a = actor.build(actor.ActorConfig(), mesh=mesh, device=device)
    c = critic.build(critic.CriticConfig(mode=mode), model_path=None, mesh=mesh, device=device,
                     actor_cfg=a.cfg, actor_model=a.model)
    batch = tiny_batch(8, 5, device, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lend = dict(trunk=a.model, lent=actor.policy_stashes(a)) if mode == "shared" else {}
        critic.compute_values(c, batch, {}, **lend)
        batch["returns"] = torch.rand(8, 5).to(device)
        stats = critic.update(c, batch, 8, 1, {})
    assert [str(w.message) for w in caught if "view tensor" in str(w.message)] == []
    assert batch["values"].shape == (8, 5) and stats["critic/grad_norm"] > 0
    if mode == "shared":
        with pytest.raises(ValueError, match="critic.mode=shared reads the actor's features: pass compute_values"):
            critic.compute_values(c, batch)


@launches
@pytest.mark.parametrize("mode", ["separate", "shared"])
@pytest.mark.timeout(900)                # 60 PPO steps: 176-274 s on 2 busy cores
def test_ppo_run_learns(tmp_path, mode):
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=60", "--save=false", "--algorithm.adv_estimator=gae",
             f"--critic.mode={mode}", "--critic.param_offload=true", "--critic.optimizer_offload=true"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    first = sum(x["reward_mean"] for x in m[:10]) / 10
    last = sum(x["reward_mean"] for x in m[-10:]) / 10
    assert last > first + 0.1, (first, last)
    for k in ("time/values", "time/critic_update", "mem/values/peak_gb", "mem/critic_update/peak_gb",
              "critic/vf_loss"):
        assert k in m[-1], k
    if mode == "separate":
        assert m[-1]["offload/critic_optimizer/offload_gb"] > 0 and "offload/critic_params/drop_s" in m[-1]
