"""What the planner searches and what fits: the space (each role's flags, SEARCH, and sizes, SIZES, with their
kinds), copies of a config with some options changed (`with_options`), where a plan must fit (`Target`: the GPUs,
the margin, the host), every candidate (`candidates`), and the fastest that fits (`choose`). Async rollout: the
engine's GPU must fit too (`engine_fits`). plan.py says the result (the report, --offload=auto, what would fit);
this file names no role's flag but the reserve's levers (RESERVE_LEVERS), and moves nothing.

    python plan.py --model=random:qwen2.5-7b --nproc=8 --gpu_gb=80    # the fastest that fits, by `choose`
    python -m pytest -q tests/test_plan.py -k "choose or fits or search"
"""
import itertools
from dataclasses import dataclass
from operator import attrgetter

import actor
import critic
import ref
import reward_model
import rollout
import ulysses
from predict import GB, CUDA_CONTEXT, VLLM_RESIDENT, Plan, predict, shapes


def roles(cfg) -> list:
    """(section, module) of the roles this run builds that declare flags the search may turn."""
    return [("actor", actor)] + ([("ref", ref)] if ref.needed(cfg.actor) else []) + \
        ([("critic", critic)] if cfg.algorithm.adv_estimator == "gae" and cfg.critic.mode == "separate" else []) + \
        ([("reward_model", reward_model)] if cfg.reward_model.path else [])


def search(cfg) -> dict:
    """"section.flag" -> its values, cheapest first: every role's SEARCH, in the roles' order."""
    return {f"{name}.{flag}": v for name, mod in roles(cfg) for flag, v in mod.SEARCH.items()}


SIZE_KINDS = ("update", "forward", "tensor", "sequence")   # the kinds of size the roles declare (SIZES), in the
                                                           # order the search varies them and `changes` writes them


def sizes() -> dict:
    """"section.option" -> its kind: the sizes the roles declare beside SEARCH (actor, ref, rollout: SIZES), by kind."""
    declared = {f"{name}.{key}": kind for name, mod in (("actor", actor), ("ref", ref), ("rollout", rollout))
                for key, kind in mod.SIZES.items()}
    return dict(sorted(declared.items(), key=lambda item: SIZE_KINDS.index(item[1])))


def _needless(cfg, flags: dict) -> bool:
    """A flag on whose partner (its role's NEEDS) is off, or on beside one that supersedes it (SUPERSEDES):
    it would change nothing."""
    needs = {f"{n}.{k}": f"{n}.{v}" for n, mod in roles(cfg) for k, v in getattr(mod, "NEEDS", {}).items()}
    over = {f"{n}.{k}": f"{n}.{v}" for n, mod in roles(cfg) for k, v in getattr(mod, "SUPERSEDES", {}).items()}
    return any(flags[k] and not flags[need] for k, need in needs.items()) or \
        any(flags.get(k) and flags.get(v) for k, v in over.items())


# What lowers the allocator's reserve or the update's peak without moving a byte of what a step holds between
# stages: expandable segments for the trainer once the engine is built (the update's slack,
# predict.EXPANDABLE_UPDATE_SLACK) and, with Adam streamed, the embeddings' and the head's Adam in slices no larger
# than a window of layers (the step's peak, where it is the update's). Tried where nothing else keeps the margin
# (plan.py): neither was timed against the step beside its absence, so the search does not trade them for speed.
RESERVE_LEVERS = {"expandable_segments": True, "actor.optimizer_row_windows": True}


def choose_levers(cfg, t, least_memory: bool = False):
    """`choose` with RESERVE_LEVERS on; row windows kept only where the choice streams Adam (elsewhere they act on
    nothing, and the plan is the same)."""
    best, p = choose(with_options(cfg, RESERVE_LEVERS), t, least_memory)
    if best is not None and not best.actor.optimizer_stream:
        best = with_options(best, {"actor.optimizer_row_windows": cfg.actor.optimizer_row_windows})
    return best, p


def with_options(cfg, changes: dict):
    """A copy of `cfg` with {"section.option" or "option": value} set (what it changes copied, the rest
    shared; field by field: the search makes thousands, dataclasses.replace would run each __init__)."""
    out, copied = _copy(cfg), {}
    for key, v in changes.items():
        section, _, name = key.rpartition(".")
        if not section:
            setattr(out, name, v)
            continue
        if section not in copied:
            copied[section] = _copy(getattr(cfg, section))
            setattr(out, section, copied[section])
        setattr(copied[section], name, v)
    return out


def _copy(obj):
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


@dataclass(frozen=True)
class Target:
    """Where a plan must fit: `world` ranks, prompts up to `prompt_len` tokens, `gpu_bytes` per GPU
    of which `margin` stays free at the device level, the rollout `engine`, and the pinned host
    memory one rank may use (`host_bytes`; 0: not checked)."""
    world: int
    prompt_len: int
    gpu_bytes: int
    margin: float = 0.1
    engine: str = "vllm"
    host_bytes: int = 0

    @property
    def budget(self) -> int:                   # what PyTorch may allocate on one GPU, colocated
        return self.room(VLLM_RESIDENT if self.engine == "vllm" else 0)

    def room(self, beside: int) -> int:
        """The GPU less the margin, the CUDA context and `beside` (plan.beside: a sleeping vLLM's, or an
        async engine's on rank 0's GPU): what PyTorch may allocate."""
        return int(self.gpu_bytes * (1 - self.margin) - CUDA_CONTEXT - beside)

    def says(self, beside: int) -> str:      # what the margin bounds, in GB (2^30 bytes) as every figure here
        top, room = self.gpu_bytes * (1 - self.margin) / GB, self.room(beside) / GB
        return (f"the {self.gpu_bytes / GB:.0f} GB GPU with its {self.margin:.0%} margin (device level at most "
                f"{top:.1f} GB, the allocator's peak at most {room:.1f} GB)")

    def fits(self, p: Plan) -> bool:
        """Every stage under the allocator budget, the device level keeps the margin (an async
        engine's GPU too), the pinned host mirrors and the rollout buffer fit the host."""
        if self.host_bytes and p.pinned_host + p.buffer_host > 0.9 * self.host_bytes:
            return False
        top = self.gpu_bytes * (1 - self.margin)
        return (max([s.total for s in p.stages] + [p.checkpoint]) <= self.room(p.beside) and p.device_peak <= top
                and sum(p.engine_device.values()) <= top)


def sequence_parallel_sizes(cfg, world: int) -> list[int]:
    """The Ulysses sizes the search may take (ulysses.sizes); none but the given one unpacked (it splits packed
    rows)."""
    s, a = shapes(cfg.model), cfg.actor
    k = a.ulysses_sequence_parallel_size
    if not a.remove_padding:
        return [k]
    return ulysses.sizes(k, world, s.heads, s.kv_heads, a.ppo_mini_batch_size * cfg.rollout.n)


def candidates(cfg, world: int, frugal: bool = False):
    """Every combination of the roles' SEARCH, of halved micro-batch sizes, of vLLM tensor-parallel sizes that
    divide the world and of Ulysses sizes (`sequence_parallel_sizes`), as copies of `cfg`. `frugal`: only those
    that could fit where no other does: every flag at its last value (each takes bytes off, puts none on) and the
    smallest log-prob micro-batch; the update's micro-batch, tensor and sequence parallelism are not monotone."""
    space = search(cfg)
    flag_values = [v[-1:] if frugal else v for v in space.values()]
    if frugal:                                 # a flag superseded by one at its last value: at its first (needless on)
        over = {f"{n}.{v}" for n, mod in roles(cfg) for k, v in getattr(mod, "SUPERSEDES", {}).items()
                if space.get(f"{n}.{k}", (False,))[-1]}
        flag_values = [v[:1] if key in over else fv for (key, v), fv in zip(space.items(), flag_values)]
    axes = size_axes(cfg, world, frugal)
    for values, *picked in itertools.product(itertools.product(*flag_values), *(v for _, v in axes)):
        flags = dict(zip(space, values))
        if _needless(cfg, flags):
            continue
        picks = {k: v if most is None else min(most, v)   # a forward's micro-batch at most its own
                 for (keys, _), v in zip(axes, picked) for k, most in keys.items()}
        yield with_options(cfg, {**flags, **picks})


def size_axes(cfg, world: int, frugal: bool) -> list:
    """The size search's axes in SIZE_KINDS' order, each ({option: the most it may take, or None}, its values):
    each update micro-batch halved; one log-prob micro-batch for every role's forward (each at most its own);
    vLLM's tensor-parallel sizes that divide the world (its weights and KV heads over tp GPUs; async: an engine
    a GPU); the Ulysses sizes (each micro-batch's tokens over sp GPUs). `frugal`: the smallest forward only."""
    def halvings(m):
        return sorted({x for x in (m, m // 2, m // 4, m // 8, 1) if x >= 1}, reverse=True)
    tps = [1] if cfg.rollout.mode == "async" else \
        [t for t in (1, 2, 4, 8) if world % t == 0 and t >= cfg.rollout.tensor_parallel_size]
    values = {"update": lambda key: halvings(attrgetter(key)(cfg)), "tensor": lambda key: tps,
              "sequence": lambda key: sequence_parallel_sizes(cfg, world)}
    axes, declared = [], sizes()
    for kind in SIZE_KINDS:
        keys = [k for k, v in declared.items() if v == kind]
        if kind == "forward" and keys:         # one axis: every role's forward at one size
            lp = halvings(max(attrgetter(k)(cfg) for k in keys))
            axes.append(({k: attrgetter(k)(cfg) for k in keys}, lp[-1:] if frugal else lp))
        elif kind != "forward":
            axes += [({k: None}, values[kind](k)) for k in keys]
    return axes


def engine_fits(cfg, t: Target):
    """Async: the engine's GPU keeps the margin, or a ValueError naming its parts and what to change (they
    follow the batch, the lengths and rollout.gpus)."""
    top, k = t.gpu_bytes * (1 - t.margin), cfg.rollout.gpus

    def need(gpus):                            # one engine GPU's bytes by part with `gpus` engines
        return predict(with_options(cfg, {"rollout.gpus": gpus}), t.world, t.prompt_len, t.engine).engine_device
    parts = need(k)
    if sum(parts.values()) <= top:
        return
    more = next((g for g in range(k + 1, 65) if cfg.train_batch_size % g == 0 and sum(need(g).values()) <= top),
                None)                          # each holds 1/g of the prompts (an even split)
    where = f"each of the {k} rollout GPUs" if k > 1 else "its rollout GPU" if k else "rank 0's GPU beside the trainer"
    raise ValueError(f"the rollout engine needs {sum(parts.values()) / GB:.1f} GB on {where} ("
                     + ", ".join(f"{name} {v / GB:.1f} GB" for name, v in parts.items())
                     + f") but {top / GB:.1f} GB of {t.gpu_bytes / GB:.0f} GB keeps the {t.margin:.0%} margin; give it "
                     f"fewer prompts per step (--train_batch_size), a shorter --rollout.response_length"
                     + (f", or more rollout GPUs (--rollout.gpus={more} fits)" if more else
                        " (more rollout GPUs would not fit it: its weights and workspace are too large)"))


def choose(cfg, t: Target, least_memory: bool = False):
    """(the fastest configuration that fits `t`, its Plan), or (None, None); of equals, the smallest
    Ulysses size, then the fewest changes. `least_memory`: the one with the lowest device level instead.
    Async rollout: a ValueError first when the engine's GPU cannot fit (`engine_fits`)."""
    if cfg.rollout.mode == "async":
        engine_fits(cfg, t)
    best, key = None, None
    for c in candidates(cfg, t.world):
        p = predict(c, t.world, t.prompt_len, t.engine)
        if t.fits(p):
            # of equal predicted times the smaller Ulysses size (the plan does not time its all-to-alls),
            # then the fewest changes (counted only for a tie: the search tries thousands)
            k = (round(p.seconds, 2), c.actor.ulysses_sequence_parallel_size)
            k = (p.device_peak,) + k if least_memory else k
            if best is None or k < key[:-1] or (k == key[:-1] and len(changes(cfg, c)) < key[-1]):
                best, key = (c, p), k + (len(changes(cfg, c)),)
    return best or (None, None)


def fits_at_all(cfg, t: Target) -> bool:
    """Whether any frugal candidate (`candidates`) fits `t`: what `what_would_fit` asks of each change."""
    try:
        if cfg.rollout.mode == "async":
            engine_fits(cfg, t)
    except ValueError:                         # the engine's GPU does not fit
        return False
    return any(t.fits(predict(c, t.world, t.prompt_len, t.engine)) for c in candidates(cfg, t.world, frugal=True))


def changes(before, after) -> list[str]:
    """The options `after` sets differently from `before`, as command-line flags."""
    out = []
    for key in list(search(before)) + list(RESERVE_LEVERS) + list(sizes()):
        v0, v1 = attrgetter(key)(before), attrgetter(key)(after)
        if v0 != v1:
            out.append(f"--{key}={str(v1).lower() if isinstance(v1, bool) else v1}")
    return out
