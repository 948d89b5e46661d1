"""Async rollout on the CPU (HF generate in the engine process): the buffer's bound, staleness,
each batch consumed once, the push's parity, learning, the truncated weights and their use (faults:
test_faults.py).

    python -m pytest -q tests/test_async.py
"""
import importlib.util
import os
import threading
import time

import pytest
import torch

import actor
import losses
import rollout
import rollout_async
import rollout_buffer
import rollout_engine
from conftest import launches, metrics, run
from rollout import RolloutConfig


def test_buffer_reserves_up_to_its_bound_and_hands_each_step_once():
    b = rollout_buffer.Buffer(limit=16)
    assert b.reserve(8) and b.reserve(8) and not b.reserve(1)       # ordered samples count against the bound
    b.put(0, 0, {"responses": [[1]] * 8, "nbytes": 80})
    assert (b.ordered, b.waiting, b.nbytes) == (8, 8, 80)
    assert not b.reserve(1)                                         # waiting samples count too
    assert b.take(0, 1)[0]["nbytes"] == 80
    assert (b.waiting, b.nbytes) == (0, 0) and 0 not in b.parts     # taken once: gone
    assert b.reserve(8)
    got = []
    threading.Thread(target=lambda: got.append(b.take(1, 2)), daemon=True).start()
    b.put(1, 1, {"responses": [[1]] * 4, "nbytes": 40})
    time.sleep(0.2)
    assert not got                                                  # waits for every engine's part
    b.put(1, 0, {"responses": [[1]] * 4, "nbytes": 40})
    time.sleep(0.2)
    assert [len(p["responses"]) for p in got[0]] == [4, 4]          # in engine order
    b.fail("rollout engine 0 exited")
    with pytest.raises(rollout_engine.EngineDied, match="engine 0 exited"):
        b.take(2, 1)


def test_buffer_limit_defaults_to_staleness_steps_and_gpus_leave_a_trainer():
    cfg = RolloutConfig(mode="async", n=8, max_staleness=2)
    assert rollout_buffer.buffer_limit(cfg, 16) == 2 * 16 * 8
    cfg.buffer_limit = 10                  # below one step: refused, naming the value and the step's samples
    with pytest.raises(ValueError, match=r"--rollout.buffer_limit=10 is below one step's 128 samples"):
        rollout_engine.check(cfg, 2, 16)
    cfg.buffer_limit = 128
    assert rollout_buffer.buffer_limit(cfg, 16) == 128
    assert rollout_engine.trainer_world(RolloutConfig(mode="async", gpus=1), 3) == 2
    with pytest.raises(ValueError, match="leaves no trainer"):
        rollout_engine.check(RolloutConfig(mode="async", gpus=2), 2, 16)
    with pytest.raises(ValueError) as e:   # plain python: what to run instead, not "use at most 0"
        rollout_engine.check(RolloutConfig(mode="async", gpus=1), 1, 16)
    assert "(torchrun --nproc_per_node=2 train_grpo.py ...: 1 trainer rank(s) and 1 engine(s)), or pass " \
        "--rollout.gpus=0 (one engine process beside rank 0, sharing its GPU)" in str(e.value) \
        and "at most" not in str(e.value)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        rollout_engine.check(RolloutConfig(mode="async", tensor_parallel_size=2), 4, 16)
    with pytest.raises(ValueError, match=r"--rollout.gpus=1 is for --rollout.mode=async"):
        rollout_engine.check(RolloutConfig(gpus=1), 2, 16)


def test_truncated_importance_weights():
    old = torch.tensor([[0.0, -1.0, -3.0]])
    behaviour = torch.tensor([[0.0, -2.0, -0.5]])
    w = losses.truncated_is(old, behaviour, 2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, torch.exp(torch.tensor(-2.5)).item()]]))   # e^1 truncated at 2


def test_the_truncated_weights_scale_the_policy_loss(dist_env):
    """The weights are applied, not only logged: an engine that gave every sampled token half the policy's
    probability (w = 2) doubles the micro-batch's policy loss and its gradient against an engine that
    agrees (w = 1), with actor.rollout_is=token; with none, the engine's log-probs change nothing."""
    from conftest import layout, tiny_batch
    from model import build_mesh, forward, load_model, shard
    _, world, device = dist_env
    model = shard(load_model(None, seed=0), build_mesh(device, world, -1), device)
    mb = tiny_batch(8, 4, device)
    lay = layout(8)
    mb["old_log_probs"] = forward(model, mb, 1.0, lay)[0].detach()
    tokens, seqs = float(mb["response_mask"].sum()), 8.0
    for mode, scale in (("token", 2.0), ("none", 1.0)):
        cfg = actor.ActorConfig(rollout_is=mode, use_kl_loss=False)
        losses, grads = [], []
        for shift in (0.0, torch.log(torch.tensor(2.0)).item()):   # rollout log-prob = old - log 2: w = 2
            mb["rollout_log_probs"] = (mb["old_log_probs"] - shift) * mb["response_mask"]
            model.zero_grad(set_to_none=True)
            loss = actor.micro_loss(model, mb, cfg, 1.0, lay, (tokens, seqs))[0]
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters() if p.grad is not None]))
        assert losses[1] == pytest.approx(scale * losses[0], rel=1e-5), (mode, losses)
        assert torch.allclose(grads[1], scale * grads[0], rtol=1e-4, atol=1e-8), mode


@launches
@pytest.mark.timeout(600)
def test_the_staleness_bound_holds_with_room_for_several_steps(tmp_path):
    """A buffer with room for 3 steps and max_staleness 1: only the staleness bound keeps the engine from
    sampling ahead with old weights (the buffer never fills: it is not what holds the engine). Every batch
    is at most one update old, and some is one. When a step's metrics are taken, its batch is out and the
    next is ordered (rollout_async.fill: up to step + max_staleness): one step's 16 x 8 samples, no more."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=12", "--save=false", "--rollout.mode=async", "--rollout.max_staleness=1",
             "--rollout.buffer_limit=384", "--logger=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert all(x["rollout/staleness_max"] <= 1 for x in m) and max(x["rollout/staleness_max"] for x in m) == 1
    assert max(x["rollout/buffer_samples"] + x["rollout/buffer_ordered"] for x in m) == 16 * 8 < 384


@launches
@pytest.mark.timeout(900)                # 50 steps: 166 s on 2 busy cores
def test_async_run_bounds_buffer_and_staleness_over_50_steps(tmp_path):
    """max_staleness 3 but a buffer of one step: the bound binds, the engine waits (idle), host memory is flat."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=50", "--save=false", "--rollout.mode=async", "--rollout.max_staleness=3",
             "--rollout.buffer_limit=128", "--logger=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert len(m) == 50 and [x["step"] for x in m] == list(range(50))
    assert all(x["rollout/buffer_samples"] + x["rollout/buffer_ordered"] <= 128 for x in m)
    assert all(x["rollout/staleness_max"] <= 1 for x in m)         # one step in flight at most: the buffer binds
    assert max(x["rollout/staleness_max"] for x in m) == 1         # ... and the engine does run ahead
    assert max(x["rollout/buffer_samples"] + x["rollout/buffer_ordered"] for x in m) == 128   # the bound is reached:
    # with max_staleness 3 the engine would order ahead, the buffer's bound is what holds it
    rss = [x["host_rss_gb"] for x in m]
    assert max(rss[10:]) - min(rss[10:]) < 0.1, rss                # flat: nothing accumulates
    assert "[rollout] async: 1 engine(s)" in r.stdout
    mine = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or rollout_engine.TRAINER_ALLOC_CONF   # the launcher's wins
    assert f"the trainer's allocator: {mine} " in r.stdout


@launches
@pytest.mark.timeout(900)                # 80 steps: 171 s on 2 busy cores
def test_async_learns_and_first_batch_matches_the_trainer(tmp_path):
    """The embedded default learns one step off-policy; at step 0 the engine holds the trainer's
    weights (the first push), so its log-probs equal the trainer's (fp32, HF on both sides)."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=80", "--save=false", "--rollout.mode=async", "--logger=none"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert m[0]["rollout/staleness_max"] == 0 and m[0]["rollout/logp_diff_max"] < 1e-4
    assert all(x["rollout/staleness_max"] == 1 for x in m[1:])
    assert all("rollout_is/weight_mean" in x for x in m)           # the correction is on (its use: below)
    assert all(x["rollout/push_gb"] > 0 and x["time/push"] > 0 for x in m)
    assert all(0 < x["rollout/push_wait_s"] <= x["rollout/push_s"] for x in m)   # the hand-over, inside the push
    first = sum(x["reward_mean"] for x in m[:10]) / 10
    last = sum(x["reward_mean"] for x in m[-10:]) / 10
    assert last > first + 0.1, (first, last)


@launches
def test_async_on_a_rank_of_its_own_under_torchrun(tmp_path):
    """--rollout.gpus=1 of 3 ranks: 2 trainers (their own group), 1 engine rank; weights by broadcast."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=4", "--save=false", "--rollout.mode=async", "--rollout.gpus=1",
             "--logger=none"], nproc=3)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert len(m) == 4 and m[0]["rollout/logp_diff_max"] < 1e-4
    assert '"world_size": 2' in r.stdout


def test_the_set_up_report_describes_no_in_process_engine_for_async_rollout():
    """Async rollout keeps a vLLM Engine record in the trainer but builds no engine there: the set-up report
    has no colocated engine line for it (it said "built in 0.0 s; ... 0% of the GPU"); a built one has it."""
    import rollout
    cfg = RolloutConfig(engine="vllm", mode="async")
    e = rollout.Engine("vllm", cfg, pad_id=0, eos_id=1, device=torch.device("cpu"))
    assert rollout.describe(e) == []
    built = rollout.Engine("vllm", cfg, pad_id=0, eos_id=1, device=torch.device("cpu"), llm=object(), build_s=71.8,
                           kv_cache_bytes=2 * 2**30, asleep_device_gb=0.39)
    assert rollout.describe(built)[0].startswith("[rollout] vLLM engine built in 71.8 s; KV cache 2.00 GB")


def test_the_engine_process_starts_without_the_launchers_or_the_trainers_allocator_settings(monkeypatch):
    """The engine process is spawned without torchrun's variables (its own process group would look for
    torchrun's store) and without PYTORCH_CUDA_ALLOC_CONF (the trainer's: expandable segments there would
    stop vLLM, which refuses them); the trainer's environment is put back after the start."""
    import os
    seen = {}

    class Process:
        def __init__(self, **kw):
            pass

        def start(self):
            seen.update(os.environ)
    monkeypatch.setattr(rollout_engine.multiprocessing, "get_context", lambda kind: type("C", (), {"Process": Process}))
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "r"}
    for k, v in mine.items():
        monkeypatch.setenv(k, v)
    rollout_engine.spawn(("localhost", 0), b"key", 0, torch.device("cpu"))
    assert seen and not set(mine) & set(seen)
    assert {k: os.environ.get(k) for k in mine} == mine


def test_an_async_trainer_grows_its_allocator_segments_unless_the_launcher_chose(monkeypatch):
    """Async rollout: the trainer's process (no vLLM pool in it) gets expandable segments before its first
    CUDA allocation; a colocated run keeps PyTorch's default (vLLM's sleep pool refuses them), and any
    PYTORCH_CUDA_ALLOC_CONF the launcher set is kept as it is."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")       # recorded first: the teardown puts back what was there
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")             # (trainer_allocator sets os.environ itself; later
    assert rollout_engine.trainer_allocator(RolloutConfig(mode="colocated")) is None   # tests build vLLM in-process)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert rollout_engine.trainer_allocator(RolloutConfig(mode="async")) == "expandable_segments:True"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert rollout_engine.trainer_allocator(RolloutConfig(mode="async")) is None
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_expandable_segments_stop_a_colocated_vllm_run_in_the_preflight(monkeypatch):
    """vLLM's sleep pool refuses expandable segments in its process: a colocated run that would build vLLM says
    so in the pre-flight (`rollout.resolve_engine`), not after its models load; the async trainer, whose process
    holds no engine, and other allocator settings go on. (A GPU node with vLLM, as resolve_engine sees it.)"""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    gpu = torch.device("cuda")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments:True conflicts with vLLM's sleep pool in this process"):
        rollout.resolve_engine(RolloutConfig(), gpu)
    assert rollout.resolve_engine(RolloutConfig(engine="hf"), gpu) == "hf"
    assert rollout.resolve_engine(RolloutConfig(mode="async"), gpu) == "vllm"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert rollout.resolve_engine(RolloutConfig(), gpu) == "vllm"
