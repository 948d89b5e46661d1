"""The planner's walk against the run's (CPU): one run of each kind steps twice, and its stages and what each
state group held on the device in each stage equal what predict.py composes from the roles' predictions; and
the five places the planner's copy of the roles once drifted from them, each pinned by a test.

    python -m pytest -q tests/test_walk.py
"""
import contextlib
import math

import pytest
import torch

import adam
import ledger
import offload
import options
import plan
import predict
import rollout
import rollout_async
import rollout_buffer
import rollout_engine
import train_grpo

GB = predict.GB
SMALL = ["--train_batch_size=4", "--rollout.n=4", "--actor.ppo_mini_batch_size=4", "--rollout.engine=hf",
         "--actor.param_dtype=float32", "--save=false", "--logger=none",   # fp32: what a CPU run holds
         "--val_freq=1"]                   # a validation in every step: its stage walks the plan too
EVERY = ["--actor.param_offload=true", "--actor.optimizer_offload=true", "--ref.param_offload=true"]
KINDS = {
    "grpo": [],
    "grpo, every flag": EVERY,
    "grpo without KL, param_offload": ["--actor.use_kl_loss=false", "--actor.param_offload=true"],
    "lora, param_offload": ["--actor.lora_rank=4", "--actor.param_offload=true", "--actor.optimizer_offload=true"],
    "ppo, separate critic, every flag": ["--algorithm.adv_estimator=gae", "--critic.param_offload=true",
                                         "--critic.optimizer_offload=true", *EVERY],
    "ppo, shared critic": ["--algorithm.adv_estimator=gae", "--critic.mode=shared", "--actor.param_offload=true"],
    "reward model, offloaded": ["--reward_model.path=random:tiny", "--reward_model.param_offload=true"],
    "async": ["--rollout.mode=async", "--actor.param_offload=true"],
}


def _observe(t, monkeypatch) -> dict:
    """stage -> {stash name: its most bytes on the device during the stage}, from the run's own moves:
    the stashes at each stage's start and end, and every reload inside it (a reload is how a group comes in)."""
    stashes = {s.name: s for r in train_grpo.roles(t) for s in vars(r).values() if isinstance(s, offload.Stash)}
    seen, now = {}, {}
    real_stage, real_reload = ledger.stage, offload.reload

    def held():                            # an optimizer's stash learns its tensors once Adam has stepped
        return {n: adam.take_state(s).nbytes if s.on_device else 0 for n, s in stashes.items()}

    @contextlib.contextmanager
    def stage(name, metrics, device, external=0):
        now["stage"], seen[name] = name, held()
        with real_stage(name, metrics, device, external):
            yield
        seen[name] = {n: max(b, seen[name][n]) for n, b in held().items()}

    def reload(stash, background=False):
        out = real_reload(stash, background)
        if now.get("stage") in seen:
            seen[now["stage"]][stash.name] = max(seen[now["stage"]][stash.name], adam.take_state(stash).nbytes)
        return out
    monkeypatch.setattr(ledger, "stage", stage)
    monkeypatch.setattr(offload, "reload", reload)
    return seen


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_run_walks_the_plan(kind, dist_env, tmp_path, monkeypatch):
    """A run's second step (Adam exists: the steady state the planner predicts) logs exactly the plan's
    stages in its order, and in each stage every state group held on the device what the plan puts there."""
    cfg = options.parse_args(SMALL + KINDS[kind] + [f"--out_dir={tmp_path}"])
    t = train_grpo.setup(cfg)
    try:
        if cfg.rollout.mode == "async":
            train_grpo.start_stream(t, 0)
        train_grpo.train_step(t, 0)
        seen = _observe(t, monkeypatch)
        m = train_grpo.train_step(t, 1)
    finally:
        if isinstance(t.engine, rollout_async.Stream):   # async: the stream took the engine's place
            rollout_async.close(t.engine)
    p = predict.predict(t.cfg, t.world, max(map(len, t.prompts)), t.engine_kind)
    assert [k[5:] for k in m if k.startswith("time/") and k != "time/step"] == [s.name for s in p.stages]
    groups = set(seen[p.stages[0].name])      # the run's stashes (an empty one holds 0: actor_base without LoRA)
    assert set(predict.states(predict.run(t.cfg, t.world, 8, "hf"))) - {"push bucket"} <= groups
    for st in p.stages:
        assert {g: seen[st.name][g] for g in groups} == {g: st.held(g) for g in groups}, st.name


# --------------------------------------------------------------------------- the five drifts
def _cfg(*args):
    return options.parse_args(["--model=random:qwen2.5-1.5b", "--train_batch_size=16", "--actor.ppo_mini_batch_size=16",
                               "--rollout.response_length=256", *args])


def test_no_kl_param_offload_has_no_ref_stage_and_no_prefetch():
    """GRPO without the KL loss, param_offload on: no ref_logp stage, the fp32 shards are off the GPU in
    `advantage` (nothing prefetches them: no ref forward runs), and prefetch_update changes nothing."""
    p = predict.predict(_cfg("--actor.use_kl_loss=false", "--actor.param_offload=true"), 1, 128)
    assert "ref_logp" not in [s.name for s in p.stages]
    assert p.stage("advantage").held("actor_params") == 0
    q = predict.predict(_cfg("--actor.use_kl_loss=false", "--actor.param_offload=true",
                             "--actor.prefetch_update=false"), 1, 128)
    assert q.seconds == p.seconds and q.stage("update").total == p.stage("update").total


def test_offload_auto_offloads_a_reward_model_when_only_that_fits():
    """A 7B reward model beside a 0.5B policy with every actor flag on (Adam streamed): on a GPU where nothing
    but its offload keeps the margin, the search turns --reward_model.param_offload on (its role declares it)."""
    cfg = options.parse_args(["--model=random:qwen2.5-0.5b", "--reward_model.path=random:qwen2.5-7b",
                              "--train_batch_size=16", "--actor.ppo_mini_batch_size=16",
                              "--rollout.response_length=256", "--actor.param_offload=true",
                              "--actor.optimizer_offload=true", "--actor.optimizer_stream=true",
                              "--ref.param_offload=true"])
    held = predict.predict(cfg, 1, 128).device_peak
    off = predict.predict(plan.with_options(cfg, {"reward_model.param_offload": True}), 1, 128).device_peak
    assert off < held
    t = plan.Target(1, 128, int((held + off) / 2 / 0.9), 0.1)
    best, _ = plan.choose(cfg, t)
    assert best is not None and "--reward_model.param_offload=true" in plan.changes(cfg, best)


def test_an_fp32_engine_is_planned_at_4_bytes():
    """--rollout.dtype=float32: the engine's weights, its KV cache and the sync's bucket at 4 bytes an
    element, the same request the run builds its engine with."""
    cfg = _cfg("--rollout.dtype=float32")
    p, half = predict.predict(cfg, 1, 128), predict.predict(_cfg(), 1, 128)
    req = rollout.request(cfg.rollout, prompts=cfg.train_batch_size, prompt_len=128, param_dtype=cfg.actor.param_dtype)
    assert req.dtype == "float32" and req.dtype_bytes == 4
    assert p.vllm_device["vLLM weights"] == 2 * half.vllm_device["vLLM weights"] == 4 * predict.shapes(cfg.model).params
    assert p.vllm_device["vLLM KV cache"] == rollout.kv_bytes(cfg.rollout, predict.model_config(cfg.model), req)
    assert p.vllm_device["vLLM KV cache"] == pytest.approx(2 * half.vllm_device["vLLM KV cache"], rel=1e-6)


def test_engines_that_do_not_divide_the_prompts_are_planned_as_they_are_ordered():
    """3 prompts over 2 engines: the orders give 2 and 1 (`prompts_per_engine`: contiguous parts); the
    engine's request and the plan's KV cache are sized for the larger part, n sequences a prompt."""
    cfg = options.parse_args(["--model=random:qwen2.5-0.5b", "--train_batch_size=3", "--actor.ppo_mini_batch_size=3",
                              "--rollout.n=4", "--rollout.mode=async", "--rollout.gpus=2"])
    assert rollout_engine.prompts_per_engine(cfg.rollout, 3) == 2
    parts = []
    s = rollout_async.Stream(cfg.rollout, 0, torch.device("cpu"), torch.float32, [], 2, 100, 12, 1, 0, 8,
                             conns=[type("C", (), {"send": lambda self, m: parts.append(m[1]["prompts"])})()] * 2)
    rollout_async._order(s, 0, lambda j: [[1], [2], [3]])
    assert [len(x) for x in parts] == [2, 1]
    req = rollout_engine.request(cfg.rollout, 3, 64, "bfloat16")
    assert req.seqs == 2 * 4
    p = predict.predict(cfg, 1, 64)
    assert p.engine_device["KV cache"] == rollout.kv_bytes(cfg.rollout, predict.model_config(cfg.model), req)


def test_a_buffer_below_one_step_is_refused_by_the_run_and_the_planner(capsys):
    """--rollout.buffer_limit under a step's samples could never hand the trainer a step: the run's check
    and plan.py refuse it in one line naming the value; at a step or more the plan's buffer is that bound."""
    bad = ["--model=random:qwen2.5-0.5b", "--train_batch_size=4", "--actor.ppo_mini_batch_size=4", "--rollout.n=4",
           "--rollout.mode=async", "--rollout.gpus=1", "--rollout.buffer_limit=1"]
    with pytest.raises(ValueError, match=r"--rollout.buffer_limit=1 is below one step's 16 samples"):
        rollout_engine.check(options.parse_args(bad).rollout, 2, 4)
    with pytest.raises(SystemExit):
        plan.main(bad + ["--nproc=2", "--prompt_len=64"])
    assert "buffer_limit=1 is below one step's 16 samples" in capsys.readouterr().err
    ok = options.parse_args(bad[:-1] + ["--rollout.buffer_limit=16"])
    assert predict.predict(ok, 1, 64).buffer_host == 16 * rollout_buffer.sample_bytes(64, ok.rollout.response_length)
    assert math.isclose(rollout_buffer.buffer_limit(ok.rollout, 4), 16)
