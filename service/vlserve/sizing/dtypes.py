"""Dtypes: the language model's, and those of the two compute-bound phases (vision tower, prompts).

Decoding reads every weight once per token, so it wants the narrowest native dtype; the vision tower
and a prompt's prefill are large matrix products, which want the fastest products on this CPU.
"""

from __future__ import annotations

from typing import Any

from .common import gib
from .contract import QUANTIZE_LEVELS
from .footprints import ModelFootprint, worker_memory
from .policy import Policy


def is_arm(cpu: dict[str, Any]) -> bool:
    return cpu.get("arch") in ("aarch64", "arm64")


def bfloat16_feature(cpu: dict[str, Any]) -> str | None:
    """The CPU feature that computes bfloat16 natively, by the architecture's own name, or None."""
    isa = cpu["isa"]
    if is_arm(cpu):
        return "Arm BF16 (bf16)" if isa.get("bf16") else None
    if isa.get("amx_bf16"):
        return "AMX"
    return "AVX-512 BF16" if isa.get("avx512_bf16") else None


def native_bfloat16(cpu: dict[str, Any]) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX-512 BF16, AMX, Arm BF16), so bf16 is the faster dtype."""
    return bfloat16_feature(cpu) is not None


def int8_products(cpu: dict[str, Any]) -> bool:
    """Whether the service's int8 products (vlserve's Q8_0 kernels, service/vlserve/kernels/q8.cpp) beat
    float32 on compute-bound work here: x86 with AVX2 or better. With AVX-512 VNNI, 64-row products (24 x
    6144x2048, 2 threads) took int8 27 ms against float32 321 ms; held to AVX2 (ATEN_CPU_CAPABILITY=avx2,
    ONEDNN_MAX_CPU_ISA=AVX2) a 256-token prompt took 3.96 s at int8 against 4.37 s in float32
    (bench-decode, 2026-12-03, docs/quantization.md). Arm's i8mm is not used by these kernels."""
    isa = cpu["isa"]
    return not is_arm(cpu) and bool(isa.get("avx2") or isa.get("avx512_vnni") or isa.get("amx_int8"))


def quantized_isa(cpu: dict[str, Any]) -> str | None:
    """The ISA on which the int8 and int4 levels' accuracy is established for this CPU, or None.

    vlserve's kernels (service/vlserve/kernels/q8.cpp) round and multiply int8 the same way on AVX-512
    VNNI and on AVX2, bit for bit, and quant-check and the test suite measure both (the suite runs
    held to AVX2 too: docs/quantization.md). Elsewhere (Arm, x86 without AVX2) torch's own kernels
    would serve, whose accuracy this project has not measured."""
    isa = cpu["isa"]
    if is_arm(cpu):
        return None
    if isa.get("avx512_vnni") and isa.get("avx512f"):
        return "AVX-512 VNNI"
    return "AVX2" if isa.get("avx2") else None


def quantize_checked(cpu: dict[str, Any], level: str) -> str:
    """What a plan says of a quantize level's accuracy on this CPU."""
    if level == "none":
        return ""
    checked = quantized_isa(cpu)
    if checked:
        return "accuracy established on %s (docs/quantization.md)" % checked
    why = "Arm" if is_arm(cpu) else "x86 without AVX2"
    return "accuracy not established on this CPU (%s: measure it with vlserve quant-check)" % why


def auto_levels(cpu: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    """The quantize levels `auto` tries, in order, and why a level is left out where it is: only levels
    whose accuracy is established on this CPU's ISA. int8 comes before int4 on every such CPU: it is
    the more accurate (mean KL 0.0016 against 0.038 on the real-size checkpoint) and, through vlserve's
    Q8_0 kernel, the faster to decode on AVX2 too (held to AVX2: 65 ms a step against int4's 123 ms,
    bench-decode, 2026-12-03; oneDNN's int8 product had taken longer than int4's there)."""
    if quantized_isa(cpu) is None:
        return ("none",), "int8 and int4 left out: their accuracy is established on x86 with AVX2 or better only"
    return QUANTIZE_LEVELS, ""


def packed_weights_supported(cpu: dict[str, Any]) -> bool:
    """The service packs bfloat16 weights with oneDNN's x86 bf16 kernels (vlserve/model/packing.py), which
    need AVX-512 BF16 or AMX."""
    return not is_arm(cpu) and native_bfloat16(cpu)


def plan_dtype(
    cpu: dict[str, Any], footprint: ModelFootprint, policy: Policy, available: int, quantize: str = "none"
) -> tuple[str, str]:
    """The language model's dtype (what is not quantized, and the activations): bfloat16 where the CPU
    computes it natively or has AVX2 (decoding is memory-bound), else float32 if it fits."""
    if policy.dtype != "auto":
        return policy.dtype, "set by policy"
    if native_bfloat16(cpu):
        return "bfloat16", "the CPU has %s: half the memory traffic per token" % bfloat16_feature(cpu)
    if not is_arm(cpu) and cpu["isa"].get("avx2"):
        return "bfloat16", (
            "no AVX-512 BF16 or AMX, but a decode step reads half the bytes in bfloat16: held to AVX2, "
            "plain bfloat16 weights decoded a token in 90 ms against float32's 309 (docs/benchmark-history.md); "
            "prompts and images, which are compute-bound, get float32 where it fits"
        )
    lacking = "no Arm BF16 (bf16)" if is_arm(cpu) else "no AVX-512 BF16 or AMX"
    as_float32 = worker_memory(
        footprint, "float32", policy.max_batch_size, policy.max_context_tokens, quantize=quantize
    )
    if as_float32["high_bytes"] <= available:
        return "float32", "%s: bfloat16 would be emulated" % lacking
    return "bfloat16", (
        "no native bfloat16, but a float32 worker needs %s and %s is available: "
        "bfloat16 fits, at emulated speed" % (gib(as_float32["high_bytes"]), gib(available))
    )


def bfloat16_products_fast(cpu: dict[str, Any]) -> str | None:
    """Why bfloat16 matrix products outrun float32 ones on this x86 CPU, or None where they do not.

    AMX runs them on its tiles. AMD's AVX-512 BF16 (Zen 4 on) does too: on a 2-vCPU EPYC VM, torch's
    bfloat16 products of 64-1024 rows took 0.21-0.23 of float32's time (6144x2048 and 2048x6144, 2
    threads), and a `none` worker's first token on a 1280x720 photo came in 2.1 s against 6.7 s with
    the float32 copies, in 5.4 GB settled against 11.8 (2026-12-04, docs/benchmarks.md). Intel's AVX-512
    BF16 without AMX does not: there oneDNN's bf16 products ran at 0.6-0.7 of float32's speed (a
    2-core Sapphire Rapids VM with AMX hidden). Arm's BF16 products are not measured here."""
    if is_arm(cpu):
        return None
    isa = cpu["isa"]
    if isa.get("amx_bf16"):
        return "AMX: bfloat16 matrix products are the fast ones"
    if isa.get("avx512_bf16") and cpu.get("vendor") == "AuthenticAMD":
        return "AVX-512 BF16 on AMD: bfloat16 matrix products are the fast ones (4.5x float32's, no copy)"
    return None


def plan_vision_dtype(cpu: dict[str, Any], dtype: str, quantize: str = "none") -> tuple[str, str]:
    """The vision tower's dtype: it runs once per image on hundreds of patches, so it is compute-bound.

    bfloat16 where its matrix products are the fast ones (`bfloat16_products_fast`), else float32:
    with AVX-512 BF16 alone on Intel, oneDNN's bf16 GEMMs measured 174-190 GFLOP/s against 283 for
    float32 on a 2-core Sapphire Rapids VM (the vision encoder: 3.4 s in bf16, 1.95 s in float32 for a
    448x448 image). Decoding is memory-bound and stays in `dtype`. At a quantize level and with VNNI,
    int8 (vlserve/kernels/quantized.py), the rest of the tower in `vision_rest_dtype`.
    """
    chosen = _compute_dtype(cpu, dtype, quantize, work="the vision tower", float32_why=_FLOAT32_VISION_WHY)
    if chosen[0] != "int8":
        return chosen
    rest, why = vision_rest_dtype(cpu, dtype)
    return "int8", "%s; its norms, GELU and attention in %s, as unquantized: %s" % (chosen[1], rest, why)


_FLOAT32_VISION_WHY = (
    "no AMX: float32 matrix products outrun bfloat16 ones, and the encoder is compute-bound "
    "(its float32 copy costs 0.8 GB)"
)


def vision_rest_dtype(cpu: dict[str, Any], dtype: str) -> tuple[str, str]:
    """What an int8 vision tower computes the rest in (its norms, GELU, attention): the dtype the
    whole tower would take unquantized. On a 2-vCPU Zen 5 (AVX-512 BF16) an int8 tower encoded a
    1280x720 photo in 0.65-0.72 s with the rest in bfloat16 against 1.04-1.20 s in float32 (its
    attention 0.10 against 0.33-0.39 s: vlserve's bfloat16 attention, kernels/prompt_attention.cpp)."""
    return _compute_dtype(
        cpu, dtype, "none", work="the vision tower", float32_why="no AMX: bfloat16 would be no faster here"
    )


def plan_prefill_dtype(cpu: dict[str, Any], dtype: str, quantize: str = "none") -> tuple[str, str]:
    """The dtype of the prompt's pass through the text decoder (prefill), which is compute-bound.

    Decoding reads every weight once per token and wants bfloat16's half-size reads; a prompt of a few
    hundred tokens is a matrix product as big as the vision tower's. Where bfloat16 products are not
    the fast ones (`bfloat16_products_fast`), float32 GEMMs beat oneDNN's packed bfloat16 ones from
    about 48 rows on (0.66-0.72 of the time at 128-256 rows, on a 2-core Sapphire Rapids VM without
    AMX), so a bfloat16 worker keeps a float32 copy of the decoder's linear layers for prompts of 64
    tokens or more. At quantize=int8 prompts run on the int8 weights
    themselves; at int4 through an int8 copy where int8 products are fast (VNNI), for accuracy (int4
    prompts doubled the answers' KL divergence on the real-size checkpoint, docs/quantization.md),
    else on the int4 weights.
    """
    if quantize == "int8" and is_arm(cpu):
        return (
            "int8",
            "quantize=int8: prompts on the int8 weights through torch's weight-only kernel (not measured on Arm)",
        )
    if quantize == "int8":
        return "int8", "quantize=int8: prompts run on the int8 weights themselves (no copy)" + amx_int8_why(cpu)
    if quantize == "int4":
        if int8_products(cpu):
            return (
                "int8",
                "quantize=int4: an int8 copy for prompts, mapped from the weight cache: int4 prompts doubled the "
                "answers' KL divergence (0.070 against 0.039 nats, docs/quantization.md)" + amx_int8_why(cpu),
            )
        return "int4", "quantize=int4: prompts on the int4 weights (int8 products are not fast here)"
    return _compute_dtype(
        cpu,
        dtype,
        quantize,
        work="prompts",
        float32_why="no AMX: float32 matrix products outrun bfloat16 ones on prompts (a float32 copy of the "
        "decoder's linear layers, 5.6 GB, beside the packed bfloat16 one that decodes)",
    )


def _compute_dtype(cpu: dict[str, Any], dtype: str, quantize: str, *, work: str, float32_why: str) -> tuple[str, str]:
    """The fastest products for compute-bound `work`: int8 if asked and fast, bf16 where its products are
    fast (`bfloat16_products_fast`), else float32."""
    fast_bfloat16 = bfloat16_products_fast(cpu)
    if dtype == "float32":
        chosen = "float32", "as the language model"
    elif fast_bfloat16:
        chosen = "bfloat16", fast_bfloat16
    elif is_arm(cpu):
        chosen = "float32", "as on x86 without AMX: bfloat16 matrix products on Arm are not measured faster here"
    else:
        chosen = "float32", float32_why
    if quantize == "none":
        return chosen
    if is_arm(cpu):
        return chosen[0], chosen[1] + "; not int8: its int8 products are vlserve's x86 kernels"
    if not int8_products(cpu):
        return chosen[0], chosen[1] + "; not int8: no AVX2 (int8 would be slower)"
    return "int8", "quantize=%s: %s through dynamic int8 products (numerics change)%s" % (
        quantize,
        work,
        amx_int8_why(cpu),
    )


def amx_int8_why(cpu: dict[str, Any]) -> str:
    """How the int8 weights multiply many rows on an AMX CPU (a clause to append), else "".

    There AMX's bfloat16 tiles outrun vpdpbusd's int8 products, so from 32 rows on
    (vlserve.kernels.native.AMX_PROMPT_ROWS) the rows, unrounded, multiply the int8 weights made bfloat16
    a few tiles at a time in the core's cache (kernels/q8.cpp): on a 2-vCPU Xeon with AMX, a first
    turn's forward (a 480x384 image, 231 tokens) took int8 1.34 s and int4 1.35 against `none`'s 1.31
    (before, with each layer made bfloat16 in memory for oneDNN: 1.55 and 1.57; 2026-12-06,
    docs/quantization.md)."""
    if is_arm(cpu) or not cpu["isa"].get("amx_bf16"):
        return ""
    return "; on AMX, from 32 rows on its bfloat16 tiles, the int8 weights made bfloat16 in the cache (as fast as none)"
