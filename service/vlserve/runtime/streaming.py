"""Generated tokens into text for each sequence: stop strings, length limits, held-back tails, and
the finish (usage, metrics, the result cache)."""

from __future__ import annotations

import json
import time

from vlserve.runtime.caches import LRUCache
from vlserve.runtime.metrics import Metrics
from vlserve.runtime.requests import Sequence, Usage
from vlserve.settings import LimitSettings

# An incomplete UTF-8 character decodes to up to 3 replacement characters until its last byte comes.
MAX_REPLACEMENT_TAIL = 3


class OutputStream:
    """Turns each new token of a sequence into the text its sink has not seen yet, and finishes it."""

    def __init__(self, tokenizer, eos_ids: set[int], limits: LimitSettings, metrics: Metrics, result_cache: LRUCache):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.limits, self.metrics, self.result_cache = limits, metrics, result_cache

    def emit(self, seq: Sequence, token: int) -> bool:
        """Record a new token for a sequence; returns False once the sequence is finished."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft_seconds.observe(now - seq.submitted)
        seq.generated.append(token)
        reason = None
        if token in self.eos_ids and not seq.params.ignore_eos:
            reason = "stop"
            ids = seq.generated[:-1]
        else:
            ids = seq.generated
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stop_at = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            text, reason = text[:stop_at], "stop"
        if reason is None and (
            len(seq.generated) >= seq.params.max_tokens
            or seq.prompt.tokens + len(seq.generated) >= self.limits.max_context_tokens
        ):
            reason = "length"
        seq.text = text
        safe = len(text) if reason is not None else self._safe_length(seq, text)
        if safe > seq.emitted:
            seq.sink.on_text(text[seq.emitted : safe])
            seq.emitted = safe
        if reason is None:
            return True
        self.finish(seq, reason)
        return False

    @staticmethod
    def _safe_length(seq: Sequence, text: str) -> int:
        """How much of an unfinished sequence's text can go out: not a tail that may still become a
        stop string or a multi-byte character."""
        safe = len(text) - max((len(s) - 1 for s in seq.params.stop), default=0)
        for _ in range(MAX_REPLACEMENT_TAIL):
            if safe > seq.emitted and text[safe - 1] == "\ufffd":
                safe -= 1
        return safe

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.done = True
        now = time.monotonic()
        completion = len(seq.generated)
        self.metrics.generated_tokens.inc(completion)
        self.metrics.prompt_tokens.inc(seq.prompt.tokens)
        self.metrics.cached_prompt_tokens.inc(seq.cached_tokens)
        self.metrics.e2e_seconds.observe(now - seq.submitted)
        if completion > 1 and seq.first_token_at is not None:
            self.metrics.tpot_seconds.observe((now - seq.first_token_at) / (completion - 1))
        if seq.use_result_cache:
            self.result_cache.put(result_key(seq), (seq.text, reason, completion))
        images = len(seq.prompt.image_keys)
        usage = Usage(
            seq.prompt.tokens,
            completion,
            images,
            seq.images_from_cache,
            image_tokens=seq.prompt.image_tokens,
            cached_tokens=seq.cached_tokens,
        )
        seq.sink.on_finish(reason, usage)


def answer_from_cache(seq: Sequence, result_cache: LRUCache, metrics: Metrics) -> bool:
    """Give a greedy request its earlier answer at once, if the result cache holds it."""
    cached = result_cache.get(result_key(seq))
    metrics.cache_lookup("result", cached is not None)
    if cached is None:
        return False
    text, reason, completion = cached
    seq.sink.on_text(text)
    images = len(seq.prompt.image_keys)
    usage = Usage(seq.prompt.tokens, completion, images, answer_from_cache=True, image_tokens=seq.prompt.image_tokens)
    seq.sink.on_finish(reason, usage)
    seq.done = True
    return True


def result_key(seq: Sequence) -> str:
    """What makes two greedy answers equal: the prompt, the token budget, the stop strings."""
    return "%s|%d|%s|%s" % (
        seq.prompt.cache_key,
        seq.params.max_tokens,
        json.dumps(list(seq.params.stop)),
        seq.params.ignore_eos,
    )
