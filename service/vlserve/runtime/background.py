"""The work a ready worker still does between requests, one step per scheduler pass: weight chunks an
aged page cache held in small pages read again into 2 MiB folios (vlserve/model/pages.py), weights into
their kernels' layout, then the prompt copies of the decoder's layers (what the weight cache does not
hold; vlserve/model/packing.py). Each step is 10-60 ms, so a request never waits long for one; a step
that runs out of memory ends its kind of work (slower, never wrong). What no level converts stays in
the checkpoint's memory map for good: nothing is copied out of it just to own it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundWork:
    def __init__(
        self,
        page_steps: list[Callable[[], None]],
        layout_steps: list[Callable[[], None]],
        prefill_copies: list,
        prefill_dtype: str | None,
    ):
        self.page_steps = page_steps  # first, in order: chunks of weight files read again (pages.py)
        self.layout_steps = layout_steps  # then weights still in a plain layout (packing.py)
        self.prefill_copies = prefill_copies  # layers still waiting for their prompt copy (packing.py, quantized.py)
        self.prefill_dtype = prefill_dtype
        self._layouts_started: float | None = None
        self._copies_started: float | None = None

    @property
    def pending(self) -> int:
        return len(self.page_steps) + len(self.layout_steps) + len(self.prefill_copies)

    def step(self) -> None:
        """One step of whichever work comes first."""
        if self.page_steps:
            self._read_pages_again()
        elif self.layout_steps:
            self._finish_a_layout()
        elif self.prefill_copies:
            self._make_prefill_copy()

    def _read_pages_again(self) -> None:
        """Up to 32 MiB of weights dropped from the page cache and read again (20-40 ms)."""
        step = self.page_steps.pop(0)
        try:
            step()
        except OSError as error:  # the file went away or cannot be read: its pages stay as they are
            log.error("leaving the weight files' pages as they are: %s", error)
            self.page_steps = []

    def _finish_a_layout(self) -> None:
        """One weight into its kernel's layout (20-60 ms each): decode steps reach full speed."""
        if self._layouts_started is None:
            self._layouts_started = time.monotonic()
        try:
            self.layout_steps[-1]()
        except RuntimeError as error:  # out of memory: the rest keep their plain layout, slower, not wrong
            log.error("leaving %d weights in their plain layout: %s", len(self.layout_steps), error)
            self.layout_steps = []
            return
        self.layout_steps.pop()
        if not self.layout_steps:
            log.info("kernel layouts of the weights made in %.1f s", time.monotonic() - self._layouts_started)

    def _make_prefill_copy(self) -> None:
        """One layer's prefill copy (10-30 ms each)."""
        if self._copies_started is None:
            self._copies_started = time.monotonic()
        try:
            self.prefill_copies[-1].make_prefill_copy()
            self.prefill_copies.pop()  # only now: the pending count must not reach 0 before the last copy exists
        except RuntimeError as error:  # out of memory, most likely: prompts stay on the packed weights
            log.error("giving up the %s prefill copies: %s", self.prefill_dtype, error)
            for layer in self.prefill_copies:
                layer.drop_prefill_source()
            self.prefill_copies = []
            return
        if not self.prefill_copies:
            log.info(
                "%s prefill copies of the decoder's linear layers made in %.1f s",
                self.prefill_dtype,
                time.monotonic() - self._copies_started,
            )
