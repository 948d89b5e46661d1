"""Every host<->device move (the memory ledger that measures them is ledger.py).

    python -m pytest tests/test_dist.py test_memory.py        # round trips (CPU) and freed bytes (GPU)

Manual offload (the default mode) works on storages, not on modules: each FSDP2 parameter's local shard
(and each Adam state tensor) lives in one untyped storage. Offload copies it into a pinned host buffer
allocated once (exact size) and reused every step, then resizes the device storage to 0 bytes, which
returns it to the caching allocator at once, whoever holds a view of it. Reload resizes it back and copies
the bytes in. The Parameter and DTensor objects never change: FSDP2, the optimizer and autograd see the
same tensors. Why not `model.cpu()`: pageable memory and new host tensors each time (slower, host RSS
creeps), and a live `state_dict()` result keeps the GPU shard alive.
"""
import contextlib
import mmap
import time
import weakref
from dataclasses import dataclass, field

import torch

GB = 1024 ** 3


# --------------------------------------------------------------------------- the stash
@dataclass
class Stash:
    """The device storages of one offloadable group and their pinned host mirrors."""
    name: str
    enabled: bool = True                   # its offload flag is on: it lives on the host between uses. Off:
                                           # every move is a no-op, so each bracket reads the same either way
    storages: list = field(default_factory=list, repr=False)  # torch.UntypedStorage on the device
    views: list = field(default_factory=list, repr=False)     # (nbytes,) uint8 view of each storage
    host: list = field(default_factory=list, repr=False)      # (nbytes,) uint8 host mirrors, pinned on CUDA
    on_device: bool = True
    host_current: bool = False             # the host buffers hold the same bytes as the device
    pending: object = None                 # CUDA event of a background reload not yet waited for
    frozen: bool = False                   # never written after build (a LoRA base): once on the host, the
                                           # host copy stays current, so no bracket copies it out again
    marks: list = field(default_factory=list, repr=False)  # CUDA events: reload issued, use reached, wait done
    device: torch.device | None = None     # where its storages live (a stash filled later: where they will)
    source: object = None                  # what fills it later: Adam's state, born at its first step (adam.Filling)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() for v in self.views)


def add(stash: Stash, tensors) -> Stash:
    seen = {s.data_ptr() for s in stash.storages}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:   # tied weights share one storage
            continue
        seen.add(st.data_ptr())
        view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        stash.storages.append(st)
        stash.views.append(view)
        stash.device = stash.device or t.device
    return stash


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t   # DTensor -> this rank's shard


def param_stash(name: str, *modules: torch.nn.Module, trainable: bool | None = None, enabled: bool = True) -> Stash:
    """Each parameter's local FSDP2 shard (padding included: it shares the shard's storage).
    `trainable`: None takes every parameter; True only those that train; False only the frozen
    ones, and the stash is marked `frozen` (a LoRA actor's base). `enabled`: its offload flag."""
    params = [p for m in modules for p in m.parameters() if trainable is None or p.requires_grad == trainable]
    return add(Stash(name, enabled, frozen=trainable is False), [local(p) for p in params])


def host_buffers(stash: Stash, sizes: list | None = None) -> list:
    """One exact-size host allocation for the whole stash, carved into a view per storage (or per
    one of `sizes`, bytes: a streamed first step carves as Adam's state appears) and, on CUDA,
    page-locked once with cudaHostRegister. Not torch.empty(pin_memory=True) per tensor: torch's
    pinned allocator rounds every buffer up to a power of two, which at Qwen2.5-7B shapes pins 189 GB
    of host RAM for 99 GB of shards + Adam + ref (+90 %)."""
    sizes = sizes or [v.numel() for v in stash.views]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + -(-n // 512) * 512)          # each view 512-byte aligned
    # an anonymous mapping: page-aligned pages of its own (no neighbour can have registered them), and
    # the tensor's storage starts where the registration does, which is what is_pinned() looks at
    arena = torch.frombuffer(mmap.mmap(-1, max(offsets[-1], 1)), dtype=torch.uint8)
    cuda = stash.device.type == "cuda"
    if cuda:
        cudart = torch.cuda.cudart()
        register = getattr(cudart, "cudaHostRegister", None)
        err = int(register(arena.data_ptr(), arena.numel(), 0)) if register else -1
        if err:     # keep going at full speed on torch's pinned allocator, at its rounded size
            print(f"[offload] warning: cudaHostRegister of {arena.numel() / GB:.2f} GB failed (cudaError "
                  f"{err}); {stash.name} falls back to torch's pinned allocator (sizes rounded up to 2^k)")
            try:    # the failed call left CUDA's last-error set: let one checked launch read and clear it
                torch.zeros(1, device=stash.device).add_(1)
            except RuntimeError:
                pass
            return [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
        unpin = weakref.finalize(stash, cudart.cudaHostUnregister, arena.data_ptr())  # before the unmap
        unpin.atexit = False             # at exit the process's memory goes anyway; CUDA may be gone
    return [arena[o:o + n] for o, n in zip(offsets, sizes)]


def offload(stash: Stash, modified: bool = True) -> dict:
    """Device -> pinned host, then free the device storages (`stash.nbytes`). `modified=False` (a forward-only
    bracket) skips the copy when the host already holds these bytes: only the free remains. A frozen stash
    is never modified (after its first offload, a free); one whose flag is off stays where it is."""
    if not stash.enabled or not stash.on_device or not stash.views:
        return {}
    _wait(stash, marked=False)
    t0 = time.perf_counter()
    if not stash.host:      # first offload: host buffers, allocated once and reused every step
        stash.host = host_buffers(stash)
    copy = (modified and not stash.frozen) or not stash.host_current
    if copy:
        for view, host in zip(stash.views, stash.host):
            host.copy_(view, non_blocking=True)
        if stash.device.type == "cuda":
            torch.cuda.synchronize(stash.device)   # one synchronize per bracket: host bytes are complete
    for st in stash.storages:
        st.resize_(0)                     # returns the block to the caching allocator now
    stash.on_device, stash.host_current = False, True
    return {**_moved(stash, "offload" if copy else "drop", time.perf_counter() - t0), **_overlap(stash)}


_copy_stream = None


def reload(stash: Stash, background: bool = False) -> dict:
    """Pinned host -> device into the same storages, so every view (Parameter, DTensor) is valid again.
    `background=True` (CUDA): the copies run on a side stream and this returns at once; `ready(stash)`
    makes the current stream wait for them (a GPU-side wait) before the tensors are used."""
    global _copy_stream
    if stash.on_device or not stash.views:
        return {}
    t0, device = time.perf_counter(), stash.views[0].device
    for st, host in zip(stash.storages, stash.host):
        st.resize_(host.numel())          # allocated on the current stream, like every other tensor
    if background and device.type == "cuda":
        stash.marks = [_event()]          # GPU clock: the copy is issued (the update starts)
        _copy_stream = _copy_stream or torch.cuda.Stream(device)
        _copy_stream.wait_stream(torch.cuda.current_stream(device))   # the memory is free to write now
        with torch.cuda.stream(_copy_stream):
            for view, host in zip(stash.views, stash.host):
                view.copy_(host, non_blocking=True)
        stash.pending = _copy_stream.record_event()
    else:
        for view, host in zip(stash.views, stash.host):
            view.copy_(host, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    stash.on_device = True
    if background:                        # issued only (on CUDA): the host's time is the allocations
        return {f"offload/{stash.name}/prefetch_gb": stash.nbytes / GB,
                f"offload/{stash.name}/prefetch_issue_s": time.perf_counter() - t0}
    return _moved(stash, "reload", time.perf_counter() - t0)


def ready(stash: Stash) -> dict:
    """Make the stash's tensors usable on the current stream, right where they are needed: wait for a background
    reload (a GPU-side wait; the host does not block), or copy in now. A no-op for a stash already in."""
    if stash.pending is not None:
        _wait(stash, marked=True)
        return {}
    return reload(stash)


def _wait(stash: Stash, marked: bool):
    if stash.pending is None:
        return
    if marked:
        stash.marks.append(_event())      # GPU clock: the work before the wait (forward/backward) is queued
    torch.cuda.current_stream(stash.views[0].device).wait_event(stash.pending)
    if marked:
        stash.marks.append(_event())      # ... and the copy has landed
    stash.pending = None


def _event():
    """A timing event recorded now on the current CUDA stream."""
    (e := torch.cuda.Event(enable_timing=True)).record()
    return e


def _overlap(stash: Stash) -> dict:
    """Did the background reload hide behind the work before its wait? (After a synchronize.)"""
    if len(stash.marks) != 3:
        return {}
    issued, reached, landed = stash.marks
    stash.marks = []
    return {f"offload/{stash.name}/forward_backward_gpu_s": issued.elapsed_time(reached) / 1e3,
            f"offload/{stash.name}/step_waited_s": reached.elapsed_time(landed) / 1e3}


def _moved(stash: Stash, verb: str, seconds: float) -> dict:
    if verb == "drop":                    # freed without a copy: only the time to free
        return {f"offload/{stash.name}/drop_s": seconds}
    gb = stash.nbytes / GB
    return {f"offload/{stash.name}/{verb}_gb": gb, f"offload/{stash.name}/{verb}_s": seconds,
            f"offload/{stash.name}/{verb}_gbps": gb * GB / 1e9 / max(seconds, 1e-9)}


@contextlib.contextmanager
def loaded(stashes, metrics: dict, modified: bool = False, keep: bool = False):
    """The bracket: reload every enabled stash (one already in, e.g. prefetched: its pending copy waited
    for), run the body, offload them again; a stash whose flag is off stays (a no-op). `modified`: the body
    changes them (the update), so they are copied back out (a frozen stash's are not). `keep`: leave them on
    the device; the next bracket's offload copies them out (if modified)."""
    for s in stashes:
        metrics.update(reload(s))
        _wait(s, marked=False)
    yield
    for s in stashes:
        if keep:
            s.host_current = s.host_current and not (modified and not s.frozen)
        else:
            metrics.update(offload(s, modified))


def empty_host_cache():
    """Give the pinned host blocks PyTorch's caching host allocator holds unused back to the OS. DCP's writer
    stages every tensor in that cache with a non_blocking copy, and the cache keeps them (host RSS +11.4 GB
    after one checkpoint at Qwen2.5-0.5B with every offload flag). The stashes' mirrors are not touched."""
    if torch.cuda.is_available():
        for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):   # the name moved across torch versions
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                return


def describe(label: str, nbytes: int, on: bool, device: torch.device) -> str:
    """The set-up report's line for one offload flag: what it moves, or what it keeps."""
    where = "pinned host" if device.type == "cuda" else "host (CPU run: no device memory to save)"
    return f"[offload] {label}: " + (f"ON: moves {nbytes / GB:.3f} GB to {where} between uses" if on
                                     else f"off: keeps {nbytes / GB:.3f} GB on {device.type}")
