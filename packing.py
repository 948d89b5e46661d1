"""Responses through the model in bounded memory: token-budget micro-batches, padding removed, and
the LM head applied to response tokens only, a chunk at a time.

    python -m pytest tests/test_packing.py -q        # packed == padded, chunked == whole, budgets balanced

The memory consumers no offload flag touches, and what this file does to each:
- The (tokens, vocab) logits. At Qwen's 151,936-token vocabulary one fp32 copy for 32 samples x
  320 tokens is 6.2 GB, and log-softmax, entropy and their backward hold several. Here only the
  positions that predict a response token reach the LM head, `chunk` of them at a time: one
  (chunk, vocab) fp32 block exists at once, and backward recomputes it (activation checkpointing
  per chunk) instead of keeping every chunk's logits alive until then.
- Padding. Prompts are left-padded and responses right-padded to the longest in the batch. With
  `pack`, each micro-batch's real tokens go into one row, position ids restart per sequence, and
  attention keeps to each sequence's own tokens: FlashAttention's variable-length kernel on a GPU
  (bf16/fp16); elsewhere (CPU, fp32) attention alone runs on the sequences side by side again.
- One sequence's length. With `sp` > 1 (Ulysses, ulysses.py) each of sp ranks runs 1/sp of the packed
  row: activations and the head's tokens per rank / sp, attention on whole sequences with heads / sp.
- The micro-batch size. A fixed count of samples sizes memory for the longest; `max_tokens` fills
  micro-batches to a token budget instead, balanced across them, the same number on every rank
  (every FSDP forward is a collective), results returned in the original order.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ulysses

ATTENTION = "packed_sdpa"      # the attention implementation the roles' models are switched to


@dataclass(frozen=True)
class Layout:
    """How one role runs its batches (built from its config, where the defaults are)."""
    micro: int                 # samples per micro-batch (when max_tokens is 0)
    max_tokens: int            # token budget per micro-batch (prompt + response); 0: fixed `micro`
    pack: bool                 # remove padding (one packed row per micro-batch)
    chunk: int                 # response tokens per LM-head chunk; 0: all at once
    sp: int = 1                # Ulysses sequence-parallel size: each rank runs 1/sp of a packed row


# --------------------------------------------------------------------------- attention
def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, except for a packed row (`cu_seq_lens_q` given): then each sequence attends only to
    its own earlier tokens. query (1, Hq, T, D), key/value (1, Hkv, T, D) -> (1, T, Hq, D).
    With a Ulysses group (`ulysses`: T is this rank's T/k tokens) q, k, v first trade tokens for
    heads (all-to-all: (T, H/k, D), the whole row), and the output trades back."""
    cu, group = kwargs.get("cu_seq_lens_q"), kwargs.get("ulysses")
    if cu is None:                 # padded batches (HF generate, pack off): transformers' SDPA path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))      # (T, H, D)
    if group is not None:          # k x the tokens, 1/k of the heads: the same bytes per rank
        q, k, v = (ulysses.to_heads(x, group) for x in (q, k, v))
    L = int(kwargs["max_length_q"])    # a host int (packing knows it): no device sync per layer
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # FlashAttention-2's varlen kernel as built into PyTorch (autograd included); GQA natively
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False, scale=scaling)[0]
    else:                          # CPU / fp32: the sequences side by side again, just for attention
        lengths = cu.diff().long()
        col = torch.arange(L, device=q.device)
        valid = col[None, :] < lengths[:, None]                               # (n, L)
        index = (cu[:-1].long()[:, None] + col[None, :]).clamp(max=q.shape[0] - 1)   # (n, L) -> packed row
        mask = valid[:, None, None, :] & (col[:, None] >= col[None, :])       # (n, 1, L, L): causal, no pads
        padded = [x[index].transpose(1, 2) for x in (q, k, v)]               # (n, H, L, D)
        out = F.scaled_dot_product_attention(*padded, attn_mask=mask, scale=scaling, enable_gqa=True)
        out = out.transpose(1, 2)[valid]                                      # (T, H, D), packed order
    if group is not None:
        out = ulysses.to_tokens(out, group)                                   # (T/k, H, D)
    return out[None], None


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch an HF model to this file's attention (SDPA for padded batches, varlen for packed)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = ATTENTION
    return model


# --------------------------------------------------------------------------- packing
def host_lengths(batch: dict) -> dict:
    """The batch with "lengths" (B, 2) on the CPU: each row's real tokens and response tokens.
    One device->host copy per stage, so that packing each micro-batch needs no host sync of its own
    (a sync per micro-batch drains the GPU's queue and leaves it idle while the next one is launched)."""
    if "lengths" not in batch:
        batch = {**batch, "lengths": torch.stack([batch["attention_mask"].sum(-1),
                                                  batch["response_mask"].sum(-1)], 1).cpu()}
    return batch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor to `device` without a synchronization (pinned, non-blocking)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def pack(mb: dict) -> dict:
    """Where everything sits, from the host-side lengths alone. Rows of `mb` are prompt (left-padded
    to P) + response (right-padded to R): row i's real tokens are the contiguous columns
    [P - p_i, P + r_i). Returns `cu` (n+1,) sequence boundaries of the packed row and its longest
    sequence, `src` (T,) where each packed token comes from in the flattened (B, P+R) ids,
    `position_ids` (T,) restarting at 0 per sequence, `at` (N,) the packed positions whose output
    predicts a response token, `dst` (N,) where each response token sits in the flattened (B, R),
    and `j`/`rows` (N,) its column and row (N = valid response tokens, row-major)."""
    B, W = mb["input_ids"].shape
    R = mb["responses"].shape[1]
    n, r = mb["lengths"][:, 0], mb["lengths"][:, 1]
    p = n - r
    if bool((p < 1).any()):
        raise ValueError("a sample has no prompt token: nothing predicts its first response token")
    cu = F.pad(n.cumsum(0), (1, 0))
    tok_rows = torch.repeat_interleave(torch.arange(B), n)
    within = torch.arange(int(n.sum())) - cu[:-1][tok_rows]                 # position in its sequence
    rows = torch.repeat_interleave(torch.arange(B), r)
    j = torch.arange(int(r.sum())) - F.pad(r.cumsum(0), (1, 0))[:-1][rows]  # response column
    return {"cu": cu.to(torch.int32), "max_len": int(n.max()), "src": tok_rows * W + (W - R - p)[tok_rows] + within,
            "position_ids": within, "at": cu[:-1][rows] + p[rows] - 1 + j, "dst": rows * R + j, "j": j, "rows": rows}


def model_inputs(mb: dict, packed: bool, sp: int = 1) -> tuple[dict, torch.Tensor, dict]:
    """The model's forward arguments (the micro-batch packed into one row, or its padded rows as
    they are), `at` (N,): the flat positions of the output that predict the response tokens, and
    the packing's host-side indices. `mb` needs "lengths" (host_lengths). sp > 1 (packed only):
    this rank's 1/sp of the row (ulysses.plan); `at` then covers this rank's response tokens, and
    `ulysses.gather(x, p)` joins what the head computes on them."""
    dev = mb["input_ids"].device
    p = pack(mb)
    if packed and sp > 1:
        p = ulysses.plan(p, ulysses.group(sp))
    if packed:
        ids = mb["input_ids"].reshape(-1).index_select(0, to_device(p["src"], dev))[None]    # (1, T)
        cu = to_device(p["cu"], dev)
        kw = dict(input_ids=ids, position_ids=to_device(p["position_ids"], dev)[None],
                  attention_mask=torch.ones_like(ids),   # no padding: SDPA's mask builder returns no mask
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=p["max_len"], max_length_k=p["max_len"])
        if "group" in p:           # attention's all-to-alls (the kwarg reaches `_attention`)
            kw["ulysses"] = p["group"]
        return kw, to_device(p["at"], dev), p
    W, R = mb["input_ids"].shape[1], mb["responses"].shape[1]
    kw = {k: mb[k] for k in ("input_ids", "attention_mask", "position_ids")}
    return kw, to_device(p["rows"] * W + (W - R - 1) + p["j"], dev), p   # position P-1+j predicts token j


# --------------------------------------------------------------------------- the LM head, chunked
# Bytes per (token, vocab) element of an eager chunk at its peak (model.Shapes.head): the fp32 logits, logsumexp's
# exp, the softmax and its product with them; in backward the recomputed chunk too (the H200, test_plan.py)
HEAD_FORWARD, HEAD_BACKWARD = 12, 20
HEAD = {}                      # the chunk function, when not _head_chunk: kernel_choice.compile_head's


def _head_chunk(h, w, ids, temperature: float, entropy: str):
    """(C, H) hidden states -> (C, 2): log p(ids) and the entropy (zeros if "none"), from one (C, V) fp32 block."""
    logits = (h @ w.t()).float().div_(temperature)                         # (C, V): this chunk only
    lse = logits.logsumexp(-1)
    logp = logits.gather(-1, ids[:, None])[:, 0] - lse
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1) if entropy != "none" else torch.zeros_like(lse)
    return torch.stack([logp, ent], -1)


def head_logprobs(hidden, weight, ids, temperature: float, chunk: int, entropy: str = "none") -> torch.Tensor:
    """log p(ids) and entropy, (N, 2), for hidden (N, H) through the LM head `weight` (V, H).
    With grad, each chunk is checkpointed: backward recomputes its logits (one chunk alive), one
    more head matmul per token. chunk <= 0: all N at once, nothing recomputed.
    N = 0 still runs one (empty) chunk, so the head's weight takes part in backward on every rank."""
    n, fn = ids.numel(), HEAD.get("chunk", _head_chunk)
    if chunk <= 0:                         # one block, kept for backward: fastest, most memory
        return fn(hidden, weight, ids, temperature, entropy)
    out = []
    for s in range(0, max(n, 1), chunk):
        args = (hidden[s:s + chunk], weight, ids[s:s + chunk], temperature, entropy)
        out.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
    return torch.cat(out)


@contextlib.contextmanager
def _head_computes_logprobs(model, pick, targets, temperature: float, chunk: int, entropy: str):
    """Inside this block the model's LM head returns (N, 2) log-probs and entropies of `targets`
    instead of logits, from the hidden states at the flat rows `pick` (N,) of what it is given
    (B, K, H). It runs inside the model's forward, so FSDP2 has the head's weight gathered there
    (and again in backward), as for any layer."""
    head = model.get_output_embeddings()

    def forward(hidden):                   # (B, K, H) -> (N, 2)
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pick)
        return head_logprobs(h, head.weight, targets, temperature, chunk, entropy)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward                   # the class's forward again


def response_logprobs(model, mb: dict, temperature: float, layout: Layout, entropy: str = "none"):
    """(B, R) log-probs of the response tokens and entropies (zero on padding; entropy "none": zeros, "log":
    no graph, "grad"). Only the positions that predict a response token reach the LM head, never (B, T, V).
    `mb` needs "lengths" (host_lengths); nothing here waits for the GPU."""
    mb = host_lengths(mb)
    B, R = mb["responses"].shape
    dev = mb["responses"].device
    kw, at, p = model_inputs(mb, layout.pack, layout.sp)
    dst = to_device(p["dst"], dev)
    targets = ulysses.own(mb["responses"].reshape(-1).index_select(0, dst), p)   # (N,), or this rank's
    if layout.pack:                        # the head sees exactly the N positions (logits_to_keep)
        keep, pick = at, torch.arange(at.numel(), device=dev)
    else:                                  # the head sees each row's last R+1 positions
        keep, pick = R + 1, to_device(p["rows"] * (R + 1) + p["j"], dev)
    with _head_computes_logprobs(model, pick, targets, temperature, layout.chunk, entropy):
        out = model(**kw, logits_to_keep=keep, use_cache=False).logits     # (N, 2)
    out = ulysses.gather(out[:targets.numel()], p)   # an empty micro-batch ran one empty chunk; (N, 2)
    zeros = torch.zeros(B * R, dtype=torch.float32, device=dev)
    return zeros.index_put((dst,), out[:, 0]).view(B, R), zeros.index_put((dst,), out[:, 1]).view(B, R)


# --------------------------------------------------------------------------- micro-batches
def micro_batches(batch: dict, layout: Layout) -> list[torch.Tensor]:
    """Row indices of each micro-batch. Fixed: consecutive slices of `layout.micro` rows.
    Token budget: balanced bins of at most `max_tokens` real tokens each (longest first, each into
    the emptiest bin), as many bins on this rank as on the rank that needs the most (FSDP's
    collectives run once per micro-batch, so every rank must run the same number). A bin may be
    empty on a rank that needs fewer: the caller runs it as a dummy forward."""
    n = batch["responses"].shape[0]
    if layout.max_tokens <= 0:
        return [torch.arange(i, min(i + layout.micro, n)) for i in range(0, n, layout.micro)]
    # what a row costs: its real tokens when packed, the padded width otherwise
    lengths = host_lengths(batch)["lengths"][:, 0].tolist() if layout.pack else [batch["input_ids"].shape[1]] * n
    if max(lengths) > layout.max_tokens:
        per = f" / {layout.sp} (a sequence-parallel group runs {layout.sp} x the budget)" if layout.sp > 1 else ""
        raise ValueError(f"a sample has {max(lengths)} tokens, more than the token budget {layout.max_tokens}; "
                         f"raise the *_max_token_len_per_gpu option to at least that{per}")
    bins = max(1, math.ceil(sum(lengths) / layout.max_tokens))
    while True:                               # the fewest balanced bins that all fit the budget
        groups = _balance(lengths, bins)
        if max(sum(lengths[i] for i in g) for g in groups) <= layout.max_tokens:
            break
        bins += 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([bins], device=batch["responses"].device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t) > bins:
            groups = _balance(lengths, int(t))
    return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]


def _balance(lengths: list, bins: int) -> list[list[int]]:
    """Longest-first greedy: each sample into the bin with the fewest tokens so far."""
    groups, loads = [[] for _ in range(bins)], [0] * bins
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = loads.index(min(loads))
        groups[b].append(i)
        loads[b] += lengths[i]
    return groups


def take(batch: dict, rows: torch.Tensor) -> dict:
    """The micro-batch of these rows; an empty bin becomes a one-row dummy with nothing to learn
    (response_mask zero), so the rank still runs its forward/backward and FSDP's collectives."""
    if rows.numel() == 0:
        mb = {k: v[:1] for k, v in batch.items()}
        mb["response_mask"] = torch.zeros_like(mb["response_mask"])
        mb["attention_mask"] = mb["attention_mask"].clone()
        mb["attention_mask"][:, -mb["response_mask"].shape[1]:] = 0       # the prompt alone
        if "lengths" in mb:                # the prompt alone: no response token to predict
            mb["lengths"] = mb["lengths"].clone()
            mb["lengths"][:, 0] -= mb["lengths"][:, 1]
            mb["lengths"][:, 1] = 0
        return mb
    on = {d: to_device(rows, d) for d in {v.device for v in batch.values()}}   # no sync: pinned, async
    return {k: v.index_select(0, on[v.device]) for k, v in batch.items()}
