"""Every memory measurement on record is a test: each row of bench/results/corpus.json (one measured run: its
options, world size, GPU, commit, raw file, each stage's allocator peak and device level) replayed through the
planner on the CPU, every stage above 1 GB within 5 % at the allocator and 8 % at the device level or its row's
written bound; the row `bench/corpus.py add` makes of a run's out_dir is the row the replay reads; the planner's
figures in bench/README.md are the corpus's.

    python -m pytest -q tests/test_corpus.py
"""
import json
import os
import sys

import pytest

from conftest import HERE, launches, run

sys.path.insert(0, os.path.join(HERE, "bench"))
import corpus  # noqa: E402  (bench/corpus.py)

ROWS = corpus.load()["rows"]


def test_the_corpus_covers_the_measured_kinds():
    """At least 100 stage measurements over many runs, 0.5B to 7B, one and two GPUs: every offload flag, LoRA, PPO
    with a separate critic and a shared one, a reward model, FP8 rollout, the streamed optimizer, the engine awake,
    1,024-token answers, the default path, the kernels, the real model colocated and async (held from above: its
    answers end early); each row with its GPU, commit and raw file; the runs left out each with a reason."""
    data = corpus.load()
    assert len(ROWS) >= 60 and sum(len(r["peak_gb"]) + len(r.get("device_gb", {})) for r in ROWS) >= 100
    args = [" ".join(r["args"]) for r in ROWS]
    for needle in ("--actor.lora_rank", "--algorithm.adv_estimator=gae", "--critic.mode=shared", "--reward_model.path",
                   "--rollout.quantization=fp8", "--actor.optimizer_stream=true", "--rollout.sleep_level=0",
                   "--rollout.response_length=1024", "--kernels=liger", "--actor.param_offload=true",
                   "--rollout.mode=async", "--model=bench/results/models/"):   # async, and the real model's runs
        assert any(needle in a for a in args), needle
    assert {corpus.size_of(r) for r in ROWS} >= {"0.5b", "1.5b", "3b", "7b"} and {r["world"] for r in ROWS} == {1, 2}
    assert all(r["gpu"] and r["commit"] and r["source"] for r in ROWS)
    real = {r["name"] for r in ROWS if "/models/" in r["args"][0]}
    assert {r["name"] for r in ROWS if r.get("bound") == "upper"} == real and len(real) >= 10
    assert data["left_out"] and all(x["source"] and len(x["reason"]) > 40 for x in data["left_out"])
    assert len({r["name"] for r in ROWS}) == len(ROWS)


def test_every_recorded_stage_is_within_its_bound_of_the_plan():
    """Each row's every stage above 1 GB: the plan within 5 % of the measured allocator peak and 8 % of the device
    level, or the row's own bound where it writes why (a known term the planner does not model); `upper` rows
    only from above. The failure names the row, the stage, the measured and the planned GB."""
    bad = [line for row in ROWS for line in corpus.misses(row)]
    assert not bad, "\n".join(bad)
    wider = [(r["name"], k, v) for r in ROWS for k, v in r.get("bounds", {}).items()]
    assert all(len(why) > 20 and share <= 0.11 for _, _, (share, why) in wider), wider
    held = [x for row in ROWS for x in corpus.replay(row)]
    assert sum(share == corpus.ALLOCATOR for _, level, _, _, share, _ in held if level == "allocator") >= 300


def test_a_miss_names_the_row_stage_and_both_figures():
    """A stage 10 % under its measurement fails with one line: the row, the level, the stage, measured and planned."""
    row = dict(next(r for r in ROWS if r["name"].startswith("qwen2.5-7b the 1 x 80 GB template")))
    planned = {s: p for s, level, m, p, *_ in corpus.replay(row) if level == "allocator"}
    row["peak_gb"] = {**row["peak_gb"], "update": planned["update"] * 1.1}
    lines = corpus.misses(row)
    assert len(lines) == 1 and lines[0].startswith(f"{row['name']}: allocator update measured ")
    assert f"planned {planned['update']:.2f} GB (the plan -9.1% of the measurement; bound 5%)" in lines[0]
    upper = {**row, "bound": "upper", "peak_gb": {**row["peak_gb"], "update": planned["update"] * 0.8}}
    assert corpus.misses(upper) == []          # under the plan: an upper row's answers ended early


def test_bench_readme_quotes_the_corpus_table():
    """bench/README.md's planner section holds `python bench/corpus.py table`'s output, the figures' one home."""
    with open(os.path.join(HERE, "bench", "README.md")) as f:
        readme = f.read()
    assert corpus.table(corpus.load()) in readme


@launches
def test_add_makes_the_row_the_replay_reads(tmp_path):
    """`bench/corpus.py add OUT_DIR --gpu --commit` on a fresh two-step CPU run: the row it writes is
    row_from_run's, with the run's options (the differences from the defaults), its world and each stage's
    medians; the replay reads it (a CPU run's figures are the host's: only the plumbing is checked here); with
    --log, plan.relax's choices from the run's output join its options; adding it again replaces it; a run outside
    the corpus's folder is refused."""
    out = tmp_path / "run"
    r = run(["--steps=2", f"--out_dir={out}", "--logger=none", "--val_data=", "--rollout.response_length=16"],
            timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps({"note": "", "rows": [], "left_out": []}))
    corpus.main(["add", str(out), "--gpu=cpu", "--commit=abc1234", "--name=tiny", f"--corpus={path}"])
    rows = json.loads(path.read_text())["rows"]
    want = corpus.row_from_run(str(out), name="tiny", gpu="cpu", commit="abc1234", prompt_len=4)
    assert rows == [want] and "--rollout.response_length=16" in want["args"] and want["world"] == 1
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(x) for x in f]
    assert want["peak_gb"]["update"] == [m["mem/update/peak_gb"] for m in steps if m["step"] == 1][0]   # after step 0
    replayed = corpus.replay({**want, "peak_gb": {s: 2.0 for s in want["peak_gb"]}})   # each above FLOOR_GB
    assert {s for s, *_ in replayed} == set(want["peak_gb"])
    log = tmp_path / "log.txt"                 # plan.relax's choices are in the run's output, not in run_config.json
    log.write_text("[data] ...\n[plan] actor.gradient_checkpointing=false actor.ppo_micro_batch_size_per_gpu=64: "
                   "faster, and the run keeps 10% of the 140 GB GPU free by the plan (pass ...)\n")
    corpus.main(["add", str(out), "--gpu=H200", "--commit=x", "--name=tiny", f"--log={log}", f"--corpus={path}"])
    relaxed = json.loads(path.read_text())["rows"]
    assert len(relaxed) == 1 and relaxed[0]["args"][-2:] == ["--actor.gradient_checkpointing=false",
                                                             "--actor.ppo_micro_batch_size_per_gpu=64"]
    with pytest.raises(SystemExit, match="has no metrics.jsonl"):
        corpus.main(["add", str(tmp_path), "--gpu=cpu", "--commit=x", f"--corpus={path}"])
    (tmp_path / "other").mkdir()               # a run outside the corpus's folder: its raw files would not be on record
    with pytest.raises(SystemExit, match="is outside .*: copy its metrics.jsonl"):
        corpus.main(["add", str(out), "--gpu=cpu", "--commit=x", f"--corpus={tmp_path / 'other' / 'corpus.json'}"])
    metrics = out / "metrics.jsonl"           # a GPU run's device levels; --shared (other runs on its GPU) drops them
    metrics.write_text("".join(json.dumps({**json.loads(x), "mem/update/device_used_gb": 9.0}) + "\n"
                               for x in metrics.read_text().splitlines()))
    for flags, update in (([], 9.0), (["--shared"], None)):
        corpus.main(["add", str(out), "--gpu=H100", "--commit=x", "--name=tiny", f"--corpus={path}", *flags])
        device = json.loads(path.read_text())["rows"][0]["device_gb"]
        assert device.get("update") == update and bool(device) == (update is not None)
