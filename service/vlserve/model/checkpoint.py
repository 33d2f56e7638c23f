"""A checkpoint directory's weights into the network (model/network.py), mapped, not read.

Each `.safetensors` file is mapped privately (copy-on-write, never written) and every tensor the
network keeps in the file's dtype is a view of that map: loading touches no weight page, the page
cache backs what a level serves as it is, and model/mapped.py hands back the pages of what a level
converts. A tensor in another dtype than the one asked for is converted (a copy). The format is
safetensors' own: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data.

The network is built on the meta device first (no memory, no random initialisation; the tables its
modules compute, on the CPU) and each parameter then takes its tensor by name; a parameter the
files lack fails the load with its name.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

from vlserve.errors import ModelDirectoryError
from vlserve.model.config import load_config, load_generation_config
from vlserve.model.network import Qwen3VLForConditionalGeneration

log = logging.getLogger(__name__)

DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TIED_HEAD = "lm_head.weight"
TIED_TO = "model.language_model.embed_tokens.weight"


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def mapped_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as a view of its private map."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ModelDirectoryError("%s is not a safetensors file (no header)" % path)
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(handle.read(size))
        except ValueError as error:
            raise ModelDirectoryError("%s has an unreadable safetensors header: %s" % (path, error)) from None
        mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = 8 + size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype"))
        start, end = entry["data_offsets"]
        if dtype is None or base + end > len(mapping):
            raise ModelDirectoryError("%s: tensor %s is not one vlserve can read (%s)" % (path, name, entry))
        count = (end - start) // dtype.itemsize
        flat = (
            torch.frombuffer(mapping, dtype=dtype, count=count, offset=base + start)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.view(entry["shape"])
    return tensors


def load_network(directory: Path, dtype: torch.dtype) -> Qwen3VLForConditionalGeneration:
    """The network of a checkpoint directory, its floating-point weights in `dtype`."""
    config = load_config(directory)
    with torch.device("meta"):
        network = Qwen3VLForConditionalGeneration(config, load_generation_config(directory, config))
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        tensors.update(mapped_tensors(path))
    if config.tie_word_embeddings:
        tensors.pop(TIED_HEAD, None)
    for name, parameter in list(network.named_parameters()):
        if name == TIED_HEAD and config.tie_word_embeddings:
            continue
        tensor = tensors.pop(name, None)
        if tensor is None:
            raise ModelDirectoryError("%s has no tensor %s" % (directory, name))
        if tuple(tensor.shape) != tuple(parameter.shape):
            raise ModelDirectoryError(
                "%s: %s is %s, the config makes it %s" % (directory, name, list(tensor.shape), list(parameter.shape))
            )
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        _set_parameter(network, name, tensor)
    if config.tie_word_embeddings:
        network.lm_head.weight = network.model.language_model.embed_tokens.weight
    if tensors:
        log.warning("%s: %d tensors the network does not use (%s ...)", directory, len(tensors), next(iter(tensors)))
    return network.eval()


def _set_parameter(network: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    network.get_submodule(owner)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
