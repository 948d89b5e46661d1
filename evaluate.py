"""Evaluation: any model folder's greedy answers to held-out prompts, scored as a run's validation scores them.

    python evaluate.py --model=out/final --val_data=gsm8k_val.jsonl \
        --instruction='Let'"'"'s think step by step and output the final answer after "####".' --out=eval.jsonl
    python evaluate.py --model=out/final                        # the embedded run's: the built-in task's 100 held-out
    python evaluate.py --model=out/checkpoints/step_000020      # a checkpoint: its run's model, these weights
    python evaluate.py --model=random:qwen2.5-0.5b              # random weights; no --model: the embedded default
    torchrun --nproc_per_node=8 evaluate.py --model=/models/Qwen2.5-0.5B-Instruct --val_data=gsm8k_val.jsonl
    python -m pytest -q tests/test_evaluate.py

It takes train_grpo.py's options (a run's own command line works, `--out` added) and runs the run's own code:
the held-out prompts as the run builds them (data.held_out_data: --val_data, --instruction appended, the chat
template, --val_max_prompts), the policy as the actor builds it (actor.build, from the folder), the engine the
run would build (trainer.build_engine: vLLM where it is installed and a GPU is there, else HF generate; for a run's
folder in the run's batch shape, engine_shape), and
validation's greedy answers of at most --val_response_length tokens, scored (validate.held_out). So a run's
final/ scores what the run's last validation scored, to the last digit on the CPU (tests/test_evaluate.py).
The reward: --reward, else the built-in one the held-out data's form picks (data.held_out_reward_data: GSM8K's
rule, both forms reported, for a file whose answers are numbers; the copy task's for the built-in task).
Memory: the actor's params (fp32 shards, as in a run; --actor.param_offload=true keeps them on the host but
for the weight sync) and the engine's. Every held-out answer goes to --out, one JSON line each, as the run's
val_samples.jsonl writes them; the metrics (val/*, as metrics.jsonl names them) are printed, last as one JSON line.
"""
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist

import actor
import checkpoint
import data as data_io
import kernel_choice
import launch
import options
import trainer
import validate
from checks import check_model
from model import build_mesh, hf_config, is_dir


@dataclass
class EvalConfig:
    out: str = "eval.jsonl"                # every held-out answer, one JSON line each (val_samples.jsonl's fields)


USAGE = ("usage: python evaluate.py --model=<a model folder, a run's final/, a checkpoint's step_N/, random:<size>; "
         "none: the embedded default> [--val_data=held_out.jsonl] [--out=eval.jsonl] [train_grpo.py's options: "
         "--instruction, --val_max_prompts, --val_response_length, --reward, --gsm8k_format, ...]: the folder's "
         "greedy answers to the held-out prompts, scored as a run's validation scores them")
# the options that shape the held-out answers and their score: a folder's run that set them otherwise is told
SHAPING = ("val_data", "instruction", "prompt_key", "answer_key", "max_prompt_length", "val_max_prompts",
           "val_response_length", "reward", "gsm8k_format")


def parse(argv: list[str]) -> tuple[options.Config, EvalConfig]:
    """evaluate.py's own options (EvalConfig's), then train_grpo.py's, parsed and checked as a run parses them."""
    ours = {f"--{f.name}" for f in fields(EvalConfig)}
    mine, rest, args = [], [], list(argv)
    while args:
        arg = args.pop(0)
        key = arg.partition("=")[0]
        if key in ours:
            mine += [arg] if "=" in arg or not args else [arg, args.pop(0)]
        else:
            rest.append(arg)
    return options.parse_args(rest), options.apply(mine, EvalConfig())


def resolve(cfg: options.Config) -> tuple[options.Config, str | None, int, dict]:
    """(the config the policy is built by, the checkpoint to load into it or None, the updates its weights have had,
    the config of the run that wrote the folder or {}). A checkpoint (step_N/: meta.json) is its run's --model with
    its run's actor settings (LoRA and all), then its weights; a run's final/ says its steps in run_config.json."""
    path = cfg.model
    if is_dir(path) and os.path.isfile(os.path.join(path, "meta.json")):
        meta = checkpoint.read_meta(path)
        run = meta.get("config") or {}
        saved = run.get("actor", {})
        known = {f.name: saved[f.name] for f in fields(actor.ActorConfig) if f.name in saved}
        run = {**run, "world_size": meta.get("world_size"), "engine_prompt_len": meta.get("engine_prompt_len")}
        return replace(cfg, model=run.get("model"), actor=actor.ActorConfig(**known)), path, meta["step"], run
    run = {}
    if is_dir(path) and os.path.isfile(os.path.join(path, "run_config.json")):   # a run's final/
        try:
            with open(os.path.join(path, "run_config.json")) as f:
                run = json.load(f)
        except (OSError, ValueError):      # only the step count and the notes read it: without them
            run = {}
    run = run if isinstance(run, dict) else {}
    return cfg, None, int(run.get("steps_done", 0)), run


def engine_shape(cfg: options.Config, run: dict, prompt_len: int, world: int) -> tuple[options.Config, int, list]:
    """(cfg with the run's batch, the prompt length to build the engine for, a note): the engine of the run that
    wrote the folder, as its validation had it (its prompts a call, --train_batch_size x --rollout.n, and its longest
    prompt, training's or held-out): greedy bf16 answers differ in a few problems between engines of other batch
    shapes. Without a run (a base model), or one that recorded no prompt length, the command's own."""
    if not run.get("engine_prompt_len"):
        return cfg, prompt_len, []
    n = run.get("rollout", {}).get("n", cfg.rollout.n)
    cfg = replace(cfg, train_batch_size=run.get("train_batch_size", cfg.train_batch_size),
                  rollout=replace(cfg.rollout, n=n))
    note = [] if run.get("world_size") in (None, world) else [
        f"[eval] note: the run had {run['world_size']} rank(s), this evaluation {world}: each rank's engine holds "
        f"another share of the batch, and greedy answers can differ in a few problems from the run's validation"]
    return cfg, max(prompt_len, run["engine_prompt_len"]), note


def differs(cfg: options.Config, run: dict, folder: str) -> list[str]:
    """The held-out-shaping options that `folder`'s run set otherwise: its validation and this evaluation differ
    there."""
    if not run:                            # a base model, or none: no run's validation to differ from
        return []
    length = run.get("val_response_length") or run.get("rollout", {}).get("response_length")
    flat = {**run, "val_response_length": length}
    here = {**asdict(cfg), "val_response_length": validate.response_length(cfg)}
    changed = [f"--{k}={flat[k]!r} (here {here[k]!r})" for k in SHAPING if k in flat and flat[k] != here[k]]
    return [f"[eval] note: the run that wrote {folder} validated with {', '.join(changed)}: its validation and "
            f"this evaluation answer other prompts or score them otherwise"] if changed else []


def writable(out: str):
    """--out can be written, said before anything is built (a file made to check it is removed again: a run that
    stops later leaves no empty answers file behind)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        existed = os.path.exists(out)
        with open(out, "a"):
            pass
        if not existed:
            os.remove(out)
    except OSError as e:
        raise OSError(f"--out {out}: cannot write it ({e.strerror}); name a file in a writable folder") from None


def evaluate(cfg: options.Config, out: str) -> dict:
    """Score the policy in cfg.model on the held-out prompts: its metrics (val/*, summed over ranks); rank 0 writes
    every answer to `out` and prints the metrics."""
    rank, world, device = launch.init_distributed(cfg.dist_timeout_s)
    folder = cfg.model
    cfg, ckpt, step, run = resolve(replace(cfg, rollout=replace(cfg.rollout, mode="colocated")))   # no engine ranks
    check_model(cfg.model, cfg.rollout.response_length)
    if rank == 0:
        writable(out)
    tokenizer = data_io.load_tokenizer(cfg.model)
    val = data_io.held_out_data(cfg, tokenizer)
    if val is None:
        raise ValueError("--data without --val_data: nothing is held out to evaluate on; give held-out prompts with "
                         "--val_data (with neither, the built-in task's 100 held-out items)")
    scored_as = data_io.held_out_reward_data(cfg, val[1])
    reward_fn = data_io.load_reward(cfg.reward, scored_as, cfg.gsm8k_format)
    torch.manual_seed(cfg.seed)            # the embedded default and random:<size>: the run's starting weights
    used, _ = kernel_choice.use(cfg.kernels, device, hf_config(cfg.model).model_type, cfg.head_kernel,
                                cfg.actor.logits_chunk_tokens)   # the run's kernels: its numbers
    a = actor.build(cfg.actor, mesh=build_mesh(device, world, cfg.fsdp_size), device=device, model_path=cfg.model,
                    seed=cfg.seed)
    kernel_choice.compile_layers([a.model], used)
    if ckpt is not None:                   # DCP reshards to this world size
        checkpoint.load(ckpt, trainer.trained(a, None), {**run, "resume": ckpt}, world)
    cfg, prompt_len, notes = engine_shape(cfg, run, max(map(len, val[0])), world)
    with tempfile.TemporaryDirectory() as tmp:   # vLLM's config.json of a built-in or random model
        engine = trainer.build_engine(replace(cfg, out_dir=tmp), a, tokenizer, prompt_len, world, device, rank)
        m, samples = validate.held_out(engine, None, a.model, actor.policy_stashes(a), val, cfg=cfg,
                                       reward_fn=reward_fn, tokenizer=tokenizer, warned=set(), device=device,
                                       rank=rank, world=world)
    every = [samples]
    if world > 1:                          # rank 0 writes them all, in the held-out order (share's parts)
        every = [None] * world
        dist.all_gather_object(every, samples)
    if rank == 0:
        report(cfg, folder, step, engine.kind, run, m, data_io.reward_name(cfg.reward, scored_as, cfg.gsm8k_format),
               notes=notes)
        with open(out, "w") as f:
            f.writelines(json.dumps({"step": step, **s}) + "\n" for part in every for s in part)
        print(f"[eval] every answer in {out}", flush=True)
        print(json.dumps({"model": folder, "step": step, **m}), flush=True)
    return m


def report(cfg: options.Config, folder: str | None, step: int, kind: str, run: dict, m: dict, reward: str, *,
           notes: list):
    """What was evaluated and how, what it scored (val/*, as the run's validation line), and the answer forms."""
    where = f"{folder or 'the embedded default'}" + (f" (after {step} updates)" if step else "")
    engine = {"vllm": "vLLM", "hf": "HF generate"}[kind]
    lines = differs(cfg, run, folder) + notes + validate.not_held_out(cfg)
    lines.append(f"[eval] {where}: {m['val/prompts']:.0f} held-out prompts of {cfg.val_data or 'the built-in task'}, "
                 f"greedy through {engine}, at most {validate.response_length(cfg)} tokens; scored by {reward}")
    if "val/strict" in m:
        lines.append(validate.first_line(m, reward, lead="scored by"))
    lines.append(f"evaluation of {where} | " + " | ".join(f"{k}={v:.4g}" for k, v in m.items() if k.startswith("val/")))
    print("\n".join(lines), flush=True)


def main(argv=None):
    """The command line: --help, the options, the evaluation, and every failure as one `error:` line."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    if "--help" in argv or "-h" in argv:
        if rank == 0:                      # once under torchrun
            print(USAGE)
        return
    try:
        cfg, ecfg = parse(argv)
        evaluate(cfg, ecfg.out)
    except (ValueError, OSError) as e:     # bad input: what to change
        launch.fail(f"error: {e}", rank)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:                # launch.fail()'s one line
        launch.leave(e.code if isinstance(e.code, int) else 1)
    launch.leave(0)
