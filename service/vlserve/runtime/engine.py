"""The engine: loads Qwen3-VL once and owns it; one scheduler thread runs every forward pass.

Knows nothing of HTTP. Requests come in as a prepared prompt (`Engine.prepare`, safe to call from
any thread: tokenization and image preprocessing only) and sampling parameters; results go out
through a `Sink` whose methods the scheduler calls as tokens arrive. The engine keeps the lifecycle
(load, warm-up, ready, shutdown) and admission (the result cache, the memory guard); the parts it
runs live beside it: the scheduler (continuous batching, scheduler.py), the model runner (forward
passes, runner.py), the output stream (tokens to text, streaming.py) and the background work after
ready (background.py).

Every multi-threaded torch call runs on the scheduler thread, loading included; other threads
(`prepare`) run torch on one thread. libgomp gives each thread that starts a parallel region its
own pool of workers, and once a process holds more of them than it has CPUs, every worker stops
spinning between regions and sleeps in the kernel instead: a decode step is some 1,500 regions,
and it took 232-239 ms with a second pool alive against 177-190 ms without (real-size model, this
project's 2-core VM).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
from PIL import Image

from vlserve import sizing
from vlserve.errors import EngineFailure, MemoryPressure, NotReady
from vlserve.kernels import native
from vlserve.model.loader import LoadChoices, LoadedModel, check_model_directory, load_model
from vlserve.runtime.background import BackgroundWork
from vlserve.runtime.caches import LRUCache
from vlserve.runtime.images import ImageInput
from vlserve.runtime.metrics import Metrics, resident_memory
from vlserve.runtime.prefixcache import PrefixCache
from vlserve.runtime.prompts import build_prompt, image_tokens_only, resolve_max_tokens
from vlserve.runtime.requests import Prompt, Sequence, Sink, WaitingSink
from vlserve.runtime.runner import WARMUP_KEY, ModelRunner, feature_bytes
from vlserve.runtime.sampling import SamplingParams
from vlserve.runtime.scheduler import Scheduler
from vlserve.runtime.streaming import OutputStream, answer_from_cache
from vlserve.settings import LimitSettings, ModelSettings

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: ModelSettings, limits: LimitSettings, metrics: Metrics | None = None):
        self.model_settings = model
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.state = "created"  # created -> loading -> warming -> ready | failed; stopped
        self.loaded: LoadedModel | None = None  # the model, its processor and how they were loaded
        self.result_cache = LRUCache(limits.result_cache_entries)
        self.vision_cache = LRUCache(limits.vision_cache_bytes, cost=feature_bytes)
        self.prefix_cache = PrefixCache(0)  # sized at load, once the model's key/value shape is known
        self.scheduler = Scheduler(limits, self.metrics)
        self.background = BackgroundWork([], [], [], None)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._memory_limit = limits.memory_limit_bytes if limits.memory_limit_bytes else _cgroup_memory_limit()
        self._process = psutil.Process()
        self.metrics.bind_engine(self)

    # -- what was loaded, and how -------------------------------------------------------------

    @property
    def model(self):
        return None if self.loaded is None else self.loaded.model

    @property
    def processor(self):
        return None if self.loaded is None else self.loaded.processor

    @property
    def loaded_as(self) -> LoadChoices | None:
        """The load choices (dtypes, threads, packing, quantize level) of the loaded model."""
        return None if self.loaded is None else self.loaded.choices

    def running_as(self) -> dict[str, Any] | None:
        """What /readyz and /status show of the loaded model: its load choices and its kernels."""
        choices = self.loaded_as
        if choices is None:
            return None
        return {
            "dtype": choices.dtype,
            "vision_dtype": choices.vision_dtype,
            "prefill_dtype": choices.prefill_dtype,
            "quantize": choices.quantize,
            "packed_weights": choices.packed,
            "threads": choices.threads,
            "kernels": self.kernels,
        }

    @property
    def kernels(self) -> str:
        """Which kernels serve the products (vlserve's own at which ISA tier, or torch's)."""
        return native.STOCK if self.loaded is None else self.loaded.kernels.status

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
        self.background = BackgroundWork(
            loaded.page_steps, loaded.layout_steps, loaded.prefill_copies, loaded.choices.prefill_dtype
        )
        budget = planned_kv_cache(loaded.model.config.text_config, loaded.choices.dtype, self.limits)
        self.prefix_cache = PrefixCache(budget, self.limits.prefix_cache_bytes)
        runner = ModelRunner(
            loaded.model,
            loaded.choices.dtype,
            loaded.pad_id,
            self.vision_cache,
            self.metrics,
            prefix_cache=self.prefix_cache,
        )
        stream = OutputStream(loaded.processor.tokenizer, loaded.eos_ids, self.limits, self.metrics, self.result_cache)
        self.scheduler.attach(runner, stream)
        self.loaded = loaded

    def warmup(self, status: Callable[[str], None] = lambda message: None) -> None:
        """One request through every stage (chat template, image processor, vision encoder, prefill,
        decode), caches bypassed. The model runs only the image's own tokens (<|vision_start|>, one
        image token, <|vision_end|>): three prompt rows cost what a decode step costs, where the whole
        24-token conversation took 0.1-0.2 s more of every start on the quantized levels (its rows went
        through the decode kernels: a float32 prompt copy is made after ready), and the first request
        after ready is no slower for it (docs/benchmark-history.md)."""
        self.state = "warming"
        status("warming up")
        started = time.monotonic()
        image = Image.linear_gradient("L").resize((32, 32)).convert("RGB")
        content = [{"type": "image", "image": ImageInput(image, WARMUP_KEY)}, {"type": "text", "text": "Describe."}]
        prompt = self.prepare([{"role": "user", "content": content}])
        waiter = WaitingSink()
        self.submit(
            image_tokens_only(prompt, self.processor),
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
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.scheduler.fail_all(NotReady("the server is shutting down"))
        self.state = "stopped"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.queue)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def prefill_copies_pending(self) -> int:
        return len(self.background.prefill_copies)

    @property
    def background_steps_pending(self) -> int:
        """Work a ready worker still does between requests: kernel layouts, prefill copies, then copies
        out of the map."""
        return self.background.pending

    # -- requests ---------------------------------------------------------------------------

    def prepare(self, messages: list[dict[str, Any]]) -> Prompt:
        """Chat template, tokens and image patches for one conversation (prompts.build_prompt); no model involved."""
        if self.processor is None:
            raise NotReady("the model is still loading")
        if threading.current_thread() is not self._thread:
            torch.set_num_threads(1)  # no second OpenMP pool (see the module's docstring)
        return build_prompt(self.processor, messages, self.limits.max_images_per_request)

    def sampling_defaults(self) -> dict[str, float]:
        """Temperature and top-p when a request gives none: the checkpoint's generation_config, as vLLM does."""
        config = self.model.generation_config
        if not config.do_sample:
            return {"temperature": 0.0, "top_p": 1.0}
        return {"temperature": float(config.temperature or 1.0), "top_p": float(config.top_p or 1.0)}

    def resolve_max_tokens(self, prompt: Prompt, requested: int | None) -> int:
        return resolve_max_tokens(prompt, requested, self.limits)

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
        if seq.use_result_cache and answer_from_cache(seq, self.result_cache, self.metrics):
            return seq
        held = resident_memory(self._process)
        if self._memory_limit and held > self._memory_limit and not warmup and self.prefix_cache.cost:
            self.prefix_cache.clear()  # stored prefixes go before any request is refused
            held = resident_memory(self._process)
        if self._memory_limit and held > self._memory_limit and not warmup:
            raise MemoryPressure(
                "resident memory %.1f GiB is over the limit of %.1f GiB; try again shortly"
                % (held / 2**30, self._memory_limit / 2**30),
                retry_after=5,
            )
        self.scheduler.enqueue(seq)
        return seq

    # -- the scheduler thread ---------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                background = self.state == "ready" and self.background.pending > 0
                if background:
                    self.background.step()  # one step per pass, so requests never wait long for it
                self.scheduler.run_pass(wait=not background)


# --- helpers ---------------------------------------------------------------------------------


def planned_kv_cache(text_config, dtype: str, limits: LimitSettings) -> int:
    """The key/value cache the plan gave this worker (its batch at its full context, the sizing
    engine's formula), from the loaded model's shape: what the prefix cache may fill when it is free."""
    per_token = sizing.kv_bytes_per_token(
        text_config.num_hidden_layers,
        text_config.num_key_value_heads,
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads,
        getattr(torch, dtype).itemsize,
    )
    return sizing.kv_cache_bytes(per_token, limits.max_batch_size, limits.max_context_tokens)


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
