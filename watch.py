"""The watch: the plan (predict.py) against what the run measures, read while it runs. Each stage's prediction
goes into the step's metrics beside the ledger's measurement (`record`); each step's early warnings compare the
two (`watch`: near the GPU's limit, allocator retries, a peak off the plan, reserved memory or host RSS
creeping); an OOM inside a stage is explained with the plan's terms and the change that shrinks the biggest
(`explain_oom`, each role's RELIEF). It predicts nothing itself and moves nothing.

    python train_grpo.py                                   # plan/<stage>/predicted_gb beside mem/<stage>/peak_gb
    python -m pytest -q tests/test_plan.py -k "watch or oom or push"
"""
import actor
import critic
import ledger
import ref
import reward_model
import rollout
import rollout_async
from predict import GB, Plan, Stage


def relief_of() -> dict:
    """A term of a stage's prediction -> the change that removes or shrinks it (each role's RELIEF)."""
    return {**actor.RELIEF, **ref.RELIEF, **critic.RELIEF, **reward_model.RELIEF, **rollout.RELIEF,
            **rollout_async.RELIEF, "forward transient": "a smaller *.log_prob_micro_batch_size_per_gpu (or "
            "actor.logits_chunk_tokens)"}


def relief(st: Stage) -> str:
    """The cheapest change for a stage: the one that removes its biggest term."""
    name = max(st.terms, key=st.terms.get) if st.terms else ""
    return f"{name} is its biggest term ({st.terms.get(name, 0) / GB:.1f} GB): {relief_of().get(name, 'more GPUs')}"


def watch(m: dict, seen: dict, p: Plan, gpu_bytes: int, host_bytes: int, every: int = 50) -> list[str]:
    """This step's early warnings, one line each, each kind at most once per `every` steps: a stage
    above 90 % of the GPU; allocator retries; a measured peak off the plan by more than 10 % and
    0.25 GB (below it only in a step of full-length responses, the plan's case); reserved memory growing
    while allocated does not; host RSS growing; pinned host memory short."""
    out = []

    def warn(kind, text):
        if m["step"] - seen.get(kind, -every) >= every:
            seen[kind] = m["step"]
            out.append("[memory] warning: " + text)

    for st in p.stages:
        peak = m.get(f"mem/{st.name}/peak_gb")
        if peak is None:
            continue
        if peak * GB > 0.9 * gpu_bytes:
            warn(f"high/{st.name}", f"{st.name} peaked at {peak:.1f} GB, over 90 % of the GPU's "
                                    f"{gpu_bytes / GB:.0f} GB; {relief(st)}")
        if m.get(f"mem/{st.name}/alloc_retries", 0) > 0:
            warn(f"retries/{st.name}", f"{st.name}: the allocator freed its cache and retried "
                                       f"{m[f'mem/{st.name}/alloc_retries']:.0f} times (it runs at the memory "
                                       f"limit, and pays in time); {relief(st)}")
        pred = st.total / GB                   # off by 10 %, and by more than the model's resolution
        # (a 30 MB stage is no news; nor is a peak under the plan in a step whose responses were shorter
        # than the full length it plans for: a real model's answers end early, 280 of 512 tokens on GSM8K)
        short = m.get("response_length", p.response_length) < 0.9 * p.response_length
        if m["step"] >= 1 and abs(peak - pred) > max(0.1 * pred, 0.25) and not (peak < pred and short):
            warn(f"plan/{st.name}", f"{st.name} peaked at {peak:.2f} GB, the plan predicted {pred:.2f} GB "
                                    f"({peak / pred - 1:+.0%}); plan.py's terms for it: "
                                    + ", ".join(f"{k} {v / GB:.2f}" for k, v in st.terms.items() if v))
    last = p.stages[-1].name                   # after the last stage: what stays between steps
    alloc, reserved, rss = (m.get(f"mem/{last}/allocated_gb"), m.get(f"mem/{last}/reserved_gb"), m.get("host_rss_gb"))
    if alloc is not None and m["step"] >= 3:   # after warm-up (Adam's state, the caches)
        a0, r0, h0 = seen.setdefault("base", (alloc, reserved, rss))
        if reserved - r0 > 0.05 * r0 + 0.5 and alloc - a0 < 0.1:
            warn("reserved", f"reserved memory grew {r0:.1f} -> {reserved:.1f} GB since step 3 while allocated stayed "
                             f"at {alloc:.1f} GB: fragmentation; it will end in an OOM that more memory would not need")
        if rss is not None and rss - h0 > 0.05 * h0 + 0.5:
            warn("rss", f"host RSS grew {h0:.1f} -> {rss:.1f} GB since step 3: host memory creeps "
                        f"(pinned buffers re-made, or a reference kept per step)")
    if host_bytes and p.pinned_host > 0.9 * host_bytes:
        warn("pinned", f"the offloaded groups need {p.pinned_host / GB:.1f} GB of pinned host memory per rank, "
                       f"over 90 % of the {host_bytes / GB:.0f} GB this process's share of the host has")
    return out


def explain_oom(stage: str, p: Plan, m: dict, device_gb: float) -> str:
    """An OOM inside a stage, in one message: where, what the ledger saw resident before it, what
    the plan predicted, and the change to make."""
    held = {k.split("/")[1]: v for k, v in m.items() if k.startswith("mem/") and k.endswith("/allocated_gb")}
    before = (f"{held[list(held)[-1]]:.1f} GB allocated after {list(held)[-1]}" if held
              else "(no stage finished this step)")
    st = p.stage(stage)
    pred = f"the plan predicted {st.total / GB:.1f} GB for it; {relief(st)}" if st else "the plan has no such stage"
    return (f"out of GPU memory in stage {stage} (a {device_gb:.0f} GB GPU): {before}; {pred}. "
            f"Or let the planner choose: --offload=auto.")


def record(p: Plan | None, name: str, metrics: dict):
    """The plan's prediction for stage `name`, beside the ledger's measurement in the step's metrics:
    the allocator's peak (vs mem/<stage>/peak_gb) and the device level (vs mem/<stage>/device_used_gb;
    generate: vs rollout/device_peak_gb)."""
    predicted = p.stage(name) if p else None
    if predicted is not None:
        metrics[f"plan/{name}/predicted_gb"] = predicted.total / GB
        metrics[f"plan/{name}/device_gb"] = p.device.get(name, 0) / GB


def step_warnings(m: dict, seen: dict, p: Plan, device) -> list[str]:
    """On a GPU: this step's early warnings (`watch`: near the limit, retries, off the plan, creep)."""
    return watch(m, seen, p, ledger.gpu_capacity(device), ledger.host_bytes_per_rank()) if device.type == "cuda" else []

