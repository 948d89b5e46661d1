"""TRL beside this project on one GPU, in one machine's calls (TRL is not a dependency: its wheels travel to the GPU
machine for this bench only). Three parts, each a process of its own:

    # TRL's GRPO workload on a random Qwen2.5 shape (16 prompts x 8, 64-token prompts, 256-token answers,
    # micro-batch 32, KL 0.04, colocated vLLM with sleep mode); ours is bench/bench_step.py on the same shape
    python bench/vs_trl.py speed --size=qwen2.5-0.5b --tokenizer=/tmp/qwen-coder-0.5b --out=trl_speed_0p5b.json
    # the real task: the same model, GSM8K rows, instruction, strict reward, 32 x 8 a step, lr, KL and answer
    # length as bench/real_model.sh's GRPO; a checkpoint every --save_steps for `eval`
    python bench/vs_trl.py task --model=/tmp/qwen-coder-0.5b --train=/tmp/gsm8k_train.jsonl --steps=50 --out=trl_task
    # greedy held-out accuracy of checkpoints (TRL's, or ours: final/, a checkpoint's hf/ folder) with the
    # evaluator our validation uses (chat template, instruction, 512 tokens, strict and flexible forms)
    python bench/vs_trl.py eval --val=/tmp/gsm8k_val.jsonl --out=trl_eval.json trl_task/checkpoint-10 ...
    python bench/vs_trl.py report --trl=trl_task --eval=trl_eval.json --ours=<our run dir> --out=vs_trl.md
    # the training reward of each side's runs against minutes (no evaluator); TRL's loss gradient against ours
    python bench/vs_trl.py reward --trl=trl_task,trl_task_s1 --ours=async=<dir>,async_s1=<dir> --out=reward.txt
    python bench/vs_trl.py grad --out=trl_grad.json        # CPU: one batch, the tiny model, no vLLM

`speed` and `task` write each optimizer step's wall-clock time, TRL's own step_time, reward, KL and
completion length to JSON as they come (a call cut short keeps its steps). DRY=1 runs `speed` and `task`
without vLLM (HF generate) on the CPU with a small local model: the plumbing, checked before a GPU is spent on it.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                   # data.py: the rows, the instruction; gsm8k.py: the reward
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'   # verl's GSM8K sentence
DRY = os.environ.get("DRY") == "1"


def trl_config(out: str, seed: int = 0, **kw):
    """GRPOConfig with what both parts share: colocated vLLM asleep between generations, bf16 autocast,
    a log line every step, no hub, no reports, nothing saved unless asked."""
    from trl import GRPOConfig
    base = dict(output_dir=out, seed=seed, use_vllm=not DRY, vllm_mode="colocate", vllm_enable_sleep_mode=not DRY,
                bf16=not DRY, logging_steps=1, report_to=[], save_strategy="no", temperature=1.0,
                use_cpu=DRY, dataloader_num_workers=0)
    return GRPOConfig(**{**base, **kw})


class Steps:
    """A TrainerCallback (duck-typed: transformers calls the methods it finds) that writes every optimizer
    step's wall time since training began and TRL's logged figures to `path`, after each step."""

    def __init__(self, path: str, meta: dict):
        self.path, self.rows, self.saves, self.meta, self.t0 = path, [], [], meta, None

    def __getattr__(self, name):           # every other callback event: nothing
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        import torch
        row = {"step": state.global_step, "wall_s": time.perf_counter() - self.t0,
               **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}, **TIMES}
        TIMES.update({k: 0.0 for k in TIMES})
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            row.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / 2 ** 30,
                       device_used_gb=(total - free) / 2 ** 30)
            torch.cuda.reset_peak_memory_stats()
        self.rows.append(row)
        self._write()

    def on_save(self, args, state, control, **kw):
        # the Trainer logs a step, then saves: the time since that log is the save's, left out of training time
        last = self.rows[-1]["wall_s"] if self.rows else 0.0
        self.saves.append({"step": state.global_step, "save_s": time.perf_counter() - self.t0 - last})
        self._write()

    def _write(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump({**self.meta, "steps": self.rows, "saves": self.saves}, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


TIMES = {"generate_s": 0.0, "logp_nograd_s": 0.0}   # since the last logged step (`timed`)


def timed(trainer):
    """Time TRL's own phases on this trainer: `_generate` (the weight sync into vLLM, generation, its sleep and
    wake) and the no-grad log-prob forwards (old and ref); what is left of a step is its train part."""
    import torch

    def wrap(name, key, when=lambda: True):
        inner = getattr(trainer, name)

        def call(*args, **kw):
            if not when():
                return inner(*args, **kw)
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t0 = time.perf_counter()
            out = inner(*args, **kw)
            sync()
            TIMES[key] += time.perf_counter() - t0
            return out
        setattr(trainer, name, call)
    wrap("_generate", "generate_s")
    wrap("_get_per_token_logps_and_entropies", "logp_nograd_s", lambda: not torch.is_grad_enabled())
    return trainer


def versions() -> dict:
    import importlib.util
    from importlib.metadata import version
    import torch
    out = {p: version(p) for p in ("trl", "transformers", "torch", "vllm") if importlib.util.find_spec(p)}
    return {**out, "gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else out


# --------------------------------------------------------------------------- speed: TRL's workload
def random_folder(size: str, tokenizer: str, where: str) -> str:
    """A Qwen2.5 shape with random weights (model.SIZES) saved with a real Qwen tokenizer: vLLM and TRL read a
    folder. bf16 on disk, as published checkpoints are: vLLM serves that dtype, and TRL at its defaults
    (dtype "auto") trains it as loaded."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM
    import model
    if os.path.exists(os.path.join(where, "config.json")):
        return where
    cfg, tok = model.size_config(size), AutoTokenizer.from_pretrained(tokenizer)
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, None   # the tokenizer's
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(where)
    tok.save_pretrained(where)
    return where


def speed_prompts(tok, n: int, length: int) -> list[str]:
    """`n` prompts of `length` tokens each: words of the vocabulary (" word", one token that encodes back
    to itself), so the text re-tokenizes to the same count; the JSON records the mean."""
    import re
    words = [i for i in range(len(tok)) if re.fullmatch(r" [a-z]{3,}", tok.decode([i]))]
    words = [i for i in words if tok(tok.decode([i]), add_special_tokens=False)["input_ids"] == [i]] \
        or list(range(3, len(tok)))
    rng = random.Random(0)
    return [tok.decode([rng.choice(words) for _ in range(length)]) for _ in range(n)]


def speed(a):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    folder = a.model or random_folder(a.size, a.tokenizer, f"/tmp/vs_trl_{a.size}")
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = speed_prompts(tok, a.prompts * (a.steps + 1), a.prompt_len)
    lengths = [len(tok(p)["input_ids"]) for p in prompts]
    cfg = trl_config(a.out + ".trl", num_generations=a.n, max_completion_length=a.response_len, beta=a.kl,
                     per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.prompts * a.n // a.micro,
                     max_steps=a.steps, learning_rate=1e-6, gradient_checkpointing=a.gradient_checkpointing,
                     use_liger_kernel=a.liger, vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                     shuffle_dataset=False)
    meta = {"part": "speed", "size": a.size, "args": vars(a), "prompt_tokens_mean": statistics.fmean(lengths),
            "versions": versions(), "trl_dtype": "as loaded (TRL's default)"}
    trainer = GRPOTrainer(model=folder, reward_funcs=lambda completions, **kw: [float(len(c) % 2) for c in completions],
                          args=cfg, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          callbacks=[Steps(a.out, meta)])
    timed(trainer).train()


# --------------------------------------------------------------------------- task: the real model on GSM8K
def gsm8k_rows(path: str, limit: int = 0) -> list[dict]:
    """{"prompt": [user turn: question + instruction], "answer"} from published GSM8K rows (question,
    answer) or this project's (prompt, answer), as train_grpo reads them (data.read_rows)."""
    import data
    rows = data.read_rows(path)
    key = data.prompt_key_of(rows[0], data.PROMPT_KEYS[0])
    chat = [[{"role": "user", "content": r[key]}] if isinstance(r[key], str) else r[key] for r in rows]
    out = [{"prompt": data.with_instruction(c, INSTRUCTION), "answer": str(r["answer"])} for c, r in zip(chat, rows)]
    return out[:limit] if limit else out


def strict_reward(completions, answer, **kw) -> list[float]:
    """The reward our run uses (gsm8k.gsm8k_reward: the last `#### N` equals the answer's)."""
    import gsm8k
    return [gsm8k.gsm8k_reward(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]


def task(a):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    rows = gsm8k_rows(a.train)
    tok = AutoTokenizer.from_pretrained(a.model)
    per_step = a.prompts * a.n              # samples a step; two optimizer steps of `mini` prompts each
    cfg = trl_config(a.out, a.seed, num_generations=a.n, max_completion_length=a.response_len, beta=a.kl,
                     per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.mini * a.n // a.micro,
                     generation_batch_size=per_step, max_steps=a.steps * a.prompts // a.mini,
                     learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
                     max_grad_norm=1.0, gradient_checkpointing=a.gradient_checkpointing, use_liger_kernel=a.liger,
                     vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                     save_strategy="steps", save_steps=a.save_steps * a.prompts // a.mini, save_only_model=True,
                     model_init_kwargs={"dtype": "float32"})   # fp32 master weights, bf16 autocast: as ours
    meta = {"part": "task", "args": vars(a), "versions": versions(),
            "optimizer_steps_per_step": a.prompts // a.mini}
    os.makedirs(a.out, exist_ok=True)
    if a.sample_seed >= 0 and not DRY:     # TRL seeds its engine with the process index (0): another draw, same data
        import trl.generation.vllm_generation as vg
        llm = vg.LLM
        vg.LLM = lambda *x, **k: llm(*x, **{**k, "seed": a.sample_seed})
    trainer = GRPOTrainer(model=a.model, reward_funcs=strict_reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Steps(os.path.join(a.out, "steps.json"), meta)])
    timed(trainer).train()


# --------------------------------------------------------------------------- eval: one evaluator for both
def evaluate(a):
    """Greedy answers to the held-out rows from each checkpoint folder, scored strict and flexible: one vLLM
    engine built from the first folder, the next folders' weights loaded into it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import gsm8k
    import importlib.util
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine's model in this process: _load reaches it
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams
    rows = gsm8k_rows(a.val, a.limit)
    tok = AutoTokenizer.from_pretrained(a.folders[0])
    # the text as data.py renders it, then its ids (transformers 5's tokenize=True returns a dict, not ids)
    prompts = [tok(tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for r in rows]
    llm = LLM(model=a.folders[0], dtype="bfloat16", gpu_memory_utilization=a.vllm_gpu_memory_utilization, seed=0,
              max_model_len=max(map(len, prompts)) + a.response_len, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=a.response_len)
    results = []
    for i, folder in enumerate(a.folders):
        if i:                               # the next checkpoint's weights into the same engine
            _load(llm, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict())
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        strict = statistics.fmean(gsm8k.gsm8k_reward(t, r["answer"]) for t, r in zip(texts, rows))
        flexible = statistics.fmean(gsm8k.gsm8k_flexible_reward(t, r["answer"]) for t, r in zip(texts, rows))
        results.append({"folder": folder, "strict": strict, "flexible": flexible, "prompts": len(rows),
                        "response_tokens_mean": statistics.fmean(len(o.outputs[0].token_ids) for o in outs),
                        "generate_s": time.perf_counter() - t0})
        print(json.dumps(results[-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump({"val": a.val, "response_len": a.response_len, "results": results}, f, indent=1)


def _load(llm, weights: dict):
    """Another checkpoint's weights into the engine (this process's model: vLLM's in-process executor)."""
    import vllm_engine
    vllm_engine.vllm_model(llm).load_weights(weights.items())


# --------------------------------------------------------------------------- report
def report(a):
    """Held-out accuracy against training minutes (TRL: wall time at each checkpoint, its checkpoint writes
    left out; ours: the step times up to each validation, validation itself left out) as a table and a
    picture."""
    trl_steps = json.load(open(os.path.join(a.trl, "steps.json")))
    per, wall = trl_steps["optimizer_steps_per_step"], trl_training_s(trl_steps)
    evals = json.load(open(a.eval))["results"]
    step_of = {e["folder"]: int(e["folder"].rstrip("/").rsplit("-", 1)[1]) for e in evals
               if os.path.basename(e["folder"].rstrip("/")).startswith("checkpoint-")}   # TRL's optimizer steps
    trl = [(0, 0.0, evals[0]["strict"], evals[0]["flexible"])] + [   # the first folder: the base model
        (step_of[e["folder"]] // per, wall[step_of[e["folder"]]] / 60, e["strict"], e["flexible"])
        for e in evals if e["folder"] in step_of]
    other = [e for e in evals[1:] if e["folder"] not in step_of]   # e.g. our final/: the evaluator against our run's
    runs = {"TRL": trl, **{name: ours_curve(d) for name, d in named(a.ours, "ours")}}
    lines = ["| run | step | training min | strict | flexible |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {s} | {m:.2f} | {st:.3f} | {fl:.3f} |" for name, pts in runs.items() for s, m, st, fl in pts]
    lines += [f"| (evaluator) {e['folder']} | | | {e['strict']:.3f} | {e['flexible']:.3f} |" for e in other]
    # TRL's step: the wall time between generations (`per` optimizer steps, one generate), saves left out
    walls = sorted((s, w) for s, w in wall.items() if s % per == 0)
    gaps = [per * (b - a) / (j - i) for (i, a), (j, b) in zip(walls, walls[1:])]
    step_s = {"TRL": statistics.median(gaps) if gaps else float("nan")}
    step_s.update({name: ours_step_s(d) for name, d in named(a.ours, "ours")})
    lines += ["", *time_to(runs, trl[-1][2], step_s)]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.plot:
        plot(runs, a.plot)


def ours_curve(out_dir: str) -> list:
    """(step, training minutes, strict, flexible) at each validation of one of our runs: the steps' time
    before it, the validations' own time left out."""
    rows = [json.loads(x) for x in open(os.path.join(out_dir, "metrics.jsonl"))]
    pts, minutes = [], 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        if "val/strict" in r:
            pts.append((r["step"], minutes, r["val/strict"], r["val/flexible"]))
        minutes += (r.get("time/step", 0) - r.get("time/val", 0)) / 60
    return pts


def ours_step_s(out_dir: str) -> float:
    """The median step of one of our runs after its first two (the engine's warm-up), validation left out."""
    rows = [json.loads(x) for x in open(os.path.join(out_dir, "metrics.jsonl")) if '"time/step"' in x]
    later = [r for r in rows if r["step"] >= 2] or rows
    return statistics.median(r["time/step"] - r.get("time/val", 0) for r in later) if later else float("nan")


def time_to(runs: dict, target: float, step_s: dict) -> list:
    """The training minutes each run took to first reach TRL's final held-out strict score, against TRL's
    own (the first validation at or above it; none: not reached), and each run's median step."""
    first = {name: next((m for _, m, st, _ in pts if st >= target), None) for name, pts in runs.items()}
    lines = [f"| run | minutes to {100 * target:.1f} % strict (TRL's final) | x TRL's | median step s | x TRL's |",
             "|---|---|---|---|---|"]
    for name, m in first.items():
        ratio = f"{m / first['TRL']:.2f}" if m is not None and first["TRL"] else "not reached"
        lines.append(f"| {name} | {'not reached' if m is None else f'{m:.2f}'} | {ratio} | {step_s[name]:.2f} | "
                     f"{step_s[name] / step_s['TRL']:.2f} |")
    return lines


def plot(runs: dict, path: str, what: str = "held-out accuracy, greedy"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in runs.items():
        line, = ax.plot([p[1] for p in pts], [100 * p[2] for p in pts], marker="o", label=f"{name} (strict)")
        if len(pts[0]) > 3:                # the held-out curves' flexible scores
            ax.plot([p[1] for p in pts], [100 * p[3] for p in pts], marker=".", ls="--", color=line.get_color(),
                    label=f"{name} (flexible)")
    ax.set_xlabel("training minutes (validation left out)")
    ax.set_ylabel(f"{what} (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------- reward: no evaluator needed
def reward(a):
    """The training reward (strict, the sampled batch's mean) against training minutes, TRL's runs beside ours:
    each run's mean over blocks of --block generation steps, and the minutes each run took to first reach the
    lowest of the TRL runs' last-block means (so that every TRL run reaches it). A proxy for the held-out curve
    when TRL's checkpoints were not evaluated; per step it compares what each side's samples earned, not the greedy
    answers."""
    runs = {**{name: trl_reward(d) for name, d in named(a.trl, "TRL")},
            **{name: ours_reward(d) for name, d in named(a.ours, "ours")}}
    blocks = {name: [(pts[i + a.block - 1][0], pts[i + a.block - 1][1],
                      statistics.fmean(p[2] for p in pts[i:i + a.block]))
                     for i in range(0, len(pts) - a.block + 1, a.block)] for name, pts in runs.items()}
    trl = [b for name, d in named(a.trl, "TRL") for b in blocks[name][-1:]]
    target = min(b[2] for b in trl)
    first = {name: next((b for b in bs if b[2] >= target), None) for name, bs in blocks.items()}
    base = statistics.fmean(first[name][1] for name, _ in named(a.trl, "TRL"))
    lines = [f"| run | steps | mean reward over steps ({a.block} a block): step, minutes, reward |", "|---|---|---|"]
    lines += [f"| {name} | {len(runs[name])} | " + "; ".join(f"{s}: {m:.2f} min, {r:.3f}" for s, m, r in bs) + " |"
              for name, bs in blocks.items()]
    lines += ["", f"| run | minutes to {target:.3f} (the lowest TRL run's last block) | x TRL's mean | at step |",
              "|---|---|---|---|"]
    lines += [f"| {name} | " + (f"{b[1]:.2f} | {b[1] / base:.2f} | {b[0]} |" if b else "not reached | | |")
              for name, b in first.items()]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.plot:
        plot(blocks, a.plot, f"training reward, a mean over {a.block} steps")


def named(spec: str, default: str) -> list:
    """--ours, --trl: name=dir pairs split by commas (colocated=...,async=...); a bare dir is `default` (then
    default_2, ...)."""
    out = []
    for i, x in enumerate(y for y in spec.split(",") if y):
        out.append(tuple(x.split("=", 1)) if "=" in x else (default if i == 0 else f"{default}_{i + 1}", x))
    return out


def trl_training_s(d: dict) -> dict:
    """{optimizer step: training seconds at its log} of a TRL steps.json, the checkpoint writes before it left out."""
    saved = d.get("saves", [])
    return {r["step"]: r["wall_s"] - sum(x["save_s"] for x in saved if x["step"] < r["step"])
            for r in d["steps"] if "train_runtime" not in r}


def trl_reward(folder: str) -> list:
    """(generation step from 1, training minutes, the batch's mean reward), logged at each generation's first step."""
    d = json.load(open(os.path.join(folder, "steps.json")))
    per, wall = d["optimizer_steps_per_step"], trl_training_s(d)
    return [((r["step"] + per - 1) // per, wall[r["step"]] / 60, r["reward"])
            for r in d["steps"] if "reward" in r and "train_runtime" not in r]


def ours_reward(out_dir: str) -> list:
    """(step from 1, training minutes at its end, the batch's mean reward) of one of our runs, validation left out."""
    rows = sorted((json.loads(x) for x in open(os.path.join(out_dir, "metrics.jsonl")) if '"reward_mean"' in x),
                  key=lambda r: r["step"])
    minutes, out = 0.0, []
    for r in rows:
        minutes += (r.get("time/step", 0) - r.get("time/val", 0)) / 60
        out.append((r["step"] + 1, minutes, r["reward_mean"]))
    return out


# --------------------------------------------------------------------------- grad: one batch, both losses
def grad(a):
    """TRL's GRPO loss gradient against ours on one batch (CPU, fp32, the embedded tiny model, no vLLM): 16
    samples of 3-6 prompt and 4-12 response tokens (every third ending in EOS), random advantages, a reference
    0.02 away; a GRPOTrainer's `_compute_loss` (its defaults: the dapo loss, clip 0.2, k3 KL times its ratio)
    against actor.update_policy with SGD at lr 1, for each of --betas: the two gradients' cosine and norm ratio."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""   # both sides fp32 on the CPU, on a GPU machine too (before torch)
    import torch
    import tiny
    folder, tok = os.path.join(a.out + ".d", "tiny"), tiny.build_tokenizer()
    tiny.build_tiny_model(0).save_pretrained(folder)
    tok.save_pretrained(folder)
    batch, results = grad_batch(16, 12), []
    for beta in map(float, a.betas.split(",")):
        mine, theirs = ours_grad(batch, beta).double(), trl_grad(a.out + ".d", folder, tok, batch, beta).double()
        results.append({"beta": beta, "cosine": torch.nn.functional.cosine_similarity(mine, theirs, dim=0).item(),
                        "norm_ours_over_trl": (mine.norm() / theirs.norm()).item()})   # fp64: fp32 sums drift past 1
        print(json.dumps(results[-1]), flush=True)
    with open(a.out, "w") as f:
        json.dump({"versions": versions(), "results": results}, f, indent=1)


def grad_batch(B: int, R: int) -> dict:
    """The compared batch: rollout.make_batch's tensors, "advantages" (B,) and the reference's "ref_log_probs"."""
    import torch
    import actor
    import launch
    import rollout
    import tiny
    from model import build_mesh, compute_log_probs, make_layout, shard
    device, g = launch.init_distributed()[2], torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 16, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    resps = [torch.randint(2, 16, (int(torch.randint(4, R + 1, (1,), generator=g)),), generator=g).tolist()
             for _ in range(B)]
    resps = [r[:-1] + [1] if i % 3 == 0 else r for i, r in enumerate(resps)]     # EOS (id 1) inside the mask
    batch = {**rollout.make_batch(prompts, resps, R, pad_id=0, eos_id=1, device=device),
             "advantages": torch.randn(B, generator=g)}
    ref = tiny.build_tiny_model(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    layout = make_layout(actor.ActorConfig(), B, 32768)
    ref_logp = compute_log_probs(shard(ref, build_mesh(device, 1, -1), device), batch, layout, 1.0)
    return {**batch, "ref_log_probs": ref_logp}


def ours_grad(batch: dict, beta: float):
    """Our loss's gradient on `batch`, flat: actor.update_policy's one SGD step at lr 1 (the weights' change)."""
    import torch
    import actor
    import tiny
    from model import build_mesh, shard
    device = batch["input_ids"].device
    model = shard(tiny.build_tiny_model(0), build_mesh(device, 1, -1), device)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    cfg = actor.ActorConfig(grad_clip=1e9, kl_loss_coef=beta, use_kl_loss=beta > 0, rollout_is="none")
    mb = {**batch, "advantages": batch["advantages"][:, None] * batch["response_mask"]}
    actor.update_policy(model, torch.optim.SGD(model.parameters(), lr=1.0), mb, cfg, len(mb["responses"]), 1.0)
    return torch.cat([(b - p.detach().full_tensor()).flatten() for b, p in zip(before, model.parameters())])


def trl_grad(where: str, folder: str, tok, batch: dict, beta: float):
    """TRL's loss's gradient on `batch`, flat: a GRPOTrainer's `_compute_loss`, backward."""
    import torch
    B, R = batch["responses"].shape
    trainer = trl_trainer(where, folder, tok, B, R, beta)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1   # set by its training loop; one window of one batch
    P = batch["input_ids"].shape[1] - R
    trainer._compute_loss(trainer.model, {
        "prompt_ids": batch["input_ids"][:, :P], "prompt_mask": batch["attention_mask"][:, :P],
        "completion_ids": batch["responses"], "completion_mask": batch["response_mask"],
        "advantages": batch["advantages"], "num_items_in_batch": batch["response_mask"].sum().float(),
        "ref_per_token_logps": batch["ref_log_probs"]}).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])


def trl_trainer(where: str, folder: str, tok, batch: int, response_len: int, beta: float):
    """A GRPOTrainer on the CPU over `folder`, one batch a step (its loss is all that is used)."""
    from datasets import Dataset
    from trl import GRPOTrainer
    cfg = trl_config(os.path.join(where, "trl"), use_vllm=False, vllm_enable_sleep_mode=False, bf16=False,
                     use_cpu=True, per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=4,
                     generation_batch_size=batch, max_completion_length=response_len, beta=beta)
    return GRPOTrainer(model=folder, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                       train_dataset=Dataset.from_list([{"prompt": "1="}] * batch), processing_class=tok)


def speed_report(a):
    """TRL's speed run beside ours (bench_step.py's JSON, every variant) as one table: medians over the steps
    after the first two (TRL: its wall time a step, `_generate`'s share, the rest its train part; ours: the
    step, generate, ref + update), and each row's step against TRL's."""
    import statistics as st
    rows = [r for r in json.load(open(a.trl))["steps"] if "train_runtime" not in r]
    walls = [b["wall_s"] - p["wall_s"] for p, b in zip(rows, rows[1:])][1:]     # steps 3 on
    gens = [r.get("generate_s", float("nan")) for r in rows[2:]]
    trl = {"step": st.median(walls), "generate": st.median(gens)}
    trl["train part"] = st.median(w - g for w, g in zip(walls, gens))
    lines = ["| run | step s | x TRL | generate s | train part s (ours: ref + update) | update peak GB |",
             "|---|---|---|---|---|---|", f"| TRL | {trl['step']:.2f} | 1 | {trl['generate']:.2f} | "
             f"{trl['train part']:.2f} | {max(r.get('peak_allocated_gb', 0) for r in rows):.1f} (the step's) |"]
    for name, run in json.load(open(a.ours))["runs"].items():
        if run["ok"]:
            m = run["metrics"]
            lines.append(f"| ours {name} | {m['time/step']:.2f} | {m['time/step'] / trl['step']:.2f} | "
                         f"{m['time/generate']:.2f} | {m['time/ref_logp'] + m['time/update']:.2f} | "
                         f"{m['mem/update/peak_gb']:.1f} |")
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=("speed", "task", "eval", "report", "reward", "grad", "speed_report"))
    ap.add_argument("folders", nargs="*", help="eval: checkpoint folders, the first one's engine reused")
    ap.add_argument("--size", default="qwen2.5-0.5b")
    ap.add_argument("--tokenizer", default="/tmp/qwen-coder-0.5b", help="speed: a Qwen2.5 tokenizer's folder")
    ap.add_argument("--model", default="", help="task: the model folder; speed: a folder instead of --size")
    ap.add_argument("--train", default="/tmp/gsm8k_train.jsonl")
    ap.add_argument("--val", default="/tmp/gsm8k_val.jsonl")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--mini", type=int, default=16, help="task: prompts an optimizer step")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--response_len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--kl", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="task: the data order (our --data_seed's randperm)")
    ap.add_argument("--sample_seed", type=int, default=-1,
                    help="task: the engine's seed (-1: TRL's, the process index)")
    ap.add_argument("--save_steps", type=int, default=10, help="task: a checkpoint every this many steps")
    ap.add_argument("--limit", type=int, default=0, help="eval: the first this many held-out rows (0: all)")
    ap.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--liger", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3)
    ap.add_argument("--trl", default="", help="report: TRL's task folder (reward: or name=folder,...); "
                    "speed_report: TRL's speed JSON")
    ap.add_argument("--eval", default="", help="report: eval's JSON")
    ap.add_argument("--ours", default="", help="report: our run's out_dir, or name=dir,name=dir (colocated=...,"
                    "async=...); speed_report: bench_step.py's JSON")
    ap.add_argument("--block", type=int, default=5, help="reward: generation steps a mean")
    ap.add_argument("--betas", default="0,0.001,0.04,1", help="grad: the KL coefficients to compare at")
    ap.add_argument("--plot", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_intermixed_args()         # eval's folders may come after the options
    {"speed": speed, "task": task, "eval": evaluate, "report": report, "reward": reward, "grad": grad,
     "speed_report": speed_report}[a.part](a)


if __name__ == "__main__":
    main()
