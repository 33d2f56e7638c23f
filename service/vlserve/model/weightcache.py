"""The weight cache: a model's quantized weights rounded once per host, mapped by every start after.

Rounding the language model to int8 or int4 costs 47-60 ms per 6144x2048 weight here, 9-11 s for
Qwen3-VL-2B at every start, and its results depend only on the checkpoint, the level and the code.
So the first start writes them to one safetensors file per model, level and kernel layout
(`<root>/<model>-<path digest>-<level>-<layouts>.safetensors`, e.g. `...-int8-q8tiles`,
`...-int4-q8tiles-blocks`), with the outlier channels it keeps exact, and later starts map that
file instead: nothing is copied at load, and workers on one host share its pages in the page cache.

A cache file is used only when the key in its header equals the one this process computes: the
checkpoint's files (names, sizes, modification times, a digest of each safetensors header), the
level and its group size, torch's version and CPU capability, and a digest of the code that decides
what the file holds (WRITERS: this module, the packing, the outlier channels, the formats). Anything
else (another checkpoint copied in place, a torch upgrade, a file brought from another host, a
truncated or unreadable file, a layer of the wrong shape) makes the worker round the weights again
and replace the file, atomically, so a crash mid-write leaves the old file or none. safetensors
holds tensors only (no pickled code), and the directory belongs to the service's user.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vlserve.kernels import native
from vlserve.kernels.formats import INT4_GROUP

log = logging.getLogger(__name__)

# The modules whose code decides the cached tensors and their placement: a release that changes
# any of them rounds the weights again, with no version number to remember to bump.
WRITERS = (
    "model/weightcache.py",
    "model/packing.py",
    "model/outliers.py",
    "kernels/formats.py",
    "kernels/quantized.py",
)
KEY_FIELD = "vlserve_weight_cache_key"
# Every tensor starts at a multiple of this in the file, so at a cache-line boundary in the map. torch's
# int4 kernel reads a weight that starts 16 bytes past a boundary 50% slower (33.7 ms against 22.3 ms
# for the 112 products of a decode step here), and safetensors' own writer aligns to 8 bytes only.
ALIGNMENT = 64
PADDING = "__padding"  # filler tensors between others: safetensors allows no gaps in its data
SAFETENSORS_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return file.read(length)


@functools.cache
def code_digest() -> str:
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in WRITERS:
        digest.update(name.encode() + b"\0" + (package / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_key(model_dir: Path, level: str, kernels: native.Kernels) -> dict[str, Any]:
    """What the cached tensors are a function of: a file whose key differs is rebuilt."""
    files = []
    for path in sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"]):
        stat = path.stat()
        entry = {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if path.suffix == ".safetensors":
            entry["header_sha256"] = hashlib.sha256(_safetensors_header(path)).hexdigest()
        files.append(entry)
    return {
        "code": code_digest(),
        "level": level,
        "int4_group": INT4_GROUP,
        "int8_layout": kernels.int8_layout(),
        **({"int4_layout": kernels.int4_layout()} if level == "int4" else {}),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "model": files,
    }


class PreparedWeights:
    """Weights by layer name: those found in a cache file, and those rounded here to be written to one."""

    def __init__(self, found: dict[str, dict[str, torch.Tensor]] | None = None):
        self.found = found or {}
        self.made: dict[str, Any] = {}
        self.taken = 0

    def weight(self, name: str, fmt: type, make: Callable[[], Any], shape: tuple[int, int] | None = None):
        """`fmt.from_tensors` of the cached tensors of `name`, else `make()` (kept for writing)."""
        tensors = self.found.get(name)
        if tensors is not None:
            try:
                weight = fmt.from_tensors(tensors)
            except (KeyError, IndexError, ZeroDivisionError) as error:
                log.warning("weight cache: %s unusable (%r): rounding it again", name, error)
            else:
                if shape is None or weight.shape == shape:
                    self.taken += 1
                    return weight
                log.warning("weight cache: %s is %s, the model's is %s: rounding it again", name, weight.shape, shape)
        weight = make()
        self.made[name] = weight
        return weight

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight's tensors under `name.field`, for a new cache file."""
        flat = {}
        for name, tensors in self.found.items():
            if name not in self.made:
                flat.update({"%s.%s" % (name, field): tensor for field, tensor in tensors.items()})
        for name, weight in self.made.items():
            flat.update({"%s.%s" % (name, field): tensor for field, tensor in weight.tensors().items()})
        return flat


class WeightCache:
    """One model's cache file at one level, in the layouts of the process's `kernels`."""

    def __init__(self, root: Path, model_dir: Path, level: str, kernels: native.Kernels):
        self.model_dir, self.level = model_dir, level
        place = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
        # Weights in each kernel's layout have a file each: switching kernels rounds nothing again.
        layouts = [kernels.int8_layout(), *([kernels.int4_layout()] if level == "int4" else [])]
        variant = "-".join([level, *layouts])
        self.path = root / ("%s-%s-%s.safetensors" % (model_dir.resolve().name, place, variant))
        self.key = cache_key(model_dir, level, kernels)
        self._lock = None  # the open lock file while this process rounds the weights (open() to write())

    def open(self) -> PreparedWeights:
        """The cached weights when the file's key is this one. Else an empty set to round into, and this
        process holds the file's lock until `write`: workers starting together on a cold cache round
        once, the others wait for that file and map it."""
        found = self._read(quiet=False)
        if found is not None:
            return found
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock = (self.path.parent / (".%s.lock" % self.path.name)).open("w")
        except OSError as error:  # an unwritable cache: round here, write nothing (write() says so)
            log.warning("weight cache: cannot lock %s (%s)", self.path, error)
            return PreparedWeights()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("weight cache: another worker is rounding %s: waiting for its file", self.path.name)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        found = self._read(quiet=True)  # written by the worker this one waited for
        if found is not None:
            self.release()
            return found
        return PreparedWeights()

    def _read(self, quiet: bool) -> PreparedWeights | None:
        """The file's weights when its key is this one, else None (the reason logged unless `quiet`)."""
        from safetensors import safe_open  # noqa: PLC0415 - a transformers dependency, loaded with it

        say = (lambda *args: None) if quiet else log.info
        if not self.path.is_file():
            say("weight cache: no %s yet: rounding the weights, then writing it", self.path)
            return None
        try:
            with safe_open(str(self.path), framework="pt") as file:
                stored = json.loads((file.metadata() or {}).get(KEY_FIELD, "null"))
                if stored != self.key:
                    say(
                        "weight cache: %s is stale or foreign (%s): rebuilding it",
                        self.path,
                        _differs(stored, self.key),
                    )
                    return None
                found: dict[str, dict[str, torch.Tensor]] = {}
                for name in file.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name.startswith(PADDING):
                        continue
                    layer, _, field = name.rpartition(".")
                    found.setdefault(layer, {})[field] = file.get_tensor(name)  # a view of the file's map
        except Exception as error:  # noqa: BLE001 - safetensors raises its own and OSError; any means rebuild
            log.warning("weight cache: %s is unreadable (%s): rebuilding it", self.path, error)
            return None
        log.info("weight cache: mapping %d layers from %s", len(found), self.path)
        return PreparedWeights(found)

    def release(self) -> None:
        """Drop the lock `open` took to round (write does; a failed load does it here)."""
        if self._lock is not None:
            self._lock.close()  # closing the descriptor drops the lock (a crash drops it too)
            self._lock = None

    def write(self, prepared: PreparedWeights) -> bool:
        """Write a new file when anything was rounded here; False (logged) when it cannot be written.
        Releases the lock `open` took either way."""
        try:
            return self._write(prepared)
        finally:
            self.release()

    def _write(self, prepared: PreparedWeights) -> bool:
        if not prepared.made:
            return False
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".", suffix=".partial")
            os.close(handle)
            write_aligned(Path(temporary), prepared.tensors(), {KEY_FIELD: json.dumps(self.key, sort_keys=True)})
            os.replace(temporary, self.path)  # readers see the old file or the new one, never a part
        except (OSError, RuntimeError, ValueError) as error:
            log.warning("weight cache: cannot write %s (%s): the next start rounds again", self.path, error)
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            return False
        log.info("weight cache: wrote %d layers to %s", len(prepared.made), self.path)
        return True


def write_aligned(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file whose every tensor starts at a multiple of ALIGNMENT (from the file's start),
    written tensor by tensor (no copy of the whole set in memory); any safetensors reader reads it."""
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[torch.Tensor | int] = []  # tensors, and the sizes of the zero fillers between them
    offset = 0
    for name, tensor in tensors.items():
        filler = -offset % ALIGNMENT
        if filler:
            header["%s%d" % (PADDING, len(parts))] = {
                "dtype": "U8",
                "shape": [filler],
                "data_offsets": [offset, offset + filler],
            }
            parts.append(filler)
            offset += filler
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        parts.append(tensor)
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGNMENT)  # the data starts aligned too (spaces are allowed)
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for part in parts:
            if isinstance(part, int):
                file.write(bytes(part))
            else:
                file.write(part.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _differs(stored: Any, current: dict[str, Any]) -> str:
    if not isinstance(stored, dict):
        return "no key"
    fields = sorted(name for name in current if stored.get(name) != current[name])
    return "differs in " + ", ".join(fields) if fields else "extra fields"
