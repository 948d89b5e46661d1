"""The run as people watch it, on the CPU: TensorBoard holds every metric of every step exactly once
after a resume, --logger=none writes nothing, the memory picture is drawn from a run folder, and
`plan.py --plot` of a folder that is not a run is one line.

    python -m pytest tests/test_tracker.py -q
"""
import json
import math
import os

import pytest

import ledger
import offload
import options
import tracker
from conftest import launches, metrics, run

SMALL = ["--train_batch_size=8", "--actor.ppo_mini_batch_size=4", "--rollout.n=4", "--save=false"]


def events(out):
    """{tag: [(step, value), ...]} of <out>/tensorboard as TensorBoard's reader sees it (purges applied),
    and the config text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = [e for tag in acc.Tags()["tensors"] if tag.startswith("config") for e in acc.Tensors(tag)]
    return scalars, texts


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """4 steps with a checkpoint every 2; then the state a kill leaves after step 3's line but before
    the checkpoint of step 4 (latest -> step_000002); the same out_dir then runs to 6 steps. Steps 2
    and 3 are logged twice: the resumed run's lines must replace the first run's."""
    out = str(tmp_path_factory.mktemp("tb") / "run")
    first = run([f"--out_dir={out}", "--steps=4", "--save_freq=2"] + SMALL)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[logger] tensorboard" in first.stdout          # auto: tensorboard is installed here
    ckpt = os.path.join(out, "checkpoints")
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("step_000002")
    import shutil
    shutil.rmtree(os.path.join(ckpt, "step_000004"))
    before, _ = events(out)
    assert sorted(s for s, _ in before["pg_loss"]) == [0, 1, 2, 3]
    second = run([f"--out_dir={out}", "--steps=6", "--save_freq=2"] + SMALL)
    assert second.returncode == 0, second.stderr[-3000:]
    return out, before


@launches
def test_tensorboard_holds_every_metric_of_every_step_once_after_a_resume(resumed):
    out, before = resumed
    rows = metrics(out, every_line=True)   # the validation after the last step has a line (and scalars) too
    assert [r["step"] for r in rows] == list(range(7))
    scalars, texts = events(out)
    numeric = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert set(scalars) == numeric
    for key in ("pg_loss", "time/update", "mem/update/peak_gb", "plan/update/predicted_gb", "reward/errors"):
        assert key in scalars, key
    for key, points in scalars.items():
        steps = [s for s, _ in points]
        assert steps == [r["step"] for r in rows if key in r], (key, steps)      # each step once, in order
        for (s, v), r in zip(points, (r for r in rows if key in r)):             # the values metrics.jsonl holds
            assert math.isclose(v, r[key], rel_tol=1e-6, abs_tol=1e-6) or (math.isnan(v) and math.isnan(r[key])), \
                (key, s, v, r[key])
    # the resumed run's steps 2 and 3 replaced the first run's (a resumed step's time differs)
    assert [v for s, v in scalars["time/step"] if s in (2, 3)] != [v for s, v in before["time/step"] if s in (2, 3)]
    assert len(texts) == 2                                 # the resolved config, once per start (steps 0 and 2)
    assert '"logger": "auto"' in texts[0].tensor_proto.string_val[0].decode()


@launches
def test_picture_from_a_run_folder(resumed, tmp_path):
    out, _ = resumed
    path = tracker.picture(out, str(tmp_path / "memory.png"))
    with open(path, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    memory, copies = tracker.series(metrics(out))
    rows = metrics(out)
    assert list(memory) == [s for s in ledger.STAGES if f"mem/{s}/peak_gb" in rows[0]]
    assert memory["update"]["peak"] == [r["mem/update/peak_gb"] for r in rows]
    assert memory["update"]["predicted"] == [r["plan/update/predicted_gb"] for r in rows]
    assert memory["update"]["device"] == [r["mem/update/device_used_gb"] for r in rows]
    if "plan/update/device_gb" in rows[0]:                # the plan's device-level figure, where it gives one
        assert memory["update"]["plan_device"] == [r["plan/update/device_gb"] for r in rows]
    assert copies == {}                                    # no offload flag on
    # the command draws the same into the run folder
    r = run(["--plot", out], script="plan.py", timeout=120)         # and val.png: the run validated
    assert r.returncode == 0 and r.stdout.split() == [os.path.join(out, "memory.png"), os.path.join(out, "val.png")], \
        r.stderr
    assert os.path.getsize(os.path.join(out, "memory.png")) > 20_000 \
        and os.path.getsize(os.path.join(out, "val.png")) > 20_000


def test_picture_draws_offload_copies_and_vllm_device_use(tmp_path):
    """A GPU run's keys, written by hand: the offload copies' GB and GB/s, vLLM's device use inside
    generate, the plan's device-level figure."""
    rows = [{"step": s, "mem/generate/peak_gb": 10.0 + s, "mem/generate/device_used_gb": 12.0,
             "rollout/generate_device_gb": 60.0 + s, "plan/generate/predicted_gb": 11.0,
             "plan/generate/device_gb": 70.0,
             "mem/update/peak_gb": 30.0, "plan/update/predicted_gb": 31.0,
             "offload/actor.params/offload_gb": 3.0, "offload/actor.params/offload_s": 0.1,
             "offload/actor.params/offload_gbps": 32.2, "offload/actor.adam/prefetch_gb": 6.0,
             "offload/actor.adam/prefetch_issue_s": 0.01} for s in range(3)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    memory, copies = tracker.series(rows)
    assert list(memory) == ["generate", "update"]
    assert memory["generate"]["device"] == [60.0, 61.0, 62.0]          # vLLM's pool counted
    assert memory["generate"]["plan_device"] == [70.0] * 3
    assert copies["actor.params offload"] == {"gb": [3.0] * 3, "gbps": [32.2] * 3}
    assert copies["actor.adam prefetch"]["gb"] == [6.0] * 3 \
        and all(map(math.isnan, copies["actor.adam prefetch"]["gbps"]))
    assert set(copies) == {"actor.params offload", "actor.adam prefetch"}
    path = tracker.picture(str(tmp_path))
    assert path == str(tmp_path / "memory.png") and os.path.getsize(path) > 20_000


@launches
@pytest.mark.parametrize("what", ["missing", "empty"])
def test_plot_of_a_folder_that_is_not_a_run_is_one_line(tmp_path, what):
    folder = tmp_path / "run"
    if what == "empty":
        folder.mkdir()
    r = run([f"--plot={folder}"], script="plan.py", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(folder) in lines[0], r.stderr
    assert "matplotlib" not in lines[0]


@launches
def test_logger_none_writes_nothing(tmp_path):
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--steps=1", "--save_freq=0", "--logger=none"] + SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == [".run.lock", "metrics.jsonl", "run_config.json",   # the lock: launch.py
                                       "val.png", "val_samples.jsonl"]
    assert "[logger]" not in r.stdout


def test_only_rank_0_writes_and_none_has_the_same_methods(tmp_path):
    for kind, rank in (("tensorboard", 1), ("none", 0)):
        log = tracker.open(kind, str(tmp_path), "{}", rank, 0)
        log.log({"step": 0, "pg_loss": 1.0}, 0)
        log.close()
    assert os.listdir(tmp_path) == []
    log = tracker.open("tensorboard", str(tmp_path), "{}", 0, 0)
    log.log({"step": 0, "pg_loss": 1.0, "note": "text is skipped"}, 0)
    log.close()
    scalars, _ = events(str(tmp_path))
    assert scalars == {"pg_loss": [(0, 1.0)]}


def test_logger_option_is_checked():
    with pytest.raises(ValueError, match="--logger=foo: use one of auto, tensorboard, wandb, none"):
        options.parse_args(["--logger=foo"])
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="--logger=wandb: wandb is not installed"):
            tracker.resolve("wandb")
