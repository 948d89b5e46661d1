"""End to end on the CPU: the embedded run learns, the metrics are complete, the checkpoint loads,
the real-model path runs, two "nodes" joined by torchrun's c10d rendezvous run as one node does,
and bad input fails with one clear line.

    python -m pytest tests/test_train.py -q
"""
import json
import os

import pytest
import torch

import train_grpo
import options
import ledger
import tracker
import offload
from model import load_model
from conftest import launches, metrics, run, start
from test_checkpoint import in_process  # noqa: F401

GRPO_STAGES = [s for s in ledger.STAGES if s not in ("values", "critic_update", "reward_model", "rollout_wait", "push")]


@launches
@pytest.mark.timeout(900)                # 60 steps on 2 ranks: 233 s on 2 busy cores
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
    # fastest <= slowest rank, in each stage a step ran (val: before training and every --val_freq=10 steps)
    assert all(0 < x[f"time_min/{s}"] <= x[f"time/{s}"] for x in m for s in GRPO_STAGES if f"time/{s}" in x)
    assert [x["step"] for x in m if "time/val" in x] == list(range(0, 60, 10))
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


@launches
def test_a_started_process_is_not_a_rank_of_this_one(monkeypatch):
    """A vLLM engine built in the pytest process leaves rank variables in os.environ
    (rollout.build_vllm's setdefault of RANK and LOCAL_RANK); a plain `python` started after it is
    still a 1-process run, not a rank looking for torchrun's MASTER_ADDR (test_vllm's async run)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(k, v)
    r = run(["-c", "import launch; print(launch.init_distributed()[:2])"], script=None)
    assert r.returncode == 0 and r.stdout.strip() == "(0, 1)", r.stderr[-3000:]


@launches
def test_two_nodes_through_c10d_rendezvous_equal_one_node(tmp_path):
    """Two "nodes" of one CPU process each, started as a multi-node job starts (one torchrun per
    node, --nnodes=2, c10d rendezvous at 127.0.0.1:<free port>, one --rdzv-id), run 3 steps with the
    same rewards, response lengths, losses and grad norms, step for step, as 2 processes on one node
    (--standalone); the run's metrics file is written once (global rank 0)."""
    args = ["--steps=3", "--save=false"]          # both runs: gloo on the CPU (run's and start's default)
    port = _free_port()
    # --node_rank is left out: c10d rendezvous assigns the ranks (torchrun ignores it and warns)
    node = ("--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}")
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]     # files: a full pipe would block a node
    nodes = [start(args + [f"--out_dir={tmp_path / 'nodes'}"], 1, torchrun=node, log=log) for log in logs]
    codes = _wait_all(nodes, timeout=600)
    for log in logs:
        log.close()
    assert codes == [0, 0], [(tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(2)]
    one = run(args + [f"--out_dir={tmp_path / 'one'}"], 2)
    assert one.returncode == 0, one.stderr[-3000:]
    keys = ("reward_mean", "response_length", "pg_loss", "kl", "entropy", "grad_norm", "pg_clipfrac", "ppo_kl")
    got, want = metrics(tmp_path / "nodes"), metrics(tmp_path / "one")
    assert len(got) == len(want) == 3
    assert [[m[k] for k in keys] for m in got] == [[m[k] for k in keys] for m in want]


@launches
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


@launches
def test_copy_levers_change_no_number_and_save_a_copy(tmp_path):
    """prefetch_update, defer_param_offload and optimizer_load_at_step only move copies in time:
    the same run with them off gives the same numbers. On: per step one param copy in (prefetched during the ref
    forward, so the update has nothing left to reload) and one out (after the next sync), not two in and one out."""
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


@launches
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
    fresh = load_model(None, seed=0)
    moved = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(),
                                                            fresh.state_dict().values()))
    assert moved > 0                                       # the saved weights are the trained ones
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i}{i}=", "answer": f"#### {i}{i}"})
                              for i in range(8)) + "\n")
    r = run([f"--out_dir={tmp_path / 'b'}", "--steps=2", "--save=false", f"--model={ckpt}", "--data",
             str(data), "--prompt_key=question", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[data] 8 prompts" in r.stdout and len(metrics(str(tmp_path / "b"))) == 2, r.stdout[-3000:]   # the file's


@launches
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
    assert options.profile_steps("1, 3") == {1, 3} and options.profile_steps("") == set()
    for bad in ("a", "-1", "1;2"):
        with pytest.raises(ValueError, match="give step numbers from 0"):
            options.profile_steps(bad)
    with tracker.profiled("unused", options.profile_steps("1"), 0, 0, torch.device("cpu")):
        assert not torch.autograd._profiler_enabled()


def test_parquet_and_gsm8k_reward(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tiny
    import data
    import gsm8k
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["1=", "22="], "answer": ["x #### 1", "#### 22"]}), path)
    prompts, answers, chats = data.load_data(path, tiny.build_tokenizer())
    assert prompts == [[3, 12], [4, 4, 12]] and answers == ["x #### 1", "#### 22"]
    assert chats == [[{"role": "user", "content": "1="}], [{"role": "user", "content": "22="}]]
    assert gsm8k.gsm8k_reward("so #### 1,000", "#### 1000") == 1.0
    assert gsm8k.gsm8k_reward("#### 7 then #### 8", "8") == 1.0      # the last one counts
    assert gsm8k.gsm8k_reward("8", "#### 8") == 0.0                  # no #### in the response


def test_config_overrides_are_typed():
    cfg = options.parse_args(["--actor.lr=1e-6", "--ref.param_offload", "true", "--model=none",
                                 "--rollout.n=4"])
    assert cfg.actor.lr == 1e-6 and cfg.ref.param_offload is True and cfg.model is None
    assert cfg.rollout.n == 4


@launches
@pytest.mark.parametrize("args,expect", [
    (["--model=/nonexistent/model"], "/nonexistent/model: no such directory"),
    (["--actor.no_such_key=1"], "unknown option --actor.no_such_key"),
    (["--nosection.lr=1"], "unknown option --nosection.lr"),
    (["--lr=1e-6"], "unknown option --lr (did you mean --actor.lr or --critic.lr?); known here: model, "),
    (["--actor.lr=fast"], "expected float"),
    (["--actor.param_offload=maybe"], "expected true or false"),
    (["--train_batch_size=16", "--actor.ppo_mini_batch_size=5"], "not a multiple of actor.ppo_mini_batch_size=5; "
     "pass a divisor of it, such as --actor.ppo_mini_batch_size=4"),
    (["--actor.ppo_micro_batch_size_per_gpu=48"], "does not divide"),
    (["--train_batch_size=3", "--actor.ppo_mini_batch_size=3"], "does not divide the 24 samples per rank of a "
     "mini-batch (world size 1); pass --actor.ppo_micro_batch_size_per_gpu=12"),
    (["--data=/nonexistent.jsonl"], "no such file"),
    (["--reward=nosuchmodule:fn"], "cannot load it"),
    (["--actor.lora_rank=-1"], "--actor.lora_rank=-1: must be >= 0"),
])
def test_bad_input_gives_one_clear_line(tmp_path, args, expect):
    r = run(args + ["--steps=1", "--save=false", f"--out_dir={tmp_path}"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], r.stderr[-2000:]


@launches
def test_malformed_data_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1=", "answer": "1"}\n{"prompt": "2=", "answer": \n')
    r = run([f"--data={data}", "--steps=1", "--save=false", f"--out_dir={tmp_path}"])
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "line 2 is not valid JSON" in r.stderr


@launches
def test_indivisible_world_size(tmp_path):
    r = run(["--train_batch_size=3", "--actor.ppo_mini_batch_size=3", "--steps=1", "--save=false",
             f"--out_dir={tmp_path}"], nproc=2)
    assert r.returncode != 0 and "not divisible by the world size 2" in r.stderr


# --------------------------------------------------------------------------- options, --help, bad input
def test_help_prints_every_option_with_its_default_and_comment(capsys):
    """--help lists every option of every section with its default and a non-empty comment,
    both read from the config dataclasses, and exits 0."""
    from dataclasses import fields, is_dataclass
    import re
    train_grpo.main(["--help"])
    out = capsys.readouterr().out
    lines = {m.group(1): m for m in re.finditer(r"^  --(\S+?)=(.*?)  \((.*?)\)  (.+)$", out, re.M)}
    for name, (obj, _, _) in options.sections(options.Config()).items():
        for f in fields(obj):
            if not is_dataclass(getattr(obj, f.name)):
                key = f"{name}.{f.name}" if name else f.name
                assert key in lines, key
                assert lines[key].group(2) == str(getattr(obj, f.name)) and lines[key].group(4).strip(), key


def test_every_numeric_option_has_a_range():
    """Each int / float option is in its section's RANGES (or CHOICES), and every default passes."""
    from dataclasses import fields
    for name, (obj, ranges, choices) in options.sections(options.Config()).items():
        for f in fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                assert f.name in ranges or f.name in choices, f"{name}.{f.name} has no range"
    options.check_config(options.Config())


def test_range_rules():
    """options.within on each rule form, at and beside each bound; NaN and inf never pass."""
    import options
    cases = [(">= 1", 1, True), (">= 1", 0.999, False), ("> 0", 0, False), ("> 0", 1e-12, True),
             ("[0, 1)", 0, True), ("[0, 1)", 1, False), ("(0, 1]", 0, False), ("(0, 1]", 1, True),
             ("-1 or >= 1", -1, True), ("-1 or >= 1", 0, False), ("-1 or >= 1", 2, True),
             ("any", -5.0, True), ("any", float("nan"), False), (">= 0", float("inf"), False)]
    assert [options.within(v, rule) for rule, v, _ in cases] == [ok for _, _, ok in cases]


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    """Model dirs and data files that are each wrong in one way."""
    from transformers import BertConfig, GPT2Config
    d = tmp_path_factory.mktemp("bad")
    import tiny
    tiny.tiny_config().save_pretrained(d / "noweights")
    for name, cfg in (("gpt2", GPT2Config(n_layer=1)), ("bert", BertConfig(num_hidden_layers=1))):
        cfg.save_pretrained(d / name)
        (d / name / "model.safetensors").write_bytes(b"")
    (d / "unknown").mkdir()
    (d / "unknown" / "config.json").write_text('{"model_type": "nosuchmodel"}')
    (d / "unknown" / "model.safetensors").write_bytes(b"")
    (d / "empty.jsonl").write_text("\n")
    (d / "latin1.jsonl").write_bytes(b'{"prompt": "1=", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    rows = {"nullprompt": {"prompt": None, "answer": "1"}, "emptyprompt": {"prompt": "", "answer": "1"},
            "dictanswer": {"prompt": "1=", "answer": {"x": 1}}, "nullanswer": {"prompt": "1=", "answer": None},
            "nocontent": {"prompt": [{"role": "user", "text": "1="}], "answer": "1"}}
    for name, row in rows.items():
        (d / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    (d / "words.jsonl").write_text("".join(json.dumps({"prompt": f"{c}=", "answer": f"City{c}"}) + "\n" for c in "12"))
    (d / "numbers.jsonl").write_text("".join(json.dumps({"prompt": f"{c}=", "answer": c}) + "\n" for c in "12"))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["1="], "answer": ["1"]}), d / "table.pq")
    (d / "table.csv").write_text("prompt,answer\n1=,1\n")
    (d / "otherkeys.jsonl").write_text(json.dumps({"question": "1=", "final": "1"}) + "\n")
    (d / "array.json").write_text(json.dumps([{"prompt": "1=", "answer": "1"}]))
    for name, file in (("arun/final", "config.json"), ("anadapter", "adapter_config.json"),
                       ("acheckpoint", "meta.json")):
        (d / name).mkdir(parents=True)
        (d / name / file).write_text("{}")
    (d / "afile").write_text("x")
    return d


BAD = [   # (options, what the one line says); {d}: the bad_dir fixture
    (["--steps=0"], "--steps=0: must be >= 1"),
    (["--actor.ppo_epochs=0"], "--actor.ppo_epochs=0: must be >= 1"),
    (["--actor.grad_clip=0"], "--actor.grad_clip=0.0: must be > 0"),
    (["--rollout.n=0"], "--rollout.n=0: must be >= 1"),
    (["--rollout.response_length=0"], "--rollout.response_length=0: must be >= 1"),
    (["--train_batch_size=0"], "--train_batch_size=0: must be >= 1"),
    (["--actor.ppo_micro_batch_size_per_gpu=0"], "must be >= 1"),
    (["--actor.ppo_mini_batch_size=0"], "--actor.ppo_mini_batch_size=0: must be >= 1"),
    (["--actor.lr=-1e-6"], "--actor.lr=-1e-06: must be >= 0"),
    (["--actor.lr=nan"], "--actor.lr=nan: must be >= 0"),
    (["--actor.entropy_coeff=inf"], "(a finite number)"),
    (["--rollout.temperature=-0.5"], "--rollout.temperature=-0.5: must be >= 0"),
    (["--rollout.temperature=0"], "--rollout.temperature=0 is greedy"),
    (["--rollout.top_p=0"], "--rollout.top_p=0.0: must be (0, 1]"),
    (["--rollout.top_p=1.5"], "must be (0, 1]"),
    (["--critic.gamma=1.5"], "--critic.gamma=1.5: must be [0, 1]"),
    (["--fsdp_size=0"], "--fsdp_size=0: must be -1 or >= 1"),
    (["--save_freq=-1"], "--save_freq=-1: must be >= 0"),
    (["--keep_checkpoints=0"], "--keep_checkpoints=0: must be >= 1"),
    (["--dist_timeout_s=0"], "--dist_timeout_s=0.0: must be > 0"),
    (["--reward_error=ignore"], "--reward_error=ignore: use one of stop, zero"),
    (["--actor.loss_agg_mode=sum"], "--actor.loss_agg_mode=sum: use one of"),
    (["--rollout.engine=sglang"], "--rollout.engine=sglang: use one of auto, hf, vllm"),
    (["--actor.offload_policy=true", "--actor.param_offload=true"], "already keeps params and Adam"),
    (["--ref.offload_policy=true", "--ref.param_offload=true"], "already keeps the ref's params on the CPU"),
    (["--actor.lora_rank=4", "--actor.lora_target_modules=q_proj,lm_head"], "lm_head is not a decoder projection"),
    (["--model=random:qwen9"], "known sizes are"),
    (["--rollout.response_length=64"], "--rollout.response_length=64 leaves no room for a prompt in the 64 positions "
                                       "of the embedded model (max_position_embeddings); use at most 63"),
    (["--model={d}/noweights"], "no weights there"),
    (["--model={d}/arun"], "arun is a run's out_dir (no config.json); its policy is in "),
    (["--model={d}/anadapter"], "anadapter is a LoRA adapter (no config.json); pass the folder "
                                "actor.save_merged wrote"),
    (["--model={d}/acheckpoint"], "acheckpoint is a training checkpoint (no config.json; --resume takes it); "
                                  "pass its "),
    (["--model={d}/afile"], "afile is a file; pass the folder that holds it and its config.json"),
    (["--model={d}/gpt2"], "GPT2LMHeadModel has no model.model.layers / model.model.norm; supported: decoder-only"),
    (["--model={d}/bert"], "BertLMHeadModel has no model.model.layers"),
    (["--model={d}/unknown"], "transformers builds no causal LM from its config.json"),
    (["--data={d}/empty.jsonl"], "the file holds no rows"),
    (["--data={d}/latin1.jsonl"], "line 2 is not UTF-8 text"),
    (["--data={d}/nullprompt.jsonl"], "row 1: the prompt is null"),
    (["--data={d}/emptyprompt.jsonl"], "row 1: the prompt is empty"),
    (["--data={d}/dictanswer.jsonl"], "row 1: the answer is a dict"),
    (["--data={d}/nullanswer.jsonl"], "row 1: the answer is null"),
    (["--data={d}/nocontent.jsonl"], "row 1: chat message 0 is not"),
    (["--data={d}/words.jsonl"], "words.jsonl: none of its 2 answers is a number (the first: 'City1'), which the "
                                 "built-in GSM8K reward needs; pass --reward=module:function"),
    (["--data={d}/numbers.jsonl", "--val_data={d}/words.jsonl"], "--val_data"),
    (["--data={d}/numbers.jsonl", "--val_data={d}/otherkeys.jsonl"], "otherkeys.jsonl row 1 has no 'answer' field "
     "(it has ['final', 'question']); set --prompt_key / --answer_key, which name the fields of --data and --val_data"),
    (["--data={d}/table.pq"], "table.pq: read as .jsonl or .parquet only; it is a parquet file: name it *.parquet"),
    (["--data={d}/table.csv"], "read as .jsonl or .parquet only; convert it to .jsonl (one JSON object a line)"),
    (["--data={d}/array.json"], "line 1 is not a JSON object (the file is one JSON array? write one object a line"),
    (["--reward=os:sep"], "--reward os:sep: sep is a str, not a function"),
    (["--resume={d}/nothing"], "no complete checkpoint there"),
    (["--out_dir={d}/afile"], "is a file; pass a directory"),
    (["--out_dir={d}/afile/sub"], "is not a writable directory"),
]


@pytest.mark.parametrize("args,expect", BAD)
def test_bad_value_stops_before_anything_is_built(args, expect, bad_dir, capsys):
    """Each bad option or input file, through main() in this process: exit code 2, exactly one
    stderr line, `error: ...` saying what is wrong, and nothing on stdout: each is found before
    the set-up (which builds the models and prints its report)."""
    args = [a.replace("{d}", str(bad_dir)) for a in args]
    with pytest.raises(SystemExit) as e:
        train_grpo.main(["--steps=1", "--save=false", f"--out_dir={bad_dir / 'out'}"] + args)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and expect in err[0], err
    assert captured.out == ""


# --------------------------------------------------------------------------- rewards, greedy, no-op runs
def test_reward_failures_are_named_with_the_sample():
    """data.score: a reward that raises or returns None, a string, NaN or inf gives that sample 0
    and a message naming the reward and the response; numbers (also bool, numpy) pass."""
    import numpy as np
    import data

    def reward(response, answer):
        return {"raise": lambda: 1 / 0, "none": lambda: None, "str": lambda: "1.0", "nan": lambda: float("nan"),
                "inf": lambda: float("inf"), "bool": lambda: True, "np": lambda: np.float64(0.25)}[response]()
    scores, errors = data.score(reward, "mod:reward", ["raise", "none", "str", "nan", "inf", "bool", "np"], ["a"] * 7)
    assert scores == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.25] and len(errors) == 5
    assert errors[0].startswith("reward mod:reward raised ZeroDivisionError: division by zero for the response 'raise'")
    assert [e.split(" for the")[0] for e in errors[1:]] == [
        "reward mod:reward returned None", "reward mod:reward returned '1.0'", "reward mod:reward returned nan",
        "reward mod:reward returned inf"]


@launches
def test_reward_error_zero_scores_and_counts(tmp_path):
    """--reward_error=zero: a reward returning None for some samples does not stop the run; those
    samples score 0, reward/errors counts them, one warning shows the first, the end line totals."""
    (tmp_path / "flaky.py").write_text("def reward(response, answer):\n"
                                       "    return None if response[:1] == answer[:1] else 0.5\n")
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=3", "--save=false", "--reward=flaky:reward", "--reward_error=zero"],
            env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    failed = sum(m["reward/errors"] for m in metrics(out))
    assert failed > 0 and r.stdout.count("rewards failed this step and scored 0") == 1
    assert "reward flaky:reward returned None for the response" in r.stdout
    assert f"; {failed} rewards failed and scored 0" in r.stdout


@launches
def test_equal_rewards_warn_and_the_end_line_says_nothing_moved(tmp_path):
    """A reward that is always 0 (GRPO, no KL term): every group is flat, so the gradient is exactly
    0: one warning at the first step, and the end-of-run line says all optimizer steps were
    applied but |delta w| is 0, with a warning that the weights never moved."""
    (tmp_path / "zero.py").write_text("def reward(response, answer):\n    return 0.0\n")
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=2", "--save=false", "--reward=zero:reward", "--actor.use_kl_loss=false"],
            env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("every group's rewards are equal") == 1 and "[warn] step 0:" in r.stdout
    assert "[done] 2 of 2 optimizer steps applied; mean |delta w| 0 per step" in r.stdout
    assert "2 of 2 steps had equal rewards in every group" in r.stdout
    assert "[warn] the weights never moved: this run trained nothing" in r.stdout
    assert all(m["reward/equal_groups_frac"] == 1 and m["delta_w_abs_mean"] == 0 for m in metrics(out))


@pytest.mark.parametrize("extra", [["--actor.param_offload=true", "--actor.optimizer_offload=true",
                                     "--actor.optimizer_stream=true", "--ref.param_offload=true"],
                                    ["--algorithm.adv_estimator=gae", "--critic.param_offload=true",
                                     "--critic.optimizer_offload=true"]], ids=["grpo_every_flag", "ppo_every_flag"])
def test_a_dropped_run_leaves_nothing_alive(tmp_path, dist_env, extra):
    """A run set up, stepped once and dropped (a notebook's or research script's pattern) leaves no module
    with weights and no tensor of 64K elements or more that it made alive after a gc: no global, hook, thread or
    handler keeps a role (test_memory.py checks the allocator on a GPU, where a set-up's bytes would stay)."""
    import gc
    import weakref
    def made():
        return {id(o): o for o in gc.get_objects()   # modules with weights (transformers caches activations)
                if isinstance(o, torch.nn.Module) and next(o.parameters(), None) is not None or
                (isinstance(o, torch.Tensor) and o.numel() >= 65536)}
    gc.collect()
    before = made()
    cfg = options.parse_args([f"--out_dir={tmp_path}", "--steps=1", "--save=false", *extra])
    (data, val), _ = train_grpo.preflight(cfg)
    t = train_grpo.setup(cfg, data=data, val=val)
    train_grpo.train_step(t, 0)
    refs = [weakref.ref(o) for k, o in made().items() if k not in before]
    assert len(refs) > 10
    t = None
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, alive


def test_data_seed_keeps_the_prompts_and_draws_other_samples(tmp_path, in_process):
    """--data_seed, the prompt order's own seed: `--seed=1 --data_seed=0` trains at every step the prompts
    `--seed=0` trains (data/prompt_crc) on samples of its own; `--seed=1` alone trains other prompts. A run's
    spread on one task is measured this way: one order, several sampling seeds."""
    def crc_and_samples(name, *extra):
        in_process([f"--out_dir={tmp_path / name}", "--steps=3", "--train_batch_size=4", "--rollout.n=4",
                    "--actor.ppo_mini_batch_size=4", "--logger=none", "--save=false", "--save_freq=0",
                    "--val_freq=0", "--val_before_train=false", *extra])
        rows = metrics(tmp_path / name)
        return [x["data/prompt_crc"] for x in rows], [(x["response_length"], x["pg_loss"]) for x in rows]
    (crc0, samples0), (crc1, samples1) = crc_and_samples("a"), crc_and_samples("b", "--seed=1", "--data_seed=0")
    assert crc1 == crc0 and len(set(crc0)) == 3 and samples1 != samples0
    assert crc_and_samples("c", "--seed=1")[0] != crc0


def test_temperature_zero_is_greedy_end_to_end(tmp_path, dist_env):
    """Temperature 0: each group's samples are the same greedy response, the log-probs use
    temperature 1 (no division by 0), and a PPO step (which can learn from greedy samples)
    gives finite losses and applies its optimizer steps."""
    import rollout
    cfg = options.parse_args([f"--out_dir={tmp_path}", "--algorithm.adv_estimator=gae",
                                 "--rollout.temperature=0", "--rollout.n=4", "--steps=1"])
    assert rollout.logprob_temperature(cfg.rollout) == 1.0
    (data, val), _ = train_grpo.preflight(cfg)
    t = train_grpo.setup(cfg, data=data, val=val)
    batch = rollout.generate_hf(t.actor.model, t.prompts[:3], cfg.rollout, 0, 1, t.device, seed=0)
    groups = batch["responses"].view(3, 4, -1)
    assert all(torch.equal(g[0], g[i]) for g in groups for i in range(4))
    m = train_grpo.train_step(t, 0)
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("pg_loss", "kl", "critic/vf_loss", "grad_norm"))
    assert m["skipped_steps"] == 0 and m["delta_w_abs_mean"] > 0


# --------------------------------------------------------------------------- a local model directory
def _local_model(d):
    """A small Qwen2 with its own byte-level BPE tokenizer (no digit splitting), chat template and
    generation_config.json, saved the way a user's checkpoint is (save_pretrained)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    corpus = [f"what is {i} plus {i * 7}? #### {i * 8}" for i in range(300)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} A:{% endif %}")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)).save_pretrained(d)
    tok.save_pretrained(d)
    GenerationConfig(eos_token_id=1, pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.9).save_pretrained(d)


@launches
def test_local_model_ppo_critic_and_final_round_trip(tmp_path):
    """PPO with a separate critic on a local --model dir (it used to fail: classifier_dropout passed
    to from_pretrained), then out/final: the input's tokenizer files and generation_config.json
    byte for byte, and the same token ids for each of three loaders (AutoTokenizer,
    PreTrainedTokenizerFast, tokenizers) before and after."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    model = tmp_path / "model"
    _local_model(model)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"what is {i} plus {i}?"}],
                                          "answer": f"#### {2 * i}"}) for i in range(8)) + "\n")
    out = str(tmp_path / "out")
    r = run([f"--out_dir={out}", f"--model={model}", f"--data={data}", "--steps=2", "--algorithm.adv_estimator=gae",
             "--train_batch_size=4", "--actor.ppo_mini_batch_size=4", "--rollout.n=2", "--rollout.response_length=8"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "critic/vf_loss" in metrics(out)[-1]
    final = os.path.join(out, "final")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert open(model / name, "rb").read() == open(os.path.join(final, name), "rb").read(), name
    text = "what is 123 plus 4567? #### 2024"
    for load in (lambda d: AutoTokenizer.from_pretrained(d)(text)["input_ids"],
                 lambda d: PreTrainedTokenizerFast.from_pretrained(d)(text)["input_ids"],
                 lambda d: Tokenizer.from_file(os.path.join(d, "tokenizer.json")).encode(text).ids):
        assert load(str(model)) == load(final)


# --------------------------------------------------------------------------- long-run flatness
@launches
@pytest.mark.timeout(900)                # 60 steps: 210 s on 2 busy cores
def test_host_memory_flat_over_many_steps(tmp_path):
    """60 steps of the embedded model with every offload flag on, a checkpoint and a validation every 10 steps
    (the host buffers, the DCP saves and the held-out answers are where a leak would live). After a 20-step
    warm-up (allocator pools and DCP's machinery are set up once) host RSS does not drift: the median of the
    last 15 steps is within 2 % of steps 20-35's, and the least-squares trend over steps 20-60 adds up to
    less than 2 % (a leak of 0.4 MB a step fails it). The noise it must pass: 140 steps with validation on
    and off, 20-step medians from step 20 on within 0.6 % and 0.8 % of each other with no trend, single
    steps apart by up to 2.4 %, a 15-step window once 1.4 % above another. glibc is told to return every
    freed block of 256 KiB or more and to trim its heap at once, so that RSS follows what is alive rather
    than what malloc keeps cached (without that it swings by +-3 % from step to step at this scale), and to
    keep two arenas: glibc opens a new one when a thread finds the others locked, so their count (and RSS)
    followed the machine's load (+1.5 % once, in a suite run beside other work)."""
    import statistics
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=60", "--save=false", "--save_freq=10", "--actor.param_offload=true",
             "--actor.optimizer_offload=true", "--ref.param_offload=true"],
            env={"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    rss = [m["host_rss_gb"] for m in metrics(out)][20:]
    early, late = statistics.median(rss[:15]), statistics.median(rss[-15:])
    assert abs(late - early) <= 0.02 * early, (early, late, rss)
    xs = range(len(rss))
    mx, my = statistics.fmean(xs), statistics.fmean(rss)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, rss)) / sum((x - mx) ** 2 for x in xs)
    assert abs(slope * len(rss)) <= 0.02 * early, (slope, rss)
    assert all(k in metrics(out)[-1] for k in ("mem/update/allocated_gb", "mem/update/reserved_gb"))


# --------------------------------------------------------------------------- the sampled tokens' log-probs
def test_logprobs_every_asks_the_engine_on_every_kth_step_only(tmp_path, monkeypatch):
    """--rollout.logprobs_every=k: the engine is asked for the sampled tokens' log-probs on steps 0, k, 2k, ...
    (bench/README.md: ~27 % of vLLM's decode step); a batch without them trains, and the correction that
    reads them every step refuses k > 1 in one line; the default (0) is 1 where the correction is on, else 10.
    vLLM's outputs read as the rollout reads them: the sampled token's log-prob a position, from flat lists
    (flat_logprobs) or Logprob dicts."""
    import rollout
    import vllm_engine
    asked, real = [], rollout.generate
    monkeypatch.setattr(rollout, "generate", lambda *a, logprobs=True, **k: asked.append(logprobs) or real(*a, **k))
    t = train_grpo.setup(options.parse_args([f"--out_dir={tmp_path}", "--save=false", "--logger=none", "--val_freq=0",
                                             "--val_before_train=false", "--rollout.logprobs_every=3"]))
    for step in range(4):
        train_grpo.train_step(t, step)
    assert asked == [True, False, False, True]
    for extra in (["--actor.rollout_is=token"], ["--rollout.mode=async"]):
        with pytest.raises(ValueError, match="--rollout.logprobs_every=1"):
            options.parse_args(["--rollout.logprobs_every=2", *extra])
        assert options.parse_args(extra).rollout.logprobs_every == 1       # the default: every step they are read
    assert options.parse_args([]).rollout.logprobs_every == rollout.LOGPROBS_EVERY == 10   # else each 10th
    assert options.parse_args(["--rollout.kv_cache_dtype=fp8"]).rollout.logprobs_every == 1
    # vLLM's outputs as the rollout reads them: no log-probs asked, none in the batch
    sample = lambda lp: type("S", (), {"token_ids": [5, 6], "logprobs": lp})()  # noqa: E731
    out = lambda lp: type("Out", (), {"outputs": [sample(lp)]})()  # noqa: E731
    lp = [{5: type("L", (), {"logprob": -0.5})()}, {6: type("L", (), {"logprob": -1.5})()}]
    assert vllm_engine.vllm_samples([([1, 2], out(lp))])[2] == [[-0.5, -1.5]]
    flat = type("Flat", (), {"start_indices": [0, 1], "token_ids": [5, 6], "logprobs": [-0.5, -1.5]})()  # flat_logprobs
    assert vllm_engine.vllm_samples([([1, 2], out(flat))])[2] == [[-0.5, -1.5]]
    wide = type("Flat", (), {"start_indices": [0, 2], "token_ids": [5, 7, 6, 8], "logprobs": [-0.5, -2, -1.5, -3]})()
    assert vllm_engine.vllm_samples([([1, 2], out(wide))])[2] == [[-0.5, -1.5]]   # logprobs=k: k + 1 a position
    flat.token_ids = [6, 5]
    with pytest.raises(RuntimeError, match="do not start with the sampled token"):
        vllm_engine.vllm_samples([([1, 2], out(flat))])
    rows, responses, logps = vllm_engine.vllm_samples([([1, 2], out(None))])
    assert logps is None
    batch = rollout.samples_batch(rows, responses, logps, 4, 0, 9, torch.device("cpu"))
    assert "rollout_log_probs" not in batch and batch["responses"].shape == (1, 4)


def test_the_step_counts_the_responses_cut_at_the_length_cap(dist_env):
    """`response/clipped_frac`: the share of responses that reached --rollout.response_length without ending (a
    full mask row), beside the mean length, the share of groups with equal rewards and the passes over the training
    prompts (`data/epochs`, counting a resume's prompts walked before step 0), over all ranks."""
    from types import SimpleNamespace
    cfg = options.parse_args(["--rollout.n=2", "--rollout.response_length=3", "--train_batch_size=2"])
    t = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), order=list(range(5)), data_offset=0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    batch = {"response_mask": mask, "input_ids": torch.ones(4, 5, dtype=torch.long),
             "attention_mask": torch.ones(4, 5, dtype=torch.long)}
    m = train_grpo.step_figures(t, 3, torch.tensor([1.0, 0.0, 1.0, 1.0]), batch)
    assert (m["response/clipped_frac"], m["response_length"], m["reward/equal_groups_frac"]) == (0.5, 2.25, 0.5)
    assert m["data/epochs"] == 8 / 5       # steps 0-3 took 2 prompts each of the 5
    t.data_offset = 1                      # a resume that changed the batch size had walked one more
    assert train_grpo.step_figures(t, 3, torch.tensor([1.0, 0.0, 1.0, 1.0]), batch)["data/epochs"] == 9 / 5
