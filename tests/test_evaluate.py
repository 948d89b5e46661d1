"""evaluate.py (CPU): a run's final/, its checkpoint and the embedded default score what the run's own
validations scored, to the last digit; a GSM8K-style held-out file gets the GSM8K rule and both its forms;
bad input is one line.

    python -m pytest -q tests/test_evaluate.py
"""
import json
import os

import pytest

import evaluate
import options
import trainer
from conftest import launches, metrics, run

KEYS = ("val/reward_mean", "val/response_length", "val/prompts", "val/reward_errors")
# the run's and each evaluation's (the batch sets HF generate's chunks of held-out prompts): a short test
SHORT = ["--val_max_prompts=24", "--train_batch_size=4", "--actor.ppo_mini_batch_size=4"]


def scored(tmp_path, args: list, name: str) -> tuple[dict, list]:
    """evaluate.evaluate in this process (the session's process group): its metrics and the answers it wrote."""
    out = tmp_path / f"{name}.jsonl"
    m = evaluate.evaluate(options.parse_args(args), str(out))
    with open(out) as f:
        return m, [json.loads(line) for line in f]


@launches
@pytest.mark.timeout(300)
def test_a_runs_folders_score_what_its_validations_scored(tmp_path, dist_env, monkeypatch):
    """The embedded default trained 2 steps, validated before and after: `python evaluate.py` on its final/ and
    in-process on its step-2 checkpoint gives the last validation's figures, on no --model the first one's; the
    answers file holds every held-out answer in val_samples.jsonl's form, its first ones the run's own."""
    out = tmp_path / "run"
    r = run([f"--out_dir={out}", "--steps=2", "--val_freq=2", "--save_freq=2", "--logger=none", *SHORT])
    assert r.returncode == 0, r.stderr[-2000:]
    first, last = [x for x in metrics(out, every_line=True) if "val/reward_mean" in x]
    assert (first["step"], last["step"]) == (0, 2) and first["val/reward_mean"] != last["val/reward_mean"]
    answers = tmp_path / "final.jsonl"        # the run's batch (HF generate's chunks) comes from its folder
    r = run([f"--model={out / 'final'}", f"--out={answers}", "--val_max_prompts=24"], script="evaluate.py")
    assert r.returncode == 0, r.stderr[-2000:]
    said = json.loads(r.stdout.splitlines()[-1])
    assert {k: said[k] for k in KEYS} == {k: last[k] for k in KEYS} and said["step"] == 2
    assert f"evaluation of {out / 'final'} (after 2 updates) | val/reward_mean=" in r.stdout
    with open(answers) as f:
        rows = [json.loads(line) for line in f]
    with open(out / "val_samples.jsonl") as f:
        run_rows = [json.loads(line) for line in f if json.loads(line)["step"] == 2]
    assert len(rows) == 24 and rows[:len(run_rows)] == run_rows and set(rows[0]) == set(run_rows[0])
    built = []                             # the engine's shape: the run's batch and longest prompt, recorded
    real_build = trainer.build_engine
    monkeypatch.setattr(trainer, "build_engine", lambda cfg, *a: built.append((cfg, a[2])) or real_build(cfg, *a))
    m, _ = scored(tmp_path, [f"--model={out / 'checkpoints' / 'step_000002'}", "--val_max_prompts=24"], "checkpoint")
    assert {k: m[k] for k in KEYS} == {k: last[k] for k in KEYS}
    with open(out / "final" / "run_config.json") as f:
        recorded = json.load(f)
    (cfg, prompt_len), = built
    assert (cfg.train_batch_size, cfg.rollout.n) == (4, recorded["rollout"]["n"])   # not the default 16
    assert prompt_len == recorded["engine_prompt_len"] > 0 and recorded["world_size"] == 1
    m, _ = scored(tmp_path, SHORT, "default")
    assert {k: m[k] for k in KEYS} == {k: first[k] for k in KEYS}


def test_a_gsm8k_style_file_is_scored_by_both_gsm8k_forms(tmp_path, dist_env, capsys, monkeypatch):
    """A held-out file of GSM8K's form and no --data: the GSM8K rule (strict: the copy task's reward would give
    (1 + 0 + 6/7) / 3), both forms and what the answers held, as shares; --instruction appended, --val_max_prompts
    and --val_response_length kept. The engine's answers are planned (the tiny model's would score 0)."""
    import rollout
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps({"question": f"{a}=", "answer": f"#### {a}"}) + "\n" for a in range(10, 16)))
    planned, asked = {"10= #": "#### 10", "11= #": "11", "12= #": "#### 13"}, []

    def greedy(engine, model, prompts, length, *rest):
        asked.append(length)
        tok = evaluate.data_io.load_tokenizer(None)
        return [tok(planned[tok.decode(p)], add_special_tokens=False)["input_ids"] for p in prompts]
    monkeypatch.setattr(rollout, "greedy", greedy)
    m, rows = scored(tmp_path, [f"--val_data={path}", "--instruction=#", "--val_max_prompts=3",
                                "--val_response_length=3"], "gsm")
    third = 1 / 3
    assert {k[4:]: m[k] for k in m if k not in ("val/response_length", "val/reward_errors")} == {
        "reward_mean": third, "prompts": 3, "strict": third, "flexible": 2 * third, "found_strict": 2 * third,
        "found_boxed": 0, "found_number": 1, "clipped_frac": 2 * third}   # two planned answers pass the 3-token cap
    assert [r["prompt"] for r in rows] == list(planned) and [r["score"] for r in rows] == [1, 0, 0] and asked == [3]
    said = capsys.readouterr().out
    assert "scored by gsm8k.gsm8k_reward (built in, strict" in said and "right by the strict form" in said


@pytest.mark.parametrize("args,line", [
    (["--help"], "usage: python evaluate.py --model="),
    (["--model=/no/such/folder"], "error: --model /no/such/folder: no such directory"),
    (["--val_data=/no/such.jsonl"], "error: --val_data /no/such.jsonl: no such file"),
    (["--data={d}/x.jsonl"], "error: --data without --val_data: nothing is held out"),
    (["--model={d}"], "error: --model {d} is a run's out_dir (no config.json); its policy is in {d}/final"),
    (["--out={d}"], "error: --out {d}: cannot write it"),
])
def test_bad_input_is_one_line(tmp_path, dist_env, capsys, monkeypatch, args, line):
    """Each mistake is one `error:` line (exit 2), and the refused command leaves no answers file behind."""
    d = str(tmp_path)
    monkeypatch.chdir(tmp_path)            # the default --out, eval.jsonl, is a name in the working directory
    (tmp_path / "x.jsonl").write_text(json.dumps({"prompt": "1=", "answer": "1"}) + "\n")
    os.makedirs(tmp_path / "final")
    (tmp_path / "final" / "config.json").write_text("{}")
    code = 0
    try:
        evaluate.main([a.format(d=d) for a in args])
    except SystemExit as e:
        code = e.code
    said = capsys.readouterr()
    text = (said.out if args == ["--help"] else said.err).strip()
    assert text.startswith(line.format(d=d)) and len(text.splitlines()) == 1, text
    assert code == (0 if args == ["--help"] else 2)
    assert not (tmp_path / "eval.jsonl").exists()
