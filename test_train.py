"""End to end on the CPU: the embedded run learns, the metrics are complete, the checkpoint loads,
the real-model path runs, two "nodes" joined by torchrun's c10d rendezvous run as one node does,
and bad input fails with one clear line.

    python -m pytest test_train.py -q
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import train_grpo

HERE = os.path.dirname(os.path.abspath(__file__))
GRPO_STAGES = [s for s in train_grpo.STAGES if s not in ("values", "critic_update", "reward_model")]


def run(args, nproc=0, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc > torch.cuda.device_count():     # more ranks than GPUs: run this one on the CPU (gloo)
        env["CUDA_VISIBLE_DEVICES"] = ""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    return subprocess.run(launch + [os.path.join(HERE, "train_grpo.py")] + args, env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=HERE)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_embedded_run_learns_on_two_processes(tmp_path):
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=60", "--save=false"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert len(m) == 60
    first = sum(x["reward_mean"] for x in m[:10]) / 10
    last = sum(x["reward_mean"] for x in m[-10:]) / 10
    assert last > first + 0.15, (first, last)
    need = ["step", "reward_mean", "pg_loss", "kl", "entropy", "grad_norm", "host_rss_gb"]
    need += [f"time/{s}" for s in GRPO_STAGES]
    need += [f"mem/{s}/{k}" for s in GRPO_STAGES for k in ("allocated_gb", "peak_gb", "reserved_gb")]
    assert not [k for k in need if k not in m[0]]
    assert all(0 < x[f"time_min/{s}"] <= x[f"time/{s}"] for x in m for s in GRPO_STAGES)   # fastest <= slowest rank
    assert "reward_mean=" in r.stdout and "[####" in r.stdout        # the per-step line and its bar


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(procs, timeout: float) -> list:
    """Wait for every process; if one fails (or time runs out), stop the others: a node whose peer
    died would otherwise wait in a collective until gloo's 30-minute timeout."""
    import time
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs):
        if time.time() > deadline or any(p.poll() for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    return [p.returncode for p in procs]


def test_two_nodes_through_c10d_rendezvous_equal_one_node(tmp_path):
    """Two "nodes" of one CPU process each, started as a multi-node job starts (one torchrun per
    node, --nnodes=2, c10d rendezvous at 127.0.0.1:<free port>, one --rdzv-id), run 3 steps with the
    same rewards, response lengths, losses and grad norms, step for step, as 2 processes on one node
    (--standalone); the run's metrics file is written once (global rank 0)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}   # both runs: gloo on the CPU
    run = [sys.executable, "-m", "torch.distributed.run"]
    args = [os.path.join(HERE, "train_grpo.py"), "--steps=3", "--save=false"]
    port = _free_port()
    # --node_rank is left out: c10d rendezvous assigns the ranks (torchrun ignores it and warns)
    node = run + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                  f"--rdzv-id=two-nodes-{port}"]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]     # files: a full pipe would block a node
    nodes = [subprocess.Popen(node + args + [f"--out_dir={tmp_path / 'nodes'}"], env=env, cwd=HERE,
                              stdout=log, stderr=subprocess.STDOUT) for log in logs]
    codes = _wait_all(nodes, timeout=600)
    for log in logs:
        log.close()
    assert codes == [0, 0], [(tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2)]
    one = subprocess.run(run + ["--standalone", "--nproc_per_node=2"] + args + [f"--out_dir={tmp_path / 'one'}"],
                         env=env, cwd=HERE, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    keys = ("reward_mean", "response_length", "pg_loss", "kl", "entropy", "grad_norm", "pg_clipfrac", "ppo_kl")
    got, want = metrics(tmp_path / "nodes"), metrics(tmp_path / "one")
    assert len(got) == len(want) == 3
    assert [[m[k] for k in keys] for m in got] == [[m[k] for k in keys] for m in want]


def test_offload_flags_and_off_policy_path_run(tmp_path):
    """Every manual offload flag on, 2 mini-batches x 2 epochs (so old log-probs are recomputed)."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=3", "--save=false", "--actor.param_offload=true",
             "--actor.optimizer_offload=true", "--ref.param_offload=true", "--actor.ppo_epochs=2",
             "--actor.ppo_mini_batch_size=8", "--actor.loss_agg_mode=seq-mean-token-mean"])
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out)
    assert m[-1]["time/old_logp"] > 0 and m[-1]["offload/actor_optimizer/offload_gb"] > 0
    assert m[-1]["offload/actor_params/reload_gb"] > 0 and m[-1]["offload/ref_params/reload_gb"] > 0
    assert "offload/ref_params/drop_s" in m[-1]              # the ref never changes: freed, not copied out
    assert "[offload] actor.param_offload: ON" in r.stdout


def test_copy_levers_change_no_number_and_save_a_copy(tmp_path):
    """prefetch_update, defer_param_offload and optimizer_load_at_step only move copies in time:
    the same run with them off gives the same numbers. On: per step one param copy in (prefetched during the ref forward, so
    the update has nothing left to reload) and one out (after the next sync), not two in and one out."""
    runs = {}
    for on in ("true", "false", "at_step"):      # at_step: levers off, Adam in just before the step
        out = str(tmp_path / on)
        lever = "true" if on == "true" else "false"
        r = run([f"--out_dir={out}", "--steps=3", "--save=false", "--actor.param_offload=true",
                 "--actor.optimizer_offload=true", "--ref.param_offload=true",
                 f"--actor.prefetch_update={lever}", f"--actor.defer_param_offload={lever}",
                 f"--actor.optimizer_load_at_step={on == 'at_step'}"])
        assert r.returncode == 0, r.stderr[-3000:]
        runs[on] = metrics(out)
    keys = ("reward_mean", "pg_loss", "kl", "grad_norm")
    for a, b, c in zip(runs["true"], runs["false"], runs["at_step"]):
        assert [a[k] for k in keys] == [b[k] for k in keys] == [c[k] for k in keys]
    assert runs["at_step"][-1]["offload/actor_optimizer/reload_gb"] > 0    # a blocking copy, at the step
    on, off = runs["true"][-1], runs["false"][-1]
    assert on["offload/actor_params/prefetch_gb"] > 0
    assert "offload/actor_params/reload_s" not in on and "offload/actor_params/drop_s" not in on
    assert on["offload/actor_params/offload_gb"] > 0                # copied out by the generate bracket
    assert off["offload/actor_params/reload_gb"] > 0 and "offload/actor_params/drop_s" in off


def test_checkpoint_loads_and_real_model_path_runs(tmp_path):
    """Save the embedded policy, load it with from_pretrained, then train from it on a jsonl file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = str(tmp_path / "a")
    r = run([f"--out_dir={out}", "--steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = os.path.join(out, "final")
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok("12=")["input_ids"] == [3, 4, 12]
    import actor
    fresh = actor.load_model(None, seed=0)
    moved = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(),
                                                            fresh.state_dict().values()))
    assert moved > 0                                       # the saved weights are the trained ones
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i}{i}=", "answer": f"#### {i}{i}"})
                              for i in range(8)) + "\n")
    r = run([f"--out_dir={tmp_path / 'b'}", "--steps=2", "--save=false", f"--model={ckpt}", "--data",
             str(data), "--prompt_key=question", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8"])
    assert r.returncode == 0, r.stderr[-3000:]


def test_profile_steps_writes_one_trace(tmp_path):
    """A 3-step run with --profile_steps=1 writes one trace, step 1's from rank 0, and no other: valid
    JSON (Chrome trace format) with CPU op events and their input shapes (record_shapes), allocation
    events (profile_memory) and one span per stage."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=3", "--save=false", "--train_batch_size=2", "--actor.ppo_mini_batch_size=2",
             "--rollout.n=2", "--profile_steps=1"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.listdir(os.path.join(out, "profile")) == ["step1.rank0.pt.trace.json"]
    with open(os.path.join(out, "profile", "step1.rank0.pt.trace.json")) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    assert "[memory]" in names and {f"stage:{s}" for s in ("generate", "update")} <= names
    assert any(e.get("cat") == "cpu_op" and e.get("args", {}).get("Input Dims") for e in events)
    assert len(metrics(out)) == 3


def test_profile_steps_option():
    """"1, 3" -> {1, 3}; "" -> off; anything else is refused with the fix; a step not named runs with
    no profiler started."""
    assert train_grpo.profile_steps("1, 3") == {1, 3} and train_grpo.profile_steps("") == set()
    for bad in ("a", "-1", "1;2"):
        with pytest.raises(ValueError, match="give step numbers from 0"):
            train_grpo.profile_steps(bad)
    with train_grpo.profiled(train_grpo.parse_args(["--profile_steps=1"]), 0, 0, torch.device("cpu")):
        assert not torch.autograd._profiler_enabled()


def test_parquet_and_gsm8k_reward(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tiny
    import data
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["1=", "22="], "answer": ["x #### 1", "#### 22"]}), path)
    prompts, answers, chats = data.load_data(path, tiny.build_tokenizer())
    assert prompts == [[3, 12], [4, 4, 12]] and answers == ["x #### 1", "#### 22"]
    assert chats == [[{"role": "user", "content": "1="}], [{"role": "user", "content": "22="}]]
    assert data.gsm8k_reward("so #### 1,000", "#### 1000") == 1.0
    assert data.gsm8k_reward("#### 7 then #### 8", "8") == 1.0      # the last one counts
    assert data.gsm8k_reward("8", "#### 8") == 0.0                  # no #### in the response


def test_config_overrides_are_typed():
    import train_grpo
    cfg = train_grpo.parse_args(["--actor.lr=1e-6", "--ref.param_offload", "true", "--model=none",
                                 "--rollout.n=4"])
    assert cfg.actor.lr == 1e-6 and cfg.ref.param_offload is True and cfg.model is None
    assert cfg.rollout.n == 4


@pytest.mark.parametrize("args,expect", [
    (["--model=/nonexistent/model"], "no config.json"),
    (["--actor.no_such_key=1"], "unknown option --actor.no_such_key"),
    (["--nosection.lr=1"], "unknown option --nosection.lr"),
    (["--actor.lr=fast"], "expected float"),
    (["--actor.param_offload=maybe"], "expected true or false"),
    (["--train_batch_size=16", "--actor.ppo_mini_batch_size=5"], "not a multiple"),
    (["--actor.ppo_micro_batch_size_per_gpu=48"], "does not divide"),
    (["--data=/nonexistent.jsonl"], "no such file"),
    (["--reward=nosuchmodule:fn"], "cannot load it"),
    (["--actor.lora_rank=4", "--actor.lora_target_modules=q_proj,lm_head"], "lm_head is not a decoder projection"),
    (["--actor.lora_rank=-1"], "use 0 (off) or a positive rank"),
])
def test_bad_input_gives_one_clear_line(args, expect):
    r = run(args + ["--steps=1", "--save=false", "--out_dir=/tmp/grpo-bad-input"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], r.stderr[-2000:]


def test_malformed_data_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": "2=", "answer": \n')
    r = run([f"--data={data}", "--steps=1", "--save=false", f"--out_dir={tmp_path}"])
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "line 2 is not valid JSON" in r.stderr


def test_indivisible_world_size(tmp_path):
    r = run(["--train_batch_size=3", "--actor.ppo_mini_batch_size=3", "--steps=1", "--save=false",
             f"--out_dir={tmp_path}"], nproc=2)
    assert r.returncode != 0 and "not divisible by the world size 2" in r.stderr
