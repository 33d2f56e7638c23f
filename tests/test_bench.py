"""The benchmark tools work, on the tiny model: counts, shapes and error kinds, never speeds.

Speed claims live in `vlserve bench-compare` and `vlserve bench-peer` runs (docs/benchmarks.md), not in tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics

import httpx
import pytest
import torch
import yaml
from transformers import Qwen3VLForConditionalGeneration

from conftest import NATIVE_KERNELS, REPO, Server, load_topology, run_tool
from vlserve import sizing
from vlserve.bench.autotune import AutotuneOptions, candidates, plan_key
from vlserve.bench.bandwidth import decode_bytes_per_token, measure_read_bandwidth
from vlserve.bench.decode import readers_medians, step_shares
from vlserve.bench.footprint import budget_of, misses
from vlserve.bench.loadgen import chat_url, percentile
from vlserve.bench.workload import Workload, parse_size, synthetic_photo
from vlserve.kernels import native


def bench(*args: str, status: int = 0) -> dict:
    """`vlserve bench --json`; it exits 1 when not one request succeeded."""
    result = run_tool("vlserve", "bench", "--json", *args, timeout=300)
    assert result.returncode == status, result.stderr
    return json.loads(result.stdout)


def test_percentiles_match_the_statistics_module():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.3]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (5, 50, 95, 99):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])
    assert percentile([], 50) is None


def test_urls_and_sizes_are_read_as_people_write_them():
    for given in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/chat/completions"):
        assert chat_url(given) == "http://h:1/v1/chat/completions"
    assert parse_size("1280x720") == (1280, 720)
    for bad in ("big", "0x10", "10x"):
        with pytest.raises(ValueError, match="image size"):
            parse_size(bad)


def test_the_request_set_is_the_same_on_every_run():
    from PIL import Image  # noqa: PLC0415

    first, again = synthetic_photo(320, 200, seed=3), synthetic_photo(320, 200, seed=3)
    assert first == again != synthetic_photo(320, 200, seed=4)
    import io  # noqa: PLC0415

    assert Image.open(io.BytesIO(first)).size == (320, 200)
    workload = Workload(image_size=(64, 48), max_tokens=5)
    body = workload.payload(2, "m")
    assert body["max_tokens"] == 5 and body["ignore_eos"] and body["stream"] and body["model"] == "m"
    assert workload.payload(2, None) == {k: v for k, v in body.items() if k != "model"}
    assert (
        Workload(image_size=None).payload(0, None)["messages"][0]["content"]
        == Workload().payload(0, None)["messages"][0]["content"][1]["text"]
    )


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    running = Server(tiny_model, "--api-key", "sesame").wait_ready()
    yield running
    running.stop()


def test_bench_counts_every_request_and_token_and_sees_the_server(server):
    report = bench("--url", server.url, "--concurrency", "2", "--requests", "6", "--max-tokens", "5")
    assert report["schema"] == "vlserve.bench/1"
    assert (report["completed"], report["failed"], report["errors"]) == (6, 0, {})
    assert report["output_tokens"] == 6 * 5  # ignore_eos: every answer is max_tokens long
    assert report["prompt_tokens"] > 6
    assert report["e2e_s"]["p50"] > 0 and report["e2e_s"]["p99"] >= report["e2e_s"]["p50"]
    assert report["request_throughput"] == pytest.approx(6 / report["elapsed_s"])
    assert report["server_pids"] == [server.process.pid]
    assert report["server_peak_rss_bytes"] >= server.rss() * 0.5


def test_bench_at_a_rate_and_with_a_text_only_workload(server):
    report = bench("--url", server.url, "--rate", "20", "--requests", "4", "--max-tokens", "3", "--image-size", "none")
    assert (report["completed"], report["failed"]) == (4, 0)
    assert report["load"]["rate"] == 20


def test_bench_reports_failures_by_kind(keyed_server):
    report = bench("--url", keyed_server.url, "--requests", "3", "--warmup", "0", status=1)
    assert (report["completed"], report["failed"], report["errors"]) == (0, 3, {"http_4xx": 3})
    report = bench("--url", keyed_server.url, "--requests", "2", "--api-key", "sesame", "--max-tokens", "2")
    assert (report["completed"], report["failed"]) == (2, 0)
    closed = bench("--url", "http://127.0.0.1:9", "--requests", "2", "--warmup", "0", status=1)
    assert closed["errors"] == {"connection": 2}


def test_decode_bytes_are_the_language_model_weights_a_step_reads(tiny_model):
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=torch.bfloat16)
    text = model.model.language_model
    embedding = text.embed_tokens.weight.numel()
    per_step = sum(p.numel() for p in text.parameters()) - embedding + model.lm_head.weight.numel()
    assert decode_bytes_per_token(tiny_model, "bfloat16") == 2 * per_step
    assert decode_bytes_per_token(tiny_model, "float32") == 4 * per_step


def test_bandwidth_is_measured_on_a_buffer_of_the_asked_size():
    result = measure_read_bandwidth(1, size_bytes=64 * 2**20, repeats=3)
    assert result["buffer_bytes"] == 64 * 2**20 and result["bytes_per_s"] > 0
    assert result["reader"] == "torch.dot" and list(result["readers_bytes_per_s"]) == ["torch.dot"]
    # In 2 MiB pages as far as the kernel gives them (counted from smaps), none where THP is off.
    assert 0 <= result["buffer_huge_page_bytes"] <= result["buffer_bytes"]
    assert result["buffer_huge_page_bytes"] % (2 * 2**20) == 0
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.is_file() and "[never]" in thp.read_text():
        assert result["buffer_huge_page_bytes"] == 0


def test_bandwidth_is_the_faster_of_torch_s_read_and_the_kernels(monkeypatch):
    """Where vlserve's kernels run, their prefetched read takes turns with torch's on the same buffer and
    the faster one is the bound; torch's kernels alone have no read of their own."""
    monkeypatch.setattr(native, "_outcome", None)  # load as a new process would
    kernels = native.load(pathlib.Path(NATIVE_KERNELS))
    result = measure_read_bandwidth(2, size_bytes=64 * 2**20, repeats=3, kernels=kernels)
    speeds = result["readers_bytes_per_s"]
    assert set(speeds) == ({"torch.dot", "vlserve"} if kernels.ops is not None else {"torch.dot"})
    assert result["bytes_per_s"] == max(speeds.values()) == speeds[result["reader"]]
    stock = measure_read_bandwidth(1, size_bytes=8 * 2**20, repeats=1, kernels=native.STOCK_KERNELS)
    assert list(stock["readers_bytes_per_s"]) == ["torch.dot"]


def test_each_reader_s_median_counts_only_the_turns_that_read_with_it():
    """bench-decode --kernels both: the stock turns read with torch's dot alone, the others with both."""
    turns = [{"torch.dot": 30.0, "vlserve": 33.0}, {"torch.dot": 31.0}, {"torch.dot": 29.0, "vlserve": 35.0}]
    assert readers_medians(turns) == {"torch.dot": 30.0, "vlserve": 34.0}
    assert readers_medians([{"torch.dot": 30.0}]) == {"torch.dot": 30.0}


def test_each_step_is_held_against_the_memory_speed_just_before_and_after_it():
    """bench-decode reads between its steps: a step in a slow moment is held against that moment's speed,
    the faster reader's on each side, not against the turn's median."""
    passes = [{"torch.dot": 30e9, "vlserve": 40e9}, {"torch.dot": 20e9}, {"torch.dot": 10e9, "vlserve": 60e9}]
    # 1 GB at 30 GB/s (40 and 20 around it) takes 1/30 s: a step that long is at its bound
    shares = step_shares(1e9, [1 / 30, 2 / 40], passes)
    assert shares == pytest.approx([1.0, 1e9 / 40e9 / (2 / 40)])
    with pytest.raises(IndexError):  # a step needs a pass on each side
        step_shares(1e9, [0.1, 0.1, 0.1], passes)


def fresh_torch_threads() -> int:
    """torch's default thread count in a new process (this one's may have been set by another test)."""
    result = run_tool("python", "-c", "import torch; print(torch.get_num_threads())")
    return int(result.stdout)


def test_footprint_measures_a_worker_per_level_against_its_plan(tiny_model, tmp_path):
    out = tmp_path / "footprint.json"
    result = run_tool(
        "vlserve",
        *("bench-footprint", "--model", str(tiny_model), "--levels", "none", "int8"),
        *("--max-tokens", "4", "--image-size", "256x192", "--output", str(out)),
        timeout=600,
    )
    data = json.loads(out.read_text())
    # The tiny checkpoint fits every budget of the real model's plan: no miss, exit 0.
    assert result.returncode == 0, result.stdout + result.stderr
    assert [level["level"] for level in data["levels"]] == ["none", "int8"]
    for level in data["levels"]:
        plan = sizing.plan(data["facts"], sizing.Policy(quantize=level["level"], max_workers=1))
        assert level["plan"] == budget_of(plan)
        assert level["dtypes"]["prefill_dtype"] == plan["model"]["prefill_dtype"]
        measured = level["measured"]
        # A Python process with torch and a model: more than 100 MB, far less than the real model's budget.
        assert all(1e8 < value < level["plan"]["high_bytes"] for value in measured.values()), measured
        assert measured["serving_peak_bytes"] >= measured["served_bytes"]
        assert level["settled_s"] >= level["ready_s"] > 0
    assert "the plan's budget" in result.stdout
    # A figure below its measurement is named, and makes the command fail.
    short = dict(data["levels"][0], plan=dict(data["levels"][0]["plan"], load_peak_bytes=1))
    assert misses(short) == [
        "load_peak_bytes: plan 0.00 GB < measured %.2f GB (the load's peak)"
        % (short["measured"]["load_peak_bytes"] / 1e9)
    ]


def test_compare_runs_naive_and_tuned_and_fills_every_figure(tiny_model, tmp_path):
    out = tmp_path / "compare.json"
    result = run_tool(
        "vlserve",
        "bench-compare",
        "--model",
        str(tiny_model),
        "--latency-requests",
        "2",
        "--throughput-requests",
        "4",
        "--cache-pairs",
        "1",
        "--startup-runs",
        "1",
        "--max-tokens",
        "4",
        "--image-size",
        "256x192",
        "--output",
        str(out),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    plan = sizing.plan(sizing.probe())
    assert data["naive"]["server"] == {
        "dtype": "float32",
        "vision_dtype": "float32",
        "prefill_dtype": "float32",
        "threads": fresh_torch_threads(),
        "packed_weights": False,
        "quantize": "none",
    }
    assert data["tuned"]["server"]["dtype"] == plan["model"]["dtype"]
    assert data["tuned"]["server"]["vision_dtype"] == plan["model"]["vision_dtype"]
    assert data["tuned"]["server"]["prefill_dtype"] == plan["model"]["prefill_dtype"]
    assert data["tuned"]["server"]["packed_weights"] == plan["model"]["packed_weights"]
    assert data["tuned"]["workers"] == plan["workers"]["count"]
    for name in ("naive", "tuned"):
        assert data[name]["latency"]["completed"] == 2
        assert data[name]["throughput"]["completed"] == 4
        assert data[name]["ready_s"] > 0 and data[name]["peak_rss_bytes"] > 0
        assert data[name]["settled_s"] >= data[name]["ready_s"]
    assert data["figures"]["throughput_ratio"] > 0
    assert set(data["targets"]) == set(data["figures"])
    assert data["bandwidth"]["decode_bytes_per_token"] == decode_bytes_per_token(tiny_model, plan["model"]["dtype"])
    assert "| throughput, 4 clients (requests/min) |" in result.stdout
    # The plan at the other quantize levels is measured beside it, never instead.
    assert plan["model"]["quantize"] == "none"
    for level in ("int8", "int4"):
        column = data["tuned_" + level]
        assert column["server"]["quantize"] == level and column["plan"]["quantize"] == level
        assert column["latency"]["completed"] == 2 and column["throughput"]["completed"] == 4
        assert set(column["targets"]) == set(data["targets"])
        assert "| tuned, %s | %s/naive |" % (level, level) in result.stdout
        assert "tuned, %s: the plan with quantize=%s" % (level, level) in result.stdout
    assert (
        data["bandwidth"]["decode_bytes_per_token"]
        > data["tuned_int8"]["decode_bytes_per_token"]
        > data["tuned_int4"]["decode_bytes_per_token"]
    )


def test_autotune_ranks_the_plan_and_writes_host_vars_the_role_accepts(tiny_model, tmp_path):
    override = tmp_path / "host_vars.yml"
    result = run_tool(
        "vlserve",
        "autotune",
        "--model",
        str(tiny_model),
        "--requests",
        "2",
        "--clients",
        "2",
        "--max-tokens",
        "2",
        "--image-size",
        "128x128",
        "--batch-sizes",
        "1",
        "2",
        "--dtypes",
        "float32",
        "--write-override",
        str(override),
        "--json",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    measured = [row for row in data["rows"] if row.get("request_throughput")]
    facts = sizing.probe()
    options = AutotuneOptions(model=tiny_model, batch_sizes=(1, 2), dtypes=("float32",))
    distinct = {plan_key(sizing.plan(facts, policy)) for policy in candidates(facts, sizing.Policy(), options)}
    assert len(measured) == len(distinct) >= 2  # every distinct plan once (policies that plan alike share a row)
    assert len({row["config"] for row in measured}) == len(measured)
    assert data["best"]["request_throughput"] == max(row["request_throughput"] for row in measured)
    assert sum(1 for row in measured if row["is_plan"]) <= 1
    variables = yaml.safe_load(override.read_text())
    specs = yaml.safe_load((REPO / "roles/vlserve_facts/meta/argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert variables and set(variables) <= set(options)
    policy = sizing.Policy.from_mapping({k.removeprefix("vlserve_facts_"): v for k, v in variables.items()})
    assert policy.dtype == "float32" and policy.max_batch_size in (1, 2) and policy.quantize == "auto"


def test_autotune_sweeps_quantize_levels_only_when_asked(tmp_path):
    facts = load_topology("xeon-avx512bf16-2vcpu-vm")
    base = sizing.Policy()
    default = candidates(facts, base, AutotuneOptions(model=tmp_path, batch_sizes=(1,), dtypes=("bfloat16",)))
    assert {policy.quantize for policy in default} == {base.quantize}  # the policy's numerics, kept
    swept = candidates(
        facts, base, AutotuneOptions(model=tmp_path, batch_sizes=(1,), dtypes=("bfloat16",), levels=("none", "int4"))
    )
    assert len(swept) == 2 * len(default) and {policy.quantize for policy in swept} == {"none", "int4"}
    assert {plan_key(sizing.plan(facts, policy))[-1] for policy in swept} == {"none", "int4"}


def test_the_peer_benchmark_caps_llama_servers_images_at_the_tokens_a_worker_spends(tiny_model, server):
    """bench-peer gives llama-server the image-token count a default vlserve worker reports for the
    same generated photo, so both encode the same number of patches."""
    from vlserve.bench.peer import image_tokens  # noqa: PLC0415

    workload = Workload(image_size=(1280, 720), max_tokens=1)
    body = workload.payload(0, None) | {"stream": False}
    del body["stream_options"]
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert image_tokens(tiny_model, (1280, 720)) == answer["usage"]["image_tokens"] > 0
    assert image_tokens(tiny_model, None) == 0


def test_the_peer_benchmark_finds_the_files_a_worker_maps(server, tmp_path):
    """bench-peer warms the files a level's workers mapped at their first start, as it warms
    llama-server's GGUF files: read from /proc/PID/maps, only while they are mapped."""
    import mmap  # noqa: PLC0415

    from vlserve.bench.servers import mapped_files  # noqa: PLC0415

    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 8192)
    with weights.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ):
        assert weights in mapped_files(os.getpid())
    assert weights not in mapped_files(os.getpid())
    assert any(path.name.startswith("libtorch") for path in mapped_files(server.process.pid))


def test_each_peer_load_sends_photos_no_cache_of_the_worker_has_seen(tiny_model, server):
    """bench-peer's loads at 1, 2 and 4 clients against one worker, as a round runs them: no answer,
    image encoding or prompt came from the worker's caches (llama-server starts afresh for each)."""
    from vlserve.bench.peer import PeerOptions, _load  # noqa: PLC0415

    options = PeerOptions(model=tiny_model, requests=2, image_size=(96, 64), max_tokens=2, progress=False)
    before = server.metrics()
    for clients in (1, 2, 4):
        figures = _load(options, [server.url], clients, [])
        assert figures["output_tokens_per_s"] > 0
    after = server.metrics()
    for name in ("vlserve_cache_hits_total", "vlserve_cache_misses_total"):
        for cache in ("result", "vision"):
            key = (name, (("cache", cache),))
            hits_or_misses = after[key] - before.get(key, 0)
            # a warm-up request a load and 2 + 4 + 8 measured ones: every one a miss
            assert hits_or_misses == (0 if name == "vlserve_cache_hits_total" else 3 + 14), (name, cache)


def peer_side(ttft: float, tpot: float, rates: dict[int, float], peak: float, ready: float) -> dict:
    loads = {
        n: {"ttft_s": ttft, "tpot_s": tpot, "output_tokens_per_s": rate, "peak_rss_bytes": peak * n / 4}
        for n, rate in rates.items()
    }
    second = {"first_ttft_s": ttft, "second_ttft_s": ttft / 4, "follow_up_ttft_s": ttft / 2}
    return {"loads": loads, "turns": second, "peak_rss_bytes": peak, "settled_rss_bytes": peak / 2,
            "ready_s": ready, "settled_s": ready}  # fmt: skip


def test_the_peer_table_is_the_ratio_of_the_medians_over_rounds_with_each_sides_range():
    from vlserve.bench.peer import PeerOptions, summarize  # noqa: PLC0415

    vlserve = [peer_side(0.2, 0.05, {1: 20, 4: 60}, 4e9, 5), peer_side(0.4, 0.07, {1: 18, 4: 50}, 5e9, 6),
               peer_side(0.3, 0.06, {1: 19, 4: 40}, 6e9, 4)]  # fmt: skip
    llama = [peer_side(1.0, 0.1, {1: 10, 4: 20}, 2e9, 2), peer_side(0.8, 0.1, {1: 9, 4: 25}, 2e9, 3),
             peer_side(1.2, 0.1, {1: 11, 4: 30}, 2e9, 2)]  # fmt: skip
    rounds = [{"int8": {"vlserve": ours, "llama": theirs}} for ours, theirs in zip(vlserve, llama, strict=True)]
    summary = summarize(rounds, PeerOptions(model=REPO, pairs=("int8",), concurrency=(1, 4)))["int8"]
    assert summary["TTFT (ms)"]["vlserve"] == {"median": 300, "min": 200, "max": 400}
    assert summary["TTFT (ms)"]["ratio"] == pytest.approx(0.3 / 1.0)
    assert summary["2nd question TTFT (ms)"]["vlserve"]["median"] == pytest.approx(75)
    assert summary["2nd / 1st question TTFT"]["llama"]["median"] == pytest.approx(0.25)
    assert summary["follow-up / 1st TTFT"]["vlserve"]["median"] == pytest.approx(0.5)
    assert summary["tok/s at 4"]["ratio"] == pytest.approx(50 / 25)
    assert summary["peak memory (GB)"]["ratio"] == pytest.approx(2.5)
    assert summary["ready (s)"]["llama"] == {"median": 2, "min": 2, "max": 3}
    assert summary["memory at 1 (GB)"]["llama"]["median"] == pytest.approx(0.5)
    assert summary["memory at 4 (GB)"]["vlserve"] == {"median": 5, "min": 4, "max": 6}
    assert "tok/s at 2" not in summary and "tok/s at 8" not in summary  # not measured in this run
    assert "tok/s at 1" not in summary  # the single-client figures are TTFT and TPOT


def test_side_by_side_pairs_send_each_photo_once_to_each_server(tiny_model, server):
    """bench-peer's side-by-side phase: both servers up, each pair one new photo to one side then the
    other, after a warm-up to each; every request a miss of the workers' caches."""
    from vlserve.bench.peer import PeerOptions, side_by_side  # noqa: PLC0415

    other = Server(tiny_model).wait_ready()
    try:
        options = PeerOptions(model=tiny_model, side_by_side=3, image_size=(96, 64), max_tokens=3, progress=False)
        before = {name: s.metrics() for name, s in (("a", server), ("b", other))}
        pairs = side_by_side(options, {"vlserve": server.url, "llama": other.url})
        after = {name: s.metrics() for name, s in (("a", server), ("b", other))}
    finally:
        other.stop()
    assert len(pairs) == 3
    for measured in pairs:
        assert set(measured) == {"vlserve", "llama"}
        assert all(measured[side]["ttft_s"] > 0 and measured[side]["tpot_s"] > 0 for side in measured)
    for name in ("a", "b"):  # a warm-up and three pairs: four new photos to each server
        for cache in ("result", "vision"):
            hits = ("vlserve_cache_hits_total", (("cache", cache),))
            misses = ("vlserve_cache_misses_total", (("cache", cache),))
            assert after[name][hits] - before[name].get(hits, 0) == 0
            assert after[name][misses] - before[name].get(misses, 0) == 4


def test_the_side_by_side_ratio_is_the_median_of_each_pairs_own_ratio():
    """A pair's two requests met one moment of the machine: the ratio is the median of the pairs'
    ratios, which a slow minute for both sides does not move, unlike the ratio of the medians."""
    from vlserve.bench.peer import render, summarize_side_by_side  # noqa: PLC0415

    def pair(ours: float, theirs: float) -> dict:
        return {"vlserve": {"ttft_s": 2 * ours, "tpot_s": ours}, "llama": {"ttft_s": 2 * theirs, "tpot_s": theirs}}

    # fast, fast, slow minutes: vlserve 0.9x of llama.cpp in each pair; the medians' ratio says 0.6x
    rounds = [{"int8": {"side_by_side": [pair(0.045, 0.05), pair(0.054, 0.06)]}},
              {"int8": {"side_by_side": [pair(0.09, 0.1)]}}]  # fmt: skip
    summary = summarize_side_by_side([p for r in rounds for p in r["int8"]["side_by_side"]])
    tpot = summary["TPOT side by side (ms)"]
    assert tpot["ratio"] == pytest.approx(0.9) and tpot["ratio_range"] == pytest.approx([0.9, 0.9])
    assert tpot["vlserve"]["median"] == pytest.approx(54) and tpot["llama"]["median"] == pytest.approx(60)
    assert tpot["pairs"] == 3 and summary["TTFT side by side (ms)"]["llama"]["max"] == pytest.approx(200)
    result = {"llama_cpp": {"commit": "0c1e57098", "llama_cpp_python": "0.3.36", "amx": True}, "threads": 2,
              "image_tokens": 180, "max_tokens": 32, "rounds": rounds, "concurrency": [1],
              "pairs": {"int8": "Q8_0"}, "summary": {"int8": summary}}  # fmt: skip
    assert "0.90x (0.90-0.90x over 3 pairs)" in render(result)


def test_bench_peer_refuses_a_sweep_without_single_client_figures_and_a_missing_model(tiny_model, tmp_path):
    result = run_tool("vlserve", "bench-peer", "--model", str(tiny_model), "--concurrency", "2", "4")
    assert result.returncode == 2 and "--concurrency needs 1" in result.stderr
    result = run_tool("vlserve", "bench-peer", "--model", str(tiny_model), "--side-by-side", "-1")
    assert result.returncode == 2 and "--side-by-side takes a count" in result.stderr
    result = run_tool("vlserve", "bench-peer", "--model", str(tmp_path / "none"))
    assert result.returncode == 2 and str(tmp_path / "none") in result.stderr


def test_the_peer_build_patches_ggmls_tile_config_load_once_and_records_it(tmp_path):
    """ggml's `_tile_loadconfig(&tc)` becomes ldtilecfg with the whole struct as operand (GCC 12 may
    drop the struct's stores otherwise); applying it again changes nothing, and a source without the
    line is left alone with no patch recorded."""
    from vlserve.bench.llamacpp import TILE_CONFIG_FILE, patch_tile_config  # noqa: PLC0415

    mmq = tmp_path / TILE_CONFIG_FILE
    mmq.parent.mkdir(parents=True)
    original = "    tc.rows[7] = 16;  tc.colsb[7] = 64;\n\n    _tile_loadconfig(&tc);\n    done = true;\n"
    mmq.write_text(original)
    first = patch_tile_config(tmp_path)
    patched = mmq.read_text()
    assert first and "_tile_loadconfig" not in patched
    assert 'asm volatile("ldtilecfg %0" :: "m"(tc));' in patched and "tc.rows[7] = 16;" in patched
    assert patch_tile_config(tmp_path) == first and mmq.read_text() == patched
    mmq.write_text("    _tile_loadconfig(config_pointer);\n")
    assert patch_tile_config(tmp_path) == [] and mmq.read_text() == "    _tile_loadconfig(config_pointer);\n"
    assert patch_tile_config(tmp_path / "elsewhere") == []
