"""HF generate on the FSDP2 actor: the engine without vLLM (CPU runs, tests, the async engine's stand-in).
rollout.generate calls it with --rollout.engine=hf, inside the bracket that brings the actor's offloaded params in.

    python train_grpo.py --rollout.engine=hf               # every step's samples from here
    python -m pytest -q tests/test_shape.py -k rollout     # rollout.py's copy set, HF generate on the tiny model

Memory: `gathered` all-gathers every FSDP2 unit once for the whole call (one all-gather per layer, not one per
decoded token) and frees the gathered weights after it: the whole model in the compute dtype on each rank for the
call's length, beside generate's own KV cache and logits (rollout.predicted_generate counts them). A LoRA actor
generates with its adapter on (its target layers hold it).
"""
import contextlib

import torch
from torch.distributed.fsdp import FSDPModule


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
def sample_hf(model, prompts: list[list[int]], cfg, pad_id: int, eos_id: int, device, seed: int, *,
              logprobs: bool = False) -> tuple[list, list, list | None]:
    """(rows, responses, their sampled tokens' log-probs or None): each prompt n times in a row, sampled as
    `cfg` says (a rollout.RolloutConfig: n, response_length, temperature, top_p, top_k).
    `logprobs`: the processed distribution's (after temperature, top-k, top-p, as vLLM's
    processed_logprobs), from the scores generate keeps: (rows x vocab) fp32 per token, so only
    where the model is small (the async engine's HF stand-in)."""
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
        sample = cfg.temperature > 0                 # temperature 0: greedy
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=sample,
                             max_new_tokens=cfg.response_length, temperature=cfg.temperature if sample else None,
                             top_p=cfg.top_p if sample else None, top_k=(cfg.top_k or None) if sample else None,
                             pad_token_id=pad_id, eos_token_id=eos_id, output_scores=logprobs,
                             return_dict_in_generate=True)
    responses = out.sequences[:, P:]
    if not logprobs:
        return rows, responses.tolist(), None
    steps = torch.stack(out.scores, 1).float().log_softmax(-1)            # (rows, tokens, vocab)
    lp = steps.gather(-1, responses[:, :steps.shape[1], None]).squeeze(-1)
    return rows, responses.tolist(), lp.nan_to_num(0.0, neginf=0.0).tolist()


def greedy(model, prompts: list[list[int]], cfg, pad_id: int, eos_id: int, device, chunk: int) -> list[list[int]]:
    """Validation's answers (`cfg`: rollout.greedy_config's), `chunk` prompts a generate call: every rank makes the
    same number of calls (each gathers the actor's shards), each call no larger than a training step's."""
    responses = []
    for i in range(0, len(prompts), chunk):
        responses += sample_hf(model, prompts[i:i + chunk], cfg, pad_id, eos_id, device, 0)[1]
    return responses


def cut(responses: list[list[int]], eos_id: int) -> list[list[int]]:
    """Each response up to and including its first EOS (HF generate pads what follows; vLLM stops there)."""
    return [r[:r.index(eos_id) + 1] if eos_id in r else r for r in responses]
