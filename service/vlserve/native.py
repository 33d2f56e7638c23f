"""vlserve's own decode kernels (kernels/decode_vnni.cpp), compiled once per host, loaded by every worker.

The int8 and int4 levels decode through them where the CPU has AVX-512 VNNI: a step's 1-4 rows
times integer weights at about the speed the weights stream from memory. The exact level decodes its
bfloat16 weights through them where the CPU has AVX-512 BF16 too: on AMX CPUs oneDNN's one-row
bfloat16 products swing between about 9 and 20 GB/s (eighty 6144x2048 products: 121-221 ms
medians, processes alternating), this one holds 19-20 GB/s (104-108 ms) in the same runs. Measured here (2 threads,
eighty 6144x2048 products, beyond the last-level cache, side by side): int8 one row 53-55 ms
against oneDNN's 122-136 ms (`torch._int_mm` 99-115), four rows 84-90 against 117-134; int4 one row
26 ms against torch's int4 kernel's 30-33, four rows 39 against 61. The int8 product equals the
`torch._int_mm` path bit for bit (the source says how); the int4 one rounds its inputs to int8 per
block of 32, as llama.cpp's Q4_0 x Q8_0 products do, where torch's kernel takes bfloat16 inputs.

They are built with the host's C++ compiler against the installed torch, the first time a worker
needs them, into `<cache>/decode_vnni-<key>.so` (about 8 s); the key digests the source, torch's
version, the compiler's version and the flags, so an upgrade of any of them builds a new file and a
stale one is never loaded. A lock file serialises builds, which go to a temporary name and are
renamed, so workers starting together build once and none loads a half-written file. Before use,
each op is checked against a reference computed in Python.

Where they cannot be had (not x86-64, no AVX-512 VNNI, torch held below AVX-512 by
ATEN_CPU_CAPABILITY, no compiler, a failed build or check, `native_kernels: off`) the reason is
logged once, shown by /readyz and /status, and torch's kernels serve.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "decode_vnni.cpp"
MAX_ROWS = 4  # the kernel's rows per call: decode batches up to four; more rows go to torch._int_mm
INPUT_MULTIPLE = 64  # its inputs per vpdpbusd: a layer whose inputs are not a multiple stays stock
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
BF16_FLAG = "avx512_bf16"  # bf16_linear's vdpbf16ps, beyond CPU_FLAGS
BF16_INPUT_MULTIPLE = 32  # its inputs per vdpbf16ps
# /readyz's line where no level asked for the kernels (the exact level on a CPU without AVX-512 BF16)
STOCK = "torch's kernels (vlserve's own serve the int8 and int4 levels, and bfloat16 on AVX-512 BF16)"
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")  # no FMA: equal results
BUILD_TIMEOUT_S = 600
# How far the norm op may be from transformers' RMSNorm, relative: its float32 sum of squares adds in
# another order, which moves a float32 result by a few units in the last place and a bfloat16 one
# by at most one (where the float32 value was near a tie).
NORM_TOLERANCE = {torch.float32: 8 * 2.0**-23, torch.bfloat16: 2 * 2.0**-7}


class NativeUnavailable(Exception):
    """Why the native kernel cannot serve on this host, in one line."""


def _cpu_flags() -> list[str] | None:
    try:
        return next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return None


def cpu_reason() -> str | None:
    """Why this CPU (or torch's view of it) cannot run the kernel; None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86-64 CPU (%s)" % platform.machine()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX512_BF16", "AMX"):  # names torch has used for AVX-512 and up
        return "torch runs its kernels at %s (ATEN_CPU_CAPABILITY or the CPU), below AVX-512" % capability
    flags = _cpu_flags()
    if flags is None:
        return "cannot read the CPU's flags from /proc/cpuinfo"
    missing = [flag for flag in CPU_FLAGS if flag not in flags]
    return "the CPU lacks %s" % ", ".join(missing) if missing else None


def compiler() -> str:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    found = shutil.which(os.environ.get("CXX", "")) if os.environ.get("CXX") else None
    found = found or shutil.which("c++") or shutil.which("g++")
    if not found:
        raise NativeUnavailable("no C++ compiler (install g++, or set CXX)")
    return found


def _command(cxx: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension  # noqa: PLC0415 - only when building

    includes = ["-I" + path for path in cpp_extension.include_paths()]
    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *COMPILE_FLAGS,
        abi,
        *includes,
        str(SOURCE),
        "-L" + torch_lib,
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def library_path(root: Path, cxx: str) -> Path:
    """Where the build for this source, torch, compiler and flags lives."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeUnavailable("the compiler %s does not run (%s)" % (cxx, error)) from error
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), version.encode(), " ".join(COMPILE_FLAGS).encode()):
        key.update(hashlib.sha256(part).digest())
    key.update((sysconfig.get_config_var("SOABI") or "").encode())
    return root / ("decode_vnni-%s.so" % key.hexdigest()[:16])


def build(root: Path) -> tuple[Path, bool]:
    """The compiled library under `root`, built unless already there: (path, whether built now)."""
    cxx = compiler()
    path = library_path(root, cxx)
    if path.is_file():
        return path, False
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = (root / ".build.lock").open("w")
    except OSError as error:
        raise NativeUnavailable("cannot write %s (%s)" % (root, error)) from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be building it: wait, then find it
        if path.is_file():
            return path, False
        handle, temporary = tempfile.mkstemp(dir=root, prefix=".", suffix=".so.partial")
        os.close(handle)
        try:
            result = subprocess.run(
                _command(cxx, Path(temporary)), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if result.returncode != 0:
                log.warning("native kernel: the build failed:\n%s", result.stderr[-4000:])
                last = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise NativeUnavailable("the build with %s failed: %s" % (cxx, last))
            os.replace(temporary, path)
        except subprocess.TimeoutExpired as error:
            raise NativeUnavailable("the build took over %d s" % BUILD_TIMEOUT_S) from error
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return path, True


def _check(ops) -> None:
    """The loaded kernels against references on a few shapes: a miscompiled build is not used. int8:
    the Python path, bit for bit (then rounded to bfloat16 for bfloat16 rows). int4: the same rounded
    quantities summed in float64."""
    from vlserve.quantized import INT4_GROUP, _int4_groups, int4_blocks, quantize_rows  # noqa: PLC0415 - cyclic

    generator = torch.Generator().manual_seed(0)
    for rows, inputs, outputs in ((1, 64, 5), (3, 192, 12), (4, 128, 9)):
        weight, scales = quantize_rows(torch.randn(outputs, inputs, generator=generator))
        bias = torch.randn(outputs, generator=generator)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, inputs, generator=generator).to(dtype)
            values, row_scales = quantize_rows(x)
            sums = values.double() @ weight.double().t()  # exact: integers far below 2**53
            expected = sums.float().mul_(row_scales[:, None]).mul_(scales).add_(bias).to(dtype)
            got = ops.int8_linear(x, weight, scales, bias)
            if not torch.equal(got, expected):
                raise NativeUnavailable(
                    "its int8 check differs from the reference by %.3g" % (got - expected).abs().max()
                )
    for rows, inputs, outputs in ((1, 128, 64), (2, 64, 128), (5, 96, 64)):
        levels, scales, lows = _int4_groups(torch.randn(outputs, inputs, generator=generator), INT4_GROUP)
        x = torch.randn(rows, inputs, generator=generator)
        blocks, block_scales = quantize_rows(x.reshape(-1, INT4_GROUP))  # the kernel's input rounding
        x_rounded = (blocks.double() * block_scales.double()[:, None]).reshape(rows, inputs)
        scale_w, low_w = scales.bfloat16().double(), lows.bfloat16().double()
        weight = levels.double() * scale_w.repeat_interleave(INT4_GROUP, 1) + low_w.repeat_interleave(INT4_GROUP, 1)
        expected = x_rounded @ weight.t()
        got = ops.int4_linear(x, int4_blocks(levels, scales, lows)).double()
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())):
            raise NativeUnavailable("its int4 check differs from the reference by %.3g" % (got - expected).abs().max())
    if _state.bf16:
        _check_bf16(ops, generator)
    _check_decoder_ops(ops, generator)


def _check_bf16(ops, generator: torch.Generator) -> None:
    """The bfloat16 product against the exact sum of the same bfloat16 values: within the result's
    rounding to bfloat16 and float32's accumulation error."""
    for rows, inputs, outputs in ((1, 64, 5), (3, 96, 12), (4, 256, 9)):
        weight = torch.randn(outputs, inputs, generator=generator).bfloat16()
        x = torch.randn(rows, inputs, generator=generator).bfloat16()
        for bias in (None, torch.randn(outputs, generator=generator).bfloat16()):
            expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
            got = ops.bf16_linear(x, weight, bias).double()
            if not torch.allclose(got, expected, rtol=2**-8, atol=1e-4 * inputs):
                raise NativeUnavailable(
                    "its bfloat16 check differs from the reference by %.3g" % (got - expected).abs().max()
                )


def _check_decoder_ops(ops, generator: torch.Generator) -> None:
    """The norm and rotary ops against transformers' own (rotary bit for bit, the norm within
    NORM_TOLERANCE), the attention op against vlserve.attention's Python path (within a unit of
    bfloat16: its float32 sums add in another order, which may move a rounding)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm  # noqa: PLC0415 - only here

    from vlserve import attention  # noqa: PLC0415 - it imports this module

    for dtype, tolerance in NORM_TOLERANCE.items():
        norm = Qwen3VLTextRMSNorm(128, eps=1e-6).to(dtype)
        norm.weight.data = torch.randn(128, generator=generator).to(dtype)
        x = torch.randn(3, 2, 128, generator=generator).to(dtype)
        expected, got = norm(x).float(), ops.rms_norm(x, norm.weight, 1e-6).float()
        if not torch.all((got - expected).abs() <= expected.abs() * tolerance):
            raise NativeUnavailable("its norm check differs from transformers' by %.3g" % (got - expected).abs().max())
        q = torch.randn(2, 3, 4, 64, generator=generator).to(dtype).transpose(1, 2)  # a transposed view, as served
        k = torch.randn(2, 3, 2, 64, generator=generator).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(2, 3, 64, generator=generator).to(dtype) for _ in range(2))
        # transformers' apply_rotary_pos_emb, written out: decoderops may have replaced it already.
        c, s = cos[:, None], sin[:, None]
        expected_q, expected_k = (x * c + torch.cat((-x[..., 32:], x[..., :32]), -1) * s for x in (q, k))
        got_q, got_k = ops.rotary(q, k, cos, sin)
        if not (torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)):
            raise NativeUnavailable("its rotary check differs from transformers'")
    query = torch.randn(2, 1, 4, 32, generator=generator).bfloat16().transpose(1, 2)
    key, value = (torch.randn(2, 2, 9, 32, generator=generator).bfloat16() for _ in range(2))
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :3] = False  # a left-padded sequence
    expected = attention.one_query_attention(query, key, value, mask, scaling=0.2).float()
    got = ops.one_query_attention(query, key, value, mask, 0.2).float()
    if not torch.allclose(got, expected, rtol=2**-7, atol=1e-3):
        raise NativeUnavailable(
            "its attention check differs from the Python path by %.3g" % (got - expected).abs().max()
        )


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = None
        self.bf16 = False  # the CPU runs bf16_linear (AVX-512 BF16)
        self.status: str | None = None  # None: not asked for (quantize=none on a CPU without AVX-512 BF16)


_state = _State()


def enable(root: Path | None) -> str:
    """Build (when missing) and load the kernel from `root` (None: off); returns the status line that
    is also logged and shown on /status. Later calls return the first call's outcome."""
    with _state.lock:
        if _state.status is not None:
            return _state.status
        try:
            if root is None:
                raise NativeUnavailable("switched off (native_kernels: off)")
            reason = cpu_reason()
            if reason:
                raise NativeUnavailable(reason)
            path, built = build(root)
            torch.ops.load_library(str(path))
            ops = torch.ops.vlserve
            _state.bf16 = BF16_FLAG in (_cpu_flags() or [])
            _check(ops)
        except NativeUnavailable as error:
            _state.bf16 = False
            _state.status = "stock kernels: %s" % error
            log.info("native kernel: %s", _state.status)
        except (OSError, RuntimeError) as error:  # load_library's and the op's errors
            _state.bf16 = False
            _state.status = "stock kernels: the built kernel does not load (%s)" % str(error).splitlines()[0]
            log.warning("native kernel: %s", _state.status)
        else:
            _state.ops = ops
            _state.status = "vlserve's decode kernels (%s products, norm, rotary, attention) %s %s" % (
                "bf16/int8/int4" if _state.bf16 else "int8/int4",
                "built into" if built else "loaded from",
                path,
            )
            log.info("native kernel: %s", _state.status)
        return _state.status


def status() -> str:
    """What serves the decode products in this process, as /readyz and /status show it."""
    return (
        _state.status
        or "torch's kernels (vlserve's own serve the int8 and int4 levels, and bfloat16 ones on AVX-512 BF16)"
    )


def int8_linear():
    """The loaded int8 op, or None: (rows <= MAX_ROWS, in) float32 or bfloat16 x (out, in) int8, scales,
    bias -> (rows, out) in the rows' dtype."""
    return None if _state.ops is None else _state.ops.int8_linear


def bf16_linear():
    """The loaded bfloat16 op where the CPU runs it, or None: (rows <= MAX_ROWS, in) bfloat16 x (out, in)
    bfloat16, bias or None -> (rows, out) bfloat16; `in` a multiple of BF16_INPUT_MULTIPLE."""
    return None if _state.ops is None or not _state.bf16 else _state.ops.bf16_linear


def int4_linear():
    """The loaded int4 op, or None: (rows, in) float32 or bfloat16 x blocks (quantized.int4_blocks) ->
    (rows, out) in the rows' dtype."""
    return None if _state.ops is None else _state.ops.int4_linear


def rms_norm():
    """The loaded norm op, or None: (..., d) float32 or bfloat16 rows, (d,) weight of their dtype, eps ->
    transformers' Qwen3VLTextRMSNorm of them (vlserve.decoderops)."""
    return None if _state.ops is None else _state.ops.rms_norm


def rotary():
    """The loaded rotary op, or None: q, k (batch, heads, tokens, dim) and cos, sin (batch, tokens, dim)
    of one dtype -> transformers' apply_rotary_pos_emb of them (vlserve.decoderops)."""
    return None if _state.ops is None else _state.ops.rotary


def one_query_attention():
    """The loaded attention op, or None: q (batch, heads, 1, dim), key and value (batch, kv_heads, tokens,
    dim) with a contiguous last dimension, mask or None, scale -> (batch, 1, heads, dim) as
    vlserve.attention.one_query_attention computes it."""
    return None if _state.ops is None else _state.ops.one_query_attention


def int4_layout() -> str:
    """Which layout int4 weights take in this process (the weight cache keeps each in its own file)."""
    return "blocks" if int4_linear() is not None else "int4pack"
