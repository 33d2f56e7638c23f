"""What the operator asks for (`Policy`), bounded field by field before anything is planned."""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from .common import GIB, MIB
from .contract import AUTO, FLOAT_DTYPES, QUANTIZE_LEVELS
from .cpulist import format_cpu_list, parse_cpu_list
from .footprints import FOOTPRINTS


def one_of(choices: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return choices[0] if len(choices) == 1 else "%s or %s" % (", ".join(choices[:-1]), choices[-1])


@dataclass(frozen=True)
class Policy:
    """What the operator asks for. Every field has a safe default; `validate` bounds them."""

    objective: str = field(
        default="throughput",
        metadata={
            "help": "throughput: workers of min_threads_per_worker cores or more; latency: one worker per NUMA node",
            "choices": ("throughput", "latency"),
        },
    )
    model: str = field(
        default="qwen3-vl-2b-instruct",
        metadata={"help": "model footprint to size for", "choices": tuple(sorted(FOOTPRINTS))},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "choices": (AUTO, *FLOAT_DTYPES),
            "help": "auto (bfloat16 with AVX-512 BF16, AMX, Arm BF16 or AVX2, else float32 if it fits), bfloat16 "
            "or float32",
        },
    )
    quantize: str = field(
        default="auto",
        metadata={
            "choices": (AUTO, *QUANTIZE_LEVELS),
            "help": "rounding of the weights: none (exact), int8 (the language model's linear layers and the "
            "output head as llama.cpp's Q8_0, inputs rounded per block of 32 too; images too), int4 (the "
            "decoder's linear layers in 4-bit groups of 32, the head int8); auto: none wherever one worker "
            "fits, else the widest level that does, among those whose accuracy is established on the CPU's "
            "ISA (x86 with AVX2 or better). First tokens: with AMX, int8 and int4 images and prompts run on its "
            "bfloat16 tiles, the int8 weights made bfloat16 in the cache, as fast as none (measured at 1.02-1.03x "
            "its first-turn time); elsewhere on vlserve's int8 products (AVX-512 VNNI, AVX2; docs/quantization.md)",
        },
    )
    min_threads_per_worker: int = field(
        default=4, metadata={"help": "throughput objective: the fewest cores a worker gets"}
    )
    max_workers: int | None = field(default=None, metadata={"help": "cap on workers (default: none)"})
    housekeeping_cores: int | None = field(
        default=None,
        metadata={"help": "cores per NUMA node kept for the OS and the front (default: 0 below 4 cores, else 1)"},
    )
    memory_reserve_bytes: int | None = field(
        default=None, metadata={"help": "memory kept for the OS (default: max(1 GiB, 5 percent of memory))"}
    )
    other_services_bytes: int = field(
        default=0, metadata={"help": "memory the host's other services need, kept out of the workers' budget"}
    )
    max_batch_size: int = field(default=4, metadata={"help": "sequences a worker decodes together"})
    max_context_tokens: int = field(
        default=4096, metadata={"help": "prompt plus output tokens per sequence, for the KV-cache budget"}
    )
    base_port: int = field(default=8101, metadata={"help": "port of worker 0; worker N listens on base_port + N"})
    allowed_cpus: list[int] | None = field(
        default=None,
        metadata={"help": "restrict inference to these CPUs, a kernel CPU list such as 2-15 (default: all allowed)"},
    )
    swappiness: int | None = field(
        default=None, metadata={"help": "vm.swappiness override (default: 180 when zram is the only swap, else 10)"}
    )
    zram_fraction: float = field(default=0.5, metadata={"help": "zram swap size as a fraction of RAM"})
    zram_max_bytes: int = field(default=8 * GIB, metadata={"help": "upper bound of the zram size"})
    zram_algorithm: str = field(
        default="zstd",
        metadata={"help": "zram compression: zstd, lz4, lzo-rle or lzo", "choices": ("zstd", "lz4", "lzo-rle", "lzo")},
    )

    def validate(self, name_prefix: str = "") -> Policy:
        """Check every field; the error names each bad field (with `name_prefix`, as the caller calls it)."""
        problems = []

        def bad(name, expected):
            problems.append("%s%s must be %s, not %r" % (name_prefix, name, expected, getattr(self, name)))

        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        for item in fields(self):
            choices = item.metadata.get("choices")
            if choices is not None and getattr(self, item.name) not in choices:
                bad(item.name, one_of(choices))
        for name, low, high in (
            ("min_threads_per_worker", 1, 1024),
            ("max_batch_size", 1, 256),
            ("max_context_tokens", 256, 262144),
            ("base_port", 1024, 65000),
            ("zram_max_bytes", MIB, 2**50),
        ):
            if not is_int(getattr(self, name)) or not low <= getattr(self, name) <= high:
                bad(name, "an integer from %d to %d" % (low, high))
        if not is_int(self.other_services_bytes) or self.other_services_bytes < 0:
            bad("other_services_bytes", "an integer >= 0")
        for name, low in (("max_workers", 1), ("housekeeping_cores", 0), ("memory_reserve_bytes", 0)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < low):
                bad(name, "empty or an integer >= %d" % low)
        if self.swappiness is not None and (not is_int(self.swappiness) or not 0 <= self.swappiness <= 200):
            bad("swappiness", "empty or an integer from 0 to 200")
        if (
            isinstance(self.zram_fraction, bool)
            or not isinstance(self.zram_fraction, (int, float))
            or not 0 < self.zram_fraction <= 2
        ):
            bad("zram_fraction", "a number above 0 and at most 2")
        if self.allowed_cpus is not None and (
            not isinstance(self.allowed_cpus, list)
            or not self.allowed_cpus
            or not all(is_int(c) and c >= 0 for c in self.allowed_cpus)
        ):
            bad("allowed_cpus", "empty or a non-empty list of CPU numbers")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @classmethod
    def from_mapping(cls, values: dict[str, Any], name_prefix: str = "") -> Policy:
        """Build from a mapping (Ansible variables, CLI); unknown keys are an error, None means default."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError("unknown policy fields: %s" % ", ".join(name_prefix + name for name in unknown))
        given = {k: v for k, v in values.items() if v is not None and v != ""}
        hints = typing.get_type_hints(cls)
        for name, value in given.items():  # -e on the command line and env vars arrive as text
            kind = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
            if isinstance(value, str) and kind[0] in (int, float):
                with contextlib.suppress(ValueError):  # validate() names it
                    given[name] = kind[0](value)
        if isinstance(given.get("allowed_cpus"), str):
            try:
                given["allowed_cpus"] = parse_cpu_list(given["allowed_cpus"])
            except ValueError:
                raise ValueError(
                    "%sallowed_cpus must be a CPU list such as 0-3,8, not %r" % (name_prefix, given["allowed_cpus"])
                ) from None
        return cls(**given).validate(name_prefix)


def check_policy_fits(facts_limits: dict[str, Any], policy: Policy, name_prefix: str = "") -> None:
    """Policy values that are valid in general but not on this host (a CPU it does not have)."""
    if policy.allowed_cpus is not None:
        outside = sorted(set(policy.allowed_cpus) - set(facts_limits["allowed_cpus"]))
        if outside:
            raise ValueError(
                "%sallowed_cpus has CPUs %s that this host does not allow (it allows %s)"
                % (name_prefix, format_cpu_list(outside), format_cpu_list(facts_limits["allowed_cpus"]))
            )
