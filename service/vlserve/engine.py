"""The engine: loads Qwen3-VL once and owns it; one scheduler thread runs every forward pass.

Knows nothing of HTTP. Requests come in as a prepared prompt (`Engine.prepare`, safe to call from
any thread: tokenization and image preprocessing only) and sampling parameters; results go out
through a `Sink` whose methods the scheduler calls as tokens arrive.

Scheduling is continuous batching: waiting requests are prefilled as a group and join the
running batch between decode steps; a request that finishes, is cancelled or runs out of time
leaves it at once (see batch.py). On a memory-bound CPU a decode step costs about the same for 1
to 8 sequences in bfloat16, so batching multiplies throughput.

Every multi-threaded torch call runs on the scheduler thread, loading included; other threads
(`prepare`) run torch on one thread. libgomp gives each thread that starts a parallel region its
own pool of workers, and once a process holds more of them than it has CPUs, every worker stops
spinning between regions and sleeps in the kernel instead: a decode step is some 1,500 regions,
and it took 232-239 ms with a second pool alive against 177-190 ms without (real-size model, this
project's 2-core VM).
"""

from __future__ import annotations

import collections
import gc
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch
from PIL import Image

from vlserve import sizing
from vlserve.batch import BatchState
from vlserve.caches import LRUCache
from vlserve.errors import (
    ContextLengthExceeded,
    EngineError,
    EngineFailure,
    InvalidRequest,
    MemoryPressure,
    NotReady,
    Overloaded,
    RequestTimeout,
)
from vlserve.kvcache import new_cache
from vlserve.loader import check_model_directory, load_model
from vlserve.metrics import Metrics, anonymous_memory
from vlserve.sampling import SamplingParams, next_tokens
from vlserve.settings import LimitSettings, ModelSettings

log = logging.getLogger(__name__)


# --- What goes in and out. ------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInput:
    image: Image.Image
    key: str  # sha256 of the encoded bytes: the vision cache's key


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


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    images: int = 0
    images_from_cache: int = 0  # whose vision features came from the vision cache
    answer_from_cache: bool = False  # the whole answer came from the result cache

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

    def cancel(self) -> None:
        """Called from any thread: the scheduler drops the sequence before its next step."""
        self.cancelled = True


# --- The engine. ----------------------------------------------------------------------------


class Engine:
    def __init__(self, model: ModelSettings, limits: LimitSettings, metrics: Metrics | None = None):
        self.model_settings = model
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.state = "created"  # created -> loading -> warming -> ready | failed; stopped
        self.model = None
        self.processor = None
        self.dtype: str | None = None
        self.threads: int | None = None
        self.vision_dtype: str | None = None
        self.prefill_dtype: str | None = None
        self.packed = False
        self.quantize = "none"
        self.result_cache = LRUCache(limits.result_cache_entries)
        self.vision_cache = LRUCache(limits.vision_cache_bytes, cost=_feature_bytes)
        self.plan: dict | None = None  # the sizing plan this process computed for itself at load
        self._layout_steps: list[Callable[[], None]] = []  # first, weights still in a plain layout (packing.py)
        self._prefill_copies: list = []  # layers still waiting for their prompt copy (packing.py, quantized.py)
        self._map_copies: list[Callable[[], None]] = []  # then the tensors still in the checkpoint's memory map
        self._copies_started: float | None = None
        self._layouts_started: float | None = None
        self._queue: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._batch: BatchState | None = None
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._memory_limit = limits.memory_limit_bytes if limits.memory_limit_bytes else _cgroup_memory_limit()
        self._process = psutil.Process()
        self.metrics.bind_engine(self)

    # -- lifecycle --------------------------------------------------------------------------

    def load(self, status: Callable[[str], None] = lambda message: None) -> None:
        """Load the processor and the model from the local directory on the scheduler thread, which then
        starts scheduling; returns once loaded, raising what loading raised."""
        self.state = "loading"
        check_model_directory(Path(self.model_settings.model))
        loaded = threading.Event()
        failure: list[Exception] = []

        def load_then_run() -> None:
            try:
                self._load_model(status)
            except Exception as error:  # noqa: BLE001 - re-raised in the caller's thread, which reports it
                failure.append(error)
                return
            finally:
                loaded.set()
            self._run()

        self._thread = threading.Thread(target=load_then_run, name="vlserve-scheduler", daemon=True)
        self._thread.start()
        loaded.wait()
        if failure or self.model is None:
            self._thread.join()
            raise failure[0] if failure else EngineFailure("the scheduler thread stopped while loading the model")

    def _load_model(self, status: Callable[[str], None]) -> None:
        loaded = load_model(self.model_settings, self.limits, status)
        self.threads, self.dtype, self.packed = loaded.threads, loaded.dtype, loaded.packed
        self.quantize = loaded.quantize
        self.vision_dtype, self.prefill_dtype = loaded.vision_dtype, loaded.prefill_dtype
        self.pad_id, self.eos_ids = loaded.pad_id, loaded.eos_ids
        self._layout_steps = loaded.layout_steps
        self._prefill_copies, self._map_copies = loaded.prefill_copies, loaded.map_copies
        self.processor, self.model = loaded.processor, loaded.model
        self.plan = loaded.plan

    def warmup(self, status: Callable[[str], None] = lambda message: None) -> None:
        """One request through every stage (chat template, image processor, vision encoder, prefill,
        decode), caches bypassed. The model runs only the image's own tokens (<|vision_start|>, one
        image token, <|vision_end|>): three prompt rows cost what a decode step costs, where the whole
        24-token conversation took 0.1-0.2 s more of every start on the quantized levels (its rows went
        through the decode kernels: the prompt copies are made after ready), and the first request
        after ready is no slower for it (docs/benchmarks.md)."""
        self.state = "warming"
        status("warming up")
        started = time.monotonic()
        image = Image.linear_gradient("L").resize((32, 32)).convert("RGB")
        prompt = self.prepare(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": ImageInput(image, "warmup")},
                        {"type": "text", "text": "Describe."},
                    ],
                }
            ]
        )
        waiter = _WaitingSink()
        self.submit(
            _image_tokens_only(prompt, self.processor),
            SamplingParams(max_tokens=2),
            waiter,
            use_caches=False,
            warmup=True,
        )
        waiter.wait(self.limits.request_timeout_s)
        log.info("warm-up done in %.1f s", time.monotonic() - started)

    def start(self, status: Callable[[str], None] = lambda message: None, warmup: bool = True) -> None:
        """Load, warm up (unless told not to) and mark ready; on any failure the engine is "failed" and
        the error is raised to the caller, who reports it."""
        try:
            self.load(status)
            if warmup:
                self.warmup(status)
        except Exception:
            self.state = "failed"
            raise
        self.mark_ready()

    def mark_ready(self) -> None:
        self.state = "ready"

    def shutdown(self) -> None:
        self._stopping = True
        with self._wakeup:
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for seq in list(self._queue) + self._running:
            self._fail(seq, NotReady("the server is shutting down"))
        self._queue.clear()
        self._running.clear()
        self.state = "stopped"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, messages: list[dict[str, Any]]) -> Prompt:
        """Chat template, tokens and image patches for one conversation; no model involved.

        `messages`: [{"role", "content": str | [{"type": "text", "text"}, {"type": "image", "image": ImageInput}]}].
        """
        if self.processor is None:
            raise NotReady("the model is still loading")
        if threading.current_thread() is not self._thread:
            torch.set_num_threads(1)  # no second OpenMP pool (see the module's docstring)
        template_messages, images = [], []
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                template_messages.append({"role": message["role"], "content": content})
                continue
            parts = []
            for part in content:
                if part["type"] == "image":
                    images.append(part["image"])
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            template_messages.append({"role": message["role"], "content": parts})
        if len(images) > self.limits.max_images_per_request:
            raise InvalidRequest(
                "%d images in one request; the limit is %d" % (len(images), self.limits.max_images_per_request),
                param="messages",
            )
        try:
            text = self.processor.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=False)
            encoded = self.processor(text=[text], images=[i.image for i in images] or None, return_tensors="pt")
        except ValueError as error:  # e.g. an aspect ratio the processor refuses (over 200:1)
            raise InvalidRequest("the request could not be processed: %s" % error, param="messages") from None
        input_ids = encoded["input_ids"][0]
        keys = [i.key for i in images]
        digest = hashlib.sha256(input_ids.numpy().tobytes())
        for key in keys:
            digest.update(key.encode())
        return Prompt(
            input_ids=input_ids,
            mm_token_type_ids=encoded["mm_token_type_ids"][0],
            pixel_values=encoded.get("pixel_values"),
            image_grid_thw=encoded.get("image_grid_thw"),
            image_keys=keys,
            cache_key=digest.hexdigest(),
        )

    def sampling_defaults(self) -> dict[str, float]:
        """Temperature and top-p when a request gives none: the checkpoint's generation_config, as vLLM does."""
        config = self.model.generation_config
        if not config.do_sample:
            return {"temperature": 0.0, "top_p": 1.0}
        return {"temperature": float(config.temperature or 1.0), "top_p": float(config.top_p or 1.0)}

    def resolve_max_tokens(self, prompt: Prompt, requested: int | None) -> int:
        room = self.limits.max_context_tokens - prompt.tokens
        if room < 1:
            raise ContextLengthExceeded(
                "the prompt has %d tokens; this server's context is %d tokens"
                % (prompt.tokens, self.limits.max_context_tokens),
                param="messages",
            )
        if requested is None:
            return min(self.limits.max_tokens_default, room)
        if requested > room:
            raise ContextLengthExceeded(
                "max_tokens %d plus the prompt's %d tokens exceed this server's context of %d tokens"
                % (requested, prompt.tokens, self.limits.max_context_tokens),
                param="max_tokens",
            )
        return requested

    def submit(
        self, prompt: Prompt, params: SamplingParams, sink: Sink, use_caches: bool = True, warmup: bool = False
    ) -> Sequence:
        """Queue a request. Raises NotReady, Overloaded or MemoryPressure instead of accepting work it cannot do.

        `warmup`: the engine's own first request, before it is ready and whatever the memory guard says.
        """
        if not self.ready and not warmup:
            raise NotReady("the model is %s" % self.state)
        now = time.monotonic()
        seq = Sequence(
            prompt=prompt,
            params=params,
            sink=sink,
            submitted=now,
            deadline=now + self.limits.request_timeout_s,
            use_result_cache=use_caches and params.greedy,
        )
        if seq.use_result_cache:
            cached = self.result_cache.get(self._result_key(seq))
            self.metrics.cache_lookup("result", cached is not None)
            if cached is not None:
                text, reason, completion = cached
                sink.on_text(text)
                images = len(prompt.image_keys)
                sink.on_finish(reason, Usage(prompt.tokens, completion, images, answer_from_cache=True))
                seq.done = True
                return seq
        held = anonymous_memory(self._process)
        if self._memory_limit and held > self._memory_limit and not warmup:
            raise MemoryPressure(
                "resident memory %.1f GiB is over the limit of %.1f GiB; try again shortly"
                % (held / 2**30, self._memory_limit / 2**30),
                retry_after=5,
            )
        with self._wakeup:
            if len(self._queue) >= self.limits.max_queue + max(0, self.limits.max_batch_size - len(self._running)):
                raise Overloaded(
                    "the worker is full (%d running, %d waiting, at most %d wait); try again shortly"
                    % (len(self._running), len(self._queue), self.limits.max_queue),
                    retry_after=2,
                )
            self._queue.append(seq)
            self._wakeup.notify()
        return seq

    def _result_key(self, seq: Sequence) -> str:
        return "%s|%d|%s|%s" % (
            seq.prompt.cache_key,
            seq.params.max_tokens,
            json.dumps(list(seq.params.stop)),
            seq.params.ignore_eos,
        )

    # -- the scheduler thread ---------------------------------------------------------------

    @property
    def prefill_copies_pending(self) -> int:
        return len(self._prefill_copies)

    @property
    def background_steps_pending(self) -> int:
        """Work a ready worker still does between requests: kernel layouts, prefill copies, then copies
        out of the map."""
        return len(self._layout_steps) + len(self._prefill_copies) + len(self._map_copies)

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                background = self.state == "ready" and self.background_steps_pending > 0
                if background:
                    self._background_step()
                with self._wakeup:
                    if not self._queue and not self._running:
                        if not background:
                            self._wakeup.wait(timeout=0.5)
                        continue
                    admitted = self._admit()
                try:
                    if admitted:
                        self._prefill(admitted)
                    self._drop_cancelled()
                    if self._running:
                        self._decode_step()
                except Exception as error:
                    log.exception("model step failed")
                    for seq in admitted + self._running:
                        self._fail(seq, EngineFailure("the model failed: %s" % error))
                    self._running, self._batch = [], None
                self.metrics.queue_depth.set(len(self._queue))
                self.metrics.batch_size.set(len(self._running))

    def _background_step(self) -> None:
        """One step of the after-ready work per scheduler pass, so requests never wait long for it."""
        if self._layout_steps:
            self._finish_a_layout()
            return
        if self._prefill_copies:
            self._make_prefill_copy()
            return
        try:
            self._map_copies[-1]()
            self._map_copies.pop()
        except RuntimeError as error:  # out of memory: the rest stays mapped, which is slower to free, not wrong
            log.error("leaving the checkpoint mapped: %s", error)
            self._map_copies = []
            return
        if not self._map_copies:
            gc.collect()
            log.info("the checkpoint's memory map is released")

    def _finish_a_layout(self) -> None:
        """One weight into its kernel's layout (20-60 ms each): decode steps reach full speed."""
        if self._layouts_started is None:
            self._layouts_started = time.monotonic()
        try:
            self._layout_steps[-1]()
        except RuntimeError as error:  # out of memory: the rest keep their plain layout, slower, not wrong
            log.error("leaving %d weights in their plain layout: %s", len(self._layout_steps), error)
            self._layout_steps = []
            return
        self._layout_steps.pop()
        if not self._layout_steps:
            log.info("kernel layouts of the weights made in %.1f s", time.monotonic() - self._layouts_started)

    def _make_prefill_copy(self) -> None:
        """One layer's prefill copy (10-30 ms each)."""
        if self._copies_started is None:
            self._copies_started = time.monotonic()
        try:
            self._prefill_copies[-1].make_prefill_copy()
            self._prefill_copies.pop()  # only now: the pending count must not reach 0 before the last copy exists
        except RuntimeError as error:  # out of memory, most likely: prompts stay on the packed weights
            log.error("giving up the %s prefill copies: %s", self.prefill_dtype, error)
            for layer in self._prefill_copies:
                layer.drop_prefill_source()
            self._prefill_copies = []
            return
        if not self._prefill_copies:
            log.info(
                "%s prefill copies of the decoder's linear layers made in %.1f s",
                self.prefill_dtype,
                time.monotonic() - self._copies_started,
            )

    def _admit(self) -> list[Sequence]:
        """Take waiting requests into free batch slots; expire those that waited past their deadline."""
        now = time.monotonic()
        admitted = []
        while self._queue and len(self._running) + len(admitted) < self.limits.max_batch_size:
            seq = self._queue.popleft()
            if seq.cancelled:
                self._finish_cancelled(seq)
            elif now > seq.deadline:
                self._fail(seq, RequestTimeout("waited %.0f s in the queue" % (now - seq.submitted)))
            else:
                admitted.append(seq)
        return admitted

    def _prefill(self, group: list[Sequence]) -> None:
        model = self.model
        length = max(s.prompt.tokens for s in group)
        rows = len(group)
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, length), dtype=torch.long)
        token_types = torch.zeros((rows, length), dtype=torch.long)
        for row, seq in enumerate(group):
            n = seq.prompt.tokens
            input_ids[row, length - n :] = seq.prompt.input_ids
            mask[row, length - n :] = 1
            token_types[row, length - n :] = seq.prompt.mm_token_type_ids
        grids = [s.prompt.image_grid_thw for s in group if s.prompt.image_grid_thw is not None]
        image_grid_thw = torch.cat(grids) if grids else None
        encoder_outputs = self._vision_features(group) if grids else None
        vision_positions, deltas = model.model.get_rope_index(
            input_ids, token_types, image_grid_thw=image_grid_thw, attention_mask=mask
        )
        text_positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        started = time.monotonic()
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=torch.cat([text_positions[None], vision_positions]),
            cache=_new_cache(model),
            mm_encoder_outputs=encoder_outputs,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=token_types,
            use_cache=True,
            logits_to_keep=1,
        )
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        tokens = next_tokens(out.logits[:, -1, :].float(), [s.params for s in group])
        batch = BatchState(
            cache=out.cache,
            attention_mask=mask,
            text_positions=mask.sum(dim=1),
            rope_deltas=deltas.view(-1).to(torch.long),
            next_tokens=tokens,
        )
        keep = [row for row, seq in enumerate(group) if self._emit(seq, int(tokens[row]))]
        if len(keep) < rows:
            batch.select(keep)
        if not keep:
            return
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.merge(batch)
        self._running.extend(group[row] for row in keep)

    def _vision_features(self, group: list[Sequence]) -> dict[str, Any]:
        """Per-image vision features in prompt order, from the cache or one encoder call for the misses."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (  # noqa: PLC0415
            BaseModelOutputWithDeepstackFeatures,
        )

        ordered: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # key, pixels, grid row
        for seq in group:
            prompt = seq.prompt
            if prompt.image_grid_thw is None:
                continue
            offset = 0
            for key, grid in zip(prompt.image_keys, prompt.image_grid_thw, strict=True):
                patches = int(grid.prod())
                ordered.append((key, prompt.pixel_values[offset : offset + patches], grid))
                offset += patches
        features: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        misses: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, pixels, grid in ordered:
            if key in features or key in misses:
                continue
            cached = self.vision_cache.get(key) if key != "warmup" else None
            if key != "warmup":
                self.metrics.cache_lookup("vision", cached is not None)
            if cached is not None:
                features[key] = cached
            else:
                misses[key] = (pixels, grid)
        for seq in group:  # what each request's usage reports
            seq.images_from_cache = sum(1 for key in seq.prompt.image_keys if key in features)
        if misses:
            started = time.monotonic()
            out = self.model.model.get_image_features(
                torch.cat([p for p, _ in misses.values()]), torch.stack([g for _, g in misses.values()])
            )
            self.metrics.image_encode_seconds.observe(time.monotonic() - started)
            text_dtype = getattr(torch, self.dtype)  # a float32 vision tower's output is kept at the text's width
            for index, key in enumerate(misses):
                entry = (
                    out.pooler_output[index].to(text_dtype),
                    [layer[index].to(text_dtype) for layer in out.deepstack_features],
                )
                features[key] = entry
                if key != "warmup":
                    self.vision_cache.put(key, entry)
        embeds = tuple(features[key][0] for key, _, _ in ordered)
        layers = len(features[ordered[0][0]][1])
        deepstack = [tuple(features[key][1][layer] for key, _, _ in ordered) for layer in range(layers)]
        return {"image": BaseModelOutputWithDeepstackFeatures(pooler_output=embeds, deepstack_features=deepstack)}

    def _decode_step(self) -> None:
        batch = self._batch
        self.metrics.decode_batch.observe(batch.size)
        inputs = batch.step_inputs()
        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        batch.cache = out.cache
        tokens = next_tokens(out.logits[:, -1, :].float(), [s.params for s in self._running])
        batch.advance(inputs["attention_mask"], tokens)
        keep = [row for row, seq in enumerate(self._running) if self._emit(seq, int(tokens[row]))]
        if len(keep) < len(self._running):
            self._running = [self._running[row] for row in keep]
            if keep:
                batch.select(keep)
            else:
                self._batch = None

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        keep = []
        for row, seq in enumerate(self._running):
            if seq.cancelled:
                self._finish_cancelled(seq)
            elif now > seq.deadline:
                self._fail(
                    seq, RequestTimeout("the request ran past its %.0f s deadline" % self.limits.request_timeout_s)
                )
            else:
                keep.append(row)
        if len(keep) < len(self._running):
            self._running = [self._running[row] for row in keep]
            if keep:
                self._batch.select(keep)
            else:
                self._batch = None

    def _emit(self, seq: Sequence, token: int) -> bool:
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
        text = self.processor.tokenizer.decode(ids, skip_special_tokens=True)
        stop_at = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            text, reason = text[:stop_at], "stop"
        if reason is None and (
            len(seq.generated) >= seq.params.max_tokens
            or seq.prompt.tokens + len(seq.generated) >= self.limits.max_context_tokens
        ):
            reason = "length"
        seq.text = text
        if reason is None:
            # Hold back a tail that may still become a stop string or a multi-byte character.
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            safe = len(text) - hold
            # An incomplete UTF-8 character decodes to up to 3 replacement characters until its last byte comes.
            for _ in range(3):
                if safe > seq.emitted and text[safe - 1] == "\ufffd":
                    safe -= 1
        else:
            safe = len(text)
        if safe > seq.emitted:
            seq.sink.on_text(text[seq.emitted : safe])
            seq.emitted = safe
        if reason is None:
            return True
        self._finish(seq, reason)
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.done = True
        now = time.monotonic()
        completion = len(seq.generated)
        self.metrics.generated_tokens.inc(completion)
        self.metrics.prompt_tokens.inc(seq.prompt.tokens)
        self.metrics.e2e_seconds.observe(now - seq.submitted)
        if completion > 1 and seq.first_token_at is not None:
            self.metrics.tpot_seconds.observe((now - seq.first_token_at) / (completion - 1))
        if seq.use_result_cache:
            self.result_cache.put(self._result_key(seq), (seq.text, reason, completion))
        images = len(seq.prompt.image_keys)
        seq.sink.on_finish(reason, Usage(seq.prompt.tokens, completion, images, seq.images_from_cache))

    def _finish_cancelled(self, seq: Sequence) -> None:
        seq.done = True
        self.metrics.cancelled.inc()

    def _fail(self, seq: Sequence, error: EngineError) -> None:
        if seq.done:
            return
        seq.done = True
        seq.sink.on_error(error)


# --- helpers ---------------------------------------------------------------------------------


def _image_tokens_only(prompt: Prompt, processor) -> Prompt:
    """The prompt cut to its first image's tokens, from <|vision_start|> to <|vision_end|>."""
    ids = prompt.input_ids.tolist()
    first, last = ids.index(processor.vision_start_token_id), ids.index(processor.vision_end_token_id) + 1
    return replace(
        prompt, input_ids=prompt.input_ids[first:last], mm_token_type_ids=prompt.mm_token_type_ids[first:last]
    )


class _WaitingSink:
    """A sink for the warm-up: waits for the end and re-raises a failure."""

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


def _new_cache(model):
    return new_cache(model.config.text_config.num_hidden_layers)


def _feature_bytes(entry) -> int:
    if entry is None:
        return 0
    embeds, deepstack = entry
    return sum(t.numel() * t.element_size() for t in [embeds, *deepstack])


def _cgroup_memory_limit() -> int | None:
    """The plan's guard share of this process's cgroup memory.high (or memory.max): where to shed load."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as handle:
            line = next((x for x in handle.read().splitlines() if x.startswith("0::")), None)
    except OSError:
        return None
    if line is None:
        return None
    base = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
    for name in ("memory.high", "memory.max"):
        try:
            value = (base / name).read_text().strip()
        except OSError:
            continue
        if value != "max":
            return int(int(value) * sizing.MEMORY_GUARD_FRACTION)
    return None
