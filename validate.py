"""Validation: greedy answers to held-out prompts through the run's own engine, scored by the run's reward.

    python train_grpo.py                  # the built-in task: its 100 held-out items, before step 0 and every 10
    torchrun --nproc_per_node=8 train_grpo.py --model=/models/Qwen2.5-0.5B-Instruct --data=gsm8k_train.jsonl \
        --val_data=gsm8k_val.jsonl \
        --instruction='Let'"'"'s think step by step and output the final answer after "####".'
    python evaluate.py --model=out/final --val_data=gsm8k_val.jsonl --instruction='...'   # any folder, the same way
    python -m pytest -q tests/test_val.py

What verl's `trainer.test_freq` and `val_before_train` do: the policy answers each held-out prompt once,
greedily (temperature 0), in at most --val_response_length tokens, and the run's reward scores the answers.
When: before the first step (--val_before_train), at the start of every step that is a multiple of
--val_freq, and after the last step (val_freq > 0). Each figure is the policy's after that many updates:
it goes into that step's metrics line (`val/reward_mean`, the accuracy for a 0/1 reward;
`val/response_length`), the one after the last step into a line of its own (step = --steps). A resumed
run keeps the schedule (it validates at its first step only if that step is on it).
Memory: the generate stage's. vLLM: a bracket of its own (rollout.awake: the actor's weights synced in,
the KV cache woken, asleep after), its requests queued by the engine beyond its batch; HF generate (the
CPU): the training batch's rows a call. The stage is `val` in the ledger (`time/val`, `mem/val/*`) and
in the plan. It changes nothing else: the weights are only read, the RNG states are put back after it,
and the steps' results are the same with validation on or off (tests/test_val.py).
With the built-in GSM8K reward both answer forms are scored (`val/strict`, `val/flexible`), and the first
validation says what share of the answers each form found: a run scored 0 learns why.
`<out_dir>/val_samples.jsonl`: the first VAL_SAMPLES held-out prompts, their answers and scores, at each
validation.
"""
import os

import torch

import data as data_io
import gsm8k
import hf_engine
import rollout
import rollout_async
import rundir
from model import all_sum

VAL_SAMPLES = 8                            # held-out prompts written to val_samples.jsonl at each validation


def enabled(cfg) -> bool:
    """The run has held-out prompts (--val_data; with neither --data nor --val_data the built-in task's)
    and a validation on its schedule."""
    return (cfg.val_data is not None or cfg.data is None) and (cfg.val_before_train or cfg.val_freq > 0)


def due(cfg, step: int) -> bool:
    """Validate the policy after `step` updates (step == cfg.steps: after the last one)?"""
    if not enabled(cfg):
        return False
    if step == 0:
        return cfg.val_before_train
    return cfg.val_freq > 0 and (step % cfg.val_freq == 0 or step == cfg.steps)


def response_length(cfg) -> int:
    return cfg.val_response_length or cfg.rollout.response_length


def describe(cfg, val: tuple | None, reward: str) -> list[str]:
    """The set-up report's line: what is validated, when, how long an answer may be, by which reward."""
    if val is None:
        return ["[val] off: --data without --val_data, so nothing shows whether the run makes the model better on "
                "prompts it did not train on; give held-out prompts with --val_data"] if cfg.data else []
    when = ", ".join(w for w in ["before the first step" if cfg.val_before_train else "",
                                 f"every {cfg.val_freq} steps and after the last" if cfg.val_freq else ""] if w)
    gsm8k = data_io.builtin_gsm8k(cfg.reward, data_io.held_out_reward_data(cfg, val[1]))
    both = " (val/strict and val/flexible: both GSM8K forms)" if gsm8k else ""
    what = "prompts (the training file's: not held out)" if training_file(cfg) else "held-out prompts"
    lines = [f"[val] {len(val[0])} {what} of {cfg.val_data or 'the built-in task'}, greedy, at most "
             f"{response_length(cfg)} tokens, {when or 'never (--val_freq=0, --val_before_train=false)'}; scored by "
             f"{reward}{both}; the first {VAL_SAMPLES} to val_samples.jsonl"]
    if "gsm8k_format" in getattr(cfg, "_given", ()) and not gsm8k:
        lines.append(f"[val] warning: --gsm8k_format={cfg.gsm8k_format} does nothing: the run's reward is "
                     f"{reward}, not the built-in GSM8K rule")
    return lines + not_held_out(cfg)


def training_file(cfg) -> bool:
    """--val_data names the file --data trains on (the same path, or a link to it)."""
    return cfg.data is not None and cfg.val_data is not None and os.path.exists(cfg.val_data) and \
        os.path.exists(cfg.data) and os.path.samefile(cfg.data, cfg.val_data)


def not_held_out(cfg) -> list[str]:
    """The warning for a --val_data that is the training file: its score is how well the run fits the prompts it
    trains on, not how it does on prompts it has not seen."""
    return [f"[val] warning: --val_data {cfg.val_data} is the training file (--data): not held out; its score says "
            f"how well the policy fits its training prompts; give prompts it does not train on"] \
        if training_file(cfg) else []


def share(n: int, rank: int, world: int) -> list:
    """This rank's held-out prompts: a contiguous part (rank 0 holds the first ones, val_samples.jsonl's),
    every rank the same number, a short last part padded with None (prompt 0 again, not scored)."""
    per = -(-n // world)
    return [i if i < n else None for i in range(rank * per, (rank + 1) * per)]


def answer(engine, stream, model, stashes: list, prompts: list, idx: list, *, cfg, bracket: dict, chunk: int) -> list:
    """This rank's greedy answers (token ids, cut after EOS) to the held-out prompts `idx` (`share`'s):
    colocated, through its engine (rollout.greedy); async, rank 0's engines answer them all
    (rollout_async.greedy: with the weights pushed after the last update) and each rank keeps its own.
    `chunk`: prompts an HF generate call (a training step's rows on a rank: what its memory is planned for)."""
    L = response_length(cfg)
    if stream is not None:
        every = hf_engine.cut(rollout_async.greedy(stream, prompts, L), stream.eos_id)
        return [every[0 if i is None else i] for i in idx]
    return rollout.greedy(engine, model, [prompts[0 if i is None else i] for i in idx], L, stashes, bracket, chunk)


def held_out(engine, stream, model, stashes: list, val: tuple, *, cfg, reward_fn, tokenizer, warned: set, device,
             rank: int, world: int) -> tuple[dict, list]:
    """The greedy answers of the policy `model` to this rank's share of the held-out prompts, scored by
    `reward_fn`: the metrics summed over ranks (each val/* a share of the prompts), and this rank's samples
    (prompt, response, answer, score) in the held-out order. What validation and evaluate.py both run."""
    prompts, answers = val[0], val[1]
    idx, bracket = share(len(prompts), rank, world), {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):   # the run's RNG untouched
        out = answer(engine, stream, model, stashes, prompts, idx, cfg=cfg, bracket=bracket,
                     chunk=max(1, rollout.prompts_per_rank(cfg.train_batch_size, world)) * cfg.rollout.n)
    mine = [(i, r) for i, r in zip(idx, out) if i is not None]
    texts = tokenizer.batch_decode([r for _, r in mine], skip_special_tokens=True)
    truth = [answers[i] for i, _ in mine]
    scored_as = data_io.held_out_reward_data(cfg, answers)   # the data whose form picks the built-in reward
    name = data_io.reward_name(cfg.reward, scored_as, cfg.gsm8k_format)
    scores, errors = data_io.score(reward_fn, name, texts, truth)
    failed = data_io.reward_errors(errors, cfg.reward_error, warned, device)
    forms = gsm8k.answer_forms(texts, truth) if data_io.builtin_gsm8k(cfg.reward, scored_as) else {}
    capped = sum(len(r) >= response_length(cfg) for _, r in mine)   # cut at the length cap, not ended by EOS
    sums = all_sum(torch.tensor([sum(scores), len(scores), sum(len(r) for _, r in mine), capped, *forms.values()],
                                dtype=torch.float64, device=device)).tolist()
    m = {"val/reward_mean": sums[0] / sums[1], "val/response_length": sums[2] / sums[1], "val/prompts": sums[1],
         "val/clipped_frac": sums[3] / sums[1], "val/reward_errors": failed,
         **{f"val/{k}": v / sums[1] for k, v in zip(forms, sums[4:])}}
    if "rollout/generate_s" in bracket:   # a colocated vLLM engine's bracket
        m.update({"val/generate_s": bracket["rollout/generate_s"],
                  "val/device_peak_gb": bracket["rollout/device_peak_gb"]})
    samples = [{"prompt": tokenizer.decode(prompts[i], skip_special_tokens=True), "response": text, "answer": a,
                "score": s} for (i, _), text, a, s in zip(mine, texts, truth, scores)]
    return m, samples


def validate(engine, stream, model, stashes: list, val: tuple, *, cfg, reward_fn, tokenizer, warned: set, device,
             rank: int, world: int, step: int) -> dict:
    """One validation of the policy `model` after `step` updates (its offloaded groups `stashes` in for the
    weight sync only; `stream`: async rollout's, else None): its metrics, summed over ranks (`held_out`). Rank 0
    writes the first VAL_SAMPLES samples to val_samples.jsonl and, after the first validation with the built-in
    GSM8K reward, says what share of the answers each of its forms found (`warned` remembers)."""
    m, samples = held_out(engine, stream, model, stashes, val, cfg=cfg, reward_fn=reward_fn, tokenizer=tokenizer,
                          warned=warned, device=device, rank=rank, world=world)
    if rank == 0:                          # rank 0's share holds the first prompts
        # a full disk: the run stops after the step
        rundir.on_rank0(rundir.write_val_samples, cfg.out_dir, samples[:VAL_SAMPLES], step)
        if "val/strict" in m and "val" not in warned:
            reward = data_io.reward_name(cfg.reward, data_io.held_out_reward_data(cfg, val[1]), cfg.gsm8k_format)
            print(first_line(m, reward), flush=True)
    warned.add("val")
    return m


def first_line(m: dict, reward: str, lead: str = "the run trains on") -> str:
    """After the first validation with the built-in GSM8K reward: what the answers looked like, and what
    each form scored, so that a run scored 0 says why (an instruct model answers in \\boxed{})."""
    pct = lambda k: f"{100 * m[f'val/{k}']:.1f} %"  # noqa: E731
    return (f"[val] the held-out answers end with `#### N` in {pct('found_strict')}, hold a \\boxed{{}} in "
            f"{pct('found_boxed')} and a number in {pct('found_number')}; right by the strict form (the last #### N) "
            f"{pct('strict')}, by the flexible one (the answer's value) {pct('flexible')}; "
            f"{lead} {reward} (--gsm8k_format)")
