"""FP8 rollout on a GPU (vLLM): the KV cache at one byte an element, the engine's FP8 weights after a weight
sync equal to what a fresh FP8 engine makes of the same bf16 weights, and runs with FP8 that learn as bf16
runs do and stay within the plan. Skipped without CUDA or vLLM; every engine in a process of its own.

    python -m pytest -q -s tests/test_fp8.py
"""
import importlib.util
import json

import pytest
import torch

from conftest import metrics, HERE, launches, run
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vLLM")]

# A child process: the 0.5B-shape policy (random weights, seed 0) saved as a bf16 checkpoint, then either an
# engine of ours (random weights, asleep) that gets the policy by a weight sync, or a fresh vLLM engine built
# from the checkpoint; each dumps its weights, its KV cache's bytes and its greedy tokens.
CHILD = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
import launch, model as M, rollout, vllm_engine
out, kind, kv, quant = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
rank, world, device = launch.init_distributed()
policy = M.load_model("random:qwen2.5-0.5b", seed=0)
ckpt = os.path.join(out, "ckpt")
if not os.path.isdir(ckpt):
    policy.to(torch.bfloat16).save_pretrained(ckpt)
    policy.float()
cfg = rollout.RolloutConfig(engine="vllm", n=1, response_length=16, temperature=0.0, kv_cache_dtype=kv,
                            quantization=quant, enforce_eager=True)
req = rollout.request(cfg, prompts=8, prompt_len=48, param_dtype="bfloat16")
prompts = [[int(x) for x in torch.randint(2, 150000, (12,), generator=torch.Generator().manual_seed(i))]
           for i in range(8)]
if kind == "synced":
    sharded = M.shard(policy, M.build_mesh(device, 1, -1), device)
    engine = rollout.build(cfg, device=device, model_path=None, config=sharded.config, out_dir=out, req=req, seed=0,
                           pad_id=0, eos_id=1)
    llm = engine.llm
    llm.wake_up(tags=["weights"])
    vllm_engine.sync_weights(llm, sharded, engine.dtype, 64, device)
    llm.wake_up(tags=["kv_cache"])
else:
    from vllm import LLM
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=req.length,
              max_num_seqs=req.seqs, seed=0, gpu_memory_utilization=0.3, kv_cache_dtype=kv,
              quantization=None if quant == "none" else quant, logprobs_mode="processed_logprobs")
    engine = rollout.Engine("vllm", cfg, 0, 1, device, llm=llm)
outs = vllm_engine.sample_vllm(engine, prompts, [0] * len(prompts))
net = vllm_engine.vllm_model(llm)
runner = vllm_engine.vllm_runner(llm)
torch.save({"params": {n: p.detach().cpu() for n, p in net.named_parameters()},
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "kv_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches),
            "kv_dtype": str(runner.kv_caches[0].dtype), "asked": getattr(engine, "kv_cache_bytes", 0)},
           os.path.join(out, kind + ".pt"))
launch.leave(0)
"""


def _child(tmp_path, kind: str, kv: str, quant: str) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    r = run([str(script), HERE, str(tmp_path), kind, kv, quant], script=None, gpu=True, timeout=420)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp_path / (kind + ".pt"))


@launches
@pytest.mark.timeout(900)
def test_fp8_weights_after_a_sync_equal_a_fresh_fp8_engines(tmp_path):
    """FP8 weights + KV: after a sync of the bf16 policy, every one of the engine's tensors (FP8 weights and
    their scales included) equals a fresh FP8 engine's built from the same bf16 checkpoint, byte for byte,
    and so do the greedy tokens; the linear weights are FP8, and the KV cache is FP8 at one byte an element,
    the bytes asked for within one block per layer (vLLM rounds down to whole blocks)."""
    synced, fresh = _child(tmp_path, "synced", "fp8", "fp8"), _child(tmp_path, "fresh", "fp8", "fp8")
    fp8 = [n for n, p in synced["params"].items() if p.dtype == torch.float8_e4m3fn]
    assert any("qkv_proj" in n for n in fp8) and any("down_proj" in n for n in fp8), fp8[:4]
    assert synced["params"].keys() == fresh["params"].keys()
    differ = [n for n, p in synced["params"].items()
              if not torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                                 fresh["params"][n].view(torch.uint8) if p.dtype == torch.float8_e4m3fn
                                 else fresh["params"][n])]
    assert differ == [], differ[:8]
    assert synced["tokens"] == fresh["tokens"]
    config = json.load(open(tmp_path / "ckpt" / "config.json"))
    per_block = 2 * config["num_key_value_heads"] * (config["hidden_size"] // config["num_attention_heads"]) * 1 * 16
    print(f"\n[fp8] KV asked {synced['asked'] / 2 ** 20:.1f} MiB, allocated {synced['kv_bytes'] / 2 ** 20:.1f} MiB "
          f"({synced['kv_dtype']}); {len(fp8)} FP8 tensors")
    assert "float8" in synced["kv_dtype"] or "uint8" in synced["kv_dtype"]   # FP8 stored as bytes by some backends
    assert synced["asked"] - config["num_hidden_layers"] * per_block <= synced["kv_bytes"] <= synced["asked"]


def _run(tmp_path, name: str, args: list) -> list:
    out = str(tmp_path / name)
    r = run([f"--out_dir={out}", "--save=false", "--logger=none", "--rollout.engine=vllm", *args],
            gpu=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return metrics(out)


FP8 = ["--rollout.kv_cache_dtype=fp8", "--rollout.quantization=fp8"]


@launches
@pytest.mark.timeout(900)
def test_the_embedded_default_learns_with_fp8_as_with_bf16(tmp_path):
    """The tiny default on the GPU with vLLM, 40 steps each: FP8 weights + KV learn (reward up by 0.1) and
    end within 0.15 of bf16's; the rollout correction is on (its weights logged) and the log-prob mismatch
    is logged in both modes (bf16 asks for it every step: its default is each 10th)."""
    bf16, fp8 = (_run(tmp_path, n, ["--steps=40", *a])
                 for n, a in (("bf16", ["--rollout.logprobs_every=1"]), ("fp8", FP8)))
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    for rows in (bf16, fp8):
        assert mean(rows[-10:], "reward_mean") > mean(rows[:10], "reward_mean") + 0.1
        assert all("rollout/logp_diff_mean" in r for r in rows)
    assert abs(mean(fp8[-10:], "reward_mean") - mean(bf16[-10:], "reward_mean")) < 0.15
    assert all("rollout_is/weight_mean" in r for r in fp8) and not any("rollout_is/weight_mean" in r for r in bf16)
    print(f"\n[fp8] reward last 10: bf16 {mean(bf16[-10:], 'reward_mean'):.3f}, "
          f"fp8 {mean(fp8[-10:], 'reward_mean'):.3f}; "
          f"mismatch mean bf16 {mean(bf16, 'rollout/logp_diff_mean'):.4f}, "
          f"fp8 {mean(fp8, 'rollout/logp_diff_mean'):.4f}")


@launches
@pytest.mark.timeout(900)
def test_fp8_at_0p5b_keeps_kl_and_grad_norm_and_the_plan(tmp_path):
    """0.5B shapes, 12 steps each: with FP8 weights + KV the KL and grad-norm curves stay within noise of
    bf16's (medians within a factor 1.5), the IS weights' mean within 5 % of 1, and every stage above 1 GB
    within 10 % of the plan (allocator peak), as the run logs them side by side."""
    args = ["--model=random:qwen2.5-0.5b", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8",
            "--rollout.response_length=128", "--steps=12"]
    bf16, fp8 = _run(tmp_path, "bf16", args), _run(tmp_path, "fp8", args + FP8)
    med = lambda rows, key: sorted(r[key] for r in rows[2:])[len(rows[2:]) // 2]  # noqa: E731
    for key in ("grad_norm", "kl"):
        a, b = med(bf16, key), med(fp8, key)
        assert b <= 1.5 * a + 1e-4 and a <= 1.5 * b + 1e-4, (key, a, b)
    assert all(abs(r["rollout_is/weight_mean"] - 1) < 0.05 for r in fp8[1:])
    last = fp8[-1]
    for stage in [k.split("/")[1] for k in last if k.startswith("plan/") and k.endswith("/predicted_gb")]:
        peak, pred = last[f"mem/{stage}/peak_gb"], last[f"plan/{stage}/predicted_gb"]
        if peak > 1:
            assert abs(pred / peak - 1) <= 0.10, (stage, peak, pred)
    print(f"\n[fp8] 0.5B: grad norm {med(bf16, 'grad_norm'):.3f} / {med(fp8, 'grad_norm'):.3f}, "
          f"kl {med(bf16, 'kl'):.5f} / {med(fp8, 'kl'):.5f}; "
          f"generate device {last['rollout/generate_device_gb']:.2f} GB; mismatch "
          f"{last['rollout/logp_diff_mean']:.4f} / max {last['rollout/logp_diff_max']:.3f}")
