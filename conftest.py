"""What the tests share (test_memory.py here and every file in tests/): one process group for the whole
pytest session (torchrun's, several ranks, or a 1-process one), the one way a test starts a process
(`start`, `run`: train_grpo.py, plan.py or a test file's torchrun workers, paths from the repo root), a
run's metrics, the tiny batches and models."""
import glob
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import actor
from model import make_layout
from launch import init_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
# A launcher's variables say "you are a rank of a job": a plain `python` child that inherits RANK
# runs init_process_group(env://) and fails on the missing MASTER_ADDR. pytest under torchrun has
# them, and so does this process once vLLM was built in it (rollout.build_vllm's setdefault of RANK
# and LOCAL_RANK: test_vllm's async run failed so); torchrun sets its own for the workers it starts.
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
# the environment pytest started with, read before any test module (or the code a test runs) wrote
# into os.environ: what a started process gets, whatever ran before it in this pytest process
START_ENV = {k: v for k, v in os.environ.items() if k not in LAUNCHER and not k.startswith("TORCHELASTIC_")}
_started: list = []                # every process `start` made, stopped at the end of its test if still running


@pytest.fixture(scope="session")
def dist_env():
    """(rank, world, device) with the default process group initialised."""
    return init_distributed()


@pytest.fixture
def clean_gpu():
    """Models of earlier tests sit in reference cycles until collected: a GPU test whose figures are
    device-level starts empty (the GPU modules use it for every test)."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def tiny_batch(B: int, R: int, device, seed: int = 0, vocab: int = 16) -> dict:
    """A random rollout batch with prompts and responses of varied lengths (some end in EOS)."""
    import rollout
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    responses = [torch.randint(1, vocab, (int(torch.randint(1, R + 1, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(B)]
    batch = rollout.make_batch(prompts, responses, R, pad_id=0, eos_id=1, device=device)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(B, 1, generator=g).to(device) * mask
    batch["old_log_probs"] = (-torch.rand(B, R, generator=g) * 3).to(device) * mask
    batch["ref_log_probs"] = (-torch.rand(B, R, generator=g) * 3).to(device) * mask
    return batch


def mid_model(seed: int = 0):
    """The GPU tests' ~430M-parameter Qwen2 (random weights, built in code): large enough that
    allocator rounding stays far below their 5 % tolerances."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
                      architectures=["Qwen2ForCausalLM"])
    return Qwen2ForCausalLM(cfg)


def layout(micro: int, **actor_cfg):
    """How the default actor config runs a batch, with `micro` samples per micro-batch
    (ActorConfig fields such as remove_padding or use_dynamic_bsz overridable)."""
    import actor
    cfg = actor.ActorConfig(**actor_cfg)
    return make_layout(cfg, micro, cfg.log_prob_max_token_len_per_gpu)


# a test that starts its own processes (python or torchrun) runs once, not once per rank of a torchrun
launches = pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", 1)) > 1,
                              reason="launches its own processes: run it without torchrun")


# --------------------------------------------------------------------------- processes a test starts
def command(args, nproc: int = 0, script: str | None = "train_grpo.py", torchrun=("--standalone",)) -> list[str]:
    """`python <script> args`, or with nproc > 0 `torchrun <torchrun> --nproc_per_node=<nproc> <script> args`
    (`torchrun`: its other flags, e.g. a c10d rendezvous or --max-restarts); script None: args alone
    (["-c", code])."""
    head = [sys.executable, "-m", "torch.distributed.run", *torchrun, f"--nproc_per_node={nproc}"] if nproc \
        else [sys.executable]
    return head + ([os.path.join(HERE, script)] if script else []) + [str(a) for a in args]


def child_env(gpu: bool = False, env: dict | None = None) -> dict:
    """START_ENV with the repo root first on PYTHONPATH (a test file in tests/ started as a torchrun worker
    imports the root's modules), then on the CPU unless `gpu` (gloo; one OpenMP thread per process: 2 ranks
    on 2 cores would otherwise oversubscribe), then `env` (extra variables)."""
    path = {"PYTHONPATH": os.pathsep.join(p for p in (HERE, START_ENV.get("PYTHONPATH")) if p)}
    cpu = {} if gpu else {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return {**START_ENV, **path, **cpu, **(env or {})}


def start(args, nproc: int = 0, *, script: str | None = "train_grpo.py", torchrun=("--standalone",), gpu=False,
          env: dict | None = None, log=None, cwd=HERE, **popen) -> subprocess.Popen:
    """The one way a test starts a process: `command(...)` in the repo root (or `cwd`) with
    `child_env(gpu, env)`, in the background. `log`: an open file for stdout and stderr together (a
    pipe nobody reads would fill and block the run); else `popen` (stdout=subprocess.PIPE, ...)."""
    if log is not None:
        popen.update(stdout=log, stderr=subprocess.STDOUT)
    p = subprocess.Popen(command(args, nproc, script, torchrun), env=child_env(gpu, env), cwd=cwd, **popen)
    _started.append(p)
    return p


def run(args, nproc: int = 0, *, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    """`start(args, nproc, **kw)` to its end, stdout and stderr captured as text. Its limit is the
    test's (pytest.ini's timeout or the test's @pytest.mark.timeout), or `timeout` seconds; past it
    the whole job is killed, torchrun's workers with it, and the error raised."""
    p = start(args, nproc, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:
        stop(p)
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun's workers run in sessions of their own: a group kill misses them)."""
    kids = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:                    # the thread or process is gone
            pass
    return [d for k in kids for d in (k, *descendants(k))]


def stop(p: subprocess.Popen):
    """SIGKILL p and everything below it, then reap p."""
    for pid in descendants(p.pid) + [p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


@pytest.fixture(autouse=True)
def _no_process_left():
    """A test that fails (or times out) while its run is in the background leaves no run behind to
    take the CPU from the tests after it."""
    yield
    while _started:
        p = _started.pop()
        if p.poll() is None:
            stop(p)


def metrics(out, every_line: bool = False) -> list[dict]:
    """A run's <out>/metrics.jsonl, one dict a training step; `every_line`: with the line of the validation
    after the last step (step = --steps, validate.py), which holds no training figures."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows if every_line else [r for r in rows if "optimizer_steps" in r]
