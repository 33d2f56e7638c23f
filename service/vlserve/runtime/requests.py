"""What goes into the engine and what comes out: a prepared prompt, a sequence, its usage, its sink."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vlserve.errors import EngineError, EngineFailure
from vlserve.runtime.sampling import SamplingParams


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [T]
    mm_token_type_ids: torch.Tensor  # [T]
    pixel_values: torch.Tensor | None  # [patches, features], all images in order
    image_grid_thw: torch.Tensor | None  # [images, 3]
    image_keys: list[str]
    cache_key: str  # identifies the prompt (tokens and image bytes) for the result cache

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def image_tokens(self) -> int:
        """Prompt tokens that stand for image patches (what the vision encoder made)."""
        return int((self.mm_token_type_ids != 0).sum())


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    images: int = 0
    images_from_cache: int = 0  # not encoded for this request: from the vision cache or in a stored prefix
    answer_from_cache: bool = False  # the whole answer came from the result cache
    image_tokens: int = 0  # of prompt_tokens, those that stand for images
    cached_tokens: int = 0  # of prompt_tokens, those whose keys and values came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Sink(Protocol):
    """Receives one request's output; called from the scheduler thread (or from submit on a cache hit)."""

    def on_text(self, text: str) -> None: ...

    def on_finish(self, reason: str, usage: Usage) -> None: ...

    def on_error(self, error: EngineError) -> None: ...


@dataclass(eq=False)
class Sequence:
    prompt: Prompt
    params: SamplingParams
    sink: Sink
    submitted: float
    deadline: float
    use_result_cache: bool
    generated: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    first_token_at: float | None = None
    cancelled: bool = False
    done: bool = False
    images_from_cache: int = 0
    cached_tokens: int = 0  # the prompt's first tokens served by the prefix cache

    def cancel(self) -> None:
        """Called from any thread: the scheduler drops the sequence before its next step."""
        self.cancelled = True


class WaitingSink:
    """A sink that waits for the end and re-raises a failure (the warm-up's)."""

    def __init__(self):
        self._done = threading.Event()
        self.error: EngineError | None = None

    def on_text(self, text: str) -> None:
        pass

    def on_finish(self, reason: str, usage: Usage) -> None:
        self._done.set()

    def on_error(self, error: EngineError) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout: float) -> None:
        if not self._done.wait(timeout):
            raise EngineFailure("warm-up did not finish in %.0f s" % timeout)
        if self.error is not None:
            raise self.error
