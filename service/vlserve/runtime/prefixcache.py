"""Keys and values of finished conversations, so a prompt that starts the same way skips that part.

A follow-up turn sends the whole conversation again: the first turn's prompt (its image included)
and answer, then the new question. Every one of those tokens' keys and values was computed when the
first turn ran; causal attention makes them the same for any prompt that starts with the same
tokens at the same positions. So each finished sequence leaves its keys and values here (prompt and
answer, as the model fed them), and a new prompt takes the longest stored prefix it shares: the
image's encoding and the prefill of everything before the new question are skipped. The same holds
for a second question on an image that an earlier prompt opened with.

What makes two prefixes the same: equal token ids, and, for every image whose tokens they cover,
the same image bytes (its sha256: an image's tokens are one repeated id, whatever the picture). A
prefix never ends inside an image (the model takes an image's features whole) and leaves at least
one token to compute (the first answer token's logits). Prefixes shorter than `MIN_TOKENS` are not
worth a row of their own in the prefill.

Bounded like vLLM's prefix cache: the stored entries live in what the planned key/value cache leaves
free, so they are evicted (least recently used first) as running sequences need the room, and never
take the worker past the memory the plan gave it; the memory guard drops them all before it refuses
a request. The keys and values of a stored answer are those
its decode steps computed; a full prefill of the same tokens may round the last bits differently
(other kernels), as in llama.cpp's and vLLM's caches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from vlserve.runtime.requests import Prompt

MIN_TOKENS = 32  # shorter shared prefixes save less than the batching a row of their own costs
Span = tuple[int, int, str]  # an image's first token, one past its last, its key


@dataclass
class Entry:
    tokens: torch.Tensor  # [n] the token ids whose keys and values `kv` holds
    images: list[Span]
    kv: torch.Tensor  # [layers, 2, kv_heads, n, head_dim]: keys and values, one allocation

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class Hit:
    entry: Entry
    tokens: int  # how many of the prompt's first tokens the entry holds


def image_spans(prompt: Prompt) -> list[Span]:
    """Where each image's tokens lie in the prompt, with its key, in order."""
    is_image = (prompt.mm_token_type_ids != 0).to(torch.int8)
    edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
    starts = (edges == 1).nonzero().view(-1).tolist()
    ends = (edges == -1).nonzero().view(-1).tolist()
    return [(start, end, key) for start, end, key in zip(starts, ends, prompt.image_keys, strict=True)]


def shared_prefix(tokens: torch.Tensor, images: list[Span], entry: Entry, limit: int | None = None) -> int:
    """How many of the first `tokens` (with `images`), at most `limit`, the entry's keys and values serve."""
    n = min(int(tokens.shape[0]), int(entry.tokens.shape[0]))
    differs = (tokens[:n] != entry.tokens[:n]).nonzero()
    length = int(differs[0]) if differs.numel() else n
    if limit is not None:
        length = min(length, limit)
    for index, (start, end, key) in enumerate(images):
        if start >= length:
            break
        same = index < len(entry.images) and entry.images[index] == (start, end, key)
        if not same or end > length:  # another picture, or only part of this one
            return start
    return length


class PrefixCache:
    """Stored keys and values of finished sequences, least recently used out first: at most `max_bytes`
    (default and ceiling: `budget_bytes`, the planned key/value cache) and never more than the running
    sequences' own keys and values (`live` bytes) leave of the budget."""

    def __init__(self, budget_bytes: int, max_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.max_bytes = budget_bytes if max_bytes is None else min(max_bytes, budget_bytes)
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next_id = 0
        self._total = 0
        self._lock = threading.Lock()  # the memory guard clears it, /metrics reads it, from other threads

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def cost(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Prompt) -> Hit | None:
        """The stored prefix that serves most of the prompt (all but its last token at most), if any
        serves MIN_TOKENS."""
        with self._lock:
            entries = list(self._entries.items())
        if not entries:
            return None
        images = image_spans(prompt)
        best, best_id, best_tokens = None, None, 0
        for entry_id, entry in entries:
            tokens = shared_prefix(prompt.input_ids, images, entry, limit=prompt.tokens - 1)
            if tokens > best_tokens:
                best, best_id, best_tokens = entry, entry_id, tokens
        if best is None or best_tokens < MIN_TOKENS:
            return None
        with self._lock:
            if best_id in self._entries:  # not evicted meanwhile (the memory guard may clear from another thread)
                self._entries.move_to_end(best_id)
        return Hit(best, best_tokens)

    def room(self, live: int) -> int:
        return min(self.max_bytes, self.budget_bytes - live)

    def store(self, entry: Entry, live: int) -> None:
        """Keep an entry, within what `live` bytes of running sequences leave. Entries it extends go (it
        serves all they served); if a stored entry extends it, that one is kept instead."""
        if entry.tokens.shape[0] < MIN_TOKENS:
            return
        with self._lock:
            for entry_id, old in list(self._entries.items()):
                shared = shared_prefix(entry.tokens, entry.images, old)
                if shared == old.tokens.shape[0]:
                    del self._entries[entry_id]
                    self._total -= old.bytes
                elif shared == entry.tokens.shape[0]:
                    self._entries.move_to_end(entry_id)
                    return
            if entry.bytes > self.room(live):
                return
            self._entries[self._next_id] = entry
            self._next_id += 1
            self._total += entry.bytes
        self.fit(live)

    def clear(self) -> None:
        """Drop every entry (a request holding one keeps it until its prefill is done)."""
        with self._lock:
            self._entries.clear()
            self._total = 0

    def fit(self, live: int) -> None:
        """Evict the least recently used entries until what is kept fits beside `live` bytes."""
        limit = self.room(live)
        with self._lock:
            while self._entries and self._total > limit:
                _, evicted = self._entries.popitem(last=False)
                self._total -= evicted.bytes
