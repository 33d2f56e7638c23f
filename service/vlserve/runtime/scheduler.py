"""Continuous batching: waiting requests are prefilled as a group and join the running batch between
decode steps; a request that finishes, is cancelled or runs out of time leaves it at once (batch.py).

On a memory-bound CPU a decode step costs about the same for 1 to 8 sequences in bfloat16, so
batching multiplies throughput. The queue is shared with the threads that submit (under `wakeup`);
everything else belongs to the scheduler thread, which calls `run_pass` in a loop.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from vlserve.errors import EngineError, EngineFailure, Overloaded, RequestTimeout
from vlserve.runtime.batch import BatchState
from vlserve.runtime.metrics import Metrics
from vlserve.runtime.requests import Sequence
from vlserve.runtime.runner import ModelRunner
from vlserve.runtime.streaming import OutputStream
from vlserve.settings import LimitSettings

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # an idle scheduler looks again this often (for background work and shutdown)


class Scheduler:
    def __init__(self, limits: LimitSettings, metrics: Metrics):
        self.limits, self.metrics = limits, metrics
        self.runner: ModelRunner | None = None  # set once the model is loaded
        self.stream: OutputStream | None = None
        self.queue: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.starting = 0  # admitted, in their prefill: out of the queue, not yet running, holding slots
        self.batch: BatchState | None = None
        self.wakeup = threading.Condition()

    def attach(self, runner: ModelRunner, stream: OutputStream) -> None:
        self.runner, self.stream = runner, stream

    def enqueue(self, seq: Sequence) -> None:
        """Queue a request, or raise Overloaded when the queue and the free batch slots are full."""
        with self.wakeup:
            free = max(0, self.limits.max_batch_size - len(self.running) - self.starting)
            if len(self.queue) >= self.limits.max_queue + free:
                raise Overloaded(
                    "the worker is full (%d running, %d waiting, at most %d wait); try again shortly"
                    % (len(self.running), len(self.queue), self.limits.max_queue),
                    retry_after=2,
                )
            self.queue.append(seq)
            self.wakeup.notify()

    def run_pass(self, wait: bool) -> None:
        """Admit what fits, prefill it, drop what was cancelled or timed out, decode one step. With
        nothing to do, wait a little for work if `wait`."""
        with self.wakeup:
            if not self.queue and not self.running:
                if wait:
                    self.wakeup.wait(timeout=IDLE_WAIT_S)
                return
            admitted = self._admit()
            self.starting = len(admitted)
        try:
            if admitted:
                try:
                    self._prefill(admitted)
                finally:
                    with self.wakeup:
                        self.starting = 0
            self._drop_cancelled()
            if self.running:
                self._decode_step()
        except Exception as error:
            log.exception("model step failed")
            for seq in admitted + self.running:
                fail(seq, EngineFailure("the model failed: %s" % error))
            self.running, self.batch = [], None
        self.metrics.queue_depth.set(len(self.queue))
        self.metrics.batch_size.set(len(self.running))

    def wake(self) -> None:
        with self.wakeup:
            self.wakeup.notify_all()

    def fail_all(self, error: EngineError) -> None:
        """Every waiting and running request ends with `error` (shutdown)."""
        for seq in list(self.queue) + self.running:
            fail(seq, error)
        self.queue.clear()
        self.running.clear()

    def _admit(self) -> list[Sequence]:
        """Take waiting requests into free batch slots; expire those that waited past their deadline."""
        now = time.monotonic()
        admitted = []
        while self.queue and len(self.running) + len(admitted) < self.limits.max_batch_size:
            seq = self.queue.popleft()
            if seq.cancelled:
                self._finish_cancelled(seq)
            elif now > seq.deadline:
                fail(seq, RequestTimeout("waited %.0f s in the queue" % (now - seq.submitted)))
            else:
                admitted.append(seq)
        return admitted

    def _prefill(self, group: list[Sequence]) -> None:
        batch, tokens = self.runner.prefill(group)
        keep = self._emit(group, batch, tokens, self._live_kv() + batch.kv_bytes)
        if not keep:
            return
        if len(keep) < len(group):
            batch.select(keep)
        if self.batch is None:
            self.batch = batch
        else:
            self.batch.merge(batch)
        self.running.extend(group[row] for row in keep)
        self.runner.make_room(self._live_kv())

    def _decode_step(self) -> None:
        tokens = self.runner.decode(self.batch, [s.params for s in self.running])
        self._keep(self._emit(self.running, self.batch, tokens, self._live_kv()))

    def _live_kv(self) -> int:
        return 0 if self.batch is None else self.batch.kv_bytes

    def _emit(self, seqs: list[Sequence], batch: BatchState, tokens, live: int) -> list[int]:
        """Each row's new token to its sequence: the rows that go on. A finished sequence leaves its keys
        and values to the prefix cache first."""
        keep = []
        for row, seq in enumerate(seqs):
            if self.stream.emit(seq, int(tokens[row])):
                keep.append(row)
            else:
                self.runner.remember(seq, batch, row, live)
        return keep

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        keep = []
        for row, seq in enumerate(self.running):
            if seq.cancelled:
                self._finish_cancelled(seq)
            elif now > seq.deadline:
                fail(seq, RequestTimeout("the request ran past its %.0f s deadline" % self.limits.request_timeout_s))
            else:
                keep.append(row)
        self._keep(keep)

    def _keep(self, rows: list[int]) -> None:
        """Only these rows of the running batch go on."""
        if len(rows) == len(self.running):
            return
        self.running = [self.running[row] for row in rows]
        if rows:
            self.batch.select(rows)
        else:
            self.batch = None

    def _finish_cancelled(self, seq: Sequence) -> None:
        seq.done = True
        self.metrics.cancelled.inc()


def fail(seq: Sequence, error: EngineError) -> None:
    """End a sequence with an error, once."""
    if seq.done:
        return
    seq.done = True
    seq.sink.on_error(error)
