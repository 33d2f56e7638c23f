"""vlserve's own kernels (kernels/*.cpp), compiled once per host, loaded by every worker.

Two ISA tiers, picked from the CPU and torch's view of it (ATEN_CPU_CAPABILITY holds both back):

- `avx512_vnni`: every op. The int8 and int4 levels decode through its products (a step's 1-4 rows
  times integer weights at about the speed the weights stream from memory) and the int8 product runs
  prompts and images too; the exact level decodes its bfloat16 weights through bf16_linear where the
  CPU has AVX-512 BF16 (on AMX CPUs oneDNN's one-row bfloat16 products swing between about 9 and 20
  GB/s, this one holds 19-20 GB/s); the decoder's norm, rotary and one-query attention in one call each,
  and a decode step's whole decoder layer in one call (kernels/decoder_layer.cpp); with AVX-512 BF16
  too, the attention of prompts and images in bfloat16 (kernels/prompt_attention.cpp). With AMX, a
  prompt's or image's int8 products from AMX_PROMPT_ROWS rows on run on AMX's bfloat16 tiles (q8_amx:
  the weight made bfloat16 a few tiles at a time in the core's cache): faster than vpdpbusd there.
- `avx2` (AVX2, FMA and F16C: every x86-64 server CPU since 2013, and AVX-512 CPUs without VNNI):
  the int8 product (kernels/q8.cpp, equal to the AVX-512 one bit for bit), the norm and the rotary.
  int4 weights go through torch's int4 kernel there, attention through vlserve.model.attention's Python path.

Both tiers also carry the benchmarks' memory read (kernels/stream_read.cpp): the bandwidth bound a
decode step is held against is the faster of it and torch's read (vlserve.bench.bandwidth).

The int8 product is llama.cpp's Q8_0 x Q8_0 (q8.cpp): weights and inputs rounded per block of 32,
so an input channel many times larger than the rest coarsens its own block only. It replaces
oneDNN's int8 kernels, which round a whole row with one scale and, on CPUs without VNNI, saturate
their 16-bit pair sums (held to AVX2 here, torch._int_mm and oneDNN's prepacked product returned
wrong sums: docs/quantization.md). The int4 product rounds its inputs the same way.

They are built with the host's C++ compiler against the installed torch into
`<cache>/vlserve_kernels-<key>.so` (about 25 s); the key digests the sources and the header, torch's version, the
Python ABI and the flags, so an upgrade of any of them builds a new file and a stale one is never
loaded. On a deployed host `vlserve kernels` builds and checks them before any worker starts (the
deploy role's step: workers run with `kernels_build` off and only load, so no compiler runs in a
unit's start), records the outcome in `<cache>/build.json` and removes the builds of other keys; a
later run whose inputs are those of the record answers from it without torch (vlserve.kernels.record).
Elsewhere the first worker that needs them builds them. A lock file serialises builds, which go to
a temporary name and are renamed, so workers starting together build once and none loads a
half-written file. Before use, each op of the tier is checked against a reference computed in
Python (vlserve.kernels.checks).

Where they cannot be had (not x86-64, no AVX2, torch held below AVX2, no compiler, a failed build or
check, `native_kernels: off`) the reason is logged once, shown by /readyz and /status, and torch's
kernels serve: int8 weights then keep one scale per output row and multiply exact inputs through
torch's weight-only product (slower on prompts), int4 weights torch's int4 kernel.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlserve.kernels import checks, record
from vlserve.kernels.record import cpuinfo_field
from vlserve.sizing.contract import KERNELS_OWN, KERNELS_STOCK

log = logging.getLogger(__name__)

KERNELS = Path(__file__).parent  # the C++ sources sit beside this module
SOURCES = (
    KERNELS / "decode_vnni.cpp",
    KERNELS / "q8.cpp",
    KERNELS / "prompt_attention.cpp",
    KERNELS / "decoder_layer.cpp",
    KERNELS / "stream_read.cpp",
)
HEADERS = (KERNELS / "ops.h", KERNELS / "lanes.h")  # part of the build's key, not of its command
# Rows the model sends to bf16_linear (decode batches, short prompts such as a second question);
# more go to oneDNN. A step's 112 mapped matrices of the real-size model on a Zen 5 (2 threads):
# bf16_linear took 0.74x oneDNN's time at 4 rows, 0.80x at 8, 0.87x at 16, 1.08x at 32.
MAX_ROWS = 16
# The ISA tiers, best first: the CPU flags each needs (as /proc/cpuinfo spells them) and the torch CPU
# capabilities that allow it (ATEN_CPU_CAPABILITY=avx2 holds an AVX-512 CPU to the avx2 tier).
AVX512_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX")  # names torch has used for AVX-512 and up
TIERS = {
    "avx512_vnni": (("avx512f", "avx512bw", "avx512_vnni"), AVX512_CAPABILITIES),
    "avx2": (("avx2", "fma", "f16c"), ("AVX2", *AVX512_CAPABILITIES)),
}
TIER_NAMES = {"avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2"}
BF16_FLAG = "avx512_bf16"  # bf16_linear's vdpbf16ps, beyond the avx512_vnni tier's flags
# With AMX, torch's flash attention multiplies bfloat16 prompts on its tiles (prompt_attention's
# vdpbf16ps is not measured against them): there prompts and images keep sdpa.
AMX_FLAG = "amx_bf16"
# With AMX, the int8 products of this many bfloat16 rows or more run on its tiles (q8_amx), which pay
# the weight's conversion whatever the rows: on a 2-vCPU Xeon with AMX (two threads, medians of 7),
# 12288 x 2048 at 32 rows 2.15 ms against 2.46 on vpdpbusd, 2048 x 6144 1.10 against 1.28; at 16 rows
# 2.58 against 1.53 and 1.40 against 0.71; at 256 rows 7.7 against 18.1 and 3.8 against 9.3.
AMX_PROMPT_ROWS = 32
BF16_INPUT_MULTIPLE = 32  # its inputs per vdpbf16ps
PROMPT_ATTENTION_DIM_MULTIPLE = 64  # prompt_attention's head dimension: four vectors of its output tile
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")  # no FMA: equal results
BUILD_TIMEOUT_S = 600


class NativeUnavailable(Exception):
    """Why the native kernel cannot serve on this host, in one line."""


def _cpu_flags() -> list[str] | None:
    field = cpuinfo_field("flags")
    return None if field is None else field.split()


def amx_allowed() -> bool:
    """Whether the CPU has AMX BF16 and ONEDNN_MAX_CPU_ISA, where set, allows it (AVX512_CORE_AMX and up,
    ALL, DEFAULT): the variable that holds torch's products below AMX holds vlserve's too, so one
    setting imitates a CPU without it."""
    if AMX_FLAG not in (_cpu_flags() or []):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not cap or "AMX" in cap or cap in ("ALL", "DEFAULT")


def cpu_tier() -> tuple[str | None, str]:
    """(the best ISA tier this CPU and torch's view of it allow, or None; why, in a few words)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, "not an x86-64 CPU (%s)" % platform.machine()
    flags = _cpu_flags()
    if flags is None:
        return None, "cannot read the CPU's flags from /proc/cpuinfo"
    capability = torch.backends.cpu.get_cpu_capability()
    for tier, (needed, capabilities) in TIERS.items():
        if capability in capabilities and all(flag in flags for flag in needed):
            held = "" if tier == "avx512_vnni" or "avx512_vnni" not in flags else " (torch held to %s)" % capability
            return tier, "the CPU has %s%s" % (TIER_NAMES[tier], held)
    missing = [flag for flag in TIERS["avx2"][0] if flag not in flags]
    if missing:
        return None, "the CPU lacks %s" % ", ".join(missing)
    return None, "torch runs its kernels at %s (ATEN_CPU_CAPABILITY or the CPU), below AVX2" % capability


def cpu_tiers() -> list[str]:
    """Every tier whose instructions this CPU has, best first, whatever torch's view (for tests and tools
    that ask the ops for a given tier)."""
    flags = _cpu_flags() or []
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return [tier for tier, (needed, _) in TIERS.items() if all(flag in flags for flag in needed)]


def cpu_reason() -> str | None:
    """Why this CPU (or torch's view of it) can run none of the kernels; None when a tier applies."""
    tier, why = cpu_tier()
    return None if tier else why


def compiler() -> str:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    found = shutil.which(os.environ.get("CXX", "")) if os.environ.get("CXX") else None
    found = found or shutil.which("c++") or shutil.which("g++")
    if not found:
        raise NativeUnavailable("no C++ compiler (install g++, or set CXX)")
    return found


def _unit() -> str:
    """The one translation unit the compiler reads (from its standard input): every source included.
    torch's headers, most of each source's compile time, are then parsed once: a build takes half the
    time of one unit per source (20 against 39 s on a 2-core Xeon). The sources keep their helpers in
    anonymous namespaces, which one unit shares: a name two of them defined would be a compile error,
    or with other parameter types a silent overload, so test_native holds every file-local name to
    one source, and a helper two sources need lives in a header (lanes.h)."""
    return "".join('#include "%s"\n' % source for source in SOURCES)


def _command(cxx: str, output: Path) -> list[str]:
    """One compiler run over _unit(): every source into one library (each ISA's functions carry their own target)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - only when building

    includes = ["-I" + path for path in (str(KERNELS), *cpp_extension.include_paths())]  # ops.h from any source
    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *COMPILE_FLAGS,
        abi,
        *includes,
        "-x",
        "c++",
        "-",
        "-x",
        "none",
        "-L" + torch_lib,
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(output),
    ]


def library_path(root: Path) -> Path:
    """Where the build for these sources, this torch, this Python and these flags lives. The
    compiler's version is not part of it: loading then needs no compiler, and a build stays good."""
    key = hashlib.sha256()
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    for part in (*sources, torch.__version__.encode(), " ".join(COMPILE_FLAGS).encode()):
        key.update(hashlib.sha256(part).digest())
    key.update((sysconfig.get_config_var("SOABI") or "").encode())
    return root / ("vlserve_kernels-%s.so" % key.hexdigest()[:16])


def _compiler_version(cxx: str) -> str:
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeUnavailable("the compiler %s does not run (%s)" % (cxx, error)) from error
    return (result.stdout.splitlines() or [cxx])[0]


def prune(root: Path, keep: Path) -> list[Path]:
    """Remove the builds under `root` other than `keep` (a running worker keeps its mapped copy)."""
    removed = []
    for path in [*root.glob("vlserve_kernels-*.so"), *root.glob(".*.so.partial")]:
        if path != keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(path)
    return removed


def build(root: Path) -> tuple[Path, bool]:
    """The compiled library under `root`, built unless already there: (path, whether built now)."""
    path = library_path(root)
    if path.is_file():
        return path, False
    cxx = compiler()
    _compiler_version(cxx)  # a compiler that does not run fails here, in one line
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
                _command(cxx, Path(temporary)),
                input=_unit(),
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
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


TIER_OPS = {
    "avx512_vnni": "int8/int4 products, norm, rotary, attention, decoder layer",
    "avx2": "int8 products, norm, rotary",
}
# /readyz's line where no level asked for the kernels (the exact level on a CPU without AVX-512 BF16)
STOCK = "torch's kernels (vlserve's own serve the int8 and int4 levels, and bfloat16 on AVX-512 BF16)"


@dataclass(frozen=True, eq=False)  # one object per outcome: bound formats are cached by identity
class Kernels:
    """What serves the products in a process: vlserve's library at one ISA tier (`ops`), or torch's
    (`ops` None). Made by `load`, handed by the loader to every layer, format and op that uses it."""

    ops: Any = None
    tier: str | None = None  # the ISA tier whose ops are loaded
    bf16: bool = False  # the CPU runs bf16_linear (AVX-512 BF16)
    prefetch_rows: int = 1  # bf16_linear prefetches from this many rows on (the library's bf16_prefetch_rows)
    prompts: bool = False  # prompt_attention serves bfloat16 prompts and images (AVX-512 BF16, no AMX)
    amx: bool = False  # AMX's tiles multiply long int8 products (q8_amx)
    status: str = STOCK  # as /readyz and /status show it

    def q8_linear(self):
        """The int8 op for this tier, or None: (rows, in) float32 or bfloat16 x tiles (formats.q8_tiles),
        bias or None, outputs -> (rows, outputs) in the rows' dtype; `in` a multiple of Q8_BLOCK."""
        if self.ops is None:
            return None
        op, isa = self.ops.q8_linear, self.tier
        return lambda x, tiles, bias, outputs: op(x, tiles, bias, outputs, isa)

    def q8_amx(self):
        """The int8 op for AMX_PROMPT_ROWS bfloat16 rows or more where AMX runs it, else None: (rows, in)
        bfloat16 x tiles (formats.q8_tiles), bias or None, outputs -> (rows, outputs) bfloat16, the rows
        unrounded times each weight times its block's scale rounded to bfloat16 (nearest even), summed
        in float32, plus the bias, rounded once."""
        return self.ops.q8_amx if self.amx else None

    def bf16_linear(self):
        """The bfloat16 op where the CPU runs it, or None: (rows, in) bfloat16 x (out, in)
        bfloat16, bias or None -> (rows, out) bfloat16; `in` a multiple of BF16_INPUT_MULTIPLE."""
        if self.ops is None or not self.bf16:
            return None
        op, prefetch = self.ops.bf16_linear, self.prefetch_rows
        return lambda x, weight, bias: op(x, weight, bias, prefetch)

    def prompt_attention(self):
        """The attention op for many queries where it serves them (`prompts`), or None: q (batch,
        heads, queries, dim), key and value (batch, kv_heads, tokens, dim), bfloat16 with a contiguous
        last dimension, dim a multiple of PROMPT_ATTENTION_DIM_MULTIPLE; mask None, boolean or float32
        (4 dims, broadcastable, contiguous along the tokens), scale -> (batch, queries, heads, dim) as
        reference.prompt_attention computes it."""
        return self.ops.prompt_attention if self.prompts else None

    def int4_linear(self):
        """The int4 op (avx512_vnni tier), or None: (rows, in) float32 or bfloat16 x blocks
        (formats.int4_blocks) -> (rows, out) in the rows' dtype."""
        return None if self.tier != "avx512_vnni" else self.ops.int4_linear

    def rms_norm(self):
        """The norm op, or None: (..., d) float32 or bfloat16 rows, (d,) weight of their dtype, eps ->
        transformers' Qwen3VLTextRMSNorm of them (vlserve.model.decoderops)."""
        return None if self.ops is None else self.ops.rms_norm

    def rotary(self):
        """The rotary op, or None: q, k (batch, heads, tokens, dim) and cos, sin (batch, tokens, dim)
        of one dtype -> transformers' apply_rotary_pos_emb of them; bfloat16 q and k with float32
        tables -> the vision tower's (network.apply_vision_rotary) (vlserve.model.decoderops)."""
        return None if self.ops is None else self.ops.rotary

    def one_query_attention(self):
        """The attention op (avx512_vnni tier), or None: q (batch, heads, 1, dim), key and value
        (batch, kv_heads, tokens, dim) with a contiguous last dimension, mask or None, scale ->
        (batch, 1, heads, dim) as kernels/reference.py's one_query_attention computes it."""
        return None if self.tier != "avx512_vnni" else self.ops.one_query_attention

    def decoder_layer(self):
        """The decode step's layer op (avx512_vnni tier: it attends through one_query_attention), or None:
        (Product, make_layer). Product(kind, weights, bias, outputs, columns, column_weights, rows,
        row_weights, row_bias) is one linear layer's (or fused group's) weight; make_layer(input_norm,
        post_norm, q_norm, k_norm, eps, qkv, o, gate_up, down, heads, kv_heads, head_dim, intermediate,
        scale) a layer whose decode(hidden, cos, sin, key_buffer, value_buffer, start, mask) is
        Qwen3VLTextDecoderLayer's forward of one token a row, bit for bit (kernels/decoder_layer.cpp;
        vlserve.model.decoderops builds them from a loaded model)."""
        if self.tier != "avx512_vnni":
            return None
        classes, prefetch, isa = torch.classes.vlserve, self.prefetch_rows, self.tier
        return classes.Product, lambda *args: classes.DecoderLayer(*args, prefetch, isa)

    def stream_read(self):
        """The memory read op (both tiers), or None: a contiguous 1-d uint8 tensor -> the sum of its
        bytes, read once with every line prefetched ahead (kernels/stream_read.cpp): the benchmarks'
        measure of the memory's read speed (vlserve.bench.bandwidth)."""
        if self.ops is None:
            return None
        op, isa = self.ops.stream_read, self.tier
        return lambda buffer: op(buffer, isa)

    def int8_layout(self) -> str:
        """Which layout int8 weights take (the weight cache keeps each in its own file)."""
        return "q8tiles" if self.q8_linear() is not None else "rows"

    def int4_layout(self) -> str:
        """Which layout int4 weights take (the weight cache keeps each in its own file)."""
        return "blocks" if self.int4_linear() is not None else "int4pack"


STOCK_KERNELS = Kernels()  # torch's alone: a process that never asked for vlserve's
_lock = threading.Lock()
_outcome: Kernels | None = None  # the process's one outcome: its library is loaded once, for good


def load(root: Path | None, build_missing: bool = True) -> Kernels:
    """Build (when missing and `build_missing`), load and check the kernels from `root` (None: off); the
    status line is also logged. The library is process-wide, so later calls return the first
    call's outcome."""
    global _outcome  # noqa: PLW0603 - the record of what this process loaded, set once
    with _lock:
        if _outcome is None:
            _outcome = _load(root, build_missing)
        return _outcome


def _built(root: Path) -> tuple[Path, bool]:
    """The library `vlserve kernels` built under `root`, for a worker that must not build it."""
    path = library_path(root)
    if path.is_file():
        return path, False
    said = (record.read(root) or {}).get("status")
    if not isinstance(said, str):
        said = "no record in %s" % (root / record.BUILD_RECORD)
    raise NativeUnavailable("not built for this release and torch (vlserve kernels: %s)" % said)


def _load(root: Path | None, build_missing: bool = True) -> Kernels:
    try:
        if root is None:
            raise NativeUnavailable("switched off (native_kernels: off)")
        tier, why = cpu_tier()
        if tier is None:
            raise NativeUnavailable(why)
        path, built = build(root) if build_missing else _built(root)
        torch.ops.load_library(str(path))
        ops = torch.ops.vlserve
        bf16 = tier == "avx512_vnni" and BF16_FLAG in (_cpu_flags() or [])
        # q8_amx converts with vcvtne2ps2bf16 (AVX-512 BF16); Linux before 5.16 refuses the tiles
        amx = bf16 and amx_allowed() and bool(ops.amx_permitted())
        checks.check(ops, tier, bf16, amx)
    except (NativeUnavailable, checks.Mismatch) as error:
        kernels = Kernels(status=KERNELS_STOCK + str(error))
        log.info("native kernels: %s", kernels.status)
        return kernels
    except (OSError, RuntimeError) as error:  # load_library's and the op's errors
        kernels = Kernels(status=KERNELS_STOCK + "the built kernels do not load (%s)" % str(error).splitlines()[0])
        log.warning("native kernels: %s", kernels.status)
        return kernels
    status = KERNELS_OWN + "%s (%s%s%s) %s %s" % (
        TIER_NAMES[tier],
        "bf16/" if bf16 else "",
        TIER_OPS[tier],
        ", long int8 products on AMX" if amx else "",
        "built into" if built else "loaded from",
        path,
    )
    log.info("native kernels: %s", status)
    prompts = bf16 and AMX_FLAG not in (_cpu_flags() or [])
    return Kernels(
        ops=ops,
        tier=tier,
        bf16=bf16,
        prefetch_rows=int(ops.bf16_prefetch_rows()),
        prompts=prompts,
        amx=amx,
        status=status,
    )
