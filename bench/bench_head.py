"""The LM head over an update's response tokens, eager against compiled (kernel_choice.compile_head), side by
side in one process: the update's forward + backward and a no-grad forward (the ref stage's), each chunk's
peak, and the log-probs against an fp32 head on the same weights.

    python bench/bench_head.py --hidden=1536 --tokens=32768 --out=head_1p5b.json   # Qwen2.5-1.5B's head
    python bench/bench_head.py --hidden=896 --tokens=32768 --out=head_0p5b.json    # 0.5B's

TRL's workload puts 16 x 8 x 256 = 32,768 response tokens through the head a step. The tokens are one fewer
than a whole number of chunks, so the last chunk is a partial one, as in a run.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernel_choice  # noqa: E402
import packing  # noqa: E402

VOCAB = 151936


def timed(fn, reps: int, warmup: int) -> float:
    """Median seconds of `fn` over `reps` calls after `warmup` (the compiled head compiles in these)."""
    times = []
    for k in range(warmup + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def variant(h, w, ids, g, temperature: float, chunk: int, compiled: bool, reps: int) -> dict:
    kernel_choice.compile_head(compiled, chunk)

    def update():        # the update's: log-probs with grad, the entropy without (entropy_coeff 0)
        h.grad = w.grad = None
        out = packing.head_logprobs(h, w, ids, temperature, chunk, "log")
        (out[:, 0] * g).sum().backward()

    def ref():           # the ref / old log-prob stage's: no graph, no entropy
        with torch.no_grad():
            return packing.head_logprobs(h, w, ids, temperature, chunk, "none")

    row = {"update_s": timed(update, reps, 3), "ref_s": timed(ref, reps, 3)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    update()
    row["update_peak_gb_over_grads"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    with torch.no_grad():
        row["logp"] = packing.head_logprobs(h, w, ids, temperature, chunk, "log")[:, 0].float()
    row["grad_h"], row["grad_w"] = h.grad.float().clone(), w.grad.float().clone()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev, n = torch.device("cuda"), a.tokens - 1
    h = (torch.randn(n, a.hidden, device=dev) * 2).bfloat16().requires_grad_()     # logits of a few units
    w = (torch.randn(VOCAB, a.hidden, device=dev) / a.hidden ** 0.5).bfloat16().requires_grad_()
    ids, g = torch.randint(0, VOCAB, (n,), device=dev), torch.randn(n, device=dev)
    rows = {name: variant(h, w, ids, g, a.temperature, a.chunk, on, a.reps)
            for name, on in (("eager", False), ("compiled", True), ("eager again", False))}
    with torch.no_grad():                       # the fp32 head on the same bf16 weights, a chunk at a time
        exact = torch.cat([torch.log_softmax(h[s:s + 4096].float() @ w.float().t() / a.temperature, -1)
                           .gather(-1, ids[s:s + 4096, None])[:, 0] for s in range(0, n, 4096)])
    e = rows["eager"]
    for r in rows.values():
        r["logp_max_abs_err"] = (r["logp"] - exact).abs().max().item()
        r["logp_mean_abs_err"] = (r["logp"] - exact).abs().mean().item()
        r["grad_h_rel_diff"] = ((r["grad_h"] - e["grad_h"]).norm() / e["grad_h"].norm()).item()
        r["grad_w_rel_diff"] = ((r["grad_w"] - e["grad_w"]).norm() / e["grad_w"].norm()).item()
    for r in rows.values():
        for k in ("logp", "grad_h", "grad_w"):
            del r[k]
    res = {"hidden": a.hidden, "tokens": n, "chunk": a.chunk, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rows": rows,
           "speedup_update": e["update_s"] / rows["compiled"]["update_s"],
           "speedup_ref": e["ref_s"] / rows["compiled"]["ref_s"]}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
