"""Generation engines behind one function: `generate(engine, ...) -> batch`.

    python train_grpo.py --rollout.engine=hf      # HF generate on the FSDP actor (CPU, tests)

The HF engine gathers the actor's FSDP2 shards once for the whole generate call (one all-gather
per layer, not one per decoded token), samples, and frees the gathered weights again:
transient memory is the full model in the compute dtype while it runs.
"""
import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule


@dataclass
class RolloutConfig:
    engine: str = "auto"                   # hf | auto (auto picks hf until vLLM is available)
    n: int = 8                             # samples per prompt (the GRPO group size)
    response_length: int = 4               # max new tokens; responses are right-padded to this
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                         # 0: off


def resolve_engine(cfg: RolloutConfig, device: torch.device) -> str:
    if cfg.engine not in ("hf", "auto"):
        raise SystemExit(f"error: --rollout.engine={cfg.engine}: use hf or auto")
    return "hf"


# --------------------------------------------------------------------------- batch layout
def make_batch(prompts: list[list[int]], responses: list[list[int]], R: int, pad_id: int,
               eos_id: int, device) -> dict:
    """Left-pad prompts to the longest (P), right-pad responses to R; the response mask keeps
    tokens up to and including the first EOS. Position ids count only real tokens, so a
    left-padded row sees the same positions as it would alone."""
    P = max(len(p) for p in prompts)
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        r = list(r[:R])
        if eos_id in r:
            r = r[:r.index(eos_id) + 1]            # drop whatever follows the first EOS
        ids[i, P - len(p):P] = torch.tensor(p)
        attn[i, P - len(p):P] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r)
            attn[i, P:P + len(r)] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    batch = {"input_ids": ids, "attention_mask": attn, "position_ids": pos,
             "responses": ids[:, P:].clone(), "response_mask": attn[:, P:].clone()}
    return {k: v.to(device) for k, v in batch.items()}


# --------------------------------------------------------------------------- HF engine
@contextlib.contextmanager
def gathered(model):
    """All-gather every FSDP2 unit once and keep it gathered until the block ends."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()                              # frees the gathered copies
            m.set_reshard_after_forward(True, recurse=False)


@torch.no_grad()
def generate_hf(model, prompts: list[list[int]], cfg: RolloutConfig, pad_id: int, eos_id: int,
                device, seed: int) -> dict:
    """Each prompt n times in a row (a group per prompt), sampled with HF generate."""
    rows = [p for p in prompts for _ in range(cfg.n)]
    P = max(len(p) for p in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, P - len(p):] = torch.tensor(p)
        attn[i, P - len(p):] = 1
    torch.manual_seed(seed)                          # per rank and step: reproducible samples
    model.eval()
    with gathered(model):
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=True,
                             max_new_tokens=cfg.response_length, temperature=cfg.temperature,
                             top_p=cfg.top_p, top_k=cfg.top_k or None, pad_token_id=pad_id,
                             eos_token_id=eos_id)
    responses = out[:, P:].tolist()
    return make_batch(rows, responses, cfg.response_length, pad_id, eos_id, device)


def generate(engine: str, model, prompts, cfg: RolloutConfig, pad_id, eos_id, device, seed) -> dict:
    return generate_hf(model, prompts, cfg, pad_id, eos_id, device, seed)
