"""Tensor-parallel rollout on 2 GPUs: one vLLM engine across both (rollout.tensor_parallel_size=2)
generates what one engine per GPU generates. Skipped without 2 GPUs or vLLM.

    python -m pytest tests/test_vllm_tp.py -q -s       # a plain pytest: it launches its own torchrun runs

One process hosts one sleep-mode engine, so each configuration runs in its own
`torchrun --nproc_per_node=2` (this file's __main__: the same actor, the same prompts per rank,
the real bracket and weight sync) and saves what each rank got; the test compares the two runs.
The model is conftest's ~430M-parameter Qwen2 (random weights): 16 heads, 4 KV heads, so each
GPU of the TP=2 engine holds half of both.
"""
import launch
import dataclasses
import importlib.util
import os
import sys

import pytest
import torch
from model import build_mesh, compute_log_probs, shard
from launch import init_distributed
from conftest import launches, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("vllm") is None,
                       reason="needs 2 CUDA GPUs and vLLM"),
    launches,                          # its own torchrun runs on the GPUs: run it from a plain pytest
]


def _generate(out_dir: str, tp: int):
    """Run under torchrun (2 ranks): build the actor and an engine of `tp` ranks, then one greedy
    and one sampled bracket on this rank's 8 prompts; save what this rank got."""
    import actor
    import rollout
    from conftest import layout, mid_model
    rank, world, device = init_distributed()
    model = shard(mid_model(), build_mesh(device, world, -1), device)
    g = torch.Generator().manual_seed(100 + rank)        # this rank's prompts, the same in both runs
    prompts = [torch.randint(2, 32000, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    cfg = rollout.RolloutConfig(engine="vllm", n=2, response_length=16, tensor_parallel_size=tp, sync_bucket_mb=64)
    engine = rollout.build(cfg, device=device, model_path=None, config=model.config, out_dir=out_dir,
                           req=rollout.request(cfg, prompts=len(prompts), prompt_len=64 - cfg.response_length,
                                               param_dtype="bfloat16"), seed=rank,
                           pad_id=0, eos_id=1, rank=rank)
    greedy_cfg = rollout.RolloutConfig(**{**cfg.__dict__, "temperature": 0.0})
    m = {}
    greedy = rollout.generate(dataclasses.replace(engine, cfg=greedy_cfg), model, prompts, 7 + rank, [], m)
    pb = rollout.make_batch(prompts, [[] for _ in prompts], 0, 0, 1, device)
    with torch.no_grad():                   # the actor's first-token margin: where its top-1 is clear
        last = model(input_ids=pb["input_ids"], attention_mask=pb["attention_mask"],
                     position_ids=pb["position_ids"]).logits[:, -1].float()
    top = last.topk(2).values
    sampled = rollout.generate(engine, model, prompts, 7 + rank, [], {})
    lp = compute_log_probs(model, sampled, layout(64), 1.0)
    mask = sampled["response_mask"]
    diff = (lp - sampled["rollout_log_probs"]).abs() * mask
    torch.save({"input_ids": greedy["input_ids"].cpu(), "responses": greedy["responses"].cpu(),
                "margin": (top[:, 0] - top[:, 1]).cpu(), "kv_cache_bytes": engine.kv_cache_bytes,
                "generate_device_gb": m["rollout/generate_device_gb"], "sync_s": m["rollout/sync_s"],
                "logp_diff_mean": (diff.sum() / mask.sum()).item(), "logp_diff_max": diff.max().item()},
               os.path.join(out_dir, f"tp{tp}.rank{rank}.pt"))
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


def _run(out_dir: str, tp: int) -> list[dict]:
    r = run([out_dir, tp], 2, script="tests/test_vllm_tp.py", gpu=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return [torch.load(os.path.join(out_dir, f"tp{tp}.rank{k}.pt")) for k in range(2)]


@pytest.mark.timeout(1200)               # two torchrun runs of vLLM engines on 2 GPUs
def test_tensor_parallel_engine_generates_what_one_engine_per_gpu_does(tmp_path):
    """2 GPUs, the same actor and the same 8 prompts per rank: with tensor_parallel_size=2 (one
    engine over both GPUs, the weight sync sending whole tensors that vLLM slices per GPU) each
    rank gets back its own rows (its prompts, in order, n per prompt), the first greedy token equals
    that of an engine per GPU (TP=1) wherever the actor's top-1 leads by more than bf16 noise
    (>= 8 such prompts), its sampled tokens' log-probs match the actor's recomputation as closely as
    TP=1's do (mean < 0.03, max < 0.3), and its KV budget per GPU equals TP=1's (twice the
    sequences, half the KV heads on each GPU)."""
    one, two = _run(str(tmp_path), 1), _run(str(tmp_path), 2)
    clear_total = 0
    for rank, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a["input_ids"][:, :-16], b["input_ids"][:, :-16])    # its own prompts, its order
        clear = a["margin"] > 0.05                                           # nats; bf16 noise is ~0.01
        clear_total += int(clear.sum())
        first_a, first_b = a["responses"][::2, 0], b["responses"][::2, 0]   # n=2 rows per prompt
        rows = (a["responses"] == b["responses"]).all(-1).float().mean().item()
        print(f"\n[vllm tp] rank {rank}: first token equal on {int((first_a == first_b)[clear].sum())} of "
              f"{int(clear.sum())} clear prompts, whole rows equal {rows:.3f}; |dlogp| vs actor TP=1 "
              f"{a['logp_diff_mean']:.4f}/{a['logp_diff_max']:.3f}, TP=2 {b['logp_diff_mean']:.4f}/"
              f"{b['logp_diff_max']:.3f}; device used while generating TP=1 {a['generate_device_gb']:.2f} GB, "
              f"TP=2 {b['generate_device_gb']:.2f} GB; sync {a['sync_s'] * 1e3:.0f} / {b['sync_s'] * 1e3:.0f} ms")
        assert torch.equal(first_a[clear], first_b[clear])
        assert b["logp_diff_mean"] < 0.03 and b["logp_diff_max"] < 0.3, b
        assert a["kv_cache_bytes"] == b["kv_cache_bytes"] > 0
    assert clear_total >= 8


if __name__ == "__main__":
    _generate(sys.argv[1], int(sys.argv[2]))
