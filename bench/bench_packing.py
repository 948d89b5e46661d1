"""Padding and micro-batching on a wide spread of response lengths: padded vs packed rows, fixed
vs token-budget micro-batches, side by side in one process.

    python bench/bench_packing.py --model=random:qwen2.5-1.5b --samples=64 --min_len=32 --max_len=1024 \
        --micro=8 --budget=16384 --out=packing_1.5b.json
    python bench/bench_packing.py --model=random:qwen2.5-7b --samples=32 --micro=4 --budget=8192 \
        --actor.gradient_checkpointing=true --out=packing_7b.json       # other options go to train_grpo

Responses are random tokens with lengths drawn uniformly from [min_len, max_len] (fixed seed), after
prompts of `prompt_len` tokens, so every configuration sees the same batches. Each configuration
runs the ref log-prob stage and the update stage (`ref.compute_log_probs`, `actor.update`: the code
the trainer runs) for `steps` steps; reported: medians after the first step of each stage's time
and peak allocated, and the update's time per real token. The question each row answers: does
the update cost what the real tokens cost (packed time ~ real/padded x padded time)?
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root: the roles

import actor
import launch
import ledger
import offload
import options
import ref
import rollout
import train_grpo
from model import make_layout

CONFIGS = {  # name: (remove_padding, use_dynamic_bsz)
    "padded": (False, False),
    "packed": (True, False),
    "padded_budget": (False, True),
    "packed_budget": (True, True),
}


def wide_batch(args, vocab: int, device, seed: int) -> dict:
    """`samples` rows: prompt_len prompt tokens, a response of U[min_len, max_len] tokens (no EOS)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab, (args.samples, args.prompt_len), generator=g).tolist()
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=g).tolist()
    responses = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    batch = rollout.make_batch(prompts, responses, args.max_len, pad_id=0, eos_id=1, device=device)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(args.samples, 1, generator=g).to(device) * mask
    return batch


def parse_args():
    """The benchmark's options, and the rest (they go to train_grpo's options)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--samples", type=int, default=64, help="samples per step (one mini-batch)")
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--min_len", type=int, default=32)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="samples per micro-batch (fixed)")
    ap.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch (token budget)")
    ap.add_argument("--steps", type=int, default=3, help="the first is a warm-up")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="bench_packing.json")
    return ap.parse_known_args()


def build_trainer(args, extra):
    """The trainer's roles (HF engine: no vLLM), one mini-batch of `samples` per step, both
    micro-batch layouts' sizes set so a configuration only flips the two flags."""
    cfg = options.parse_args([f"--model={args.model}", "--rollout.engine=hf", "--save=false", "--save_freq=0",
                                 f"--train_batch_size={args.samples}", f"--actor.ppo_mini_batch_size={args.samples}",
                                 "--rollout.n=1", f"--actor.ppo_micro_batch_size_per_gpu={args.micro}",
                                 f"--ref.log_prob_micro_batch_size_per_gpu={args.micro}",
                                 f"--actor.ppo_max_token_len_per_gpu={args.budget}",
                                 f"--ref.log_prob_max_token_len_per_gpu={args.budget}",
                                 "--out_dir=/tmp/bench_packing"] + extra)
    prompts = ([[2] * args.prompt_len] * args.samples, ["0"] * args.samples, None)
    return train_grpo.setup(cfg, data=prompts)


def run_config(t, name, args, batches, real) -> dict:
    """One configuration over the batches: the ref log-prob and update stages of each step, their
    medians after the first, the update's time per real token (printed as one line)."""
    pack, dynamic = CONFIGS[name]
    t.actor.cfg.remove_padding, t.actor.cfg.use_dynamic_bsz = pack, dynamic
    t.ref.layout = make_layout(t.actor.cfg, args.micro, args.budget)
    rows = []
    for batch in batches:
        m = {}
        with ledger.stage("ref_logp", m, t.device):
            with ref.resident(t.ref, m):
                batch["ref_log_probs"] = ref.compute_log_probs(t.ref, batch, 1.0)
        with ledger.stage("update", m, t.device):
            m.update(actor.update(t.actor, batch, args.samples, 1.0, m))
        rows.append(m)
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[-1] if isinstance(rows[-1][k], float)}
    med["update_us_per_real_token"] = 1e6 * med["time/update"] / real
    print(f"[{name}] update {med['time/update']:.3f} s ({med['update_us_per_real_token']:.2f} us/real token), "
          f"ref {med['time/ref_logp']:.3f} s, peak update {med['mem/update/peak_gb']:.2f} GB, "
          f"ref {med['mem/ref_logp/peak_gb']:.2f} GB", flush=True)
    return med


def compare_packed(res: dict, real: float, padded: int):
    """packed_over_ideal (when both padded and packed ran): the packed update's time over the padded
    one's scaled by the real-token share."""
    c = res["configs"]
    if "padded" in c and "packed" in c:    # the goal: packed within 1.2x of the real-token share
        res["packed_over_ideal"] = c["packed"]["time/update"] / (real / padded * c["padded"]["time/update"])
        print(f"real/padded tokens {real / padded:.3f}; packed update / (real/padded x padded) = "
              f"{res['packed_over_ideal']:.2f}")


def main():
    args, extra = parse_args()
    t = build_trainer(args, extra)
    device, vocab = t.device, t.actor.model.config.vocab_size
    batches = [wide_batch(args, vocab, device, seed) for seed in range(args.steps)]
    real = sum(b["attention_mask"].sum().item() for b in batches[1:]) / (args.steps - 1)
    padded = batches[0]["input_ids"].numel()
    res = {"model": args.model, "args": vars(args), "extra": extra, "real_tokens": real, "padded_tokens": padded,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "configs": {}}
    for name in args.configs.split(","):
        res["configs"][name] = run_config(t, name, args, batches, real)
    compare_packed(res, real, padded)
    if t.rank == 0:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    launch.leave()                   # barrier, destroy, exit without the interpreter's teardown


if __name__ == "__main__":
    main()
