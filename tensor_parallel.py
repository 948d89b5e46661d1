"""Tensor-parallel vLLM engines inside the torchrun world (rollout.py): with
rollout.tensor_parallel_size=k one engine spans k consecutive ranks (vLLM's layout), and every rank
of an engine must send it the same requests (vLLM's contract for its external launcher), so the ranks
pool their prompts and seeds and each keeps its own rows. Host-side only: a few pickled id lists.

    torchrun --nproc_per_node=2 train_grpo.py --rollout.engine=vllm --rollout.tensor_parallel_size=2
"""
import torch.distributed as dist


def tp_group(tp: int):
    """The gloo group of the ranks that share this rank's engine: [g*tp, (g+1)*tp), how vLLM lays out
    its tensor-parallel groups (TP innermost). Gloo because what it carries is a few pickled id
    lists, host to host. Collective: every rank calls it. None for tp == 1 (an engine per rank)."""
    if tp == 1:
        return None
    world = dist.get_world_size()
    group, _ = dist.new_subgroups_by_enumeration([list(range(r, r + tp)) for r in range(0, world, tp)],
                                                 backend="gloo")
    return group


def gather(group, obj) -> tuple[list, int]:
    """`obj` from every rank of the engine's group, in rank order, and this rank's place in it
    ([obj], 0 when the engine is this rank's alone)."""
    if group is None:
        return [obj], 0
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out, dist.get_rank(group)


def requests(parts: list, n: int, greedy: bool) -> tuple[list, list, list]:
    """What one engine is asked, the same on each of its ranks: `parts` = (prompts, seed) of each
    rank in rank order. Each prompt n times: as n requests of one sample when greedy (vLLM samples
    greedily only with n=1), else one request of n. Request i of a rank is seeded from that rank's
    seed alone (seed * 10007 + i * n): its samples do not depend on which ranks share the engine.
    Returns the prompt ids, seed and owner (index in `parts`) of each request."""
    copies = n if greedy else 1
    reqs, seeds, owners = [], [], []
    for k, (prompts, seed) in enumerate(parts):
        mine = [p for p in prompts for _ in range(copies)]
        reqs += mine
        seeds += [seed * 10007 + i * n for i in range(len(mine))]
        owners += [k] * len(mine)
    return reqs, seeds, owners
