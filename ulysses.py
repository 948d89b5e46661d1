"""Ulysses sequence parallelism (DeepSpeed-Ulysses, verl's ulysses_sequence_parallel_size): one
packed micro-batch's tokens split over the k ranks of a sequence-parallel group, so that a rank's
activations, and the tokens its LM head sees, go as tokens / k.

    torchrun --nproc_per_node=2 train_grpo.py --actor.ulysses_sequence_parallel_size=2
    python -m pytest -q tests/test_ulysses.py      # k=2 and k=4 equal k=1: log-probs, entropy, grads, values

The groups are k consecutive ranks inside the FSDP world (FSDP still shards over all of it); the
data-parallel size is world / k. All k ranks of a group hold the same samples (each generates its
own share, `gather_batch` then joins them); each runs the decoder on its own 1/k of the packed row:
embeddings, projections, MLP and norms are per token. Attention needs whole sequences, so around it
q, k, v go from [tokens/k, heads, d] to [tokens, heads/k, d] by an all-to-all, attention runs on
full sequences with a slice of the heads, and the output goes back by a second all-to-all (two per
layer, forward; two more in backward). Position ids are the global ones. The LM head (or the
critic's value head) runs on the rank's own response tokens; `gather` joins the slices into the
full response rows on every rank of the group, and its backward keeps the rank's own slice only:
each rank's gradient is its tokens' share of the group's loss, FSDP's sum over the group is the
whole of it. The loss counts each sample once (losses.global_counts divides by k).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

OPTION = "--actor.ulysses_sequence_parallel_size"


@dataclass(frozen=True)
class Group:
    """This rank's sequence-parallel group: k consecutive ranks; `pg` None when k == 1."""
    size: int                              # k
    rank: int                              # this rank's place in the group (its token slice)
    dp_rank: int                           # which group: the data-parallel rank
    dp_size: int                           # world / k: how many groups deal the prompts
    pg: object = None                      # the process group of the all-to-alls and gathers


_GROUPS: dict = {}


def group(k: int) -> Group:
    """This rank's group of size k, made once per k (collective: every rank calls it at the same
    point, which the roles' builds and stages guarantee). k == 1: no group, no communication."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if k == 1:
        return Group(1, 0, rank, world)
    if k not in _GROUPS:
        check(k, world)
        pg, _ = dist.new_subgroups_by_enumeration([list(range(r, r + k)) for r in range(0, world, k)])
        _GROUPS[k] = Group(k, rank % k, rank // k, world // k, pg)
    return _GROUPS[k]


def once(t, k: int):
    """A sum over all ranks counts each sample k times (a group's k ranks hold the same rows): once."""
    return t / k if k > 1 else t


def check(k: int, world: int, config=None):
    """A k that cannot split: one line with what to change (at parse / pre-flight time)."""
    if k < 1 or world % k:
        raise ValueError(f"{OPTION}={k} does not divide the world size {world}; use a divisor of {world}")
    if config is None:
        return
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % k or kv % k:
        raise ValueError(f"{OPTION}={k} does not divide the model's {heads} attention heads and {kv} KV heads "
                         f"(each rank attends with heads / k of them); use a divisor of both")


def sizes(k: int, world: int, heads: int, kv_heads: int, mini_samples: int) -> list[int]:
    """The sizes from k up that can split (--offload=auto's search): divisors of the world and of the
    heads and KV heads that leave a mini-batch's samples divisible over world / size groups."""
    return [j for j in (1, 2, 4, 8) if j >= k and world % j == 0 and heads % j == 0 and kv_heads % j == 0
            and mini_samples % (world // j) == 0]


def describe(k: int, config) -> str:
    """The set-up report's line: what the split moves off each rank, and what it costs."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (f"[ulysses] {OPTION[2:]}={k}: each packed micro-batch's tokens split over {k} ranks "
            f"(data-parallel size {world // k}); per rank: activations and the LM head's tokens / {k}, "
            f"{config.num_attention_heads // k} of {config.num_attention_heads} heads and {kv // k} of {kv} KV "
            f"heads in attention; cost: 2 all-to-alls per layer (4 with backward); params, grads, Adam unchanged")


# --------------------------------------------------------------------------- the token split
def plan(p: dict, g: Group) -> dict:
    """A packing plan (packing.pack's host indices) for this rank's slice of the packed row. The row
    is padded to a multiple of k (the pad tokens are one more sequence in `cu`: they attend to
    themselves only, and nothing reads their output); `src`/`position_ids` become this rank's
    slice (global positions), `cu`/`max_len` stay the whole row's (attention sees full sequences),
    `at` the local positions that predict this rank's response tokens, `own` their range in the N
    response tokens, `counts` each rank's N (what `gather` joins)."""
    T = int(p["src"].numel())
    pad = -T % g.size
    s = (T + pad) // g.size                # tokens per rank
    lo, hi = g.rank * s, (g.rank + 1) * s
    src = torch.cat([p["src"], p["src"][:1].expand(pad)])          # any real id: its output is unread
    pos = torch.cat([p["position_ids"], torch.arange(pad)])
    cu = torch.cat([p["cu"], p["cu"][-1:] + pad]) if pad else p["cu"]
    counts = [int(((p["at"] >= r * s) & (p["at"] < (r + 1) * s)).sum()) for r in range(g.size)]
    first = sum(counts[:g.rank])
    mine = p["at"][first:first + counts[g.rank]]                    # `at` is ascending: a contiguous run
    return {**p, "src": src[lo:hi], "position_ids": pos[lo:hi], "cu": cu, "max_len": max(p["max_len"], pad),
            "at": mine - lo, "own": (first, first + counts[g.rank]), "counts": counts, "group": g}


def own(x: torch.Tensor, p: dict) -> torch.Tensor:
    """The rows of a per-response-token tensor (N, ...) that this rank computes."""
    return x[p["own"][0]:p["own"][1]] if "own" in p else x


def gather(x: torch.Tensor, p: dict) -> torch.Tensor:
    """This rank's (n_r, ...) slice of per-response-token outputs -> the group's (N, ...), in
    response-token order. Backward keeps this rank's slice of the gradient: every rank of the group
    computes the same loss on the gathered rows, so the slice is this rank's tokens' share."""
    return _Gather.apply(x, p["counts"], p["group"]) if "counts" in p else x


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, g):
        ctx.lo, ctx.n = sum(counts[:g.rank]), x.shape[0]
        width = max(max(counts), 1)        # gloo's all_gather wants equal sizes: pad to the largest
        padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, width - x.shape[0]))
        parts = [torch.empty_like(padded) for _ in range(g.size)]     # k x the slice: (N, 2) floats, small
        dist.all_gather(parts, padded.contiguous(), group=g.pg)
        return torch.cat([part[:c] for part, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.lo:ctx.lo + ctx.n], None, None


# --------------------------------------------------------------------------- attention's all-to-alls
def _exchange(x: torch.Tensor, g: Group, to_heads: bool) -> torch.Tensor:
    """to_heads: (T/k, H, D) -> (T, H/k, D); else (T, H/k, D) -> (T/k, H, D). Chunk j of what is
    sent goes to rank j: to_heads sends it head slice j of this rank's tokens, back sends it rank
    j's tokens of this rank's heads. Holds one send and one receive buffer of x's size."""
    k = g.size
    if to_heads:
        s, H, D = x.shape
        send = x.reshape(s, k, H // k, D).transpose(0, 1).contiguous()        # (k, s, H/k, D)
    else:
        send = x.contiguous()                                                 # (k * s, H/k, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=g.pg)
    if to_heads:
        return recv.reshape(k * s, H // k, D)
    T, h, D = x.shape
    return recv.reshape(k, T // k, h, D).transpose(0, 1).reshape(T // k, k * h, D)


class _Exchange(torch.autograd.Function):
    """One all-to-all, tokens -> heads (`to_heads`) or back; its backward is the other direction
    (the adjoint of a permutation is its inverse)."""
    @staticmethod
    def forward(ctx, x, g, to_heads):
        ctx.g, ctx.to_heads = g, to_heads
        return _exchange(x, g, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.g, not ctx.to_heads), None, None


def to_heads(x: torch.Tensor, g: Group) -> torch.Tensor:
    """(T/k, H, D) of this rank's tokens -> (T, H/k, D): every token, this rank's heads."""
    return _Exchange.apply(x, g, True)


def to_tokens(x: torch.Tensor, g: Group) -> torch.Tensor:
    """(T, H/k, D) -> (T/k, H, D): attention's output back to this rank's tokens, all heads."""
    return _Exchange.apply(x, g, False)


# --------------------------------------------------------------------------- the group's batch
def share(items: list, g: Group) -> list:
    """This rank's part of its group's prompts: the k ranks generate 1/k each (no prompt twice)."""
    n = len(items) // g.size
    return items[g.rank * n:(g.rank + 1) * n]


def gather_batch(batch: dict, g: Group) -> dict:
    """Each rank generated its own share; the group's batch is their rows in rank order, on every
    rank of the group. Prompts are left-padded to the widest rank's (responses are all
    response_length wide already). Costs k x the batch's bytes per rank: token ids, not activations."""
    if g.size == 1:
        return batch
    W = batch["input_ids"].shape[1]
    mine = torch.tensor([W], device=batch["input_ids"].device)     # the group's backend's device
    widths = [torch.empty_like(mine) for _ in range(g.size)]
    dist.all_gather(widths, mine, group=g.pg)
    wide = max(int(w) for w in widths)
    out = {}
    for key in sorted(batch):              # the same order on every rank
        v = batch[key]
        if v.dim() == 2 and v.shape[1] == W:   # prompt + response columns: pad the prompt side
            v = F.pad(v, (wide - W, 0))
        parts = [torch.empty_like(v) for _ in range(g.size)]
        dist.all_gather(parts, v.contiguous(), group=g.pg)
        out[key] = torch.cat(parts)
    return out
