"""The quantized levels' tests once more, with torch held to AVX2 as an AVX2-only host runs them.

`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` makes torch, oneDNN, the probe and vlserve's kernels
take the paths an AVX2 CPU takes (vlserve.kernels.native's avx2 tier, torch's int4 kernel, no bfloat16
packing). The selected tests run unchanged, with the limits they hold on AVX-512: an ISA never gets a
looser threshold. Skipped where the CPU has no tier above AVX2 (the main run is that run) or no AVX2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from vlserve.kernels import native

HELD = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# Every test whose numbers or paths depend on the ISA tier: the products, the quantized layers and their
# cache files, the quantized workers, quant-check, the probe and the plan, and the API's view of them.
# Not the build mechanics (locks, failed builds, a missing compiler): they do not depend on the tier,
# and build for minutes.
SELECTION = [
    "tests/test_quantized.py",
    "tests/test_weightcache.py",
    "tests/test_probe.py",
    "tests/test_native.py",
    "tests/test_engine.py",
    "tests/test_service_api.py",
    "-k",
    "not build and not compiler and not switched_off and not held_to_avx2"
    " and (not test_engine or quantized or int8 or int4 or prefill)",
]


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in native.cpu_tiers(), reason="this CPU cannot run the AVX2 tier")
@pytest.mark.skipif(native.cpu_tiers() == ["avx2"], reason="the AVX2 tier is this CPU's own: the main run covers it")
def test_the_quantized_suite_passes_held_to_avx2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"), *SELECTION],
        check=False,
        cwd=REPO,
        env={**os.environ, **HELD},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
