"""Async rollout's host buffer: its bound, one sample's bytes, and the buffer the engines fill and the
trainer empties (rollout_async.py orders and takes through it; rollout_engine.py generates what fills it).

    python -m pytest -q tests/test_async.py -k buffer

The buffer is the one host memory async rollout adds: at most `buffer_limit` samples, ordered or waiting,
each `sample_bytes` (token ids and log-probs); `buffer_bytes` is that at its fullest, for the planner
(predict.py). It is not saved in a checkpoint: a resume samples its batches again.
"""
import threading

import rollout_engine
from rollout import RolloutConfig


def buffer_limit(cfg: RolloutConfig, train_batch_size: int) -> int:
    """Samples ordered or waiting at most: buffer_limit, or max_staleness steps' worth (at least one
    step's: rollout_engine.check refuses less)."""
    return cfg.buffer_limit or cfg.max_staleness * train_batch_size * cfg.n


def sample_bytes(prompt: int, response: int) -> int:
    """Host bytes of one buffered sample: int32 token ids of prompt and response, fp32 log-probs."""
    return 4 * (prompt + 2 * response)


class Buffer:
    """Samples ordered or finished but not yet taken, at most `limit` (thread-safe: the engines'
    receiver threads put, the trainer takes). An order reserves its samples, so the engines never
    produce past the bound and host memory stays bounded."""

    def __init__(self, limit: int):
        self.limit, self.cv = limit, threading.Condition()
        self.parts: dict = {}              # step -> {engine: its payload}
        self.ordered = self.waiting = self.nbytes = 0   # samples
        self.error: str | None = None
        self.handled = threading.Event()   # the trainer said the error: the watchdog need not

    def reserve(self, samples: int) -> bool:
        with self.cv:
            if self.ordered + self.waiting + samples > self.limit:
                return False
            self.ordered += samples
            return True

    def put(self, step: int, engine: int, payload: dict):
        with self.cv:
            self.parts.setdefault(step, {})[engine] = payload
            n = len(payload["responses"])
            self.ordered, self.waiting = self.ordered - n, self.waiting + n
            self.nbytes += payload["nbytes"]
            self.cv.notify_all()

    def fail(self, message: str):
        with self.cv:
            self.error = self.error or message
            self.cv.notify_all()

    def died(self, fallback: str, wait_s: float = 5.0) -> "rollout_engine.EngineDied":
        """The error to stop with when a send to an engine failed: the receiver thread's line (it says
        which engine exited and how; given `wait_s` to see the closed connection), or `fallback`."""
        with self.cv:
            self.cv.wait_for(lambda: self.error is not None, timeout=wait_s)
            self.handled.set()
            return rollout_engine.EngineDied(self.error or fallback)

    def take(self, step: int, parts: int) -> list:
        """The `parts` payloads of `step`, waiting for them; EngineDied when an engine failed."""
        with self.cv:
            while len(self.parts.get(step, {})) < parts:
                if self.error:
                    self.handled.set()
                    raise rollout_engine.EngineDied(self.error)
                self.cv.wait(timeout=1.0)
            got = self.parts.pop(step)
            self.waiting -= sum(len(p["responses"]) for p in got.values())
            self.nbytes -= sum(p["nbytes"] for p in got.values())
            return [got[i] for i in sorted(got)]


# The planner's term (predict.py): the host's side of async rollout.
def buffer_bytes(cfg: RolloutConfig, train_batch_size: int, prompt_len: int) -> int:
    """The host's rollout buffer at its fullest."""
    return buffer_limit(cfg, train_batch_size) * sample_bytes(prompt_len, cfg.response_length)
