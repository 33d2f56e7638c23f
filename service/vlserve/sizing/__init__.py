"""The sizing engine: what this host has (`probe`) and how to run the model on it (`plan`).

One source of truth for the playbooks (through the vlserve_facts role, which ships this package to
the target as Ansible module_utils), the audit and the service's CLI. Hence two constraints:
- standard library only at import time: psutil and py-cpuinfo are used when present (the
  controller's venv, a provisioned host) and plain /proc and /sys parsing serves a bare host that
  only has python3;
- only relative imports inside the package, so Ansible can ship it under another name.

The modules, in the order a plan is made:
  cpulist     kernel CPU lists
  probing     probe(): the facts (all I/O is here)
  footprints  the model's memory figures and worker_memory()
  policy      Policy: what the operator asks for, validated
  cores       the usable cores, the worker count they allow, each worker's CPUs
  dtypes      the language model's dtype and the compute-bound phases'
  fitting     the memory budget and how one worker fits it
  knobs       the host's tuning knobs, one function each
  facts_schema  the facts format (JSON Schema); validate checks facts against it
  planner     plan(): all of the above, a pure function of facts and policy
  render      tables for people, JSON for machines
  certificates  when a certificate ends (the audit's and the workers' figure)
"""

from . import certificates
from .common import FACTS_SCHEMA, GIB, MIB, PLAN_SCHEMA, PlanError
from .contract import QUANTIZE_LEVELS
from .cores import default_threads
from .cpulist import format_cpu_list, parse_cpu_list
from .dtypes import (
    auto_levels,
    int8_products,
    native_bfloat16,
    plan_prefill_dtype,
    plan_vision_dtype,
    vision_rest_dtype,
)
from .footprints import (
    COMPUTE_BYTES_PER_32,
    DTYPE_BYTES,
    FOOTPRINTS,
    KV_CHUNK_TOKENS,
    MEMORY_GUARD_FRACTION,
    MIN_CONTEXT_TOKENS,
    QUANTIZED_BYTES_PER_32_WEIGHTS,
    ModelFootprint,
    kv_bytes_per_token,
    kv_cache_bytes,
    worker_memory,
)
from .planner import plan
from .policy import Policy, check_policy_fits
from .probing import ISA_FLAGS, probe
from .render import dumps, render_facts, render_plan
from .validate import FactsError, check_facts

__all__ = [
    "COMPUTE_BYTES_PER_32",
    "DTYPE_BYTES",
    "FACTS_SCHEMA",
    "FOOTPRINTS",
    "GIB",
    "ISA_FLAGS",
    "KV_CHUNK_TOKENS",
    "MEMORY_GUARD_FRACTION",
    "MIB",
    "MIN_CONTEXT_TOKENS",
    "PLAN_SCHEMA",
    "QUANTIZED_BYTES_PER_32_WEIGHTS",
    "QUANTIZE_LEVELS",
    "FactsError",
    "ModelFootprint",
    "PlanError",
    "Policy",
    "auto_levels",
    "certificates",
    "check_facts",
    "check_policy_fits",
    "default_threads",
    "dumps",
    "format_cpu_list",
    "int8_products",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "native_bfloat16",
    "parse_cpu_list",
    "plan",
    "plan_prefill_dtype",
    "plan_vision_dtype",
    "probe",
    "render_facts",
    "render_plan",
    "vision_rest_dtype",
    "worker_memory",
]
