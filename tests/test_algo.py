"""The loss math against hand-computed values, and micro-batch invariance (CPU, one process).

    python -m pytest tests/test_algo.py -q
"""
import math

import pytest
import torch

import actor
import losses
import options
from adam import build_optimizer
from losses import LOSS_AGG_MODES, agg_loss, global_counts
from model import all_sum, build_mesh, compute_log_probs, load_model, shard
from conftest import layout, tiny_batch


# --------------------------------------------------------------------------- advantage
def test_grpo_advantage_hand_values():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    mask = torch.tensor([[1, 1, 0]] * 8, dtype=torch.float32)
    adv = losses.grpo_advantage(scores, 4, mask)
    s = math.sqrt(1 / 3)                          # unbiased std of [1, 0, 0, 1]
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (torch.tensor([s] * 4 + [0] * 4) + 1e-6)
    assert torch.allclose(adv[:, 0], want, atol=1e-5)
    assert torch.equal(adv[:, 2], torch.zeros(8))             # padding gets no advantage
    dr = losses.grpo_advantage(scores, 4, mask, norm_by_std=False)   # Dr.GRPO
    assert torch.allclose(dr[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    one = losses.grpo_advantage(torch.tensor([0.3, 0.7]), 1, torch.ones(2, 1))
    assert torch.allclose(one[:, 0], torch.tensor([0.3, 0.7]), atol=1e-5)   # group of 1: mean 0, std 1


# --------------------------------------------------------------------------- policy loss
def test_policy_loss_clip_and_dual_clip():
    cfg = actor.ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    delta = torch.tensor([0.5, 0.5, 2.0, -0.5, -0.5])          # logp - old
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0])
    loss, clipped, ratio = losses.policy_loss(delta, torch.zeros(5), adv, cfg)
    e = math.exp
    want = [-1.28,                      # A>0, ratio 1.65 clipped at 1+0.28
            e(0.5),                     # A<0, ratio 1.65: the unclipped term is larger
            3.0,                        # A<0, ratio 7.39: dual clip bounds it at clip_ratio_c
            -e(-0.5),                   # A>0, ratio 0.61: the unclipped term is larger (pessimistic)
            0.8]                        # A<0, ratio 0.61: clipped at 1-0.2
    assert torch.allclose(loss, torch.tensor(want), atol=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert torch.allclose(ratio, delta.exp())


# --------------------------------------------------------------------------- KL
@pytest.mark.parametrize("kind,want", [("kl", [1.0, -1.0]), ("k1", [1.0, -1.0]), ("abs", [1.0, 1.0]),
                                       ("mse", [0.5, 0.5]), ("k2", [0.5, 0.5]),
                                       ("low_var_kl", [math.exp(-1), math.e - 2]),
                                       ("k3", [math.exp(-1), math.e - 2])])
def test_kl_estimators(kind, want):
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    assert torch.allclose(losses.kl_penalty(logp, ref, kind), torch.tensor(want), atol=1e-6)


def test_kl_k3_is_clamped():
    assert losses.kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0


# --------------------------------------------------------------------------- aggregation
def test_loss_aggregation_modes():
    mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert agg_loss(mat, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert agg_loss(mat, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    # explicit global denominators (as in a split mini-batch): 10 tokens, 4 sequences overall
    assert agg_loss(mat, mask, "token-mean", tokens=10).item() == pytest.approx(0.7)
    assert agg_loss(mat, mask, "seq-mean-token-mean", seqs=4).item() == pytest.approx(1.375)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(mat, mask, "token-sum")


def test_lm_head_chunk_matches_torch():
    """The LM head's chunk function (hidden states and head weight -> log p(ids), entropy) equals
    torch's log_softmax and Categorical entropy over the same logits at temperature 0.7."""
    import packing
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 5, generator=g), torch.randn(7, 5, generator=g)
    ids = torch.randint(0, 7, (6,), generator=g)
    logits = (h @ w.t()) / 0.7
    out = packing._head_chunk(h, w, ids, 0.7, "log")
    assert torch.allclose(out[:, 0], torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0], atol=1e-6)
    assert torch.allclose(out[:, 1], torch.distributions.Categorical(logits=logits).entropy(), atol=1e-5)


# --------------------------------------------------------------------------- micro-batch invariance
def _tiny_actor(device, mesh):
    return shard(load_model(None, seed=0), mesh, device)


def test_log_probs_independent_of_micro_batch(dist_env):
    _, world, device = dist_env
    model = _tiny_actor(device, build_mesh(device, world, -1))
    batch = tiny_batch(12, 5, device)
    ref = compute_log_probs(model, batch, layout(12), 1.0)
    for mb in (1, 5, 7):
        assert torch.allclose(compute_log_probs(model, batch, layout(mb), 1.0), ref, atol=1e-5)
    # a left-padded row sees the same log-probs as when it is alone in its batch
    alone = compute_log_probs(model, {k: v[3:4] for k, v in batch.items()}, layout(1), 1.0)
    assert torch.allclose(alone, ref[3:4], atol=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_update_independent_of_micro_batch(dist_env, mode):
    """Same SGD update (so params move by exactly lr x grad) for micro-batch 2, 3 and 12."""
    _, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    batch = tiny_batch(12, 5, device, seed=1)
    batch.pop("old_log_probs")             # on-policy: ratio 1, gradient -A grad logp (+ KL)
    results = []
    for micro in (2, 3, 12):
        cfg = actor.ActorConfig(ppo_micro_batch_size_per_gpu=micro, loss_agg_mode=mode, grad_clip=1e9,
                                entropy_coeff=0.01, kl_loss_coef=0.1)
        model = _tiny_actor(device, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        stats = actor.update_policy(model, opt, batch, cfg, mini_size=12, temperature=1.0)
        delta = torch.cat([(b - p.detach().full_tensor()).flatten() for b, p in zip(before, model.parameters())])
        results.append((delta, stats))
    assert results[0][0].abs().max() > 1e-4          # the update did something
    for delta, stats in results[1:]:
        assert torch.allclose(delta, results[0][0], atol=1e-6, rtol=1e-4)
        assert stats["pg_loss"] == pytest.approx(results[0][1]["pg_loss"], rel=1e-5, abs=1e-6)
        assert stats["kl"] == pytest.approx(results[0][1]["kl"], rel=1e-5)


def test_gradient_checkpointing_gives_the_same_update(dist_env):
    _, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    batch = tiny_batch(8, 5, device, seed=2)
    deltas = []
    for ckpt in (False, True):
        model = shard(load_model(None, seed=0), mesh, device, gradient_checkpointing=ckpt)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        actor.update_policy(model, opt, batch, actor.ActorConfig(grad_clip=1e9), 8, 1.0)
        deltas.append(torch.cat([(b - p.detach().full_tensor()).flatten()
                                 for b, p in zip(before, model.parameters())]))
    assert deltas[0].abs().max() > 1e-4 and torch.allclose(deltas[0], deltas[1], atol=1e-6)


def test_shuffle_mixes_the_samples_across_optimizer_steps(dist_env):
    """--actor.shuffle (TRL's order): the update's batch is permuted row for row before the mini-batch split, seeded
    by `seed` alone. One mini-batch: the same update as without it (every tensor's rows moved together); two: another
    update (the steps see other samples); the same seed twice: the same update."""
    _, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    batch = tiny_batch(8, 5, device, seed=3)
    batch.pop("old_log_probs")             # on-policy: the update's own forward is the old policy

    def delta(shuffle: bool, mini: int, seed: int = 0):
        a = actor.build(actor.ActorConfig(shuffle=shuffle, grad_clip=1e9, kl_loss_coef=0.1), mesh=mesh,
                        device=device, model=load_model(None, seed=0))
        a.optimizer = torch.optim.SGD(a.model.parameters(), lr=1.0)
        before = [p.detach().full_tensor().clone() for p in a.model.parameters()]
        actor.update(a, dict(batch), mini, 1.0, {}, seed=seed)
        return torch.cat([(b - p.detach().full_tensor()).flatten() for b, p in zip(before, a.model.parameters())])

    whole, mixed = delta(False, 8), delta(True, 8)
    assert whole.abs().max() > 1e-4 and torch.allclose(mixed, whole, atol=1e-6, rtol=1e-4)
    halves, mixed_halves = delta(False, 4), delta(True, 4)
    assert not torch.allclose(mixed_halves, halves, atol=1e-4)
    assert torch.equal(delta(True, 4), mixed_halves) and not torch.equal(delta(True, 4, seed=1), mixed_halves)


def test_batch_size_checks():
    cfg = options.parse_args([])
    assert options.check_sizes(cfg, 2) == cfg.actor.ppo_mini_batch_size * cfg.rollout.n // 2
    with pytest.raises(ValueError, match="fsdp_size=3 does not divide the world size 4"):
        options.check_sizes(options.parse_args(["--fsdp_size=3"]), 4)
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        options.check_sizes(cfg, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the world size 3"):
        options.check_sizes(options.parse_args(["--train_batch_size=12", "--actor.ppo_mini_batch_size=12",
                                                      "--rollout.tensor_parallel_size=2"]), 3)
    assert options.check_sizes(options.parse_args(["--rollout.tensor_parallel_size=2"]), 4) > 0
    # the suggested mini-batch divides the batch and its samples split over the ranks (6 x 3 would not over
    # 4), the largest below the one given, else the smallest above it
    for batch, mini, n, world, want in [(24, 7, 3, 4, 4), (8, 3, 1, 8, 8)]:
        with pytest.raises(ValueError, match=rf"such as --actor.ppo_mini_batch_size={want}$"):
            args = [f"--train_batch_size={batch}", f"--actor.ppo_mini_batch_size={mini}", f"--rollout.n={n}"]
            options.check_sizes(options.parse_args(args), world)


def test_chat_template_is_applied():
    import tiny
    tok = tiny.build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}#{% endif %}")
    import data
    prompts, _, _ = data.load_data(None, tok)
    assert prompts[0][-1] == tok.convert_tokens_to_ids("#")      # the generation prompt was added


def test_non_finite_grad_norm_skips_the_step(dist_env, capsys):
    _, world, device = dist_env
    model = _tiny_actor(device, build_mesh(device, world, -1))
    opt = build_optimizer(model, actor.ActorConfig())
    batch = tiny_batch(4, 5, device)
    batch["advantages"] = batch["advantages"] * float("inf")      # -> inf/nan gradients
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    stats = actor.update_policy(model, opt, batch, actor.ActorConfig(), 4, 1.0)
    assert stats["skipped_steps"] == 1 and "optimizer step skipped" in capsys.readouterr().out
    assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())       # the bad gradients are gone


# --------------------------------------------------------------------------- reported statistics
def test_sequence_modes_count_only_rows_with_a_valid_token(dist_env):
    """agg_loss without counts counts a sequence only when it has a valid token (verl's seq_mask);
    global_counts, the update's denominators, count every row (verl's engine: the global batch
    size), the all-padding one included."""
    mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])   # row 3: no valid token
    assert agg_loss(mat, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert agg_loss(mat, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert agg_loss(mat, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    _, world, _ = dist_env
    assert global_counts({"response_mask": mask}) == (3.0 * world, 3.0 * world)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_seq_mean_divides_by_the_global_batch_rows_as_verls_engine(dist_env, mode):
    """A mini-batch of 12 rows, one of them an empty response: the update's seq-mean loss (agg_loss
    with global_counts) and its gradient equal verl's engine formula, the per-sequence losses
    summed and divided by the global batch size (12 rows per rank, the empty one included), not by
    the 11 rows with a token (which gave 12/11 of verl's gradient)."""
    _, world, _ = dist_env
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(12, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    mask[4] = 0                                                    # the empty response
    mat = torch.randn(12, 6, generator=g, requires_grad=True)
    loss = agg_loss(mat, mask, mode, *global_counts({"response_mask": mask}))
    (grad,) = torch.autograd.grad(loss, mat)
    ref = mat.detach().clone().requires_grad_(True)
    per_seq = (ref * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    verl = per_seq.sum() / (12 * world)                            # global_batch_size = mini-batch x n, all ranks
    (want,) = torch.autograd.grad(verl, ref)
    assert loss.item() == pytest.approx(verl.item(), rel=1e-6)
    assert torch.allclose(grad, want, rtol=1e-6, atol=0)


def test_policy_stats_are_token_means():
    """pg_clipfrac and ppo_kl: sums over valid tokens divided by the token count, whatever the
    loss mode; ppo_kl is k3 = r - 1 - log r per token (a masked token counts for nothing)."""
    clipped = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    ratio = torch.tensor([[math.exp(0.5), 1.0, 2.0], [0.5, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    frac, kl = losses.policy_stats(clipped, ratio, mask, 5).tolist()
    assert frac == pytest.approx(2 / 5)
    assert kl == pytest.approx(((math.exp(0.5) - 1.5) + (0.5 - 1 - math.log(0.5))) / 5, rel=1e-6)


def test_clipfrac_is_a_fraction_in_seq_mean_token_sum(dist_env):
    """One update in seq-mean-token-sum with old log-probs 1 nat above the current ones (ratio
    e^-1 on every token): the clip binds exactly on the tokens with a negative advantage, so
    pg_clipfrac is their share of the valid tokens (not a per-sequence sum above 1), and ppo_kl
    is e^-1 - 1 + 1 = e^-1."""
    _, world, device = dist_env
    model = _tiny_actor(device, build_mesh(device, world, -1))
    batch = tiny_batch(8, 5, device, seed=7)
    m = batch["response_mask"].float()
    batch["old_log_probs"] = (compute_log_probs(model, batch, layout(8), 1.0) + 1.0) * m
    cfg = actor.ActorConfig(loss_agg_mode="seq-mean-token-sum", ppo_micro_batch_size_per_gpu=3)
    stats = actor.update_policy(model, build_optimizer(model, cfg), batch, cfg, 8, 1.0)
    want = all_sum(torch.stack([((batch["advantages"] < 0) * m).sum(), m.sum()]))
    assert stats["pg_clipfrac"] == pytest.approx((want[0] / want[1]).item(), rel=1e-6)
    assert stats["ppo_kl"] == pytest.approx(math.exp(-1), rel=1e-4)
    assert stats["optimizer_steps"] == 1 and stats["delta_w_abs_mean"] > 0


def test_param_offload_layers_moves_exactly_the_first_k_layers(dist_env):
    """actor.param_offload_layers=k (the articles' offload_ratio): the stash holds the first k decoder
    layers' local shards and nothing else; after build their storages are freed (on a GPU: device
    bytes) while every other parameter stays; a reload restores them bit for bit; the planner's
    "actor params" term takes exactly those bytes off."""
    import offload
    import predict
    _, world, device = dist_env
    cfg = actor.ActorConfig(param_offload=True, param_offload_layers=1)
    torch.manual_seed(0)
    before = {n: p.detach().clone() for n, p in load_model(None, seed=0).named_parameters()}
    a = actor.build(cfg, mesh=build_mesh(device, world, -1), device=device, seed=0)
    first = {id(p) for p in a.model.model.layers[0].parameters()}
    local = {id(p): p.to_local() for p in a.model.parameters()}
    layer0 = sum(local[i].numel() * 4 for i in first)         # this rank's fp32 shard bytes of layer 0
    assert a.params.nbytes >= layer0 and a.params.nbytes - layer0 < 4 * 64 * len(first)   # FSDP2 pads shards
    for p in a.model.parameters():
        freed = local[id(p)].untyped_storage().nbytes() == 0
        assert freed == (id(p) in first), "only the first layer's shards leave"
    offload.reload(a.params)
    offload.ready(a.params)
    for n, p in a.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(full.detach().cpu(), before[n.replace("_fsdp_wrapped_module.", "")]), n
    opts = options.parse_args(["--actor.param_offload=true", "--actor.param_offload_layers=1"])
    z = predict.sizes(opts, world, 8)
    on, between, host = predict.states(predict.run(opts, world, 8, "hf"))["actor_params"]
    assert on - between == host == z.shard(z.shapes.layer_params, 4)
    if world == 1:                             # one shard holds the whole layer: the plan's bytes are the stash's
        assert host == a.params.nbytes
