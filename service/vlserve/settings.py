"""Service settings: one pydantic-settings model per concern, every field a VLSERVE_ variable.

A systemd `EnvironmentFile=` configures the service through the same names, and `vlserve serve`
derives its flags from these models, so the three cannot disagree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vlserve.sizing.contract import AUTO, ENV_PREFIX, FLOAT_DTYPES, QUANTIZE_LEVELS, QUANTIZED_LEVELS

_CONFIG = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", env_file=None)


class ServerSettings(BaseSettings):
    model_config = _CONFIG

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8101, ge=1, le=65535, description="TCP port to listen on")
    api_key: SecretStr | None = Field(
        None, description="if set, requests must send 'Authorization: Bearer <key>' (health and metrics stay open)"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")
    plan_file: Path | None = Field(
        None,
        description="the host's sizing plan (JSON, as `vlserve plan --json` or the deploy role writes it) for the "
        "status page; unset or unreadable: the plan this process computes for itself",
    )
    served_model_name: str = Field("qwen3-vl-2b-instruct", description="model id in /v1/models and responses")


def _cache_dir(setting: str, name: str) -> Path | None:
    """A per-host cache directory setting: off -> None; auto -> systemd's CacheDirectory= (in
    $CACHE_DIRECTORY), else $XDG_CACHE_HOME or ~/.cache, under vlserve/<name>; else the path given."""
    if setting == "off":
        return None
    if setting != "auto":
        return Path(setting)
    if os.environ.get("CACHE_DIRECTORY"):
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0]) / name
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlserve" / name


class ModelSettings(BaseSettings):
    model_config = _CONFIG

    model: Path = Field(Path("/var/lib/vlserve/model"), description="local Qwen3-VL checkpoint directory")
    dtype: Literal[(AUTO, *FLOAT_DTYPES)] = Field(
        "auto", description="weights dtype; auto: bfloat16 on CPUs with AVX-512 BF16 or AMX, else float32"
    )
    vision_dtype: Literal[(AUTO, *FLOAT_DTYPES, "int8")] = Field(
        "auto",
        description="vision encoder dtype; auto: bfloat16 where its matrix products are the fast ones (AMX, "
        "AMD's AVX-512 BF16), else float32 (the encoder is compute-bound); int8: Q8_0 "
        "products through vlserve's kernels (AVX-512 VNNI or AVX2; changes the numerics; chosen by auto at "
        "the int8 and int4 levels)",
    )
    quantize: Literal[(AUTO, *QUANTIZE_LEVELS)] = Field(
        "auto",
        description="rounding of the language model's weights: none (exact); int8 (its linear layers and the "
        "output head as llama.cpp's Q8_0, a scale per block of 32, inputs rounded the same way; about half "
        "the bytes per token); int4 (the decoder's linear layers in 4-bit groups of 32, the head int8; a "
        "third of the bytes); both keep the residual streams' outlier channels exact; auto: as the sizing "
        "plan for this process decides (none wherever it fits)",
    )
    prefill_dtype: Literal[(AUTO, *FLOAT_DTYPES, *QUANTIZED_LEVELS)] = Field(
        "auto",
        description="dtype of prompt-sized products in a packed bfloat16 model; auto: bfloat16 where its "
        "matrix products are the fast ones (AMX, AMD's AVX-512 BF16), else float32 (keeps a float32 copy "
        "of the decoder's linear layers, 5.6 GB for Qwen3-VL-2B); int8, in "
        "float32 models too: a Q8_0 copy (1.5 GB) multiplied by vlserve's kernels (about twice as fast, "
        "changes the numerics; chosen by auto at the int4 level)",
    )
    threads: int | None = Field(
        None, ge=1, le=1024, description="torch threads (default: one per physical core this process may use)"
    )
    min_pixels: int = Field(32 * 32, ge=32 * 32, description="images smaller than this are upscaled (pixels)")
    max_pixels: int = Field(
        448 * 448,
        ge=32 * 32,
        description="images larger than this are downscaled before the vision encoder (pixels); "
        "448x448 costs about 1/12 of a 1280x720 photo at the processor's default",
    )
    packed_weights: bool | None = Field(
        None,
        description="in bfloat16, lay the language model's linear weights out for a decode kernel at load: "
        "vlserve's bfloat16 product (plain, fused; where it loads) or oneDNN's packed layout (decode about a "
        "fifth faster than plain F.linear; the tied output head gets its own copy, +0.6 GB); "
        "unset: as the sizing plan for this process decides",
    )
    warmup: bool = Field(True, description="run one request through the model before reporting ready")
    weight_cache: str = Field(
        "auto",
        description="directory where the first start keeps the int8/int4 weights it rounded, for every later "
        "start to map instead (rebuilt when the checkpoint, level, torch or CPU differ); auto: systemd's "
        "CacheDirectory=, else ~/.cache/vlserve/weights; off: round at every start",
    )

    native_kernels: str = Field(
        "auto",
        description="directory where `vlserve kernels` (or, with kernels_build, the first start) builds "
        "vlserve's kernels with the host's C++ compiler, for every start to load (rebuilt when their sources "
        "or torch change); used where "
        "the CPU has AVX2 (int8 products, norm, rotary) or AVX-512 VNNI (all of them), stock kernels "
        "elsewhere; auto: systemd's CacheDirectory=, else ~/.cache/vlserve/kernels; off: stock kernels only",
    )

    kernels_build: bool = Field(
        True,
        description="build vlserve's kernels at start when native_kernels holds none for this release; false "
        "(as the deploy role sets it, having built them with `vlserve kernels` first): load only, so no "
        "compiler runs in a worker's start, and a missing build shows as torch's kernels in /readyz",
    )

    @field_validator("weight_cache", "native_kernels")
    @classmethod
    def _auto_off_or_absolute(cls, value: str, info) -> str:
        if value not in ("auto", "off") and not Path(value).is_absolute():
            raise ValueError("%s must be auto, off or an absolute directory, not %r" % (info.field_name, value))
        return value

    def weight_cache_root(self) -> Path | None:
        """The weight cache's directory, None when off."""
        return _cache_dir(self.weight_cache, "weights")

    def native_kernel_root(self) -> Path | None:
        """The compiled kernel's directory, None when off."""
        return _cache_dir(self.native_kernels, "kernels")

    @model_validator(mode="after")
    def _pixels_in_order(self) -> ModelSettings:
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels (%d) must not exceed max_pixels (%d)" % (self.min_pixels, self.max_pixels))
        return self


class LimitSettings(BaseSettings):
    model_config = _CONFIG

    max_batch_size: int = Field(4, ge=1, le=256, description="sequences decoded together")
    max_context_tokens: int = Field(4096, ge=256, le=262144, description="prompt plus output tokens per request")
    max_queue: int = Field(64, ge=0, le=100000, description="requests waiting beyond the batch; more get 429")
    max_tokens_default: int = Field(512, ge=1, description="max_tokens when a request gives none")
    request_timeout_s: float = Field(600.0, gt=0, description="a request still queued or running after this fails")
    max_upload_bytes: int = Field(20 * 2**20, ge=1024, description="largest request body; larger gets 413")
    max_images_per_request: int = Field(4, ge=0, le=64, description="images one request may carry")
    max_image_source_pixels: int = Field(
        50_000_000, ge=1024, description="refuse images whose decoded size exceeds this (decompression bombs)"
    )
    image_url_hosts: list[str] = Field(
        default_factory=list,
        description="hosts whose http(s) image URLs the server may fetch (default: none, data: URIs only)",
    )
    image_fetch_timeout_s: float = Field(10.0, gt=0, description="timeout of one image fetch")
    result_cache_entries: int = Field(256, ge=0, description="answers kept for repeated greedy requests (0: off)")
    vision_cache_bytes: int = Field(256 * 2**20, ge=0, description="vision features kept by image (0: off)")
    prefix_cache_bytes: int | None = Field(
        None,
        ge=0,
        description="keys and values of finished requests kept for prompts that start the same way, as follow-up "
        "turns do (default: what the running requests leave of the planned key/value cache; 0: off)",
    )
    memory_limit_bytes: int | None = Field(
        None, ge=0, description="resident memory at which new requests get 503 (default: the cgroup's memory.high)"
    )


class Settings:
    """The three concerns together, as the app factory takes them."""

    def __init__(
        self,
        server: ServerSettings | None = None,
        model: ModelSettings | None = None,
        limits: LimitSettings | None = None,
    ):
        self.server = server or ServerSettings()
        self.model = model or ModelSettings()
        self.limits = limits or LimitSettings()


SETTINGS_MODELS = (ServerSettings, ModelSettings, LimitSettings)


def settings_problems(values: dict, name_prefix: str = "") -> list[str]:
    """What is wrong with settings given by name (the deploy role's `vlserve_deploy_settings`): unknown
    names and values a worker would refuse, one line each, so the play stops before any host changes."""
    known = {name: model for model in SETTINGS_MODELS for name in model.model_fields}
    if not isinstance(values, dict):
        return ["%s must be a mapping of setting names to values" % name_prefix.rstrip(".")]
    problems = [
        "%s%s is not a setting (see vlserve serve --help)" % (name_prefix, name) for name in values if name not in known
    ]
    for model in SETTINGS_MODELS:
        given = {name: value for name, value in values.items() if known.get(name) is model}
        try:
            model.model_validate(given)  # validates the values only: no environment is read
        except ValueError as error:  # pydantic.ValidationError
            problems += [
                "%s%s: %s" % (name_prefix, ".".join(str(part) for part in item["loc"]) or "settings", item["msg"])
                for item in error.errors()
            ]
    return problems
