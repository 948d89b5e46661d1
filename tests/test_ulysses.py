"""Ulysses sequence parallelism changes no number (CPU, gloo, fp32).

    python -m pytest -q tests/test_ulysses.py      # launches 2- and 4-process gloo runs itself

On one packed batch with ragged prompt and response lengths (padding removed), the k ranks of a
group running 1/k of each packed row give the log-probs, entropies and gradients of k = 1; an
update dealt per data-parallel group (world / k groups) gives k = 1's parameters and stats; the
critic's values and its update too (separate and shared). A k that does not divide the world or
the heads is one line before anything is built; the planner's token terms divide by k.
"""
import sys

import pytest
import torch

import actor
import critic
import launch
import options
import packing
import predict
import ulysses
from launch import init_distributed
from model import build_mesh, forward, load_model, make_layout, shard
from conftest import launches, metrics, run, tiny_batch


def _policy(kv_heads: int):
    """The tiny Qwen2 (4 heads, 2 KV heads), or the same with 4 KV heads (k = 4 divides both)."""
    if kv_heads == 2:
        return load_model(None, seed=0)
    import tiny
    from transformers import Qwen2ForCausalLM
    config = tiny.tiny_config()
    config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _mine(batch: dict, g: ulysses.Group) -> dict:
    """The data-parallel group's rows: every rank of a group holds the same ones."""
    n = next(iter(batch.values())).shape[0] // g.dp_size
    return {k: v[g.dp_rank * n:(g.dp_rank + 1) * n] for k, v in batch.items()}


def _grads(model):
    return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])


def _params(model):
    return torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()])


def _policy_figures(k: int, kv_heads: int, mesh, device) -> dict:
    """Log-probs, entropies and the gradient of one forward/backward over the whole batch (every
    rank the same rows), then two SGD steps of actor.update_policy dealt per group."""
    cfg = actor.ActorConfig(ulysses_sequence_parallel_size=k, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01,
                            kl_loss_coef=0.1, ppo_epochs=2, logits_chunk_tokens=3)
    # checkpointing as the actor builds it: backward recomputes each layer, its all-to-alls included
    model = shard(_policy(kv_heads), mesh, device, param_dtype="float32", gradient_checkpointing=True)
    batch = tiny_batch(16, 6, device, seed=1)
    lp, ent = forward(model, batch, 0.7, make_layout(cfg, 16, 0), "grad")
    w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    ((lp * w).sum() + 0.1 * ent.sum()).backward()
    # FSDP averages over the world: with k ranks per group each holding its tokens' share, the
    # world's mean is the group's gradient / k (at k = 1 every rank's copy is the whole gradient)
    out = {"lp": lp.detach(), "ent": ent.detach(), "grad": _grads(model) * k}
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # Adam would magnify rounding where a grad is ~0
    batch["old_log_probs"] = batch["old_log_probs"] * 0.0 + lp.detach() + 0.05 * batch["response_mask"]
    mine = _mine(batch, ulysses.group(k))
    out["stats"] = actor.update_policy(model, opt, mine, cfg, mini_size=mine["responses"].shape[0], temperature=0.7)
    out["params"] = _params(model)
    return out


def _critic_figures(k: int, mode: str, mesh, device) -> dict:
    """Values of the whole batch, then one critic update (SGD) dealt per group."""
    act_cfg = actor.ActorConfig(ulysses_sequence_parallel_size=k, logits_chunk_tokens=3)
    act = shard(load_model(None, seed=0), mesh, device, param_dtype="float32")
    c = critic.build(critic.CriticConfig(mode=mode, ppo_micro_batch_size_per_gpu=2), model_path=None, mesh=mesh,
                     device=device, actor_cfg=act_cfg, actor_model=act)
    batch = tiny_batch(8, 5, device, seed=6)
    batch["values"], feats = critic.values(c.model, batch, c.cfg, c.forward_layout, act)
    if feats is not None:
        batch["features"] = feats
    batch["returns"] = torch.rand(8, 5, generator=torch.Generator().manual_seed(6)).to(device)
    mine = _mine(batch, ulysses.group(k))
    c.optimizer = torch.optim.SGD(c.model.parameters(), lr=0.1)
    stats = critic.update_critic(c, mine, mine["responses"].shape[0], 1)
    return {"values": batch["values"], "stats": stats, "params": _params(c.model)}


def _run(out_path: str):
    """Under torchrun (2 or 4 ranks): every k that divides the world (and the model's heads)."""
    rank, world, device = init_distributed()
    mesh = build_mesh(device, world, -1)
    kv = 2 if world == 2 else 4
    ks = [k for k in (1, 2, 4) if world % k == 0 and kv % k == 0]
    out = {"policy": {k: _policy_figures(k, kv, mesh, device) for k in ks},
           "critic": {(k, mode): _critic_figures(k, mode, mesh, device)
                      for k in (1, 2) for mode in ("separate", "shared")}}
    if rank == 0:
        torch.save(out, out_path)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


def _launch(nproc: int, out_path: str):
    r = run([out_path], nproc, script="tests/test_ulysses.py")      # gloo on the CPU
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out_path)


def _close(a, b, what):
    # fp32 rounding of sums taken in another order (k ranks' all-to-alls and reductions; the CPU's vector
    # width changes it too): an absolute term on the tensor's own scale, not on each element's
    atol = max(1e-6, 1e-5 * b.abs().max().item())
    assert torch.allclose(a, b, atol=atol, rtol=1e-5), f"{what}: max |diff| {(a - b).abs().max():.3g} (atol {atol:.2g})"


def _same_stats(a: dict, b: dict, keys, what):
    for key in keys:
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), f"{what}: {key}"


@launches
@pytest.mark.parametrize("nproc", [2, 4])
def test_sequence_parallel_equals_one_rank_per_sequence(tmp_path, nproc):
    """2 ranks (k = 2, the tiny model's 4 heads / 2 KV heads) and 4 ranks (k = 2 and 4, 4 KV heads):
    log-probs and entropies (chunked LM head, temperature 0.7) and their gradients equal k = 1
    within fp32 rounding; two SGD steps dealt per data-parallel group give k = 1's parameters and
    losses; the critic's values and its update (separate and shared) too."""
    out = _launch(nproc, str(tmp_path / "out.pt"))
    one = out["policy"][1]
    assert one["grad"].abs().max() > 0 and len(out["policy"]) == (2 if nproc == 2 else 3)
    for k, got in out["policy"].items():
        for key in ("lp", "ent", "grad", "params"):
            _close(got[key], one[key], f"k={k} {key}")
        _same_stats(got["stats"], one["stats"], ("pg_loss", "kl", "entropy", "grad_norm", "pg_clipfrac"), f"k={k}")
    for mode in ("separate", "shared"):
        base, got = out["critic"][(1, mode)], out["critic"][(2, mode)]
        for key in ("values", "params"):
            _close(got[key], base[key], f"critic {mode} {key}")
        _same_stats(got["stats"], base["stats"], ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"), mode)


@pytest.mark.parametrize("k, world, message", [
    (3, 4, "does not divide the world size 4"),
    (4, 4, "does not divide the model's 4 attention heads and 2 KV heads"),
])
def test_bad_k_is_one_line(k, world, message):
    cfg = options.parse_args([f"--actor.ulysses_sequence_parallel_size={k}"])
    with pytest.raises(ValueError, match=message) as e:
        options.check_sizes(cfg, world)
    assert "\n" not in str(e.value) and "--actor.ulysses_sequence_parallel_size" in str(e.value)


def test_batch_checks_name_the_data_parallel_size():
    """k = 2 on 4 ranks: 2 data-parallel groups; a mini-batch of 3 x 1 samples does not split over them."""
    cfg = options.parse_args(["--actor.ulysses_sequence_parallel_size=2", "--actor.ppo_mini_batch_size=3",
                              "--train_batch_size=12", "--rollout.n=1"])
    with pytest.raises(ValueError, match=r"data-parallel size 2 \(world 4 / actor.ulysses_sequence_parallel_size 2\)"):
        options.check_sizes(cfg, 4)
    ok = options.parse_args(["--actor.ulysses_sequence_parallel_size=2"])
    assert options.check_sizes(ok, 4) == 2 * options.check_sizes(options.parse_args([]), 4)   # per rank: x k


def test_padded_rows_are_refused_with_sequence_parallelism():
    cfg = options.parse_args(["--actor.ulysses_sequence_parallel_size=2", "--actor.remove_padding=false"])
    with pytest.raises(ValueError, match="remove_padding=true"):
        options.check_sizes(cfg, 2)


@launches
@pytest.mark.timeout(900)                # 60 steps on 2 ranks: 222 s on 2 busy cores
def test_grpo_learns_with_sequence_parallelism_on_two_ranks(tmp_path):
    """The embedded default (4 heads, 2 KV heads) on 2 ranks as one Ulysses group (k = 2, data-parallel
    size 1): the reward rises over 60 steps, and the set-up report says the split."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=60", "--save=false", "--actor.ulysses_sequence_parallel_size=2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    first, last = (sum(x["reward_mean"] for x in part) / 10 for part in (m[:10], m[-10:]))
    assert last > first + 0.15, (first, last)
    assert "[ulysses] actor.ulysses_sequence_parallel_size=2" in r.stdout and "data-parallel size 1" in r.stdout


@launches
def test_ppo_runs_with_sequence_parallelism(tmp_path):
    """PPO with the separate critic, k = 2 on 2 ranks: the values, critic and actor stages run."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=2", "--save=false", "--save_freq=0", "--algorithm.adv_estimator=gae",
             "--actor.ulysses_sequence_parallel_size=2"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(x["critic/vf_loss"] > 0 for x in metrics(out))


TOKEN_TERMS = ("activations (layer inputs)", "activations (one layer rebuilt)", "LM head chunk (backward)",
               "forward transient")
LONG = ["--model=random:qwen2.5-1.5b", "--rollout.response_length=8192", "--train_batch_size=4", "--rollout.n=2",
        "--actor.ppo_mini_batch_size=4", "--actor.ppo_micro_batch_size_per_gpu=2", "--actor.logits_chunk_tokens=0",
        "--actor.log_prob_micro_batch_size_per_gpu=2", "--ref.log_prob_micro_batch_size_per_gpu=2"]


def test_plan_token_terms_halve_at_k2():
    """The planner at k = 2 on 2 GPUs: a rank holds its group's samples (2 x), and each of its
    micro-batches' tokens per GPU is half of k = 1's, so the activation, LM-head and forward terms
    of every stage halve; the states do not move."""
    one, two = (options.parse_args(LONG + [f"--actor.ulysses_sequence_parallel_size={k}"]) for k in (1, 2))
    z1, z2 = predict.sizes(one, 2, 64), predict.sizes(two, 2, 64)
    assert z2.samples == 2 * z1.samples
    assert z2.tokens(make_layout(two.actor, 2, 0)) * 2 == z1.tokens(make_layout(one.actor, 2, 0))
    p1, p2 = predict.predict(one, 2, 64, "hf"), predict.predict(two, 2, 64, "hf")
    for name in ("ref_logp", "update"):
        a, b = p1.stage(name).terms, p2.stage(name).terms
        halved = [t for t in TOKEN_TERMS if a.get(t)]
        assert halved and all(b[t] == pytest.approx(a[t] / 2, rel=1e-3) for t in halved), (name, a, b)
        assert b["actor_params"] == a["actor_params"]


def test_search_turns_on_sequence_parallelism_when_k1_does_not_fit():
    """plan.py's search considers k among the world's divisors: on a GPU just too small for the best
    k = 1 configuration, the fastest that fits sets --actor.ulysses_sequence_parallel_size=2."""
    import fit
    import plan
    cfg = options.parse_args(LONG)
    lowest = {k: min(predict.predict(c, 2, 64, "hf").device_peak for c in fit.candidates(cfg, 2)
                     if c.actor.ulysses_sequence_parallel_size == k) for k in (1, 2)}
    assert lowest[2] < lowest[1]
    t = plan.Target(2, 64, int((lowest[1] + lowest[2]) / 2 / 0.9), 0.1, "hf")
    best, _ = plan.choose(cfg, t)
    assert "--actor.ulysses_sequence_parallel_size=2" in plan.changes(cfg, best)
    assert "--actor.ulysses_sequence_parallel_size=2" in plan.report(cfg, t)


if __name__ == "__main__":
    _run(sys.argv[1])


def test_reward_errors_count_each_sample_once_in_a_group():
    """The k ranks of a Ulysses group score the same samples: reward_errors divides the all-reduced
    count by k, so reward/errors counts each failed sample once (in one process: its own count / k)."""
    import data
    errs = ["a failed", "b failed", "c failed", "d failed"]
    assert data.reward_errors(errs, "zero", set(), torch.device("cpu")) == 4
    assert data.reward_errors(errs, "zero", set(), torch.device("cpu"), copies=2) == 2
