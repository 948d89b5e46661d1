"""vLLM rollout on a GPU: parity with the actor after a weight sync, sleep/wake, and the bracket's
memory. Skipped without CUDA or vLLM. One sleep-mode engine per process, so one per module here.

    python -m pytest tests/test_vllm.py -q -s          # -s prints the measured mismatch and memory

The model is a ~430M-parameter Qwen2 built in code (random weights, no download). Both engines
compute in bf16 with different kernels, so exact greedy equality is asserted only where the
actor's top-1 token leads by more than bf16 noise, and the sampled-token log-prob mismatch is
bounded (the measured size of the rollout/training mismatch, bench/README.md).
"""
import dataclasses
import importlib.util

import pytest
import torch

import actor
import ledger
import offload
import rollout
import weights
import lora
from model import build_mesh, compute_log_probs, shard
from conftest import launches, layout, metrics, mid_model, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vLLM"),
              pytest.mark.usefixtures("clean_gpu")]     # the LoRA test's actor must not leave mid-measurement
GB = offload.GB


@pytest.fixture(scope="module")
def env(dist_env, tmp_path_factory):
    rank, world, device = dist_env
    mesh = build_mesh(device, world, -1)
    model = shard(mid_model(), mesh, device)                     # bf16 compute, fp32 master
    cfg = rollout.RolloutConfig(engine="vllm", n=2, response_length=16, gpu_memory_utilization=0.3, sync_bucket_mb=64)
    engine = rollout.build(cfg, device=device, model_path=None, config=model.config,
                           out_dir=str(tmp_path_factory.mktemp("vllm_cfg")), req=rollout.Request(32, 64, "bfloat16"),
                           seed=rank, pad_id=0, eos_id=1, rank=rank)
    print(f"\n[vllm] asleep after build: {engine.asleep_device_gb:.2f} GB stays on the GPU")
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(2, 32000, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    return model, engine, cfg, prompts, device


def _vllm(env, stashes=(), **over):
    model, engine, cfg, prompts, device = env
    c = rollout.RolloutConfig(**{**cfg.__dict__, **over})
    m = {}
    batch = rollout.generate(dataclasses.replace(engine, cfg=c), model, prompts, 7, list(stashes), m)
    return batch, m


def test_greedy_parity_and_logprob_mismatch(env):
    model, engine, cfg, prompts, device = env
    vb, m = _vllm(env, temperature=0.0)
    hb = rollout.generate_hf(model, prompts, rollout.RolloutConfig(**{**cfg.__dict__, "temperature": 0.0}),
                             0, 1, device, 7)
    # first greedy token: decided by the prompt alone; compared where the actor's choice is clear
    pb = rollout.make_batch(prompts, [[] for _ in prompts], 0, 0, 1, device)
    with torch.no_grad():
        last = model(input_ids=pb["input_ids"], attention_mask=pb["attention_mask"],
                     position_ids=pb["position_ids"]).logits[:, -1].float()
    top = last.topk(2).values
    clear = (top[:, 0] - top[:, 1]) > 0.05                           # nats; bf16 logit noise is ~0.01
    first_v, first_h = vb["responses"][::cfg.n, 0], hb["responses"][::cfg.n, 0]
    agree = (first_v == first_h)[clear].float().mean().item()
    rows = (vb["responses"] == hb["responses"]).all(-1).float().mean().item()
    # sampled tokens at T=1: vLLM's log-probs of its own samples against the actor's recomputation
    sb, _ = _vllm(env)
    lp = compute_log_probs(model, sb, layout(64), 1.0)
    mask = sb["response_mask"]
    diff = ((lp - sb["rollout_log_probs"]).abs() * mask)
    mean, mx = (diff.sum() / mask.sum()).item(), diff.max().item()
    print(f"\n[vllm] greedy first token equal on {agree:.3f} of {int(clear.sum())} clear prompts; whole rows "
          f"equal {rows:.3f}; sampled-token |dlogp| mean {mean:.4f} max {mx:.4f}")
    assert clear.sum() >= 8 and agree == 1.0
    # measured on an H200: mean 0.0095 / max 0.031 (bf16 Qwen2.5-0.5B), the e2e run 0.009 / 0.05
    assert mean < 0.03 and mx < 0.3, (mean, mx)
    assert m["rollout/sync_gb"] > 0.5 * sum(p.numel() for p in model.parameters()) * 2 / GB


def test_lora_greedy_parity_after_merged_sync(env):
    """A LoRA actor (rank 16 on mid_model's shape: bf16 base, fp32 adapters, a nonzero adapter) synced
    into the same engine, which then holds the merged weights: vLLM's first greedy token equals the
    merged HF model's (peft's merge_and_unload, bf16) on every prompt where that model's top-1 leads
    by more than 0.05 nats (at least 8 prompts), and on at least 2 of those the merged model's
    choice is not the base model's: a sync that sent the base alone would fail."""
    _, engine, cfg, prompts, device = env
    mesh = build_mesh(device, torch.distributed.get_world_size(), -1)
    a = actor.build(actor.ActorConfig(lora_rank=16), model=mid_model(), mesh=mesh, device=device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in a.model.named_parameters():
            if ".lora_B." in name:
                local = p.to_local()
                local.copy_(torch.randn(local.shape, generator=g) * 0.3)
    vb, m = _vllm((a.model, *env[1:]), temperature=0.0)
    adapter = {n: weights.full_param(p, device).cpu() for n, p in a.model.named_parameters() if p.requires_grad}
    first = {}
    for kind in ("merged", "base"):
        model = mid_model()
        if kind == "merged":
            wrapper = lora.apply(model, a.cfg, torch.device("cpu"))
            model.load_state_dict(adapter, strict=False)
            model = wrapper.merge_and_unload()
        model = model.to(device, torch.bfloat16)
        pb = rollout.make_batch(prompts, [[] for _ in prompts], 0, 0, 1, device)
        with torch.no_grad():
            last = model(input_ids=pb["input_ids"], attention_mask=pb["attention_mask"],
                         position_ids=pb["position_ids"]).logits[:, -1].float()
        top = last.topk(2)
        first[kind] = (top.indices[:, 0], (top.values[:, 0] - top.values[:, 1]) > 0.05)
        del model
    (merged_tok, clear), (base_tok, _) = first["merged"], first["base"]
    vllm_tok = vb["responses"][::cfg.n, 0]
    agree, changed = (vllm_tok == merged_tok)[clear].float().mean(), int((merged_tok != base_tok)[clear].sum())
    print(f"\n[vllm] LoRA merged sync: first greedy token equal on {agree:.3f} of {int(clear.sum())} clear prompts; "
          f"the adapter changed it on {changed}")
    assert clear.sum() >= 8 and torch.equal(vllm_tok[clear], merged_tok[clear])
    assert (merged_tok != base_tok)[clear].sum() >= 2
    assert m["rollout/sync_gb"] > 0.5 * sum(p.numel() for p in a.model.parameters() if not p.requires_grad) * 2 / GB


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_resync_leaves_output_unchanged(env, level):
    first, _ = _vllm(env, temperature=0.0, sleep_level=level)   # ends asleep at this level
    again, _ = _vllm(env, temperature=0.0, sleep_level=level)   # woken, re-synced, generated
    assert torch.equal(first["responses"], again["responses"])
    sampled, _ = _vllm(env)
    sampled2, _ = _vllm(env)
    assert torch.equal(sampled["responses"], sampled2["responses"])      # seeded: reproducible


def _first_tokens(model, prompts, device):
    """The actor's greedy first token for each prompt, and where it leads the second by > 0.05 nats."""
    pb = rollout.make_batch(prompts, [[] for _ in prompts], 0, 0, 1, device)
    with torch.no_grad():
        last = model(input_ids=pb["input_ids"], attention_mask=pb["attention_mask"],
                     position_ids=pb["position_ids"]).logits[:, -1].float()
    top = last.topk(2)
    return top.indices[:, 0], (top.values[:, 0] - top.values[:, 1]) > 0.05


def test_an_engine_that_never_sleeps_samples_as_a_sleeping_one_and_forgets_the_old_weights_prefixes(env):
    """sleep_level 0: the first bracket wakes the engine (empty_cache, both wakes), later ones are the sync
    alone and it stays awake (its weights and KV share of the GPU still taken after the bracket); greedy and
    seeded samples equal a sleeping engine's. Prompts sharing a 40-token prefix (two of vLLM's 16-token
    blocks, kept by its prefix cache while awake), then new weights: its first greedy token is the new
    actor's on every clear prompt (an engine that reused the cached blocks would read the old weights'
    keys and values there). The actor's weights and the engine's sleep are put back after."""
    model, engine, cfg, _, device = env
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 32000, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(2, 32000, (6,), generator=g).tolist() for _ in range(16)]
    e = (model, engine, cfg, prompts, device)
    slept, _ = _vllm(e, temperature=0.0)
    asleep_gb = rollout._used_gb()
    first, m1 = _vllm(e, temperature=0.0, sleep_level=0)
    awake_gb = rollout._used_gb()
    again, m2 = _vllm(e, temperature=0.0, sleep_level=0)
    seeded = [_vllm(e, sleep_level=level)[0]["responses"] for level in (0, 2, 0)]
    phases = ("empty_cache", "wake_weights", "wake_kv", "sleep")
    assert all(f"rollout/{p}_s" in m1 for p in phases[:3]) and not any(f"rollout/{p}_s" in m2 for p in phases)
    assert torch.equal(slept["responses"], first["responses"]) and torch.equal(first["responses"], again["responses"])
    assert torch.equal(seeded[0], seeded[1]) and torch.equal(seeded[1], seeded[2])
    total = torch.cuda.mem_get_info()[1] / GB
    print(f"\n[vllm] never sleeping: {asleep_gb:.2f} GB used asleep, {awake_gb:.2f} GB awake after the bracket")
    assert awake_gb - asleep_gb > 0.8 * cfg.gpu_memory_utilization * total
    saved = [p.to_local().clone() for p in model.parameters()]
    try:
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=g).to(local) * local.float().std().clamp(min=0.02))
        new, _ = _vllm(e, temperature=0.0, sleep_level=0)
        assert not engine.llm.llm_engine.is_sleeping()
        tokens, clear = _first_tokens(model, prompts, device)
        print(f"[vllm] new weights: first greedy token equal on "
              f"{(new['responses'][::cfg.n, 0] == tokens)[clear].float().mean():.3f} of {int(clear.sum())} "
              f"clear prompts")
        assert clear.sum() >= 8 and torch.equal(new["responses"][::cfg.n, 0][clear], tokens[clear])
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.to_local().copy_(s)
        _vllm(e, temperature=0.0)                          # level 2: asleep again for the module's other tests
    assert engine.llm.llm_engine.is_sleeping()


def test_param_offload_frees_the_shards_during_generate(env):
    model = env[0]
    stash = offload.param_stash("actor_params", model)
    _, on_gpu = _vllm(env)
    offload.offload(stash)
    try:
        _, off = _vllm(env, stashes=[stash])
        assert not stash.on_device                                  # the bracket put them back out
        assert ledger.gpu_bytes(model) < 0.01 * stash.nbytes
    finally:
        offload.reload(stash)           # the module's model stays usable whatever failed here
    freed = on_gpu["rollout/generate_device_gb"] - off["rollout/generate_device_gb"]
    print(f"\n[vllm] device used while generating: {on_gpu['rollout/generate_device_gb']:.3f} GB with "
          f"params on the GPU, {off['rollout/generate_device_gb']:.3f} GB offloaded "
          f"(freed {freed:.3f} GB, shards {stash.nbytes / GB:.3f} GB)")
    assert abs(freed - stash.nbytes / GB) <= 0.05 * stash.nbytes / GB


def test_twenty_bracket_cycles_leave_memory_flat(env):
    model = env[0]
    stash = offload.param_stash("actor_params", model)
    offload.offload(stash)
    asleep, rss = [], []
    try:
        for _ in range(20):
            _, m = _vllm(env, stashes=[stash])
            asleep.append(m["rollout/sleep_device_gb"])
            rss.append(ledger.host_rss_gb())
    finally:
        offload.reload(stash)
    print(f"\n[vllm] device used asleep over 20 cycles: {min(asleep):.3f}..{max(asleep):.3f} GB; "
          f"host RSS {rss[2]:.3f} -> {rss[-1]:.3f} GB")
    assert max(asleep[2:]) - min(asleep[2:]) < 0.0625                # < 64 MiB
    assert rss[-1] - rss[2] < 0.125                                  # < 128 MiB


def test_sync_transient_is_one_bucket_not_the_model(env):
    """The weight sync's peak above what was allocated before it is at most one bucket plus the
    largest parameter twice in bf16 (its cast shard and its gathered copy): no fp32 whole tensor,
    never the model."""
    model, cfg = env[0], env[2]
    _, m = _vllm(env)
    biggest = max(p.numel() for p in model.parameters())
    bound = cfg.sync_bucket_mb * 2 ** 20 + biggest * (2 + 2)        # a bucket + one bf16 shard and its bf16 gather
    model_bf16 = sum(p.numel() for p in model.parameters()) * 2
    print(f"\n[vllm] sync transient {m['rollout/sync_transient_gb']:.3f} GB (bound {bound / GB:.3f} GB, "
          f"model bf16 {model_bf16 / GB:.3f} GB), sync {m['rollout/sync_s'] * 1000:.1f} ms")
    assert m["rollout/sync_transient_gb"] * GB <= bound


@launches
def test_async_engine_process_push_parity_and_flat_memory(tmp_path):
    """--rollout.mode=async on one GPU: vLLM in its own process beside the trainer, weights pushed by
    CUDA IPC after each update. Greedy: the engine's log-probs after the first push equal the
    trainer's within bf16 noise; each stage's trainer peak stays flat over the steps. The run is a
    plain `python` of its own: `run` gives it the environment pytest started with, not this one,
    where the module's engine set RANK and LOCAL_RANK (rollout.build_vllm) and a child that saw
    them looked for torchrun's MASTER_ADDR."""
    out = str(tmp_path / "async")
    r = run([f"--out_dir={out}", "--steps=5", "--save=false", "--save_freq=0", "--logger=none", "--rollout.mode=async",
             "--rollout.engine=vllm", "--model=random:qwen2.5-0.5b", "--rollout.temperature=0", "--rollout.n=1",
             "--rollout.response_length=64"], gpu=True, timeout=500)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert m[0]["rollout/staleness_max"] == 0 and m[0]["rollout/logp_diff_mean"] < 0.02
    assert all(x["rollout/staleness_max"] == 1 and x["rollout/push_s"] > 0 for x in m[1:])
    for stage in ("rollout_wait", "ref_logp", "update", "push"):
        peaks = [x[f"mem/{stage}/peak_gb"] for x in m[1:]]
        assert max(peaks) - min(peaks) < 0.05 * max(peaks), (stage, peaks)
