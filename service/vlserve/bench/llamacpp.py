"""llama.cpp as bench-peer's baseline: llama-server built from the llama-cpp-python sdist at a pinned
version, the checkpoint converted to GGUF by llama.cpp's own converter, and llama-server run.

The sdist vendors llama.cpp and records the vendored commit in its .git/modules; the build is
llama-server and llama-quantize only, native to this CPU. The checkpoint goes to GGUF (bf16 and a
bf16 vision projector), then through llama-quantize (Q8_0, Q4_K_M, Q4_0). Builds and conversions are
cached under the caller's cache directory, keyed by what made them, so only the first run pays.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from vlserve.bench.servers import ServerProcess, free_port

LLAMA_CPP_PYTHON = "0.3.36"  # vendors llama.cpp 0c1e57098 (read from the sdist, recorded per build)

# What llama.cpp's converter imports beyond vlserve's own dependencies (torch, transformers, numpy),
# installed into the cache, never into vlserve's environment.
CONVERTER_EXTRAS = ("sentencepiece==0.2.1",)
# llama.cpp's converter names a tokenizer's pre-tokenizer by hashing how the whole tokenizer splits a
# test text, so it knows Qwen's own tokenizer but not the test checkpoint's (Qwen's split rule and
# special tokens, a small vocabulary of its own). Where it does not recognise one whose split rule
# is Qwen's, that rule is what llama.cpp calls "qwen2"; anything else still fails as it would.
CONVERTER = """
import json, sys
from pathlib import Path
source, model = Path(sys.argv[1]), Path(sys.argv[2])
sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path[:0] = [str(source), str(source / "gguf-py")]
from conversion.base import TextModel
from vlserve.model.testmodel import QWEN_SPLIT
recognise = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        pre = json.loads((model / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
        if any(p.get("pattern", {}).get("Regex") == QWEN_SPLIT for p in pre.get("pretokenizers", [])):
            return "qwen2"
        raise
TextModel.get_vocab_base_pre = get_vocab_base_pre
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""
AMX_OFF_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# ggml's AMX kernels load their tile configuration with `_tile_loadconfig(&tc)` from a struct on the
# stack. GCC 12's intrinsic names only 8 of its 64 bytes as read, so the compiler may drop the stores
# that fill it; ldtilecfg then faults on garbage (#GP, reported as SIGILL or a segfault at llama-server's
# warm-up on AMX hosts; vlserve's own AMX kernel hit the same bug). Upstream's open fix
# (ggml-org/llama.cpp#26954) moves the struct out of the stack; this is the smallest equivalent: the
# instruction with the whole struct as its operand. Applied to AMX builds only, recorded with the build.
TILE_CONFIG_FILE = "ggml/src/ggml-cpu/amx/mmq.cpp"
TILE_CONFIG_PATCH = ("    _tile_loadconfig(&tc);\n", '    asm volatile("ldtilecfg %0" :: "m"(tc));\n')


def _run(command: list[str], log: Path, **kwargs) -> None:
    """Run a build step, its output to `log`; a failure names the step and shows the log's tail."""
    with log.open("ab") as out:
        out.write(("\n$ %s\n" % " ".join(command)).encode())
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError("%s failed (exit %d); log %s:\n%s" % (Path(command[0]).name, code, log, tail))


# -- building llama.cpp ----------------------------------------------------------------------------


def llama_source(cache: Path, version: str = LLAMA_CPP_PYTHON) -> tuple[Path, str]:
    """The vendored llama.cpp of the llama-cpp-python sdist (downloaded once) and its commit."""
    root = cache / "src" / ("llama_cpp_python-" + version)
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        downloads = cache / "sdist"
        downloads.mkdir(parents=True, exist_ok=True)
        archive = downloads / ("llama_cpp_python-%s.tar.gz" % version)
        if not archive.is_file():
            _run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "llama-cpp-python==" + version, "-d", str(downloads)],
                cache / "build.log",
            )  # fmt: skip
        unpacked = Path(tempfile.mkdtemp(dir=cache, prefix="src-"))
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        (unpacked / root.name).rename(root)
        shutil.rmtree(unpacked)
    head = root / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    commit = head.read_text().strip() if head.is_file() else "unknown"
    return root / "vendor" / "llama.cpp", commit


def patch_tile_config(source: Path) -> list[str]:
    """TILE_CONFIG_PATCH applied to the vendored source (once; a source without the line is left as
    it is): the patches the source now carries, for the build's record and key."""
    path = source / TILE_CONFIG_FILE
    if not path.is_file():
        return []
    text = path.read_text()
    before, after = TILE_CONFIG_PATCH
    if before in text:
        text = text.replace(before, after)
        path.write_text(text)
    return [TILE_CONFIG_FILE + ": ldtilecfg with the whole tile config as its operand"] if after in text else []


def build_llama(cache: Path, amx: bool = True, say=print) -> dict:
    """llama-server and llama-quantize, native to this CPU (cached per version, flags and patches)."""
    source, commit = llama_source(cache)
    patches = patch_tile_config(source) if amx else []
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DGGML_CCACHE=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_OPENSSL=OFF",
    ]
    if not amx:
        # GCC's explicit -mno-* wins over what -march=native turns on, whatever their order.
        flags += ["-DCMAKE_C_FLAGS=" + AMX_OFF_FLAGS, "-DCMAKE_CXX_FLAGS=" + AMX_OFF_FLAGS]
    key = hashlib.sha256(json.dumps([LLAMA_CPP_PYTHON, commit, flags, *patches]).encode()).hexdigest()[:12]
    build = cache / ("build-" + key)
    record = build / "vlserve-build.json"
    if record.is_file():
        return json.loads(record.read_text())
    say("building llama.cpp %s (llama-cpp-python %s) in %s" % (commit[:9], LLAMA_CPP_PYTHON, build))
    log = cache / "build.log"
    started = time.perf_counter()
    _run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *flags], log)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize"], log)
    info = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "commit": commit,
        "cmake_flags": flags,
        "patches": patches,
        "amx": amx,
        "server": str(build / "bin" / "llama-server"),
        "quantize": str(build / "bin" / "llama-quantize"),
        "source": str(source),
        "build_s": round(time.perf_counter() - started, 1),
    }
    record.write_text(json.dumps(info, indent=2))
    return info


# -- converting the checkpoint ---------------------------------------------------------------------


def checkpoint_key(model: Path) -> str:
    """Names the checkpoint's contents cheaply: its config and each weight file's name, size and mtime."""
    digest = hashlib.sha256((model / "config.json").read_bytes())
    for path in sorted(model.glob("*.safetensors")):
        stat = path.stat()
        digest.update(("%s %d %d" % (path.name, stat.st_size, stat.st_mtime_ns)).encode())
    return digest.hexdigest()[:12]


def convert(model: Path, cache: Path, build: dict, types: set[str], say=print) -> dict[str, Path]:
    """GGUF files of the checkpoint: `mmproj` (bf16) and one per llama.cpp type asked for."""
    out = cache / "gguf" / ("%s-%s" % (model.name, checkpoint_key(model)))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "convert.log"
    converter = [sys.executable, "-c", CONVERTER, build["source"], str(model)]
    extras = cache / "converter-site" / hashlib.sha256(" ".join(CONVERTER_EXTRAS).encode()).hexdigest()[:12]
    if not extras.is_dir():
        partial = Path(tempfile.mkdtemp(dir=cache, prefix="converter-site-"))
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial), *CONVERTER_EXTRAS], log)
        extras.parent.mkdir(parents=True, exist_ok=True)
        partial.rename(extras)
    environment = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(extras), os.environ.get("PYTHONPATH")]))
    )
    files = {"mmproj": out / "mmproj-bf16.gguf", "bf16": out / "model-bf16.gguf"}
    for name, extra in (("bf16", []), ("mmproj", ["--mmproj"])):
        if not files[name].is_file():
            say("converting %s to GGUF (%s)" % (model, name))
            partial = files[name].with_suffix(".partial")
            _run([*converter, "--outtype", "bf16", "--outfile", str(partial), *extra], log, env=environment)
            partial.rename(files[name])
    for kind in sorted(types - {"bf16"}):
        files[kind] = out / ("model-%s.gguf" % kind)
        if not files[kind].is_file():
            say("quantizing to %s" % kind)
            partial = files[kind].with_suffix(".partial")
            _run([build["quantize"], str(files["bf16"]), str(partial), kind], log)
            partial.rename(files[kind])
    return files


# -- llama-server ----------------------------------------------------------------------------------


class LlamaServer(ServerProcess):
    """One llama-server on a loopback port."""

    ready_path = "/health"

    def __init__(self, binary: str, model: Path, mmproj: Path, *, threads: int, slots: int, image_tokens: int):
        port = free_port()
        command = [
            binary, "-m", str(model), "--mmproj", str(mmproj),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(4096 * slots),  # each slot the context a vlserve request may have (the plan's 4096)
            "--host", "127.0.0.1", "--port", str(port), "--no-webui",
        ]  # fmt: skip
        if image_tokens:
            command += ["--image-min-tokens", str(image_tokens), "--image-max-tokens", str(image_tokens)]
        super().__init__(command, port=port, name="llama-server")
