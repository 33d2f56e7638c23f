"""Loading: from a checkpoint directory to a model ready for the scheduler.

What to load it as (dtype, the vision tower's and the prompts' dtypes, packed weights, threads)
comes from the settings where they name a value, and on `auto` from the sizing plan of this
process alone: its CPUs, its cgroup's memory, the batch and context it serves. So a worker started
by hand takes the same memory-for-speed extras a deployed one would, and none the plan refuses.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vlserve import sizing
from vlserve.errors import ModelDirectoryError
from vlserve.kernels import native
from vlserve.kernels.native import Kernels
from vlserve.kernels.quantized import add_int8_prompt_copies, int4_supported, int8_products_supported
from vlserve.model import decoderops, mapped, outliers, pages
from vlserve.model.checkpoint import load_network
from vlserve.model.config import model_config, read_json
from vlserve.model.packing import (
    convert_vision_tower,
    int8_prompt_copies_from,
    layout_steps,
    pack_language_model,
    packing_supported,
    pending_prefill_copies,
)
from vlserve.model.processor import load_processor
from vlserve.model.weightcache import PreparedWeights, WeightCache
from vlserve.settings import LimitSettings, ModelSettings

log = logging.getLogger(__name__)


def check_model_directory(path: Path) -> None:
    """Fail fast, with a message that says what is wrong, before anything is loaded."""
    if not path.is_dir():
        raise ModelDirectoryError("model directory %s does not exist" % path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelDirectoryError("%s has no config.json: not a Hugging Face checkpoint" % path)
    config = read_json(config_path)
    if config.get("model_type") != "qwen3_vl":
        raise ModelDirectoryError("%s is a %r model, not qwen3_vl" % (path, config.get("model_type")))
    model_config(config)  # every value the network is built from, checked before anything loads
    if not any(path.glob("*.safetensors")):
        raise ModelDirectoryError("%s has no *.safetensors weights" % path)


@dataclass(frozen=True)
class LoadChoices:
    """How to load the model, each choice with where it came from."""

    threads: int
    dtype: str
    vision_dtype: str
    prefill_dtype: str
    packed: bool
    quantize: str
    why: str
    vision_rest_dtype: str = "float32"  # an int8 vision tower's norms, GELU and attention (sizing.vision_rest_dtype)
    plan: dict[str, Any] | None = field(default=None, repr=False)  # this process's sizing plan, if one fits


def choose(model: ModelSettings, limits: LimitSettings, facts: dict[str, Any] | None = None) -> LoadChoices:
    """The settings' explicit values; on `auto`, the plan of one worker with this process's share of the host."""
    facts = facts if facts is not None else sizing.probe(use_libraries=False)
    threads = model.threads or sizing.default_threads(facts)
    policy = sizing.Policy(
        objective="latency",
        max_workers=1,
        dtype=model.dtype,
        max_batch_size=limits.max_batch_size,
        max_context_tokens=limits.max_context_tokens,
        quantize=model.quantize,
    )
    plan = None
    try:
        plan = sizing.plan(facts, policy)
        planned = plan["model"]
        why = "the sizing plan for this process (%s)" % planned["batch_why"]
    except sizing.PlanError as error:
        # Not even one worker fits by the plan's figures: try anyway, without any extra copy.
        dtype = (
            model.dtype
            if model.dtype != "auto"
            else ("bfloat16" if sizing.native_bfloat16(facts["cpu"]) else "float32")
        )
        # The smallest level auto may take here, as the plan would take it.
        level = sizing.auto_levels(facts["cpu"])[0][-1] if model.quantize == "auto" else model.quantize
        planned = {
            "dtype": dtype,
            "vision_dtype": dtype,
            "prefill_dtype": level if level != "none" else dtype,
            "packed_weights": False,
            "quantize": level,
        }
        why = "no extra copies: %s" % error
    return LoadChoices(
        threads=threads,
        dtype=planned["dtype"],
        vision_rest_dtype=sizing.vision_rest_dtype(facts["cpu"], planned["dtype"])[0],
        vision_dtype=planned["vision_dtype"] if model.vision_dtype == "auto" else model.vision_dtype,
        prefill_dtype=planned["prefill_dtype"] if model.prefill_dtype == "auto" else model.prefill_dtype,
        packed=planned["packed_weights"] if model.packed_weights is None else model.packed_weights,
        quantize=planned["quantize"],
        why=why,
        plan=plan,
    )


@dataclass
class LoadedModel:
    """A loaded model and what the scheduler needs to know of it: `choices` as they were taken (a
    choice this host cannot run falls back: int4 without torch's int4 kernels, int8 prompts without
    vlserve's int8 product, packed weights without oneDNN's)."""

    model: Any
    processor: Any
    choices: LoadChoices
    kernels: Kernels  # what its products run on (vlserve.kernels.native)
    pad_id: int
    eos_ids: set[int]
    page_steps: list[Callable[[], None]] = field(default_factory=list)  # weight chunks to read into 2 MiB folios
    layout_steps: list[Callable[[], None]] = field(default_factory=list)  # weights still in a plain layout
    prefill_copies: list = field(default_factory=list)  # layers still waiting for their prompt copy
    rounded_layers: int = 0  # layers this load rounded itself (0: every rounded weight came from the weight cache)

    def settle(self) -> None:
        """Do now, in the engine's order, the work a worker does in the background after ready, so
        what runs next (a benchmark, a measurement) meets the model as a settled worker runs it."""
        for step in self.page_steps:
            step()
        for step in self.layout_steps:
            step()
        for layer in self.prefill_copies:
            layer.make_prefill_copy()
        self.page_steps, self.layout_steps, self.prefill_copies = [], [], []


@dataclass
class _Taken:
    """What loading has taken so far of the choices, and the work it leaves for after ready."""

    vision_dtype: str
    prefill_dtype: str
    kernels: Kernels
    packed: bool = False
    cached: bool = False  # a weight cache file backs this load: int8 prompt copies come from it
    prefill_copies: list = field(default_factory=list)


def load_model(model: ModelSettings, limits: LimitSettings, status: Callable[[str], None]) -> LoadedModel:
    """Load the processor and the model as `choose` decides; call it on the thread that will run the model."""
    path = Path(model.model)
    choices = choose(model, limits)
    torch.set_num_threads(choices.threads)
    log.info("loading as %s", choices)
    status("loading processor from %s" % path)
    processor = load_processor(path)
    processor.image_processor.size = {"shortest_edge": model.min_pixels, "longest_edge": model.max_pixels}
    status("loading %s weights (%d threads)" % (choices.dtype, choices.threads))
    started = time.monotonic()
    level = choices.quantize
    if level == "int4" and not int4_supported():
        log.warning("this torch build has no int4 CPU kernels: quantizing to int8 instead")
        level = "int8"
    # A quantized model loads in the checkpoint's dtype (from its memory map, no copy) and is converted
    # after: loading in float32 first would hold a float32 copy of every weight for a moment.
    load_dtype = getattr(torch, choices.dtype) if level == "none" else torch.bfloat16
    # Before any weight or cache file is opened: the int8 and int4 weights' layouts (and so their
    # cache file) depend on whether vlserve's kernels run, and so does the speed of int8 products.
    kernels = _kernels_for(model, choices, level, load_dtype, status)
    # Decode reads the files a level serves from at every step, fastest from 2 MiB folios: the checkpoint
    # at the exact level, else its weight cache. Settled before they are mapped (vlserve/model/pages.py).
    page_steps = pages.settle_files(sorted(path.glob("*.safetensors"))) if level == "none" else []
    network = load_network(path, load_dtype)
    decoderops.attend_with(network, kernels)
    taken = _Taken(choices.vision_dtype, choices.prefill_dtype, kernels)
    _without_int8_products(taken, choices)
    # Quantized weights come from the weight cache where it has them (at any level, the vision tower's
    # and the int8 prompt copies too).
    root = model.weight_cache_root()
    rounds = level != "none" or "int8" in (taken.vision_dtype, taken.prefill_dtype)
    cache = WeightCache(root, path, level, kernels) if root is not None and rounds else None
    taken.cached = cache is not None
    if cache is not None and level != "none":
        page_steps += pages.settle_files([cache.path])
    prepared = cache.open() if cache is not None else PreparedWeights()
    try:
        # The residual streams' outlier channels, which rounded layers keep exact: found on the exact model
        # (one pass over a generated picture) before anything is rounded, or taken from the weight cache.
        channels = None
        if rounds:
            status("finding the outlier channels (once per weight cache)")
            channels = outliers.channels_for(network, processor, prepared)
        convert = functools.partial(_quantized, level=level) if level != "none" else _exact
        convert(network, taken, choices=choices, prepared=prepared, channels=channels, status=status)
        if cache is not None:
            cache.write(prepared)  # only when something was rounded here
    finally:
        if cache is not None:
            cache.release()  # the lock open() took to round, if a failure came before write()
    tokenizer = processor.tokenizer
    eos = network.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    eos_ids.discard(None)
    log.info(
        "loaded %s in %.1f s: %s (vision %s), %d threads",
        path,
        time.monotonic() - started,
        choices.dtype,
        taken.vision_dtype,
        choices.threads,
    )
    return LoadedModel(
        model=network,
        processor=processor,
        choices=replace(
            choices,
            vision_dtype=taken.vision_dtype,
            prefill_dtype=taken.prefill_dtype,
            packed=taken.packed,
            quantize=level,
        ),
        kernels=kernels,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        eos_ids=eos_ids,
        page_steps=page_steps,
        layout_steps=layout_steps(network),
        prefill_copies=taken.prefill_copies,
        rounded_layers=len(prepared.made),
    )


def _kernels_for(model: ModelSettings, choices: LoadChoices, level: str, load_dtype, status) -> Kernels:
    """vlserve's kernels where a choice runs on them (a quantized level, int8 images or prompts, the
    exact level's packed bfloat16 decode through its own product), else torch's."""
    wanted = (
        level != "none"
        or "int8" in (choices.vision_dtype, choices.prefill_dtype)
        or (choices.packed and load_dtype == torch.bfloat16 and packing_supported(load_dtype))
    )
    if not wanted:
        return native.STOCK_KERNELS
    status("loading vlserve's kernels (built once per host)")
    return native.load(model.native_kernel_root(), build_missing=model.kernels_build)


def _without_int8_products(taken: _Taken, choices: LoadChoices) -> None:
    """Images and prompts in float where vlserve's int8 product did not load."""
    if "int8" in (taken.vision_dtype, taken.prefill_dtype) and not int8_products_supported(taken.kernels):
        # Prompts fall back to the model's own weights: a float32 copy would be 4x the int8 one the plan counted.
        log.warning("vlserve's int8 product is not loaded (%s): images and prompts in float", taken.kernels.status)
        taken.vision_dtype = "float32" if taken.vision_dtype == "int8" else taken.vision_dtype
        taken.prefill_dtype = choices.dtype if taken.prefill_dtype == "int8" else taken.prefill_dtype


def _quantized(network, taken: _Taken, *, choices: LoadChoices, level: str, prepared, channels, status):
    """The language model's linear layers rounded to `level` (int8 or int4), from the weight cache
    where it holds them."""
    status("quantizing the language model to %s" % level)
    _convert_vision_tower(network, taken, choices, prepared, channels)
    copy = taken.prefill_dtype if taken.prefill_dtype not in (level, choices.dtype) else None
    count = pack_language_model(
        network,
        prefill_dtype=None if copy is None else getattr(torch, copy),
        level=level,
        prepared=prepared,
        defer_layouts=True,
        channels=channels,
        kernels=taken.kernels,
    )
    if choices.dtype != "bfloat16":
        network.to(getattr(torch, choices.dtype))  # the rest: embedding, norms (quantized weights stay)
    # The output head has its own int8 copy: the embedding is only looked up, a row per new token, where
    # it lies in the checkpoint's map (which, unlike the weight cache, is not settled at these levels).
    mapped.read_by_rows(network.model.language_model.embed_tokens.weight)
    decoderops.decode_with(network, taken.kernels)  # the norms and rotary in one call each, where loaded
    taken.prefill_dtype = copy or level
    _int8_prompt_copies(network, taken, prepared)
    log.info("quantized %d linear layers to %s (prompts in %s)", count, level, taken.prefill_dtype)


def _exact(network, taken: _Taken, *, choices: LoadChoices, prepared, channels, status):
    """The exact level: weights packed for oneDNN, taken by vlserve's bfloat16 product, or left as loaded.

    Where the plan packs bfloat16 weights and vlserve's own bfloat16 product loads, the weights stay
    plain for it instead: it decodes at the memory's speed where oneDNN's one-row products on AMX
    swing (vlserve/kernels/native.py), and prompts still run on oneDNN. Those weights are not even
    copied: they are multiplied where they lie in the checkpoint's map (packing.NativeBf16Weight)."""
    own = choices.packed and network.dtype == torch.bfloat16 and taken.kernels.bf16_linear() is not None
    packed = not own and choices.packed and packing_supported(network.dtype)
    if choices.packed and not (packed or own):
        log.warning("packed %s weights are not available on this CPU: decoding from plain weights", choices.dtype)
    # A bfloat16 model whose prompts want a float32 copy keeps its layers in the service's own
    # linear layers even unpacked (CPUs without oneDNN's bf16 kernels, docs/sizing.md).
    plain_with_copy = network.dtype == torch.bfloat16 and taken.prefill_dtype == "float32"
    # After the checks above: the network's dtype is its first parameter's, which is the vision tower's.
    _convert_vision_tower(network, taken, choices, prepared, channels)
    if packed or own or plain_with_copy:
        status("packing weights for oneDNN" if packed else "taking the weights out of the checkpoint")
        count = pack_language_model(
            network,
            prefill_dtype=getattr(torch, taken.prefill_dtype),
            packed=packed,
            native=own,
            prepared=prepared,
            defer_layouts=True,
            channels=channels,
            kernels=taken.kernels,
        )
        if own:
            decoderops.decode_with(network, taken.kernels)
        _int8_prompt_copies(network, taken, prepared)
        how = "packed" if packed else "took (vlserve's bfloat16 product)" if own else "took"
        log.info("%s %d linear layers (prompts in %s)", how, count, taken.prefill_dtype)
    elif taken.prefill_dtype == "int8":  # unpacked: float32 models on CPUs with VNNI but no BF16
        add_int8_prompt_copies(network.model.language_model, taken.kernels)
        _int8_prompt_copies(network, taken, prepared)
    else:
        taken.prefill_dtype = choices.dtype  # no copy: prompts on the model's own weights
    taken.packed = packed or own  # the plan's choice, taken: the weights in a decode kernel's layout


def _convert_vision_tower(network, taken: _Taken, choices: LoadChoices, prepared, channels) -> None:
    rest = getattr(torch, choices.vision_rest_dtype)
    vision_dtype = getattr(torch, taken.vision_dtype)
    convert_vision_tower(network, vision_dtype, prepared, channels, rest=rest, kernels=taken.kernels)


def _int8_prompt_copies(network, taken: _Taken, prepared) -> None:
    """Int8 prompt copies mapped from the weight cache (rounded into it on its first start) where a
    cache backs the load; the rest (float32 copies, or int8 ones without a cache) after ready."""
    if taken.cached:
        mapped = int8_prompt_copies_from(network, prepared)
        if mapped:
            log.info("mapped %d int8 prompt copies from the weight cache", mapped)
    taken.prefill_copies = pending_prefill_copies(network)
