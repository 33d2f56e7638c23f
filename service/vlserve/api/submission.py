"""The one path from a request to an answer, shared by /v1/chat/completions and /v1/ask.

prepare (images decoded and tokenized in a small thread pool, off the event loop) -> bound
max_tokens by the context -> sampling parameters with the engine's defaults -> submit to the
scheduler -> collect the whole answer or hand its events to a stream. Client disconnects cancel
the work, which frees its batch slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

import anyio
from fastapi import Request

from vlserve.api.errors import APIError, from_engine_error
from vlserve.api.protocol import PromptTokensDetails, UsageInfo
from vlserve.api.requestlog import RequestTrace
from vlserve.errors import EngineError
from vlserve.runtime.engine import Engine
from vlserve.runtime.images import ImageInput, load_image
from vlserve.runtime.requests import Prompt, Sequence, Usage
from vlserve.runtime.sampling import SamplingParams
from vlserve.settings import Settings


def usage_info(usage: Usage) -> UsageInfo:
    extras = asdict(usage)
    details = PromptTokensDetails(cached_tokens=extras.pop("cached_tokens"))
    return UsageInfo(**extras, total_tokens=usage.total_tokens, prompt_tokens_details=details)


class QueueSink:
    """Engine sink that hands events to an asyncio queue, from whatever thread calls it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_usage: Callable[[Usage], None], trace: RequestTrace):
        self.loop, self.on_usage, self.trace = loop, on_usage, trace
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def _put(self, item: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def on_text(self, text: str) -> None:
        self.trace.first_token()
        self._put(("text", text))

    def on_finish(self, reason: str, usage: Usage) -> None:
        self.on_usage(usage)
        self.trace.usage = usage
        self._put(("finish", (reason, usage)))

    def on_error(self, error: EngineError) -> None:
        self._put(("error", error))


@dataclass
class Generation:
    """A submitted request: its sequence in the scheduler and the events it sends back."""

    sequence: Sequence
    sink: QueueSink

    async def collect(self, request: Request) -> tuple[str, str, Usage]:
        """Wait for the whole answer; cancel the work if the client goes away."""
        pieces = []
        while True:
            try:
                kind, payload = await asyncio.wait_for(self.sink.queue.get(), timeout=1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    self.sequence.cancel()
                    raise APIError(499, "client closed the request", "invalid_request_error") from None
                continue
            if kind == "text":
                pieces.append(payload)
            elif kind == "finish":
                return "".join(pieces), payload[0], payload[1]
            else:
                raise from_engine_error(payload)

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """("text", piece)... then ("finish", (reason, usage)) or ("error", EngineError); cancels on exit."""
        try:
            while True:
                kind, payload = await self.sink.queue.get()
                yield kind, payload
                if kind != "text":
                    return
        finally:
            # Reached on normal end too, where cancel() is a no-op; on a disconnect it frees the batch slot.
            self.sequence.cancel()


class Submitter:
    """Prepares, bounds and submits requests to one engine."""

    def __init__(self, engine: Engine, settings: Settings, prep_threads: int = 2):
        self.engine, self.settings = engine, settings
        self.limiter = anyio.CapacityLimiter(prep_threads)  # image decoding and tokenizing: few threads

    def decode_image(self, data: bytes, param: str) -> ImageInput:
        limits, model = self.settings.limits, self.settings.model
        return load_image(data, limits.max_image_source_pixels, model.max_pixels, param)

    async def prepare(self, messages: Callable[[], list[dict[str, Any]]]) -> Prompt:
        """Build the engine's messages (decoding images) and tokenize them, in the preparation threads."""
        return await anyio.to_thread.run_sync(lambda: self.engine.prepare(messages()), limiter=self.limiter)

    def generate(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        trace: RequestTrace,
    ) -> Generation:
        """Submit with the engine's sampling defaults where the request gives none; the tokens count
        for the trace's client (a usage label: Metrics.client_label), its first token and usage go to
        the request's record."""
        defaults = self.engine.sampling_defaults()
        params = SamplingParams(
            max_tokens=self.engine.resolve_max_tokens(prompt, max_tokens),
            temperature=temperature if temperature is not None else defaults["temperature"],
            top_p=top_p if top_p is not None else defaults["top_p"],
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        metrics = self.engine.metrics
        client = trace.client or ""
        sink = QueueSink(asyncio.get_running_loop(), lambda usage: metrics.count_usage(client, usage), trace)
        return Generation(self.engine.submit(prompt, params, sink), sink)
