"""The facts format, `vlserve.facts/1`, as JSON Schema: the one definition of what a facts file holds.

`service/vlserve/schemas/facts.schema.json` is written from it (`scripts/schemas`); `check_facts`
in validate.py checks facts against it before anything is planned, with the standard library only
(targets may have nothing else).
"""

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "vlserve.facts/1",
    "title": "vlserve host facts, version 1",
    "description": "What `vlserve probe --json` (and the vlserve_facts role) reports about a host. Sizes are bytes, "
    "CPU numbers are the kernel's. A change that removes or retypes a field bumps the version in `schema`; "
    "adding a field does not.",
    "type": "object",
    "required": ["schema", "hostname", "cpu", "limits", "memory", "cpufreq", "platform", "sysctl", "sources"],
    "$defs": {
        "cpus": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "bytes": {"type": "integer", "minimum": 0},
        "maybe_bytes": {"type": ["integer", "null"], "minimum": 0},
    },
    "properties": {
        "schema": {"const": "vlserve.facts/1"},
        "description": {"type": "string", "description": "Free text; fixtures say what host they stand for."},
        "hostname": {"type": "string"},
        "cpu": {
            "type": "object",
            "required": [
                "arch",
                "vendor",
                "model_name",
                "logical_cpus",
                "physical_cores",
                "sockets",
                "threads_per_core",
                "numa_nodes",
                "efficiency_cpus",
                "isa",
                "topology",
            ],
            "properties": {
                "arch": {"type": "string"},
                "vendor": {"type": "string"},
                "model_name": {"type": "string"},
                "logical_cpus": {"type": "integer", "minimum": 1, "description": "Online logical CPUs."},
                "physical_cores": {"type": "integer", "minimum": 1, "description": "Distinct SMT sibling groups."},
                "sockets": {"type": "integer", "minimum": 1},
                "threads_per_core": {"type": "integer", "minimum": 1},
                "numa_nodes": {
                    "type": "object",
                    "description": "Node number (as a string) to its online CPUs.",
                    "additionalProperties": {"$ref": "#/$defs/cpus"},
                },
                "efficiency_cpus": {
                    "$ref": "#/$defs/cpus",
                    "description": "E-cores of a hybrid CPU (cpu_atom, cpu_capacity or a max-frequency gap).",
                },
                "isa": {
                    "type": "object",
                    "additionalProperties": {"type": "boolean"},
                    "required": ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"],
                },
                "topology": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["cpu", "package", "core_cpus", "node", "capacity", "max_freq_khz"],
                        "properties": {
                            "cpu": {"type": "integer", "minimum": 0},
                            "package": {"type": "integer", "minimum": 0},
                            "core_cpus": {
                                "$ref": "#/$defs/cpus",
                                "minItems": 1,
                                "description": "This CPU and its SMT siblings: one physical core.",
                            },
                            "node": {"type": "integer", "minimum": 0},
                            "capacity": {"type": ["integer", "null"]},
                            "max_freq_khz": {"type": ["integer", "null"]},
                        },
                    },
                },
            },
        },
        "limits": {
            "type": "object",
            "required": [
                "cgroup_version",
                "affinity",
                "cgroup_cpuset",
                "allowed_cpus",
                "cpu_quota",
                "cpu_quota_cpus",
                "memory_limit_bytes",
                "memory_usage_bytes",
                "vlserve_slice_bytes",
            ],
            "properties": {
                "cgroup_version": {
                    "enum": ["v1", "v2", "hybrid", None],
                    "description": "hybrid: v1 controllers with a v2 tree for systemd only.",
                },
                "affinity": {"$ref": "#/$defs/cpus"},
                "cgroup_cpuset": {"oneOf": [{"$ref": "#/$defs/cpus"}, {"type": "null"}]},
                "allowed_cpus": {
                    "$ref": "#/$defs/cpus",
                    "description": "Online CPUs in both the affinity mask and the cpuset.",
                },
                "cpu_quota": {
                    "type": ["number", "null"],
                    "description": "CPUs' worth of the tightest cpu.max / cfs quota.",
                },
                "cpu_quota_cpus": {
                    "type": ["integer", "null"],
                    "minimum": 1,
                    "description": "The quota rounded down, at least 1.",
                },
                "memory_limit_bytes": {"$ref": "#/$defs/maybe_bytes"},
                "memory_usage_bytes": {"$ref": "#/$defs/maybe_bytes"},
                "vlserve_slice_bytes": {
                    "$ref": "#/$defs/maybe_bytes",
                    "description": "Memory held by vlserve.slice, added back when planning.",
                },
                "vlserve_slice_cpus": {
                    "oneOf": [{"$ref": "#/$defs/cpus"}, {"type": "null"}],
                    "description": "CPUs vlserve.slice holds (cgroup "
                    "v2), part of allowed_cpus: system "
                    "slices confined to housekeeping "
                    "cores do not shrink the plan.",
                },
            },
        },
        "memory": {
            "type": "object",
            "required": ["total_bytes", "available_bytes", "swap_total_bytes", "swaps", "zram"],
            "properties": {
                "total_bytes": {"type": "integer", "minimum": 1},
                "available_bytes": {"$ref": "#/$defs/bytes"},
                "swap_total_bytes": {"$ref": "#/$defs/bytes"},
                "swaps": {
                    "type": "array",
                    "items": {"type": "object", "required": ["name", "type", "size_bytes", "priority"]},
                },
                "zram": {
                    "type": "object",
                    "required": ["available", "devices"],
                    "properties": {
                        "available": {"type": "boolean"},
                        "devices": {"type": "array"},
                        "algorithms": {
                            "type": ["array", "null"],
                            "items": {"type": "string"},
                            "description": "Compression algorithms the kernel's zram offers (null: no device to ask).",
                        },
                    },
                },
                "free_page_reporting": {
                    "type": ["boolean", "null"],
                    "description": "Whether a virtio memory balloon reports free pages to the host, which "
                    "takes them back (null: no balloon). Freed memory then comes back slowly and as "
                    "other pages: decode speed can move from one worker start to the next.",
                },
            },
        },
        "cpufreq": {
            "type": "object",
            "required": [
                "available",
                "driver",
                "governors",
                "available_governors",
                "energy_performance_preferences",
                "available_energy_performance_preferences",
            ],
            "properties": {
                "available": {"type": "boolean"},
                "driver": {"type": ["string", "null"]},
                "governors": {
                    "type": "object",
                    "description": "Current governor to the CPUs that run it.",
                    "additionalProperties": {"$ref": "#/$defs/cpus"},
                },
                "available_governors": {"type": "array", "items": {"type": "string"}},
                "energy_performance_preferences": {"type": "object", "additionalProperties": {"$ref": "#/$defs/cpus"}},
                "available_energy_performance_preferences": {"type": "array", "items": {"type": "string"}},
            },
        },
        "platform": {
            "type": "object",
            "required": ["kind", "container", "vm", "wsl", "wsl_version", "kernel", "init", "os"],
            "properties": {
                "kind": {"enum": ["bare-metal", "vm", "container", "wsl"]},
                "container": {"type": ["string", "null"]},
                "vm": {"type": ["string", "null"]},
                "wsl": {"type": "boolean"},
                "wsl_version": {"enum": [1, 2, None]},
                "kernel": {"type": "string"},
                "init": {"type": "string"},
                "os": {"type": "object", "required": ["id", "version_id"]},
            },
        },
        "sysctl": {"type": "object", "additionalProperties": {"type": ["integer", "null"]}},
        "sources": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Where each group of facts came from (psutil, py-cpuinfo, /proc, /sys).",
        },
    },
}
