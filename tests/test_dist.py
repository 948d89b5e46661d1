"""Distribution and offload correctness on the CPU.

    python -m pytest tests/test_dist.py -q        # launches 1-, 2- and 4-process gloo runs itself

One update with 2 processes (each holding half the batch and half of every parameter) equals
the same update with 1 process; an offload -> reload round trip is bit-exact and the next
update is identical to one with no offload at all; the ranks of one tensor-parallel vLLM engine
send it the same requests and each keeps its own.
"""
import sys

import torch

import pytest

import actor
import offload
import rollout
import tensor_parallel
import launch
import weights
from adam import build_optimizer, optimizer_stash
from model import build_mesh, compute_log_probs, load_model, shard, size_config
from launch import init_distributed
from conftest import launches, layout, run, tiny_batch


def _untied_tiny():
    """The embedded tiny model with an LM head of its own (a 7B's layout, small): embeddings_apart's subject."""
    from transformers import Qwen2ForCausalLM
    config = size_config("tiny")
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _one_update(out_path: str, fsdp_size: int = -1, wrap: str = "tied"):
    """Run under torchrun: two Adam steps (2 PPO epochs, off-policy) on a fixed 16-sample batch
    split over the ranks. `wrap`: the tiny model ("tied"), or untied with its ends apart or in the root."""
    from torch.distributed.fsdp import FSDPModule
    rank, world, device = init_distributed()
    mesh = build_mesh(device, world, fsdp_size)
    model = load_model(None, seed=0) if wrap == "tied" else _untied_tiny()
    model = shard(model, mesh, device, embeddings_apart=wrap != "untied-root")
    cfg = actor.ActorConfig(ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01, kl_loss_coef=0.1, ppo_epochs=2)
    opt = build_optimizer(model, cfg)
    full = tiny_batch(16, 5, device, seed=3)
    full["old_log_probs"] = compute_log_probs(model, full, layout(16), 1.0).detach() + 0.05 * full["response_mask"]
    n = 16 // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in full.items()}
    stats = actor.update_policy(model, opt, mine, cfg, mini_size=n, temperature=1.0)  # 2 epochs: 2 Adam steps
    params = {k: p.detach().full_tensor().cpu() for k, p in model.named_parameters()}
    fraction = offload.param_stash("p", model).nbytes / (4 * sum(p.numel() for p in params.values()))
    if rank == 0:
        units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        torch.save({"params": params, "stats": stats, "shard_fraction": fraction, "units": units}, out_path)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


def _rollout_collectives(out_path: str):
    """Run under torchrun (4 ranks). (1) Two engines of tensor_parallel_size=2: each rank pools its
    own prompts (a different number on each rank) and seed with its engine's ranks, as
    generate_vllm does. (2) The weight sync's gather of the actor's shards, and of a 3-row layer
    (uneven over 4 ranks), in bf16 against gathering in fp32 and casting after."""
    from torch.distributed.fsdp import fully_shard
    rank, world, device = init_distributed()
    group = tensor_parallel.tp_group(2)
    prompts = [[rank, i] for i in range(rank + 1)]
    parts, me = tensor_parallel.gather(group, (prompts, 100 + rank))
    mine = (me, parts, tensor_parallel.requests(parts, 3, greedy=True),
            tensor_parallel.requests(parts, 3, greedy=False))
    seen = [None] * world
    torch.distributed.all_gather_object(seen, mine)
    mesh = build_mesh(device, world, -1)
    model = shard(load_model(None, seed=0), mesh, device)
    odd = fully_shard(torch.nn.Linear(8, 3), mesh=mesh)
    params = list(model.parameters()) + list(odd.parameters())
    synced = [weights.full_param(p, device, torch.bfloat16) for p in params]
    same = [s.dtype == torch.bfloat16 and torch.equal(s, p.full_tensor().to(torch.bfloat16))
            for s, p in zip(synced, params)]
    if rank == 0:
        torch.save({"requests": seen, "sync_equal": same}, out_path)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


def _launch(nproc: int, out_path: str, fsdp_size: int | str = -1, wrap: str = "tied"):
    # gloo on the CPU (run's default) for every run, so they differ only in the number of ranks
    r = run([out_path, fsdp_size, wrap], nproc, script="tests/test_dist.py")
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out_path)


def _same(one, two):
    for k in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert abs(one["stats"][k] - two["stats"][k]) <= 1e-5 * max(1.0, abs(one["stats"][k])), k
    for name, p in one["params"].items():
        assert torch.allclose(p, two["params"][name], atol=1e-6, rtol=1e-5), name


@launches
def test_two_processes_equal_one(tmp_path):
    one = _launch(1, str(tmp_path / "one.pt"))
    two = _launch(2, str(tmp_path / "two.pt"))
    _same(one, two)
    moved = sum((p - load_model(None, 0).state_dict()[k]).abs().sum() for k, p in one["params"].items())
    assert moved > 0
    # hybrid sharding: 4 ranks as 2 replicas x 2 shards (fsdp_size=2) make the same update
    hsdp = _launch(4, str(tmp_path / "hsdp.pt"), fsdp_size=2)
    _same(one, hsdp)
    assert one["shard_fraction"] == 1.0 and abs(two["shard_fraction"] - 0.5) < 0.01
    assert abs(hsdp["shard_fraction"] - 0.5) < 0.01       # each rank holds 1/fsdp_size, not 1/world
    assert "model.embed_tokens" not in one["units"] and "" in one["units"]   # tied: the shared table in the root


@launches
def test_an_untied_models_embeddings_and_head_as_units_of_their_own_make_the_same_update(tmp_path):
    """embeddings_apart (the default): an untied model's embeddings and LM head are FSDP2 units of their own, gathered
    and reduced one at a time (at 7B the update's backward end holds one of them, not both). Two Adam steps equal the
    one-root wrapping's bit for bit on one rank, and the same update on two."""
    root = _launch(1, str(tmp_path / "root.pt"), wrap="untied-root")
    apart = _launch(1, str(tmp_path / "apart.pt"), wrap="untied-apart")
    two = _launch(2, str(tmp_path / "two.pt"), wrap="untied-apart")
    assert {"model.embed_tokens", "lm_head"} <= set(apart["units"]) and "lm_head" not in root["units"]
    assert root["stats"] == apart["stats"]
    assert all(torch.equal(p, apart["params"][k]) for k, p in root["params"].items())
    assert not torch.equal(apart["params"]["lm_head.weight"], apart["params"]["model.embed_tokens.weight"])
    _same(apart, two)


def test_offload_round_trip_is_bit_exact(dist_env):
    _, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    cfg = actor.ActorConfig(ppo_micro_batch_size_per_gpu=4)
    twins = []
    for _ in range(2):
        model = shard(load_model(None, seed=0), mesh, device)
        opt = build_optimizer(model, cfg)
        actor.update_policy(model, opt, tiny_batch(8, 5, device, seed=4), cfg, 8, 1.0)  # Adam state exists
        twins.append((model, opt))
    (model, opt), (twin, twin_opt) = twins
    params = offload.param_stash("p", model)
    states = optimizer_stash("o", opt)
    assert states.nbytes == 2 * params.nbytes                 # exp_avg + exp_avg_sq, fp32 like the shards
    snap = [v.clone() for v in params.views + states.views]
    offload.offload(params)
    offload.offload(states)
    assert all(st.nbytes() == 0 for st in params.storages + states.storages)   # really released
    offload.reload(params)
    offload.reload(states)
    assert all(torch.equal(a, b) for a, b in zip(snap, params.views + states.views))
    # the next update, with and without the round trip, is identical to the last bit
    batch = tiny_batch(8, 5, device, seed=5)
    s1 = actor.update_policy(model, opt, batch, cfg, 8, 1.0)
    s2 = actor.update_policy(twin, twin_opt, batch, cfg, 8, 1.0)
    assert s1 == s2
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach().full_tensor(), q.detach().full_tensor())


def test_host_buffers_are_reused(dist_env):
    _, world, device = dist_env
    model = shard(load_model(None, seed=0), build_mesh(device, world, -1), device)
    stash = offload.param_stash("p", model)
    assert stash.host == []                                   # no host memory until the first offload
    offload.offload(stash)
    offload.reload(stash)
    ptrs = [h.data_ptr() for h in stash.host]
    for _ in range(3):
        offload.offload(stash)
        offload.reload(stash)
    assert [h.data_ptr() for h in stash.host] == ptrs         # no new host allocation per step
    assert offload.offload(stash)["offload/p/offload_gb"] > 0
    assert offload.offload(stash) == {}                       # already off: nothing to do
    offload.reload(stash)


@pytest.fixture(scope="module")
def rollout_collectives(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rollout") / "collectives.pt")
    return _launch(4, path, "rollout")


def test_tensor_parallel_ranks_send_one_engine_the_same_requests(rollout_collectives):
    """4 gloo ranks, tensor_parallel_size=2: ranks 0-1 and 2-3 each form one engine (vLLM's layout);
    both ranks of an engine build the same requests (prompts and seeds, greedy or sampled) from
    the two ranks' prompts, the other engine's never enter; the requests a rank owns are its own
    prompts, with the seeds it would have if the engine were its alone (greedy: n requests of one
    sample per prompt; sampled: one of n)."""
    seen = rollout_collectives["requests"]
    for rank, (me, parts, greedy, sampled) in enumerate(seen):
        engine = rank // 2
        assert me == rank % 2 and (parts, greedy, sampled) == seen[2 * engine][1:]   # one pool per engine
        assert [p for p, _ in parts] == [[[r, i] for i in range(r + 1)] for r in (2 * engine, 2 * engine + 1)]
        for is_greedy, (reqs, seeds, owners) in ((True, greedy), (False, sampled)):
            alone, alone_seeds, _ = tensor_parallel.requests([parts[me]], 3, greedy=is_greedy)
            assert len(alone) == (rank + 1) * (3 if is_greedy else 1)
            assert [q for q, k in zip(reqs, owners) if k == me] == alone
            assert [s for s, k in zip(seeds, owners) if k == me] == alone_seeds


def test_weight_sync_gathers_in_bf16_the_values_of_casting_the_fp32_gather(rollout_collectives):
    """4 gloo ranks: every actor parameter (and a 3-row layer sharded unevenly) gathered by the weight
    sync comes out bf16 and equal, bit for bit, to the whole fp32 parameter cast to bf16."""
    assert len(rollout_collectives["sync_equal"]) > 10 and all(rollout_collectives["sync_equal"])


def test_tensor_parallel_needs_the_vllm_engine(tmp_path):
    """tensor_parallel_size > 1 with the HF engine is refused with a ValueError that says so."""
    with pytest.raises(ValueError, match="needs the vLLM engine"):
        rollout.build(rollout.RolloutConfig(engine="hf", tensor_parallel_size=2), device=torch.device("cpu"),
                      model_path=None, config=None, out_dir=str(tmp_path), req=rollout.Request(1, 8, "float32"),
                      seed=0, pad_id=0, eos_id=1)


if __name__ == "__main__":
    if sys.argv[2] == "rollout":
        _rollout_collectives(sys.argv[1])
    else:
        _one_update(sys.argv[1], int(sys.argv[2]), sys.argv[3])


def test_forward_only_bracket_skips_the_copy_back(dist_env):
    """generate / old / ref log-prob brackets free the shards without copying them out again;
    the update bracket copies its new values out, and they come back exactly."""
    _, world, device = dist_env
    model = shard(load_model(None, seed=0), build_mesh(device, world, -1), device)
    opt = build_optimizer(model, actor.ActorConfig())
    stash = offload.param_stash("p", model)
    offload.offload(stash)                                    # first time: a real copy
    m = {}
    batch = tiny_batch(8, 5, device, seed=6)
    with offload.loaded([stash], m):                          # forward only
        before = compute_log_probs(model, batch, layout(8), 1.0)
    assert "offload/p/drop_s" in m and "offload/p/offload_gb" not in m
    with offload.loaded([stash], m, modified=True):
        actor.update_policy(model, opt, batch, actor.ActorConfig(), 8, 1.0)
        updated = [v.clone() for v in stash.views]
    assert m["offload/p/offload_gb"] > 0
    with offload.loaded([stash], {}):
        assert all(torch.equal(a, b) for a, b in zip(updated, stash.views))
        assert not torch.equal(compute_log_probs(model, batch, layout(8), 1.0), before)
