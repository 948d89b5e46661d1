"""Validation and the answers instruct models write (CPU, and GPU with vLLM): the GSM8K reward's two forms
on real responses, published GSM8K files as they are, the schedule (before training, every val_freq steps,
after the last, kept by a resume), a validation that changes nothing (its own RNG fork), async rollout's engines
answering; what a validation answers and reports (val/* as shares, --val_response_length, --val_max_prompts,
--instruction, each prompt once over any world) and the reward a held-out file's form picks.

    python -m pytest -q tests/test_val.py           # CPU; the GPU tests skip without CUDA and vLLM
    GRPO_REAL_MODEL=/models/Qwen2.5-Coder-0.5B-Instruct GRPO_REAL_VAL=gsm8k_val.jsonl \
        python -m pytest -q -m gpu tests/test_val.py
"""
import importlib.util
import json
import os

import pytest
import torch

import data
import gsm8k
import options
import predict
import tiny
import train_grpo
import validate
from conftest import launches, metrics, run

# --------------------------------------------------------------------------- the reward's two forms
# Responses as instruct models write them (Qwen2.5-Instruct on GSM8K), the answer 18 each time:
# (response, what strict reads, what flexible reads)
RESPONSES = [
    ("She sells 16 - 3 - 4 = 9 eggs, so she makes 9 * 2 = 18 dollars.\n\n\\[\n\\boxed{18}\n\\]", None, 18),
    ("Janet makes $18 every day.\n#### 18", 18, 18),
    ("The answer is \\boxed{\\$18}.", None, 18),
    ("So the total is \\boxed{18 \\text{ dollars}}", None, 18),
    ("#### $18.00", 18, 18),
    ("Total: 9 eggs x $2 = $18.\n#### 18.", 18, 18),
    ("```python\neggs = 16 - 3 - 4\nprint(eggs * 2)\n```\nThis prints 18.", None, 18),
    ("```python\nprint(16 - 3 - 4)\n```", None, 4),          # a code block whose printout is not shown
    ("I cannot determine the answer without more information.", None, None),
    ("First 1,000 then \\boxed{1,018}", None, 1018),
    ("The change is #### -18", -18, -18),
    ("The answer is \\boxed{18} ... wait, let me recheck: \\boxed{20}", None, 20),   # the last box counts
    ("#### 18 and then the model keeps writing 25", 18, 25),
    ("\\boxed{18", None, 18),                                # a box cut off: the last number
]


@pytest.mark.parametrize("response,strict,flexible", RESPONSES)
def test_each_form_reads_the_answer_instruct_models_write(response, strict, flexible):
    """strict: the number after the last ####; flexible: the last number inside the last \\boxed{}, else the
    last number anywhere; numbers as people write them ($, commas, a trailing period, a sign, 18.00 = 18)."""
    assert gsm8k.gsm8k_answer(response, "strict") == strict
    assert gsm8k.gsm8k_answer(response, "flexible") == flexible
    truth = "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18 every day.\n#### 18"
    assert gsm8k.gsm8k_reward(response, truth) == float(strict == 18)
    assert gsm8k.gsm8k_flexible_reward(response, truth) == float(flexible == 18)
    # both: the mean of the two, so the value pays half in any form and the asked form the other half
    assert gsm8k.gsm8k_both_reward(response, truth) == (float(strict == 18) + float(flexible == 18)) / 2


def test_numbers_as_people_write_them():
    assert gsm8k.number("1,000") == gsm8k.number("$1000.") == gsm8k.number("1000.00") == 1000
    assert gsm8k.number("-$5") == -5 and gsm8k.number("0.5") == gsm8k.number("0.50")
    assert gsm8k.number("abc") is None and gsm8k.number("") is None and gsm8k.number("1.2.3") is None
    assert gsm8k.gsm8k_truth("... #### 1,234") == 1234 and gsm8k.gsm8k_truth("72") == 72


def test_the_form_is_an_option_and_the_run_names_it():
    assert data.load_reward(None, "x.jsonl") is gsm8k.gsm8k_reward
    assert data.load_reward(None, "x.jsonl", "flexible") is gsm8k.gsm8k_flexible_reward
    assert "strict" in data.reward_name(None, "x.jsonl") and "flexible" in data.reward_name(None, "x.jsonl", "flexible")
    assert data.load_reward(None, "x.jsonl", "both") is gsm8k.gsm8k_both_reward
    assert "both forms" in data.reward_name(None, "x.jsonl", "both")
    rewards = [gsm8k.gsm8k_both_reward(r, "#### 18") for r in ("\\boxed{18}", "#### 18", "#### 17", "\\boxed{17}")]
    assert rewards == [0.5, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="gsm8k_format=boxed: use one of strict, flexible, both, bonus"):
        options.parse_args(["--gsm8k_format=boxed"])
    shares = gsm8k.answer_forms([r for r, _, _ in RESPONSES], ["#### 18"] * len(RESPONSES))
    assert shares["found_strict"] == 5 and shares["strict"] == 4 and shares["flexible"] == 8


def test_the_bonus_pays_the_form_apart_from_the_value():
    """--gsm8k_format=bonus: the right value 0.8 in any form, ending in `#### N` 0.2 right or wrong; the form
    commits the answer (a right box then a wrong `#### N` earns the form only); a `####` heading is not the form."""
    assert data.load_reward(None, "x.jsonl", "bonus") is gsm8k.gsm8k_bonus_reward
    assert "0.2 for ending in #### N" in data.reward_name(None, "x.jsonl", "bonus")
    cases = {"\\boxed{18}": 0.8, "So 9 * 2 = 18.\n#### 18": 1.0, "#### 17": 0.2, "\\boxed{17}": 0.0,
             "\\boxed{18}\n#### 18.": 1.0, "\\boxed{18}\n#### 17": 0.2, "#### $18.00\n": 1.0,
             "#### 2. The total\nShe makes \\boxed{18}": 0.8, "#### 2. The total\nShe makes \\boxed{17}": 0.0,
             "#### 18 and then the model keeps writing 25": 0.0}
    assert {r: gsm8k.gsm8k_bonus_reward(r, "#### 18") for r in cases} == pytest.approx(cases)
    # the form is the response's end: a `####` heading inside the text is not it
    assert gsm8k.ends_in_form("#### 17") and not gsm8k.ends_in_form("#### 2. The total")


# --------------------------------------------------------------------------- published GSM8K as it is
def test_published_gsm8k_trains_as_it_is_with_an_instruction(tmp_path, capsys):
    """The published keys (`question`, `answer`) need no renaming, and --instruction is appended to each
    prompt (a chat prompt: to its last user message) before the chat template."""
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps({"question": q, "answer": f"... #### {a}", "id": i})
                              for i, (q, a) in enumerate([("12=", 12), ("34=", 34)])) + "\n")
    tok = tiny.build_tokenizer()
    prompts, answers, _ = data.load_data(str(path), tok, instruction="#")
    assert [tok.decode(p) for p in prompts] == ["12= #", "34= #"] and answers[0].endswith("#### 12")
    assert "its 'question' field" in capsys.readouterr().out
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}]
    assert data.with_instruction(chat, "Think.")[3]["content"] == "2+2 Think." and chat[3]["content"] == "2+2"
    assert data.with_instruction(chat, "")[1:] == chat[1:]
    with pytest.raises(ValueError, match="has no 'q' field"):     # a named key is taken as it is
        data.load_data(str(path), tok, prompt_key="q")


# --------------------------------------------------------------------------- when it runs
def test_the_schedule():
    cfg = options.parse_args(["--steps=25", "--val_freq=10"])
    assert [s for s in range(26) if validate.due(cfg, s)] == [0, 10, 20, 25]
    cfg = options.parse_args(["--steps=20", "--val_freq=10", "--val_before_train=false"])
    assert [s for s in range(21) if validate.due(cfg, s)] == [10, 20]
    cfg = options.parse_args(["--steps=20", "--val_freq=0"])
    assert [s for s in range(21) if validate.due(cfg, s)] == [0]
    cfg = options.parse_args(["--steps=20", "--data=x.jsonl"])     # training data without held-out data
    assert not validate.enabled(cfg) and not any(validate.due(cfg, s) for s in range(21))
    assert "val" not in [s.name for s in predict.predict(options.parse_args(
        ["--model=random:qwen2.5-0.5b", "--data=x.jsonl"]), 1, 64).stages]
    with pytest.raises(ValueError, match="--val_response_length=9 is over --rollout.response_length=4"):
        options.parse_args(["--val_response_length=9"])


def test_the_built_in_task_holds_its_validation_items_out():
    held = {r["prompt"] for r in tiny.held_out()}
    assert len(held) == tiny.HELD_OUT and not held & {r["prompt"] for r in tiny.copy_task(seed=3)}


def test_a_validation_changes_nothing(dist_env, tmp_path):
    """The same run with validation at every step and with none: the same rewards, losses, grads and
    weights step by step, and the same RNG state after (greedy answers through HF generate reseed
    nothing the run sees)."""
    def steps(args):
        t = train_grpo.setup(options.parse_args(["--save=false", "--logger=none", f"--out_dir={tmp_path}",
                                                 "--rollout.engine=hf", *args]))
        rows = [train_grpo.train_step(t, s) for s in range(3)]
        w = torch.cat([p.full_tensor().flatten() if hasattr(p, "full_tensor") else p.flatten()
                       for p in t.actor.model.parameters()])
        return rows, w, torch.get_rng_state()
    on, off = steps(["--val_freq=1"]), steps(["--val_freq=0", "--val_before_train=false"])
    assert all("val/reward_mean" in r for r in on[0]) and not any("val/reward_mean" in r for r in off[0])
    keys = ["reward_mean", "pg_loss", "kl", "entropy", "grad_norm", "delta_w_abs_mean", "data/prompt_crc"]
    assert [[r[k] for k in keys] for r in on[0]] == [[r[k] for k in keys] for r in off[0]]
    assert torch.equal(on[1], off[1]) and torch.equal(on[2], off[2])



# --------------------------------------------------------------------------- what a validation answers and reports
def gsm8k_file(path, answers=(12, 34, 56, 78)) -> str:
    """A GSM8K-style held-out file the tiny tokenizer spells: prompt `12=`, answer `... #### 12`."""
    path.write_text("".join(json.dumps({"question": f"{a}=", "answer": f"so {a}\n#### {a}"}) + "\n" for a in answers))
    return str(path)


def held_out_run(tmp_path, args, model=None, answers: dict | None = None, monkeypatch=None):
    """validate.validate on the CPU as the run calls it: the held-out data as the run resolves it, the reward its
    form picks, and HF generate on the tiny model; `answers` (prompt -> response text) stands in for generation."""
    cfg = options.parse_args([f"--out_dir={tmp_path}", *args])
    tok = tiny.build_tokenizer()
    val = data.held_out_data(cfg, tok)
    if answers is not None:
        monkeypatch.setattr(validate.rollout, "greedy", lambda engine, model, prompts, *a: [
            tok(answers[tok.decode(p)], add_special_tokens=False)["input_ids"] for p in prompts])
    engine = validate.rollout.Engine("hf", cfg.rollout, pad_id=0, eos_id=1, device=torch.device("cpu"))
    reward = data.load_reward(cfg.reward, data.held_out_reward_data(cfg, val[1]), cfg.gsm8k_format)
    m = validate.validate(engine, None, model, [], val, cfg=cfg, reward_fn=reward, tokenizer=tok, warned=set(),
                          device=torch.device("cpu"), rank=0, world=1, step=0)
    with open(tmp_path / "val_samples.jsonl") as f:
        return m, [json.loads(line) for line in f]


def test_the_training_samples_answer_forms_are_step_figures(dist_env):
    """With the built-in GSM8K rule the reward stage counts how the samples answered: the share writing `#### N`
    (what the strict reward pays) and a `\\boxed{}`. Seen: a run whose samples never wrote `####` got exactly 0
    from the strict reward for 30 steps; this is the figure that says why. Another reward: no such figures."""
    import types
    texts = ["so #### 18", "\\boxed{18}", "#### 4", "it is 5"]
    t = types.SimpleNamespace(cfg=options.parse_args(["--data=x.jsonl", "--rollout.n=2", "--train_batch_size=2"]),
                              answers=["... #### 18", "... #### 5"], warned=set(), device=torch.device("cpu"),
                              tokenizer=types.SimpleNamespace(batch_decode=lambda rows, **_: texts[:len(rows)]))
    t.reward_fn = data.load_reward(None, "x.jsonl", "strict")
    batch = {"responses": torch.ones(4, 3, dtype=torch.long), "response_mask": torch.ones(4, 3)}
    m = {}
    scores = train_grpo.rule_scores(t, batch, [0, 1], 1, m)
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (m["reward/found_strict"], m["reward/found_boxed"]) == (0.5, 0.25)
    t.cfg = options.parse_args(["--data=x.jsonl", "--rollout.n=2", "--train_batch_size=2",
                                "--reward=data:gsm8k_reward"])
    m = {}
    train_grpo.rule_scores(t, batch, [0, 1], 1, m)
    assert "reward/found_strict" not in m


def test_the_gsm8k_forms_are_reported_as_shares_of_the_prompts(dist_env, tmp_path, monkeypatch):
    """Four held-out GSM8K problems answered as planned: strict right once, flexible twice, `####` found twice,
    a number three times, two answers (7 tokens) at the 7-token cap: val/* are those counts over 4 (a held-out file
    of numbers is scored by the GSM8K rule without --data too)."""
    answers = {"12=": "#### 12", "34=": "#### 35", "56=": "3 56", "78=": "="}
    m, _ = held_out_run(tmp_path, [f"--val_data={gsm8k_file(tmp_path / 'gsm.jsonl')}", "--rollout.response_length=7"],
                        answers=answers, monkeypatch=monkeypatch)
    keys = ("prompts", "strict", "flexible", "found_strict", "found_boxed", "found_number", "clipped_frac")
    assert {k: m[f"val/{k}"] for k in keys} == {"prompts": 4, "strict": 0.25, "flexible": 0.5, "found_strict": 0.5,
                                                 "found_boxed": 0, "found_number": 0.75, "clipped_frac": 0.5}
    assert m["val/reward_mean"] == 0.25    # the run's form: strict


@pytest.fixture(scope="module")
def tiny_policy():
    return tiny.build_tiny_model(seed=0).eval()


def test_val_response_length_caps_the_answers(dist_env, tmp_path, tiny_policy):
    """HF generate on the tiny policy: its greedy answers are cut at --val_response_length, not at the
    rollout's response length (they run to the cap: no EOS in 2 or 3 tokens)."""
    for cap in (2, 3):
        m, samples = held_out_run(tmp_path, [f"--val_response_length={cap}", "--val_max_prompts=8"], model=tiny_policy)
        assert m["val/response_length"] == cap and max(len(s["response"]) for s in samples) == cap


def test_val_max_prompts_and_the_instruction_shape_the_held_out_prompts(dist_env, tmp_path, tiny_policy):
    """--val_max_prompts: the first that many held-out prompts are answered; --instruction: appended to each."""
    path = gsm8k_file(tmp_path / "gsm.jsonl", answers=range(10, 20))
    m, samples = held_out_run(tmp_path, [f"--data={path}", f"--val_data={path}", "--val_max_prompts=3",
                                         "--instruction=#"], model=tiny_policy)
    assert m["val/prompts"] == 3 and [s["prompt"] for s in samples] == ["10= #", "11= #", "12= #"]


@pytest.mark.parametrize("world", [2, 3])
def test_each_held_out_prompt_is_answered_once_whatever_the_world(world):
    """validate.share: every rank as many prompts (the short last part padded with None), together each prompt
    once, rank 0 the first ones (val_samples.jsonl's); 100 prompts over 3 ranks drop none."""
    for n in (100, 7, 1, world):
        parts = [validate.share(n, r, world) for r in range(world)]
        assert len({len(p) for p in parts}) == 1 and parts[0][0] == 0
        assert sorted(i for p in parts for i in p if i is not None) == list(range(n))


def test_a_validation_leaves_the_runs_random_numbers_as_they_were(dist_env, tmp_path, tiny_policy):
    """HF generate seeds torch's generator for its samples: validation runs under a fork of it, so the draws the
    run makes after it (its next samples) are those it makes without it."""
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    held_out_run(tmp_path, ["--val_max_prompts=4"], model=tiny_policy)
    assert torch.equal(torch.rand(4), expected)


def test_a_held_out_file_is_scored_by_the_reward_its_form_picks(tmp_path):
    """Without --data, a --val_data of numbers gets the GSM8K rule (it scored 0.01 by the copy reward), one of
    words the copy reward; a run that would train by one reward and validate by the other is refused."""
    tok, gsm = tiny.build_tokenizer(), gsm8k_file(tmp_path / "gsm.jsonl")
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"prompt": "1=", "answer": "City"}) + "\n")
    for path, scored_as, fn in [(gsm, gsm, gsm8k.gsm8k_reward), (str(words), None, tiny.copy_reward)]:
        cfg = options.parse_args([f"--val_data={path}"])
        got = data.held_out_reward_data(cfg, data.held_out_data(cfg, tok)[1])
        assert got == scored_as and data.load_reward(None, got) is fn
    with pytest.raises(ValueError, match="--val_data .*gsm.jsonl: its answers are numbers, which the built-in GSM8K"):
        data.run_data(options.parse_args([f"--val_data={gsm}"]), tok)
    assert data.run_data(options.parse_args([f"--data={gsm}", f"--val_data={gsm}"]), tok)[1] is not None


def test_the_training_file_as_val_data_is_not_called_held_out(tmp_path):
    """--val_data naming --data's file: the set-up line does not call its prompts held out, and warns once."""
    path, other = gsm8k_file(tmp_path / "gsm.jsonl"), gsm8k_file(tmp_path / "other.jsonl")
    val = data.held_out_data(options.parse_args([f"--val_data={path}"]), tiny.build_tokenizer())
    same = validate.describe(options.parse_args([f"--data={path}", f"--val_data={path}"]), val, "r")
    assert same[0].startswith("[val] 4 prompts (the training file's: not held out)")
    assert sum("is the training file (--data): not held out" in line for line in same) == 1
    apart = validate.describe(options.parse_args([f"--data={other}", f"--val_data={path}"]), val, "r")
    assert apart[0].startswith("[val] 4 held-out prompts") and not any("training file" in x for x in apart)

@launches
def test_validation_before_training_at_its_frequency_after_the_last_and_on_resume(tmp_path):
    """val_freq=3 over 5 steps: the held-out score of the policy after 0, 3 and 5 updates, each once in
    metrics.jsonl and val_samples.jsonl; stopped at step 2 and resumed, the run validates on the same steps
    (not again at its first), and the set-up and end lines say what was validated."""
    out, args = str(tmp_path / "run"), ["--val_freq=3", "--save=false", "--logger=none"]
    r = run([f"--out_dir={out}", "--steps=2", "--save_freq=2", *args])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[val] 100 held-out prompts of the built-in task, greedy, at most 4 tokens, before the first step, " \
           "every 3 steps and after the last" in r.stdout
    r = run([f"--out_dir={out}", "--steps=5", "--save_freq=2", *args])   # resumes at 2
    assert r.returncode == 0, r.stderr[-2000:]
    m = metrics(out, every_line=True)
    assert [x["step"] for x in m] == [0, 1, 2, 3, 4, 5]                  # the last line: the last validation's
    assert [x["step"] for x in m if "val/reward_mean" in x] == [0, 3, 5] and "optimizer_steps" not in m[-1]
    assert all(x["val/prompts"] == 100 and 0 <= x["val/reward_mean"] <= 1 for x in m if "val/reward_mean" in x)
    with open(os.path.join(out, "val_samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [0] * 8 + [3] * 8 + [5] * 8
    assert set(samples[0]) == {"step", "prompt", "response", "answer", "score"}
    assert "held-out val/reward_mean" in r.stdout and "validation after step 5" in r.stdout


@launches
def test_two_ranks_and_async_engines_give_the_colocated_scores(tmp_path):
    """The held-out score of the starting policy is the same whoever answers: one process, two ranks
    (each a share of the prompts), and an async engine process (answers sent back from its HF model)."""
    def first(name, extra, nproc=0):
        out = str(tmp_path / name)
        r = run([f"--out_dir={out}", "--steps=1", "--val_freq=1", "--save=false", "--logger=none", *extra], nproc=nproc)
        assert r.returncode == 0, r.stderr[-2000:]
        return [(x["val/reward_mean"], x["val/prompts"]) for x in metrics(out, every_line=True)]
    one = first("one", [])
    assert first("two", [], nproc=2)[0] == one[0] and len(one) == 2
    assert first("async", ["--rollout.mode=async"])[0] == one[0]


# --------------------------------------------------------------------------- on a GPU, with vLLM
needs_vllm = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs a CUDA GPU and vLLM")
REAL = os.environ.get("GRPO_REAL_MODEL", "/tmp/qwen-coder-0.5b")
REAL_VAL = os.environ.get("GRPO_REAL_VAL", "/tmp/gsm8k_val.jsonl")


@launches
@pytest.mark.gpu
@needs_vllm
@pytest.mark.timeout(600)
def test_vllm_validates_the_embedded_model(tmp_path):
    """The embedded run with the vLLM engine: its held-out answers through a bracket of their own, at most
    the response length, the stage's memory within the plan's."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", "--rollout.engine=vllm", "--steps=2", "--val_freq=1", "--save=false",
             "--logger=none"], gpu=True)
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(out, every_line=True)
    assert [x["step"] for x in m if "val/reward_mean" in x] == [0, 1, 2]
    for x in m:
        if "val/reward_mean" in x:
            assert x["val/prompts"] == 100 and x["val/response_length"] <= 4 and x["val/device_peak_gb"] > 0
            assert x["mem/val/peak_gb"] <= 1.1 * x["plan/val/predicted_gb"] + 0.25, x   # the plan knows the stage


@launches
@pytest.mark.gpu
@needs_vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.isdir(REAL) or not os.path.isfile(REAL_VAL), reason="no real model folder here")
def test_vllm_validates_a_real_instruct_model(tmp_path):
    """A real instruct model on 64 held-out GSM8K problems, greedy through vLLM: it answers in \\boxed{}
    (flexible reads it; strict, the #### form, finds few), and the first validation's line says so."""
    out = str(tmp_path / "run")
    r = run([f"--out_dir={out}", f"--model={REAL}", f"--data={REAL_VAL}", f"--val_data={REAL_VAL}",
             "--val_max_prompts=64",
             "--instruction=Let's think step by step and output the final answer after \"####\".",
             "--rollout.engine=vllm", "--steps=1", "--train_batch_size=8", "--actor.ppo_mini_batch_size=8",
             "--rollout.n=4", "--rollout.response_length=512", "--actor.lr=1e-6", "--val_freq=0", "--save=false",
             "--logger=none"], gpu=True)
    assert r.returncode == 0, r.stderr[-3000:]
    v = metrics(out)[0]
    print(f"\n[real model] 64 held-out: strict {v['val/strict']:.3f}, flexible {v['val/flexible']:.3f}, "
          f"boxed {v['val/found_boxed']:.3f}, #### {v['val/found_strict']:.3f}, length {v['val/response_length']:.0f}")
    assert v["val/prompts"] == 64 and 0.08 < v["val/flexible"] < 0.6 and v["val/found_boxed"] > 0.5
    assert v["val/strict"] < v["val/flexible"] and "the held-out answers end with `#### N` in" in r.stdout


# --------------------------------------------------------------------------- TRL beside us: the report
def test_the_trl_report_counts_training_minutes_only(tmp_path):
    """bench/vs_trl.py report (no TRL needed): TRL's accuracy at each checkpoint against its wall time less
    the checkpoint writes before it, ours at each validation against the steps' time less the validations';
    the evaluator's other folders (our final/) in rows of their own."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import vs_trl
    trl, ours = tmp_path / "trl", tmp_path / "ours"
    trl.mkdir(), ours.mkdir()
    steps = [{"step": s, "wall_s": 6.0 * s + (5.0 if s > 20 else 0.0)} for s in range(1, 41)]   # a 5 s save at 20
    (trl / "steps.json").write_text(json.dumps({"optimizer_steps_per_step": 2, "steps": steps,
                                                "saves": [{"step": 20, "save_s": 5.0}]}))
    folders = ["base", str(trl / "checkpoint-20"), str(trl / "checkpoint-40"), str(ours / "final")]
    scores = [0.0, 0.2, 0.3, 0.25]
    (tmp_path / "eval.json").write_text(json.dumps({"results": [
        {"folder": f, "strict": s, "flexible": s + 0.01} for f, s in zip(folders, scores)]}))
    rows = [{"step": 0, "val/strict": 0.0, "val/flexible": 0.24, "time/step": 2.0, "time/val": 2.0}]
    rows += [{"step": s, "time/step": 9.0 + (3.0 if s == 10 else 0.0), "time/val": 3.0 if s == 10 else 0.0,
              **({"val/strict": 0.15, "val/flexible": 0.26} if s == 10 else {})} for s in range(1, 11)]
    (ours / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fast = tmp_path / "fast"                       # a second run of ours (async): TRL's final score at step 10
    fast.mkdir()
    (fast / "metrics.jsonl").write_text("".join(json.dumps({**r, "time/step": r["time/step"] / 3, "time/val": r[
        "time/val"] / 3, **({"val/strict": 0.3} if r["step"] == 10 else {})}) + "\n" for r in rows))
    out = tmp_path / "table.txt"
    vs_trl.report(type("A", (), {"trl": str(trl), "eval": str(tmp_path / "eval.json"), "out": str(out), "plot": "",
                                 "ours": f"{ours},async={fast}"})())
    table = out.read_text().splitlines()
    assert "| TRL | 10 | 2.00 | 0.200 | 0.210 |" in table       # optimizer step 20: 120 s
    assert "| TRL | 20 | 4.00 | 0.300 | 0.310 |" in table       # step 40: 245 s of wall, 5 s of it the save
    assert "| ours | 10 | 1.35 | 0.150 | 0.260 |" in table      # steps 0-9 before step 10 validates: 0 + 9 x 9 s
    assert "| async | 10 | 0.45 | 0.300 | 0.260 |" in table
    assert any(r.startswith("| (evaluator)") and "final" in r for r in table)
    # minutes to TRL's final 30 % (TRL: 4.00), and the median step (TRL: 2 optimizer steps of 6 s, saves left out)
    assert "| TRL | 4.00 | 1.00 | 12.00 | 1.00 |" in table
    assert "| ours | not reached | not reached | 9.00 | 0.75 |" in table
    assert "| async | 0.45 | 0.11 | 3.00 | 0.25 |" in table


def test_the_reward_report_needs_no_evaluator(tmp_path):
    """bench/vs_trl.py reward (no TRL needed): each run's training reward in blocks of steps against training minutes
    (TRL: a generation step's reward at its first optimizer step's wall time, saves left out; ours: the steps' time
    less validation), and the minutes to the lowest TRL run's last block."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import vs_trl
    trl, ours = tmp_path / "trl", tmp_path / "ours"
    trl.mkdir(), ours.mkdir()
    steps = [{"step": s, "wall_s": 6.0 * s + (5.0 if s > 4 else 0.0), **({"reward": 0.1 * (s // 2)} if s % 2 else {})}
             for s in range(1, 9)]                      # 4 generations (optimizer steps 1, 3, 5, 7), a 5 s save at 4
    (trl / "steps.json").write_text(json.dumps({"optimizer_steps_per_step": 2, "steps": steps,
                                                "saves": [{"step": 4, "save_s": 5.0}]}))
    rows = [{"step": s, "reward_mean": 0.1 * s, "time/step": 3.0 + (1.0 if s == 2 else 0.0),
             "time/val": 1.0 if s == 2 else 0.0} for s in range(6)]
    (ours / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "reward.txt"
    vs_trl.reward(type("A", (), {"trl": str(trl), "ours": f"async={ours}", "block": 2, "out": str(out), "plot": ""})())
    table = out.read_text().splitlines()
    # TRL's generations: rewards 0, 0.1, 0.2, 0.3 at 6, 18, 30, 42 s of training (the save left out)
    assert "| TRL | 4 | 2: 0.30 min, 0.050; 4: 0.70 min, 0.250 |" in table
    assert "| async | 6 | 2: 0.10 min, 0.050; 4: 0.20 min, 0.250; 6: 0.30 min, 0.450 |" in table
    assert "| TRL | 0.70 | 1.00 | 4 |" in table and "| async | 0.20 | 0.29 | 4 |" in table


def test_the_real_model_script_reports_a_failed_runs_exit_code(tmp_path):
    """bench/real_model.sh's summary line carries the run's own exit code: a missing model folder is
    train_grpo's exit 2 with its one-line error in the run's log (the summary once said 0 for a run that
    never started: the line's "$(basename ...)" had reset $? before it was read)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"),
           "MODEL": str(tmp_path / "no_model"), "TRAIN": str(tmp_path / "train.jsonl"),
           "VAL": str(tmp_path / "val.jsonl")}
    r = subprocess.run(["bash", "bench/real_model.sh", "grpo", "120"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=240)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("[grpo] exit 2 after "), (summary, r.stdout[-2000:], r.stderr[-2000:])
    assert "error: --model " in (tmp_path / "runs" / "grpo" / "log.txt").read_text()


@pytest.mark.parametrize("scored,keep", [(True, ""), (True, "1"), (False, "")])
def test_the_real_model_script_drops_trls_checkpoints_once_scored_unless_kept(tmp_path, scored, keep):
    """trl_eval removes TRL's checkpoints once the evaluator has scored them (they once filled the disk and
    a later run's check refused it); KEEP=1 keeps them, and so does an evaluator that failed, for a second
    try on the same machine. A `python` first on PATH stands in for the evaluator (no model, no vLLM here)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt = tmp_path / "runs" / "trl" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"0" * 16)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python").write_text(f"#!/bin/sh\nexit {0 if scored else 1}\n")
    (bin_ / "python").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"), "KEEP": keep,
           "PATH": f"{bin_}:{os.environ['PATH']}", "MODEL": str(tmp_path / "m"), "VAL": str(tmp_path / "v.jsonl")}
    r = subprocess.run(["bash", "bench/real_model.sh", "trl_eval"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=240)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary == f"[trl_eval] exit {0 if scored else 1}\n", (summary, r.stdout, r.stderr)
    assert ckpt.exists() == (not scored or bool(keep))


def test_trls_phases_are_timed_and_reported_beside_ours(tmp_path):
    """bench/vs_trl.py (no TRL needed): `timed` adds `_generate`'s time and the no-grad log-prob forwards'
    (not those under grad: the loss's) to each logged step, and speed_report gives TRL's medians after the
    first two steps (its train part: the step less `_generate`) beside each of our variants."""
    import sys
    import time
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import vs_trl

    class Trainer:
        def _generate(self, prompts):
            time.sleep(0.05)
            return prompts

        def _get_per_token_logps_and_entropies(self, *a):
            time.sleep(0.02)

    t, cb = vs_trl.timed(Trainer()), vs_trl.Steps(str(tmp_path / "steps.json"), {})
    cb.on_train_begin(None, None, None)
    t._generate([1])
    with torch.no_grad():
        t._get_per_token_logps_and_entropies()
    t._get_per_token_logps_and_entropies()          # under grad: the update's, not counted
    cb.on_log(None, type("S", (), {"global_step": 1})(), None, logs={"loss": 0.1})
    row = json.loads((tmp_path / "steps.json").read_text())["steps"][0]
    assert 0.05 <= row["generate_s"] < 0.2 and 0.02 <= row["logp_nograd_s"] < 0.04, row
    assert vs_trl.TIMES == {"generate_s": 0.0, "logp_nograd_s": 0.0}
    steps = [{"step": s, "wall_s": 5.0 * s, "generate_s": 3.0, "peak_allocated_gb": 50.0} for s in range(1, 9)]
    (tmp_path / "trl.json").write_text(json.dumps({"steps": steps}))
    ours = {"runs": {"bf16 default": {"ok": True, "metrics": {"time/step": 2.5, "time/generate": 1.5,
                                                              "time/ref_logp": 0.25, "time/update": 0.5,
                                                              "mem/update/peak_gb": 20.0}},
                     "bf16 --kernels=compile": {"ok": False, "error": "x"}}}
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    vs_trl.speed_report(type("A", (), {"trl": str(tmp_path / "trl.json"), "ours": str(tmp_path / "ours.json"),
                                       "out": str(tmp_path / "speed.txt")})())
    table = (tmp_path / "speed.txt").read_text().splitlines()
    assert table[2] == "| TRL | 5.00 | 1 | 3.00 | 2.00 | 50.0 (the step's) |"
    assert table[3] == "| ours bf16 default | 2.50 | 0.50 | 1.50 | 0.75 | 20.0 |" and len(table) == 4


def test_the_curves_read_the_runs_validations_against_their_minutes(tmp_path):
    """bench/curves.py: a validation at step s sits at the minutes of steps 0 .. s-1 and its own (tracker.learning),
    a resumed run reads as one curve; on the recorded both-forms run, bench/README.md's figures (step 50: 36.1 %
    flexible after 7.8 minutes, strict 0)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import curves
    val = {"val/reward_mean": 0.0}         # what marks a validation's row
    rows = [{"step": 0, **val, "val/flexible": 0.25, "val/strict": 0.0, "time/step": 60.0},
            {"step": 1, "time/step": 30.0},
            {"step": 2, **val, "val/flexible": 0.5, "val/strict": 0.25, "time/step": 90.0},
            {"step": 3, "time/step": 30.0},
            {"step": 4, **val, "val/flexible": 0.75, "val/strict": 0.5}]   # the validation after the last step
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curves.curve(str(path)) == [(0, 0.0, 0.25, 0.0), (2, 1.5, 0.5, 0.25), (4, 3.5, 0.75, 0.5)]
    table = curves.table({"run": curves.curve(str(path))})
    assert "| run | 25.0 / 0.0 (0.0); 50.0 / 25.0 (1.5); 75.0 / 50.0 (3.5) |" in table
    recorded = os.path.join(os.path.dirname(curves.__file__), "results", "2026-12-07-real-long-h100",
                            "grpo_both_metrics.jsonl")
    step, minutes, flexible, strict = next(c for c in curves.curve(recorded) if c[0] == 50)
    assert (round(100 * flexible, 1), round(minutes, 1), strict) == (36.1, 7.8, 0.0)
