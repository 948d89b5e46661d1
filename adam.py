"""AdamW for the roles that train (actor.py, critic.py): its construction, the stash of its state, the clipped
step, and the streamed step that moves the state a window of layers at a time. The frozen roles (ref.py,
reward_model.py) hold no optimizer and never import this file; the moves themselves are offload.py's.

    python -m pytest -q tests/test_stream.py        # streamed == whole step, bit for bit; resume from the host
    python -m pytest -q test_memory.py -k stream    # on a GPU: the step reserves a few windows, not all of Adam

Adam's two moments (exp_avg, exp_avg_sq: 2 x the fp32 shards of what trains) are born at the first step, on the
params' device. Their stash (`optimizer_stash`) starts empty and takes them in right after the step that made
them (`take_state`); from then on offload.py moves them as any stash. With optimizer_stream the step itself moves
them (`streamed_step`): the update never holds all of Adam, only about three windows of it (with
optimizer_row_windows the embeddings and an untied head step in row slices no larger than a layers' window, `Rows`,
so a layers' window is the largest). A trained role's
checkpoint brings its params and Adam in (`holding`); a streamed role's Adam is read and written where it lives, in
its host mirrors (`on_host`, `HostSave`, `HostLoad`). The update's predicted moments: `update_phases`.
"""
import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import offload


def build_optimizer(model, cfg) -> torch.optim.Optimizer:
    """AdamW for the actor or the critic (`cfg` has lr and weight_decay), over the parameters that
    train (with LoRA: the adapters only). Adam state (2 x fp32 shard bytes of those) appears at the
    first step, on the params' device. fused: one kernel per step and no temporaries; the default
    foreach path allocates several param-sized lists in the step (at 7B those tens of GB did not fit
    beside params + grads + Adam on one H200)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay, fused=True)


# --------------------------------------------------------------------------- the state's stash
@dataclass
class Filling:
    """What an optimizer stash knows of the state it takes in after it is made (its `source`)."""
    optimizer: torch.optim.Optimizer
    slots: dict = field(default_factory=dict)   # id(param) -> the indices of its state's storages in the stash
    spare: list = field(default_factory=list)   # a streamed first step: host views not yet taken


def optimizer_stash(name: str, optimizer: torch.optim.Optimizer, enabled: bool = True) -> offload.Stash:
    """Adam's exp_avg / exp_avg_sq. Adam creates them at its first step, so the stash starts empty
    (every move a no-op) and takes the state in right after that step (`take_state`).
    The 0-d `step` counters (on the device with fused AdamW, 4 bytes each) stay where they are."""
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
    return take_state(offload.Stash(name, enabled, device=device, source=Filling(optimizer)))


def take_state(stash: offload.Stash, params=None) -> offload.Stash:
    """An optimizer stash takes in the state of `params` (None: every param, once the state exists), each
    param's tensors at indices remembered in `slots` (a streamed step moves a window's). A param stash, or
    one that holds its state already: unchanged."""
    if stash.source is None or (params is None and stash.views):
        return stash
    for p, st in stash.source.optimizer.state.items():
        if (params is None or any(p is q for q in params)) and id(p) not in stash.source.slots:
            before = len(stash.storages)
            offload.add(stash, [offload.local(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0])
            stash.source.slots[id(p)] = list(range(before, len(stash.storages)))
    return stash


# --------------------------------------------------------------------------- the step
def clipped_step(model, optimizer, grad_clip: float, adam: offload.Stash | None, metrics: dict,
                 who: str, windows: list | None = None) -> float:
    """Clip the global grad norm and step; a non-finite norm skips the step (weights kept, the
    gradients dropped by the caller's next zero_grad). `adam`: the optimizer state's stash (a no-op
    when its flag keeps it on the device); `windows`: step it a window at a time from the host
    (optimizer_stream: `streamed_step`). Returns the norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    if math.isfinite(norm) and windows:
        metrics.update(streamed_step(optimizer, adam, windows))
    elif math.isfinite(norm):
        if adam is not None:               # Adam state: wait for its side-stream copy (or copy it in now)
            metrics.update(offload.ready(adam))
        optimizer.step()
        if adam is not None:
            take_state(adam)               # the first step made the state: from now on the stash moves it
    elif not dist.is_initialized() or dist.get_rank() == 0:   # the norm is global: one rank says it
        print(f"[{who}] grad norm {norm} is not finite: optimizer step skipped")
    return norm


def optimizer_windows(model, optimizer, layers: int, rows: bool = False) -> list[list]:
    """The streamed step's windows (`streamed_step`): the optimizer's params by decoder layer, `layers`
    layers at a time, and each param outside the layers in a window of its own: the first of those (the
    embeddings) before the layers, the rest (the final norm, the LM head, a value head) after them, so the
    two largest windows are never side by side (the step holds about three neighbours at once). `rows`
    (optimizer_row_windows): a 2-D param larger than the largest layers' window steps in row slices no larger
    than it (`Rows`), so that window sets the step's peak, not the embeddings' (4.06 GB of Adam at 7B)."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    blocks = getattr(getattr(model, "model", None), "layers", [])   # a bare value head has none
    windows = [[p for b in blocks[i:i + layers] for p in b.parameters() if id(p) in ids]
               for i in range(0, len(blocks), layers)]
    inside = {id(p) for w in windows for p in w}
    rest = [[p] for g in optimizer.param_groups for p in g["params"] if id(p) not in inside]
    cap = max((sum(offload.local(p).numel() for p in w) for w in windows), default=0)
    if rows and cap:
        rest = [_rows(w[0], cap) for w in rest]
    return rest[:1] + [w for w in windows if w] + rest[1:]


class Rows(list):
    """A window of one 2-D param stepped in row slices of its local shard (`bounds`: [start, stop) rows along
    dim 0), each slice's moments in, stepped and out before the next: AdamW is elementwise, so the numbers are
    the whole tensor's (the step count is the param's, the same for every slice)."""

    def __init__(self, params: list, bounds: list):
        super().__init__(params)
        self.bounds = bounds


def row_slices(rows: int, row: int, cap: int) -> list:
    """[start, stop) row ranges of a `rows` x `row` tensor, each at most `cap` elements (at least one row)."""
    per = max(1, cap // max(row, 1))
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


def _rows(p, cap: int) -> list:
    """[p], or a Rows window of it when its local shard is 2-D and larger than `cap` elements."""
    t = offload.local(p)
    if t.dim() != 2 or t.numel() <= cap:
        return [p]
    return Rows([p], row_slices(t.shape[0], t.shape[1], cap))


def window_sizes(windows: list) -> list:
    """Each stepping unit's local elements, in order: a window's params, or a Rows window's slices."""
    return [n for w in windows for n in ([(b - a) * offload.local(w[0]).shape[1] for a, b in w.bounds]
                                         if isinstance(w, Rows) else [sum(offload.local(p).numel() for p in w)])]


def window_peak(sizes: list) -> int:
    """The most of a streamed step's windows (`sizes`, in their order) on the device at once: one coming
    in, one stepping, one going out."""
    return max(sum(sizes[max(k - 1, 0):k + 2]) for k in range(len(sizes))) if sizes else 0


# --------------------------------------------------------------------------- Adam stepped a window at a time
_in_stream = _out_stream = None


def streamed_step(optimizer, stash: offload.Stash, windows: list) -> dict:
    """optimizer.step() a window of params (`optimizer_windows`) at a time, Adam's state on the host before
    and after (optimizer_stream): a window's state comes in on one side stream while the one before goes out
    on another, freed behind that copy, so the device holds about three windows' state, not 8 bytes a param.
    The same fused AdamW on the same tensors: bit-exact with one optimizer.step(). A window's host copy is
    overwritten only after it stepped. The first step makes the state (AdamW's lazy init) window by window."""
    global _in_stream, _out_stream
    t0, cuda = time.perf_counter(), stash.device.type == "cuda"
    if cuda:
        _in_stream = _in_stream or torch.cuda.Stream(stash.device)
        _out_stream = _out_stream or torch.cuda.Stream(stash.device)
    _room(stash, windows)
    peak, pending, out = 0, _window_in(stash, windows[0], cuda), None
    for k, w in enumerate(windows):
        if pending is not None:
            torch.cuda.current_stream(stash.device).wait_event(pending)
        if isinstance(w, Rows):            # a slice at a time (optimizer_row_windows): never its whole state
            peak = max(peak, _rows_step(optimizer, stash, w))
        else:
            with _only(optimizer, w):
                optimizer.step()
        if stash.source.spare:             # the first step: take in the state it just made
            _host_room(stash, w)
        if out is not None:     # a freed window's blocks wait for its copy out (unwaited, 7B reserved 121 GB)
            out.synchronize()
        pending = _window_in(stash, windows[k + 1], cuda) if k + 1 < len(windows) else None   # beside this one's out
        peak = max(peak, sum(st.nbytes() for st in stash.storages))   # this window and the next
        out = _window_out(stash, w, cuda)
    if cuda:
        _out_stream.synchronize()          # every window's host bytes are complete
    stash.on_device, stash.host_current = False, True
    gb, s = stash.nbytes / offload.GB, time.perf_counter() - t0
    return {f"offload/{stash.name}/stream_gb": 2 * gb, f"offload/{stash.name}/stream_s": s,
            f"offload/{stash.name}/stream_gbps": 2 * gb * offload.GB / 1e9 / max(s, 1e-9),
            f"offload/{stash.name}/stream_window_peak_gb": peak / offload.GB}


def _room(stash: offload.Stash, windows: list):
    """Before Adam's state exists: one pinned host room for both moments of every param, carved as it appears."""
    if not stash.host:
        sizes = [offload.local(p).numel() * offload.local(p).element_size() for w in windows for p in w]
        stash.source.spare = offload.host_buffers(stash, [n for n in sizes for _ in range(2)])   # both moments


def born_on_host(optimizer, stash: offload.Stash, windows: list):
    """A fresh optimizer's state made a window at a time and sent to the host: a streamed role's checkpoint or
    resume never holds all of Adam. Each param's state is what torch's zero-grad step at lr 0 makes, laid out
    from one such step on its group's smallest param: a window holds its moments, no grads (a whole state's
    zero grads and moments did not fit beside the 7B policy)."""
    if optimizer.state or not windows:
        return
    _room(stash, windows)
    lrs, made = [g["lr"] for g in optimizer.param_groups], {}
    for g in optimizer.param_groups:
        g["lr"] = 0.0                      # a step that makes the state and leaves the weights
        for q in [min(g["params"], key=lambda p: p.numel())] if g["params"] else []:
            q.grad = torch.zeros_like(q)
            with _only(optimizer, [q]):
                optimizer.step()
            q.grad, st = None, optimizer.state.pop(q)
            made.update({id(p): st for p in g["params"]})
    for w in windows:
        if isinstance(w, Rows):            # its moments never whole on the device: zeros on the host
            _hollow_state(optimizer, stash, w[0], made[id(w[0])])
            continue
        for q in w:                        # the moments zeros like the param, the step as made
            optimizer.state[q] = {k: (torch.zeros_like(q) if v.dim() else v.clone()) if torch.is_tensor(v) else v
                                  for k, v in made[id(q)].items()}
        _host_room(stash, w)
        for i in _indices(stash, w):
            stash.host[i].copy_(stash.views[i])
            stash.storages[i].resize_(0)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    stash.on_device, stash.host_current = False, True


def _host_room(stash: offload.Stash, window: list):
    """The state AdamW just made for `window` joins the stash, each tensor with the next host view carved."""
    take_state(stash, window)
    while len(stash.host) < len(stash.storages):
        n = stash.views[len(stash.host)].numel()
        if not stash.source.spare or stash.source.spare[0].numel() != n:
            raise RuntimeError(f"{stash.name}: the optimizer's state does not have its params' sizes (a state "
                               f"tensor of {n} bytes); the streamed step knows AdamW's two moments only")
        stash.host.append(stash.source.spare.pop(0))


def _indices(stash: offload.Stash, window: list) -> list:
    """A window's storages in the stash (none for a Rows window: `_rows_step` moves its slices itself)."""
    return [] if isinstance(window, Rows) else [i for p in window for i in stash.source.slots.get(id(p), [])]


# --------------------------------------------------------------------------- a large param stepped in row slices
def _rows_step(optimizer, stash: offload.Stash, w: Rows) -> int:
    """optimizer.step() over a Rows window's param a row slice at a time: each slice's moments copied in from
    the host mirrors, stepped as a param of its own (the param's group, a copy of its step count), copied back
    out; then the param's step count is the slices' (each made the same +1). Returns the most bytes of Adam on
    the device meanwhile (the stash's storages and one slice's moments)."""
    p, peak = w[0], 0
    if p.grad is None:                     # optimizer.step() skips a param without a grad: so do its slices
        return 0
    if p not in optimizer.state:           # the first step: AdamW's fresh state, its moments zeros on the host
        _hollow_state(optimizer, stash, p, _fresh(optimizer, p))
    state, idx = optimizer.state[p], stash.source.slots[id(p)]
    keys = [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
    t, g = offload.local(p).detach(), offload.local(p.grad)
    for a, b in w.bounds:
        host = [_host_rows(stash.host[i], offload.local(state[k]), a, b) for k, i in zip(keys, idx)]
        moments = {k: torch.empty_like(h, device=t.device).copy_(h, non_blocking=True) for k, h in zip(keys, host)}
        v = t[a:b]                         # a view: the step writes the param's rows in place
        v.grad = g[a:b]
        optimizer.state[v] = {k: moments[k] if k in moments else x.clone() if torch.is_tensor(x) else x
                              for k, x in state.items()}
        with _only(optimizer, [p], stand_in=v):
            optimizer.step()
        done = optimizer.state.pop(v)
        peak = max(peak, sum(st.nbytes() for st in stash.storages) + sum(m.nbytes for m in moments.values()))
        for k, h in zip(keys, host):
            h.copy_(done[k])               # blocking: the host rows are complete before the slice's memory is reused
        v.grad = None
    for k, x in state.items():             # every slice's count: the param's +1
        if torch.is_tensor(x) and k not in keys:
            x.copy_(done[k])
    return peak


def _host_rows(host: torch.Tensor, like: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of a state tensor shaped `like` (contiguous) inside its uint8 host mirror."""
    row = like.stride(0) * like.element_size()
    return host[a * row:b * row].view(like.dtype).view(b - a, *like.shape[1:])


def _fresh(optimizer, p) -> dict:
    """What AdamW's first step makes for `p` (its lazy init): a zero step count and moments like `p`."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    on = group.get("fused") or group.get("capturable")   # AdamW keeps the count on the param's device then
    step = torch.zeros((), dtype=_scalar_dtype(on), device=p.device if on else "cpu")
    return {"step": step, "exp_avg": p, "exp_avg_sq": p, **({"max_exp_avg_sq": p} if group.get("amsgrad") else {})}


def _scalar_dtype(fused) -> torch.dtype:
    from torch.optim.optimizer import _get_scalar_dtype   # torch's own choice of the count's dtype
    return _get_scalar_dtype(is_fused=bool(fused))


def _hollow_state(optimizer, stash: offload.Stash, p, made: dict):
    """`p`'s Adam state as `made` (the step count copied, each moment like `p`) whose moments have empty device
    storages, in the stash with the next host views carved, zeroed: a Rows window's state, never whole on the
    device (the embeddings' 4.06 GB at 7B)."""
    optimizer.state[p] = {k: (_hollow(p) if v.dim() else v.clone()) if torch.is_tensor(v) else v
                          for k, v in made.items()}
    before = len(stash.storages)
    for v in optimizer.state[p].values():
        if torch.is_tensor(v) and v.dim():
            loc = offload.local(v)
            st = loc.untyped_storage()
            stash.storages.append(st)
            stash.views.append(torch.empty(0, dtype=torch.uint8, device=loc.device).set_(st, 0, (loc.nbytes,), (1,)))
            st.resize_(0)                  # (set_ sized it to fit)
    stash.source.slots[id(p)] = list(range(before, len(stash.storages)))
    _host_room(stash, [])
    for i in stash.source.slots[id(p)]:
        stash.host[i].zero_()


def _hollow(p) -> torch.Tensor:
    """A tensor like `p` (a DTensor like it, its local shard's shape) over an emptied storage: no device bytes.
    torch sizes a storage to fit any shape set on it, so its bytes exist for a moment, in the caching
    allocator's pool after (a streamed step's next windows reuse them; the whole-state step held them for good)."""
    t = offload.local(p)
    e = torch.empty(0, dtype=t.dtype, device=t.device).set_(torch.UntypedStorage(0, device=t.device), 0,
                                                             t.shape, t.stride())
    e.untyped_storage().resize_(0)
    if not hasattr(p, "to_local"):
        return e
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(e, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _window_in(stash: offload.Stash, window: list, cuda: bool):
    """A window's state back into its device storages (on the side stream on CUDA: returns its event)."""
    idx = _indices(stash, window)
    for i in idx:                          # allocated on the current stream, written on the side one after it
        stash.storages[i].resize_(stash.host[i].numel())
    if not cuda:
        for i in idx:
            stash.views[i].copy_(stash.host[i])
        return None
    _in_stream.wait_stream(torch.cuda.current_stream(stash.device))
    with torch.cuda.stream(_in_stream):
        for i in idx:
            stash.views[i].copy_(stash.host[i], non_blocking=True)
    return _in_stream.record_event()


def _window_out(stash: offload.Stash, window: list, cuda: bool):
    """A stepped window's state out to its host mirrors, freed behind the copy (record_stream: reused once the
    side stream read them); the copy's event on CUDA."""
    idx, done = _indices(stash, window), None
    if cuda:
        _out_stream.wait_stream(torch.cuda.current_stream(stash.device))
        with torch.cuda.stream(_out_stream):
            for i in idx:
                stash.host[i].copy_(stash.views[i], non_blocking=True)
        done = _out_stream.record_event()
        for i in idx:
            stash.views[i].record_stream(_out_stream)
    else:
        for i in idx:
            stash.host[i].copy_(stash.views[i])
    for i in idx:
        stash.storages[i].resize_(0)
    return done


@contextlib.contextmanager
def _only(optimizer, params: list, stand_in=None):
    """The optimizer's param groups cut to `params` for one step (every group's other settings kept);
    `stand_in`: stepped in their place (a row slice of the one param: `_rows_step`)."""
    ids, kept = {id(p) for p in params}, [g["params"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["params"] = [p if stand_in is None else stand_in for p in g["params"] if id(p) in ids]
    try:
        yield
    finally:
        for g, ps in zip(optimizer.param_groups, kept):
            g["params"] = ps


# --------------------------------------------------------------------------- a trained role's checkpoint
@contextlib.contextmanager
def holding(stashes, loading: bool):
    """A checkpoint's bracket: every stash on the device while the state-dict helpers read (a save) or write
    (a load) the live tensors, then back where it was, copied out only after a load. A stash still empty at
    a load (Adam's state, born by it) goes out after it with what the body put in (`take_state`)."""
    out = [s for s in stashes if not s.on_device or (loading and not s.views)]
    for s in stashes:
        offload.ready(s)                  # host -> device (or a side-stream copy waited for)
    yield
    for s in out:                         # frees them again (a state born in the body joins its stash first)
        offload.offload(take_state(s), modified=loading)


def on_host(stash: offload.Stash) -> dict:
    """{storage key: host mirror} of a stash on the host: where a checkpoint reads and writes it (checkpoint.py)."""
    return {} if not stash.enabled or stash.on_device or not stash.host else \
        {st._cdata: h for st, h in zip(stash.storages, stash.host)}


class HostSave(DefaultSavePlanner):
    """DCP's save, with what a stash keeps on the host (a streamed role's Adam: `host`, `on_host`)
    written from its host mirror: its device storage is empty, and Adam never comes in whole."""

    def __init__(self, host: dict):
        super().__init__()
        self.host = host

    def lookup_object(self, index):
        return _mirror(super().lookup_object(index), self.host)

    def resolve_data(self, write_item):
        """A device tensor copied to pageable host memory as the writer reaches it. DCP's own staging copies it
        non_blocking into pinned blocks that its host cache keeps (at 7B the params' 30 GB beside 73 GB of pinned
        mirrors: the kernel killed the run at its first checkpoint)."""
        t = super().resolve_data(write_item)
        return t.detach().cpu() if torch.is_tensor(t) and t.device.type == "cuda" else t


class HostLoad(DefaultLoadPlanner):
    """DCP's load, into the host mirrors of what a stash keeps on the host (as HostSave)."""

    def __init__(self, host: dict):
        super().__init__()
        self.host = host

    def lookup_tensor(self, index):
        return _mirror(super().lookup_tensor(index), self.host)


def _mirror(t, host: dict):
    """`t` itself, or, when its storage lives on the host (`host`: storage key -> uint8 mirror), the same
    tensor over the mirror's bytes."""
    h = host.get(t.untyped_storage()._cdata) if host and torch.is_tensor(t) else None
    if h is None:
        return t
    h = h.view(t.dtype)                   # a view into the stash's one host arena: offsets count from the arena's start
    return h.as_strided(t.shape, t.stride(), h.storage_offset() + t.storage_offset())


# --------------------------------------------------------------------------- an update's predicted moments
def update_phases(held: dict, grads: dict, busy: dict, accumulating: bool, at_step: dict | None = None) -> list:
    """An update's moments, each {term: bytes}: the sharded grads exist from the first backward until
    the step frees them, so a micro-batch's transients (`busy`: activations, the head's chunk, the
    gathered layers) meet them only when an earlier micro-batch of the step left them (accumulation).
    With one micro-batch per step: its head backward (no grads yet), the end of its backward (every
    grad, a layer and the root still gathered), and the step itself (`at_step`: Adam just come in)."""
    phases = [{**held, **grads, **busy}] if accumulating else \
        [{**held, **busy}, {**held, **grads, "gathered layers + root": busy["gathered layers + root"]}]
    return phases + ([at_step] if at_step else [])
