"""End to end on the CPU: the embedded run learns, the metrics are complete, the checkpoint loads,
the real-model path runs, and bad input fails with one clear line.

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
GRPO_STAGES = [s for s in train_grpo.STAGES if s not in ("values", "critic_update")]


def run(args, nproc=0, timeout=600, env=None):
    """train_grpo.py in a subprocess (under torchrun when nproc > 0); `env`: extra variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
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
    assert "reward_mean=" in r.stdout and "[####" in r.stdout        # the per-step line and its bar


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


def test_parquet_and_gsm8k_reward(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tiny
    import data
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["1=", "22="], "answer": ["x #### 1", "#### 22"]}), path)
    prompts, answers = data.load_data(path, tiny.build_tokenizer())
    assert prompts == [[3, 12], [4, 4, 12]] and answers == ["x #### 1", "#### 22"]
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
