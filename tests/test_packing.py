"""Packing, the chunked LM head and token-budget micro-batches change no number (CPU).

    python -m pytest tests/test_packing.py -q

The reference everywhere is the plain computation: padded rows, the whole (B, R, vocab) logits
in fp32, log-softmax and entropy over them, fixed-size micro-batches.
"""
import importlib.util
import sys

import pytest
import torch

import actor
import packing
import launch
from model import build_mesh, compute_log_probs, load_model, make_layout, shard
from launch import init_distributed
from conftest import launches, layout, run, tiny_batch


def _model(dist_env):
    """The tiny model, fp32 compute on any device (the comparisons are at fp32 rounding)."""
    _, world, device = dist_env
    return shard(load_model(None, seed=0), build_mesh(device, world, -1), device,
                       param_dtype="float32"), device


def _full_logits(model, mb, temperature=1.0):
    """Today's reference: the (B, R, V) fp32 logits, then log-softmax and entropy over them."""
    R = mb["responses"].shape[1]
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                   position_ids=mb["position_ids"], use_cache=False, logits_to_keep=R + 1).logits
    logits = logits[:, :-1].float() / temperature
    m = mb["response_mask"]
    logp = torch.log_softmax(logits, -1).gather(-1, mb["responses"][..., None])[..., 0]
    return logp * m, torch.distributions.Categorical(logits=logits).entropy() * m


def _grads(model):
    return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])


@pytest.mark.parametrize("entropy", ["grad", "log", "none"])
def test_a_compiled_head_gives_the_eager_heads_numbers_through_fsdp2(dist_env, entropy):
    """--head_kernel=compile's chunk function, traced by torch.compile (aot_eager here: the same graph and
    autograd split as inductor's, without generating code), inside the sharded model's forward, with
    checkpointed chunks of 5 (the last one padded to 5 and its padding dropped): the log-probs, the
    entropies and the gradients equal the eager head's within fp32 rounding, with grad and without; and the head
    alone with its weight frozen (LoRA's: the hidden states' gradient only)."""
    import torch._dynamo
    import kernel_choice
    model, device = _model(dist_env)
    batch = tiny_batch(12, 6, device, seed=1)
    lay = layout(12, logits_chunk_tokens=5)
    out = {}
    torch._dynamo.reset()                  # what an earlier test compiled would be reused, not compiled here
    try:
        for on in (False, True):
            kernel_choice.compile_head(on, rows=5, backend="aot_eager")
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            model.zero_grad(set_to_none=True)
            lp, ent = packing.response_logprobs(model, batch, 0.7, lay, entropy=entropy)
            (lp.sum() + (0.1 * ent.sum() if entropy == "grad" else 0)).backward()
            with torch.no_grad():
                no_grad = packing.response_logprobs(model, batch, 0.7, lay, entropy=entropy)
            out[on] = (lp.detach(), ent, _grads(model), *no_grad)
            assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs) == on   # it really compiled
            g = torch.Generator().manual_seed(2)                # the head alone: 7 rows in chunks of 5, 7 back,
            h, w = torch.randn(7, 8, generator=g, requires_grad=True), torch.randn(11, 8, generator=g)   # w frozen:
            alone = packing.head_logprobs(h, w, torch.randint(0, 11, (7,), generator=g), 0.7, 5, entropy)   # LoRA's
            (alone[:, 0].sum() + (alone[:, 1].sum() if entropy == "grad" else 0)).backward()
            out[on] += (alone.detach(), h.grad)
    finally:
        kernel_choice.compile_head(False)
    assert int(batch["response_mask"].sum()) % 5 and out[False][2].abs().max() > 1e-3
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(out[False], out[True]))
    assert (out[True][1].abs().sum() > 0) == (entropy != "none")       # "none": zeros, no softmax pass


def test_a_compiled_heads_chunks_are_padded_to_the_chunk_and_no_further(monkeypatch):
    """The compiled head sees one shape: each chunk's rows padded up to the chunk (the last of 12 rows in chunks
    of 5: 2 -> 5), never to more (a smaller chunk is a memory choice); the whole batch at once (chunk 0) to a
    multiple of 512. The padding is dropped: the same numbers as the eager head. While the allocator records
    stacks, no chunk goes to the compiled function."""
    import kernel_choice
    seen = []

    def spy(h, w, ids, temperature, entropy):          # stands in for the compiled function
        seen.append(h.shape[0])
        return packing._head_chunk(h, w, ids, temperature, entropy)
    monkeypatch.setattr(kernel_choice, "_compiled_head", lambda backend: spy)
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(12, 8, generator=g), torch.randn(11, 8, generator=g)
    ids = torch.randint(0, 11, (12,), generator=g)
    eager = packing.head_logprobs(h, w, ids, 0.7, 5, "log")
    try:
        out = {}
        for chunk in (5, 0):
            kernel_choice.compile_head(True, rows=chunk)
            out[chunk] = packing.head_logprobs(h, w, ids, 0.7, chunk, "log")
    finally:
        kernel_choice.compile_head(False)
    assert seen == [5, 5, 5, 512]
    assert all(torch.allclose(o, eager, atol=1e-6) for o in out.values())
    monkeypatch.setattr(kernel_choice, "_recording", lambda h: True)   # the allocator records stacks: eager
    try:                                   # (torch 2.11's compiled autograd function fails there)
        kernel_choice.compile_head(True, rows=5)
        assert torch.equal(packing.head_logprobs(h, w, ids, 0.7, 5, "log"), eager) and seen == [5, 5, 5, 512]
    finally:
        kernel_choice.compile_head(False)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("chunk", [0, 3])
def test_packed_and_chunked_equal_full_logits(dist_env, packed, chunk):
    """Log-probs, entropies and their gradients (policy term + entropy term) through packed or
    padded rows and a chunked or whole LM head equal the full-logits computation within fp32
    rounding (1e-5), for a batch with varied prompt and response lengths and temperature 0.7."""
    model, device = _model(dist_env)
    batch = tiny_batch(12, 6, device, seed=1)
    lay = layout(12, remove_padding=packed, logits_chunk_tokens=chunk)
    lp, ent = packing.response_logprobs(model, batch, 0.7, lay, entropy="grad")
    (lp.sum() + 0.1 * ent.sum()).backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    want_lp, want_ent = _full_logits(model, batch, 0.7)
    (want_lp.sum() + 0.1 * want_ent.sum()).backward()
    want = _grads(model)
    assert torch.allclose(lp, want_lp, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-5)
    assert want.abs().max() > 1e-3 and torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(lp[batch["response_mask"] == 0], torch.zeros_like(lp[batch["response_mask"] == 0]))


def test_pack_layout_by_hand():
    """Two rows, prompts of 2 and 1 real tokens (left-padded), responses of 2 and 3: the packed row
    holds the 8 real tokens, positions restart per sequence, `at` points at the positions that
    predict each response token and `dst` at where each sits in the (B, R) layout."""
    import rollout
    mb = packing.host_lengths(rollout.make_batch([[5, 6], [7]], [[8, 9], [10, 11, 12]], 3, pad_id=0, eos_id=1,
                                                 device="cpu"))
    kw, at, p = packing.model_inputs(mb, packed=True)
    assert kw["input_ids"].tolist() == [[5, 6, 8, 9, 7, 10, 11, 12]]
    assert kw["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert kw["cu_seq_lens_q"].tolist() == [0, 4, 8] and kw["max_length_q"] == 4
    assert at.tolist() == [1, 2, 4, 5, 6]                 # 6->8, 8->9 | 7->10, 10->11, 11->12
    assert p["dst"].tolist() == [0, 1, 3, 4, 5]
    _, at_padded, _ = packing.model_inputs(mb, packed=False)
    assert at_padded.tolist() == [1, 2, 6, 7, 8]          # rows of width 5: P-1+j


def test_token_budget_bins_fit_balance_and_keep_order(dist_env):
    """Token-budget micro-batches: every bin holds at most the budget, every row exactly once, the
    loads are balanced (max - min <= the longest sample), and compute_log_probs returns the rows
    in their original order (equal to fixed micro-batches of 5 samples)."""
    model, device = _model(dist_env)
    batch = tiny_batch(16, 6, device, seed=2)
    lengths = batch["attention_mask"].sum(-1).tolist()
    for budget in (max(lengths), 20, 37, 1000):
        bins = packing.micro_batches(batch, layout(5, use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=budget))
        loads = [sum(lengths[i] for i in b.tolist()) for b in bins]
        assert max(loads) <= budget and sorted(i for b in bins for i in b.tolist()) == list(range(16))
        assert max(loads) - min(loads) <= max(lengths)
    fixed = compute_log_probs(model, batch, layout(5), 1.0)
    dynamic = compute_log_probs(model, batch, layout(5, use_dynamic_bsz=True,
                                                            log_prob_max_token_len_per_gpu=20), 1.0)
    assert torch.allclose(fixed, dynamic, atol=1e-6)
    with pytest.raises(ValueError, match="raise the"):
        packing.micro_batches(batch, layout(5, use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=3))


def test_empty_micro_batch_is_a_dummy_with_nothing_to_learn(dist_env):
    """An empty bin (a rank that needs fewer micro-batches than another) runs as a one-row batch
    whose response mask is zero: its log-probs are all zero and every parameter still gets a
    (zero) gradient, so FSDP's reduce-scatter runs on every rank alike."""
    model, device = _model(dist_env)
    mb = packing.take(tiny_batch(4, 5, device, seed=3), torch.tensor([], dtype=torch.long))
    assert mb["response_mask"].sum() == 0 and mb["input_ids"].shape[0] == 1
    lp, ent = packing.response_logprobs(model, mb, 1.0, layout(1), entropy="grad")
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(lp, torch.zeros_like(lp))
    assert all(p.grad is not None and torch.equal(p.grad.full_tensor(), torch.zeros_like(p.grad.full_tensor()))
               for p in model.parameters())


def _uneven_batch(device) -> dict:
    """16 samples: the first 8 with 1-2 response tokens, the last 8 with 7-9 (no EOS inside)."""
    import rollout
    g = torch.Generator().manual_seed(4)
    rand = lambda lo, hi: torch.randint(2, 16, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),  # noqa: E731
                                        generator=g).tolist()
    batch = rollout.make_batch([rand(2, 5) for _ in range(16)], [rand(1, 2) for _ in range(8)] +
                               [rand(7, 9) for _ in range(8)], 9, pad_id=0, eos_id=1, device=device)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(16, 1, generator=g).to(device) * mask
    batch["ref_log_probs"] = (-torch.rand(16, 9, generator=g) * 3).to(device) * mask
    return batch


def _update_with_lengths(out_path: str, dynamic: bool):
    """Under torchrun: one SGD step (lr 1: the parameters move by exactly the gradient) on
    `_uneven_batch` (rank 0 gets the short half, rank 1 the long one), with fixed micro-batches of 2
    or a 36-token budget; rank 0 saves the parameter deltas, the stats and how many micro-batches
    each rank ran."""
    rank, world, device = init_distributed()
    model = shard(load_model(None, seed=0), build_mesh(device, world, -1), device)
    cfg = actor.ActorConfig(ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=36,
                            entropy_coeff=0.01, kl_loss_coef=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()])
    n = 16 // world
    mine = {k: v[rank * n:(rank + 1) * n] for k, v in _uneven_batch(device).items()}
    bins = len(packing.micro_batches(mine, make_layout(cfg, 2, cfg.ppo_max_token_len_per_gpu)))
    stats = actor.update_policy(model, opt, mine, cfg, mini_size=n, temperature=1.0)
    params = torch.cat([p.detach().full_tensor().flatten() for p in model.parameters()]) - before
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    torch.distributed.all_gather(gathered, torch.tensor([bins]))
    if rank == 0:
        torch.save({"params": params, "stats": stats, "bins": [int(c) for c in gathered]}, out_path)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


@launches
def test_token_budget_update_equals_fixed_on_two_ranks(tmp_path):
    """2 gloo ranks with unequal lengths: the token-budget update runs the same number of
    micro-batches on both ranks (not the fixed path's 4) and gives the same gradient (1e-6) and
    losses as fixed micro-batches of 2 samples."""
    out = {}
    for dynamic in (False, True):
        path = str(tmp_path / f"{dynamic}.pt")
        r = run([path, int(dynamic)], 2, script="tests/test_packing.py")      # gloo on the CPU
        assert r.returncode == 0, r.stderr[-3000:]
        out[dynamic] = torch.load(path)
    assert out[True]["bins"][0] == out[True]["bins"][1] and out[False]["bins"] == [4, 4]
    assert out[True]["bins"][0] != 4                     # the budget really changed the split
    assert out[False]["params"].abs().max() > 1e-4
    assert torch.allclose(out[True]["params"], out[False]["params"], atol=1e-6, rtol=1e-5)
    for k in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert out[True]["stats"][k] == pytest.approx(out[False]["stats"][k], rel=1e-5, abs=1e-7), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_varlen_matches_padded_sdpa_in_bf16(dist_env):
    """On the GPU in bf16, the packed row through FlashAttention's varlen kernel gives the padded
    SDPA path's log-probs (mean |diff| < 0.01, max < 0.1 nats: bf16 kernels differ) and gradients
    (cosine similarity > 0.999), on the ~430M GQA model (16 query heads, 4 KV heads)."""
    from conftest import mid_model
    _, world, device = dist_env
    model = shard(mid_model(), build_mesh(device, world, -1), device)
    batch = tiny_batch(8, 48, device, seed=6, vocab=32000)
    out = {}
    for packed in (True, False):
        model.zero_grad(set_to_none=True)
        lp, _ = packing.response_logprobs(model, batch, 1.0, layout(8, remove_padding=packed))
        lp.sum().backward()
        out[packed] = lp.detach(), _grads(model)
    m = batch["response_mask"].bool()
    d = (out[True][0] - out[False][0])[m].abs()
    cos = torch.nn.functional.cosine_similarity(out[True][1], out[False][1], dim=0)
    print(f"\n[packing] bf16 packed vs padded: |dlogp| mean {d.mean():.4f} max {d.max():.4f}; grad cosine {cos:.6f}")
    assert d.mean() < 0.01 and d.max() < 0.1 and cos > 0.999


def test_kernels_choice_is_said_and_refused_where_it_cannot_run(monkeypatch):
    """On a CPU `auto` is transformers' modules and says why; liger and compile are refused in one line
    naming the fallback; torch undoes liger's classes in transformers' Qwen2 module. The LM head's `auto` is
    eager on a CPU and compile on a GPU with Triton, and the set-up line says it was auto's choice; with
    --memory_history auto is eager and compile is refused in one line."""
    import kernel_choice
    from transformers.models.qwen2 import modeling_qwen2
    cpu = torch.device("cpu")
    assert kernel_choice.resolve("auto", cpu, "qwen2") == ("torch", "auto: liger needs a GPU")
    for kind in ("liger", "compile"):
        with pytest.raises(ValueError, match="use --kernels=torch"):
            kernel_choice.resolve(kind, cpu, "qwen2")
    with pytest.raises(ValueError, match="--head_kernel=compile needs a GPU; use --head_kernel=eager"):
        kernel_choice.use("torch", cpu, "qwen2", head="compile")
    assert kernel_choice.use("torch", cpu, "qwen2", head="auto")[1].endswith("the LM head's chunk eager (auto)")
    assert "chunk" not in packing.HEAD        # auto on a CPU: the eager head
    assert [kernel_choice.resolve_head(h, torch.device("cuda")) for h in kernel_choice.HEAD_KERNELS] == \
        ["compile", "eager", "compile"]        # no GPU here: the GPU node's choice, Triton as this machine has it
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert kernel_choice.resolve_head("auto", torch.device("cuda")) == "eager"   # inductor's GPU code needs Triton
    import options                         # the allocator recording stacks (--memory_history): the compiled head fails
    assert options.parse_args(["--memory_history=true"]).head_kernel == "eager"
    with pytest.raises(ValueError, match="use --head_kernel=eager"):
        options.parse_args(["--memory_history=true", "--head_kernel=compile"])
    norm = modeling_qwen2.Qwen2RMSNorm
    used, line = kernel_choice.use("torch", cpu, "qwen2")
    assert used == "torch" and line.startswith("[kernels] torch")
    assert modeling_qwen2.Qwen2RMSNorm is norm and kernel_choice.compile_layers([load_model(None)], used) == 0


def test_torch_kernels_put_back_what_liger_replaced(monkeypatch):
    """use("liger") swaps classes in transformers' Qwen2 module; use("torch") afterwards puts transformers' own
    back, so the next model built has them. Liger is a stand-in here (the swap is the same on the CPU)."""
    import kernel_choice
    from transformers.models.qwen2 import modeling_qwen2 as m
    own = {name: getattr(m, name) for name in ("Qwen2RMSNorm", "Qwen2MLP", "apply_rotary_pos_emb")}
    for name, obj in own.items():
        monkeypatch.setattr(m, name, obj)      # put back whatever this test leaves
    stand_in = (type("StandInNorm", (m.Qwen2RMSNorm,), {}), type("StandInMLP", (m.Qwen2MLP,), {}), lambda *a, **k: None)
    monkeypatch.setattr(kernel_choice, "_liger", lambda: (stand_in, ""))
    # resolve only reads the device's type
    assert kernel_choice.use("liger", torch.device("cuda"), "qwen2")[0] == "liger"
    assert (m.Qwen2RMSNorm, m.Qwen2MLP, m.apply_rotary_pos_emb) == stand_in
    assert type(load_model(None).model.norm).__name__ == "StandInNorm"
    assert kernel_choice.use("torch", torch.device("cpu"), "qwen2")[0] == "torch"
    assert {name: getattr(m, name) for name in own} == own
    built = load_model(None)
    assert type(built.model.norm) is own["Qwen2RMSNorm"] and type(built.model.layers[0].mlp) is own["Qwen2MLP"]


def _kernel_run(kind: str, weights: dict, batch: dict, dist_env, dtype: str = "bfloat16") -> tuple:
    """(log-probs, entropies, grads) of the ~430M model with `kind`'s kernels, packed, checkpointing on
    ("head": transformers' modules and the LM head's chunk compiled, --head_kernel=compile)."""
    import kernel_choice
    from conftest import mid_model
    _, world, device = dist_env
    head = "compile" if kind == "head" else "eager"
    kind = "torch" if kind == "head" else kind
    used, _ = kernel_choice.use(kind, device, "qwen2", head)
    assert ("chunk" in packing.HEAD) == (head == "compile")   # the head the run asked for is the one installed
    torch._dynamo.reset()                  # what an earlier run compiled would be reused, not compiled here
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model = mid_model()
    model.load_state_dict(weights)
    model = shard(model, build_mesh(device, world, -1), device, param_dtype=dtype, gradient_checkpointing=True)
    assert kernel_choice.compile_layers([model], used) == (8 if kind == "compile" else 0)
    assert any(type(m).__name__ == "LigerRMSNorm" for m in model.modules()) == (kind == "liger")
    for _ in range(2):                     # compile: the second call runs the compiled graph
        model.zero_grad(set_to_none=True)
        lp, ent = packing.response_logprobs(model, batch, 1.0, layout(8), entropy="grad")
        (lp.sum() + 0.01 * ent.sum()).backward()
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    assert compiled == (head == "compile" or kind == "compile")   # it really compiled, and only then
    return lp.detach(), ent.detach(), _grads(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["liger", "compile", "head"])
def test_kernels_are_as_accurate_as_torch_in_bf16(dist_env, kind):
    """--kernels=liger and =compile (which really ran: Liger's modules in the model, 8 layers compiled), and
    --head_kernel=compile ("head", with transformers' modules; its chunk installed and compiled), are
    no further from the fp32 computation than transformers' own bf16 modules: log-probs' and entropies'
    mean |error| at most 10 % more (+0.001), max |error| < 0.1 nats, the gradient's cosine to fp32's
    within 1e-4 of torch's, on the packed path with checkpointing (~430M model). Their distance to
    torch's bf16 itself is printed: both sides round differently (fused kernels keep fp32 inside).
    liger is skipped where liger-kernel is not installed (an optional dependency)."""
    import kernel_choice
    from conftest import mid_model
    if kind == "liger":
        pytest.importorskip("liger_kernel")
    device = dist_env[2]
    batch, weights = tiny_batch(8, 48, device, seed=6, vocab=32000), mid_model().state_dict()
    try:
        exact = _kernel_run("torch", weights, batch, dist_env, dtype="float32")
        out = {k: _kernel_run(k, weights, batch, dist_env) for k in ("torch", kind)}
    finally:
        kernel_choice.use("torch", device, "qwen2")
    m = batch["response_mask"].bool()
    err = {k: [(v[i] - exact[i])[m].abs() for i in (0, 1)] for k, v in out.items()}
    cos = {k: torch.nn.functional.cosine_similarity(v[2], exact[2], dim=0).item() for k, v in out.items()}
    d = (out[kind][0] - out["torch"][0])[m].abs()
    print(f"\n[kernels] vs fp32: |dlogp| mean torch {err['torch'][0].mean():.4f} {kind} {err[kind][0].mean():.4f}, "
          f"max {err[kind][0].max():.4f}; grad cosine torch {cos['torch']:.6f} {kind} {cos[kind]:.6f}; "
          f"{kind} vs torch bf16: |dlogp| mean {d.mean():.4f} max {d.max():.4f}")
    for i in (0, 1):
        assert err[kind][i].mean() <= 1.1 * err["torch"][i].mean() + 1e-3
    assert err[kind][0].max() < 0.1 and cos[kind] > cos["torch"] - 1e-4


if __name__ == "__main__":
    _update_with_lengths(sys.argv[1], bool(int(sys.argv[2])))
