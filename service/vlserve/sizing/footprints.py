"""What the model costs in memory: its footprint as data with provenance, and one worker's bytes."""

from __future__ import annotations

from dataclasses import dataclass

from .common import GIB
from .contract import QUANTIZED_LEVELS


@dataclass(frozen=True)
class ModelFootprint:
    name: str
    parameters: int
    checkpoint_dtype: str
    text_layers: int
    kv_heads: int
    head_dim: int
    tied_head_parameters: int  # the output head shares the input embedding's weights in the checkpoint
    vision_parameters: int  # the vision tower, which may run in another dtype than the language model
    text_linear_parameters: int  # the text decoder's linear layers, of which prompts may use a float32 copy
    activation_bytes: int
    runtime_bytes: int
    provenance: str


FOOTPRINTS = {
    "qwen3-vl-2b-instruct": ModelFootprint(
        name="Qwen3-VL-2B-Instruct",
        parameters=2_128_000_000,
        checkpoint_dtype="bfloat16",
        text_layers=28,
        kv_heads=8,
        head_dim=128,
        tied_head_parameters=151_936 * 2048,
        vision_parameters=407_000_000,
        text_linear_parameters=28 * (2 * 2048 * 2048 + 2 * 1024 * 2048 + 3 * 2048 * 6144),
        activation_bytes=GIB * 3 // 4,
        runtime_bytes=GIB * 6 // 10,
        provenance=(
            "parameters and KV shape from the hub config (revision 89644892); measured by `vlserve "
            "bench-footprint` (tests/fixtures/measured-footprints.json): beside its weights a worker "
            "holds 0.48-0.55 GB up to settled, load peak included (Python, torch, tokenizer, HTTP), "
            "so 0.6 GiB covers the runtime; a batch of four requests, each with a capped image, "
            "leaves 0.55-0.59 GB more that the allocator keeps for the next batch, so 0.75 GiB for "
            "activations (a full batch at the whole context is not measured yet); in bfloat16 the "
            "service packs the output head into its own copy for oneDNN (vlserve/model/packing.py), "
            "so the tied head counts twice (vlserve's own bfloat16 product, where its kernels build, "
            "reads the embedding itself: 0.62 GB under this budget)"
        ),
    ),
}

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
# Bytes per 32 weights, scales included (vlserve/kernels/quantized.py): int8 is llama.cpp's Q8_0, a byte a
# weight and an fp16 scale per block of 32 (where vlserve's kernels run; one float32 scale a row
# elsewhere, a little less); int4 half a byte a weight and a bfloat16 scale and zero point per group
# of 32. The vision tower's and the prefill copy's dtypes may be int8 too; the output head is int8 at
# both levels. A checkpoint with outlier channels keeps at most 32 of them exact per stream (in
# float32, vlserve/model/outliers.py): up to ~80 MB for Qwen3-VL-2B, inside the runtime's allowance.
COMPUTE_BYTES_PER_32 = {"bfloat16": 64, "float32": 128, "int8": 34}
QUANTIZED_BYTES_PER_32_WEIGHTS = {"int8": 34, "int4": 20}
assert tuple(QUANTIZED_BYTES_PER_32_WEIGHTS) == QUANTIZED_LEVELS

# A worker refuses new requests (503, memory_pressure) once its anonymous memory passes this share of
# MemoryHigh, before the kernel starts throttling it (vlserve/runtime/engine.py reads it from its own cgroup).
MEMORY_GUARD_FRACTION = 0.95
MIN_CONTEXT_TOKENS = 2048  # a capped image (~200 tokens), a long question and a long answer
KV_CHUNK_TOKENS = 128  # the service's key/value cache grows by this many tokens at a time (vlserve/runtime/kvcache.py)


def kv_cache_bytes(bytes_per_token: int, sequences: int, context_tokens: int) -> int:
    """The key/value cache a worker plans for: every sequence at its full context, plus the chunk its
    buffer may hold spare. The service keeps earlier prompts' keys and values in what the running
    sequences leave of it (vlserve/runtime/prefixcache.py)."""
    return bytes_per_token * sequences * (context_tokens + KV_CHUNK_TOKENS)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, width: int) -> int:
    """Keys and values of one token through every decoder layer."""
    return 2 * layers * kv_heads * head_dim * width


def worker_memory(
    footprint: ModelFootprint,
    dtype: str,
    batch_size: int,
    context_tokens: int,
    *,
    packed: bool = False,
    vision_dtype: str | None = None,
    prefill_dtype: str | None = None,
    quantize: str = "none",
) -> dict[str, int]:
    """Per-worker memory: steady state (weights + KV + activations + runtime) and the load peak.

    `packed`: the service's oneDNN-packed bfloat16 weights (vlserve/model/packing.py), where the tied output
    head gets its own copy. `vision_dtype`: the vision tower's, when it differs from `dtype`.
    `prefill_dtype`: when it differs from `dtype`, a second copy of the text decoder's linear layers
    in that dtype for prompts (vlserve/model/packing.py). `quantize`: int8 or int4 decoder linear layers and
    an int8 copy of the tied output head, the rest (embedding, norms, vision tower) in `dtype`.
    """
    width = DTYPE_BYTES[dtype]
    weights = footprint.parameters * width
    if quantize != "none":
        weights -= footprint.text_linear_parameters * width
        weights += footprint.text_linear_parameters * QUANTIZED_BYTES_PER_32_WEIGHTS[quantize] // 32
        weights += footprint.tied_head_parameters * COMPUTE_BYTES_PER_32["int8"] // 32  # its int8 copy
    elif packed:
        weights += footprint.tied_head_parameters * width
    if vision_dtype is not None:
        weights += footprint.vision_parameters * (COMPUTE_BYTES_PER_32[vision_dtype] - 32 * width) // 32
    if prefill_dtype is not None and prefill_dtype not in (dtype, quantize):
        weights += footprint.text_linear_parameters * COMPUTE_BYTES_PER_32[prefill_dtype] // 32
    kv_cache = kv_cache_bytes(
        kv_bytes_per_token(footprint.text_layers, footprint.kv_heads, footprint.head_dim, width),
        batch_size,
        context_tokens,
    )
    steady = weights + kv_cache + footprint.activation_bytes + footprint.runtime_bytes
    # Loading into another dtype than the checkpoint's holds both copies for a moment
    # (measured: float32 from a bf16 checkpoint peaks at 12.3 GB for 8.3 GB steady).
    # A quantized model loads in the checkpoint's dtype from its memory map and converts layer by layer.
    peak = weights + footprint.runtime_bytes
    if dtype != footprint.checkpoint_dtype and quantize == "none":
        peak += footprint.parameters * DTYPE_BYTES[footprint.checkpoint_dtype]
    high = max(steady, peak)
    return {
        "weights_bytes": weights,
        "kv_cache_bytes": kv_cache,
        "activation_bytes": footprint.activation_bytes,
        "runtime_bytes": footprint.runtime_bytes,
        "steady_bytes": steady,
        "load_peak_bytes": peak,
        # Workers are counted by MemoryHigh (where the kernel throttles and reclaims); MemoryMax
        # (where it kills) sits 10% above, so a burst is slowed, not fatal, and comes out of the reserve.
        "high_bytes": high,
        "max_bytes": int(high * 1.1),
        "guard_bytes": int(high * MEMORY_GUARD_FRACTION),
    }
