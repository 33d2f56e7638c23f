"""The engine without HTTP: its output is the model's own, batching changes nothing, limits hold."""

from __future__ import annotations

import functools
import hashlib
import threading
import time

import pytest
import torch
from PIL import Image

import vlserve.model.loader
from conftest import run_tool
from vlserve import sizing
from vlserve.errors import ContextLengthExceeded, MemoryPressure, RequestTimeout
from vlserve.kernels import native
from vlserve.kernels.quantized import INT8_PREFILL_ROWS, Int8Linear, Int8Weight
from vlserve.model import mapped
from vlserve.model.packing import PREFILL_ROWS, PackedBf16Weight, PackedGroup, PackedLinear, packing_supported
from vlserve.runtime.engine import Engine
from vlserve.runtime.images import ImageInput
from vlserve.runtime.sampling import SamplingParams
from vlserve.settings import LimitSettings, ModelSettings


class Collect:
    def __init__(self, on_text=None):
        self.text, self.reason, self.usage, self.error = "", None, None, None
        self.done = threading.Event()
        self._on_text = on_text

    def on_text(self, text):
        self.text += text
        if self._on_text:
            self._on_text(self)

    def on_finish(self, reason, usage):
        self.reason, self.usage = reason, usage
        self.done.set()

    def on_error(self, error):
        self.error = error
        self.done.set()

    def wait(self):
        assert self.done.wait(60), "no answer in 60 s"
        return self


@pytest.fixture
def stock_kernels(monkeypatch):
    """A process whose workers run torch's kernels only (`native_kernels: off`, or no compiler): where
    vlserve's bfloat16 product loads, the exact level leaves the packed layout for it (test_native)."""
    monkeypatch.setattr(native, "_outcome", None)
    return "off"


def image(color, size):
    picture = Image.new("RGB", size, color)
    picture.paste((255 - color[0], color[1], 0), (0, 0, size[0] // 3, size[1] // 2))
    return ImageInput(picture, hashlib.sha256(picture.tobytes()).hexdigest())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """float32 weights: batched and solo runs must agree token for token."""
    directory = tmp_path_factory.mktemp("models") / "tiny-fp32"
    assert run_tool("vlserve", "make-test-model", str(directory), "--dtype", "float32").returncode == 0
    engine = Engine(
        ModelSettings(model=directory, dtype="float32"),
        LimitSettings(max_batch_size=4, max_context_tokens=1024, request_timeout_s=30),
    )
    engine.load()
    engine.warmup()
    engine.mark_ready()
    yield engine
    engine.shutdown()


def test_the_warm_up_runs_the_model_on_one_image_s_tokens_only(engine, monkeypatch):
    """Every stage (vision encoder, prefill, decode) but a three-row prompt: a start's cheapest full request."""
    submitted = []
    original = engine.submit

    def recording(prompt, params, sink, **kwargs):
        submitted.append((prompt, kwargs))
        return original(prompt, params, sink, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    try:
        engine.warmup()  # waits for the answer and raises if the model failed
    finally:
        engine.mark_ready()
    ((prompt, kwargs),) = submitted
    processor, ids = engine.processor, prompt.input_ids.tolist()
    assert kwargs == {"use_caches": False, "warmup": True}
    assert ids[0] == processor.vision_start_token_id and ids[-1] == processor.vision_end_token_id
    merged = int(prompt.image_grid_thw.prod()) // processor.image_processor.merge_size**2
    assert ids[1:-1] == [processor.image_token_id] * merged == [processor.image_token_id]
    assert prompt.mm_token_type_ids.shape == prompt.input_ids.shape and prompt.pixel_values is not None


CONVERSATIONS = [
    [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image((200, 30, 30), (300, 200))},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many cats are in the picture?"}],
    [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image((10, 130, 30), (100, 180))},
                {"type": "text", "text": "Describe the picture in detail, please."},
            ],
        }
    ],
]


@pytest.fixture(scope="module")
def transformers_model(engine):
    """transformers' own Qwen3-VL on the engine's checkpoint and dtype: the reference the service's
    network (vlserve/model/network.py) answers as."""
    from transformers import Qwen3VLForConditionalGeneration  # noqa: PLC0415

    return Qwen3VLForConditionalGeneration.from_pretrained(engine.model_settings.model, dtype=torch.float32).eval()


def hf_generate(model, prompt, tokens):
    """transformers' own generate() on the same inputs: the reference."""
    inputs = {
        "input_ids": prompt.input_ids[None],
        "attention_mask": torch.ones_like(prompt.input_ids)[None],
        "mm_token_type_ids": prompt.mm_token_type_ids[None],
    }
    if prompt.pixel_values is not None:
        inputs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, prompt.tokens :].tolist()


def run(engine, conversation, tokens=24, **params):
    sink = Collect()
    sequence = engine.submit(
        engine.prepare(conversation), SamplingParams(max_tokens=tokens, **params), sink, use_caches=False
    )
    sink.wait()
    return sequence, sink


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_greedy_output_is_what_transformers_generates(engine, transformers_model, index):
    sequence, sink = run(engine, CONVERSATIONS[index])
    reference = hf_generate(transformers_model, sequence.prompt, 24)
    assert sequence.generated == reference[: len(sequence.generated)]
    assert sink.usage.completion_tokens == len(sequence.generated)
    assert sink.usage.prompt_tokens == sequence.prompt.tokens


def test_requests_that_join_mid_flight_get_the_same_tokens_as_alone(engine):
    alone = [run(engine, conversation, tokens=40)[0].generated for conversation in CONVERSATIONS]
    sinks, sequences = [], []

    def submit(index):
        sink = Collect(on_text=join_next if index + 1 < len(CONVERSATIONS) else None)
        sinks.append(sink)
        prompt = engine.prepare(CONVERSATIONS[index])
        sequences.append(engine.submit(prompt, SamplingParams(max_tokens=40), sink, use_caches=False))

    def join_next(sink):
        # Called from the scheduler thread as text arrives: the next request joins a running batch.
        if not getattr(sink, "joined", False) and len(sink.text) >= 2:
            sink.joined = True
            submit(len(sinks))

    before = engine.metrics.decode_batch.collect()[0].samples
    submit(0)
    for sink in sinks:
        sink.wait()
    deadline = time.monotonic() + 30
    while len(sinks) < len(CONVERSATIONS) or not all(s.done.is_set() for s in sinks):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [s.generated for s in sequences] == alone
    after = engine.metrics.decode_batch.collect()[0].samples
    widest = {s.labels["le"]: s.value for s in after if s.name.endswith("_bucket")}
    narrow = {s.labels["le"]: s.value for s in before if s.name.endswith("_bucket")}
    assert widest["1.0"] - narrow["1.0"] < widest["+Inf"] - narrow["+Inf"], "no step ever ran two sequences"


def test_stop_strings_cut_the_text(engine):
    _, sink = run(engine, CONVERSATIONS[1], tokens=24)
    assert len(sink.text) > 4
    stop = sink.text[2:4]
    _, stopped = run(engine, CONVERSATIONS[1], tokens=24, stop=(stop,))
    assert stopped.reason == "stop"
    assert stopped.text == sink.text[: sink.text.find(stop)]


def test_seeded_sampling_is_repeatable(engine):
    first = run(engine, CONVERSATIONS[0], temperature=0.9, top_p=0.9, seed=7)[0].generated
    second = run(engine, CONVERSATIONS[0], temperature=0.9, top_p=0.9, seed=7)[0].generated
    other = run(engine, CONVERSATIONS[0], temperature=0.9, top_p=0.9, seed=8)[0].generated
    assert first == second
    assert first != other


def test_cancel_frees_the_slot(engine):
    sink = Collect()
    sequence = engine.submit(engine.prepare(CONVERSATIONS[1]), SamplingParams(max_tokens=900, ignore_eos=True), sink)
    while not sink.text:
        time.sleep(0.005)
    sequence.cancel()
    deadline = time.monotonic() + 10
    while engine.running:
        assert time.monotonic() < deadline, "the cancelled sequence is still running"
        time.sleep(0.01)
    assert not sink.done.is_set()  # a cancelled request gets no finish: nobody is listening
    assert len(sequence.generated) < 900


def test_a_request_past_its_deadline_fails_with_a_timeout(engine):
    engine.limits.request_timeout_s = 0.3
    try:
        sink = Collect()
        engine.submit(engine.prepare(CONVERSATIONS[1]), SamplingParams(max_tokens=900, ignore_eos=True), sink)
        sink.wait()
    finally:
        engine.limits.request_timeout_s = 30
    assert isinstance(sink.error, RequestTimeout)


def test_the_memory_guard_drops_the_stored_prefixes_before_it_refuses_a_request(engine, monkeypatch):
    first = run(engine, CONVERSATIONS[2], tokens=4)[0]
    assert engine.prefix_cache.cost > 0
    again = run(engine, CONVERSATIONS[2], tokens=4, temperature=0.5, seed=1)[0]  # past the result cache
    assert again.cached_tokens == first.prompt.tokens - 1  # all but the last token, whose logits it needs
    monkeypatch.setattr(engine, "_memory_limit", 1)  # any worker is over one byte
    with pytest.raises(MemoryPressure):
        engine.submit(engine.prepare(CONVERSATIONS[2]), SamplingParams(max_tokens=4, temperature=0.5), Collect())
    assert engine.prefix_cache.cost == 0 and len(engine.prefix_cache) == 0


def test_context_limit(engine):
    prompt = engine.prepare(CONVERSATIONS[1])
    assert engine.resolve_max_tokens(prompt, None) == min(512, 1024 - prompt.tokens)
    with pytest.raises(ContextLengthExceeded):
        engine.resolve_max_tokens(prompt, 1024)
    long = engine.prepare([{"role": "user", "content": "word " * 2000}])
    with pytest.raises(ContextLengthExceeded):
        engine.resolve_max_tokens(long, None)


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernels")
def test_packed_bfloat16_weights_give_the_same_tokens(tmp_path, stock_kernels):
    """Packing changes the weights' layout, not the math: same greedy tokens, logits equal to bf16 rounding."""
    directory = tmp_path / "tiny-bf16"
    assert run_tool("vlserve", "make-test-model", str(directory)).returncode == 0
    engines = {}
    for packed in (False, True):
        engines[packed] = Engine(
            ModelSettings(
                model=directory,
                dtype="bfloat16",
                packed_weights=packed,
                prefill_dtype="bfloat16",
                native_kernels=stock_kernels,
            ),
            LimitSettings(max_batch_size=4, max_context_tokens=1024, request_timeout_s=30),
        )
        engines[packed].load()
        engines[packed].mark_ready()
    try:
        assert engines[True].loaded_as.packed and not engines[False].loaded_as.packed
        layers = [m for m in engines[True].model.modules() if isinstance(m, PackedLinear)]
        assert (
            len(layers) == 7 * engines[True].model.config.text_config.num_hidden_layers + 1
        )  # q k v o gate up down, head
        fused = [m for m in layers if m.group is not None]  # q k v and gate up: one product each
        assert len(fused) == 5 * engines[True].model.config.text_config.num_hidden_layers
        assert all(m.weight is None for m in fused)
        assert not any(isinstance(m, PackedLinear) for m in engines[False].model.modules())
        for conversation in CONVERSATIONS:
            plain, _ = run(engines[False], conversation, tokens=12, ignore_eos=True)
            packed, _ = run(engines[True], conversation, tokens=12, ignore_eos=True)
            assert packed.generated == plain.generated
        ids = torch.arange(40)[None]
        with torch.inference_mode():
            logits = [engines[p].model(input_ids=ids).logits.float() for p in (False, True)]
        assert torch.allclose(logits[0], logits[1], atol=2e-2, rtol=2e-2)
    finally:
        for engine in engines.values():
            engine.shutdown()


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernels")
def test_a_packed_group_gives_each_member_its_own_product():
    torch.manual_seed(1)
    plain = [torch.nn.Linear(64, n, bias=n != 16).to(torch.bfloat16) for n in (48, 16, 32)]
    group = PackedGroup(plain, PackedBf16Weight)
    members = [PackedLinear(linear, PackedBf16Weight, group=group, index=i) for i, linear in enumerate(plain)]
    alone = [PackedLinear(linear) for linear in plain]
    for rows in (1, 3, PREFILL_ROWS + 1):
        x = torch.randn(2, rows, 64).to(torch.bfloat16)
        for order in ((0, 1, 2), (2, 0, 1)):  # whichever member comes first computes the group's product
            outputs = {i: members[i](x) for i in order}
            for i in order:
                assert outputs[i].shape == (2, rows, plain[i].out_features)
                assert torch.equal(outputs[i], alone[i](x))  # bit for bit
            assert group._input is None and not group._outputs  # all served: nothing held
    first, second = torch.randn(1, 64).to(torch.bfloat16), torch.randn(1, 64).to(torch.bfloat16)
    members[0](first)
    assert torch.equal(members[1](second), alone[1](second))  # a new input is a new product


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernels")
def test_a_group_left_unpacked_until_after_ready_answers_from_its_parts_then_packs():
    torch.manual_seed(2)
    plain = [torch.nn.Linear(64, n, bias=False).to(torch.bfloat16) for n in (48, 16)]
    deferred = PackedGroup(plain, functools.partial(PackedBf16Weight, prepack=False))
    ready = PackedGroup(plain, PackedBf16Weight)
    rows = torch.randn(3, 64).to(torch.bfloat16)
    assert deferred.weight.layout_pending and deferred.weight.packed is None
    reference = ready.weight.matmul(rows)
    assert torch.allclose(deferred.weight.matmul(rows).float(), reference.float(), rtol=1e-2, atol=1e-2)
    assert deferred.weight.nbytes == ready.weight.nbytes
    deferred.weight.finish_layout()
    assert not deferred.weight.layout_pending and deferred.weight.parts is None  # the map's views let go
    assert torch.equal(deferred.weight.matmul(rows), reference)


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="this CPU has no oneDNN bf16 kernels")
def test_prompt_sized_products_run_on_the_float32_copy_once_it_is_made():
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    layer = PackedLinear(plain, prefill_dtype=torch.float32)
    prompt, step = torch.randn(PREFILL_ROWS + 5, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    packed_prompt = layer.weight.matmul(prompt)
    assert layer.prefill_copy_pending and torch.equal(layer(prompt), packed_prompt)  # no copy yet: packed path
    layer.make_prefill_copy()
    assert not layer.prefill_copy_pending and layer.prefill_weight.dtype == torch.float32
    wide = torch.nn.functional.linear(prompt.float(), plain.weight.float(), plain.bias.float()).to(torch.bfloat16)
    assert torch.equal(layer(prompt), wide)
    assert torch.equal(
        layer(step), torch.ops.mkldnn._linear_pointwise(step, layer.weight.packed, layer.weight.bias, "none", [], "")
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_the_engine_makes_the_prefill_copies_after_it_is_ready(tmp_path, packed, stock_kernels):
    """Packed (oneDNN bf16) or plain bfloat16 layers (CPUs without AVX-512 BF16): the same copies for prompts."""
    if packed and not packing_supported(torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bf16 kernels")
    directory = tmp_path / "tiny-bf16"
    assert run_tool("vlserve", "make-test-model", str(directory)).returncode == 0
    engine = Engine(
        ModelSettings(
            model=directory,
            dtype="bfloat16",
            packed_weights=packed,
            prefill_dtype="float32",
            native_kernels=stock_kernels,
        ),
        LimitSettings(max_batch_size=2, max_context_tokens=1024, request_timeout_s=30),
    )
    engine.load()
    try:
        assert engine.loaded_as.packed == packed
        kinds = {type(m.stored).__name__ for m in engine.model.modules() if isinstance(m, PackedLinear)}
        assert kinds == {"PackedBf16Weight" if packed else "PlainWeight"}
        layers = 7 * engine.model.config.text_config.num_hidden_layers  # the head never sees a prompt
        assert engine.loaded_as.prefill_dtype == "float32" and engine.prefill_copies_pending == layers
        engine.warmup()
        assert engine.prefill_copies_pending == layers  # none while loading and warming up
        engine.mark_ready()
        deadline = time.monotonic() + 60
        while engine.prefill_copies_pending:
            assert time.monotonic() < deadline, "prefill copies never made"
            time.sleep(0.05)
        copies = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and m.prefill_weight is not None]
        assert len(copies) == layers and all(m.prefill_weight.dtype == torch.float32 for m in copies)
        # Nothing else is left for after ready: what no layer converted stays in the checkpoint's map.
        assert engine.background_steps_pending == 0
        embedding = engine.model.model.language_model.embed_tokens.weight
        assert any(low <= embedding.data_ptr() < high for low, high in mapped.checkpoint_ranges())
        sequence, sink = run(engine, CONVERSATIONS[0], tokens=6, ignore_eos=True)
        assert sequence.prompt.tokens >= PREFILL_ROWS  # this prompt's prefill ran on the copies
        assert sink.error is None and len(sequence.generated) == 6
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_int8_engine_answers(tmp_path, dtype):
    if dtype == "bfloat16" and not packing_supported(torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bf16 kernels")
    directory = tmp_path / "tiny"
    assert run_tool("vlserve", "make-test-model", str(directory), "--dtype", dtype).returncode == 0
    engine = Engine(
        ModelSettings(model=directory, dtype=dtype, vision_dtype="int8", prefill_dtype="int8"),
        LimitSettings(max_batch_size=2, max_context_tokens=1024, request_timeout_s=30),
    )
    engine.load()
    try:
        engine.warmup()
        engine.mark_ready()
        assert (engine.loaded_as.vision_dtype, engine.loaded_as.prefill_dtype, engine.loaded_as.packed) == (
            "int8",
            "int8",
            dtype == "bfloat16",
        )
        assert any(isinstance(m, Int8Linear) for m in engine.model.model.visual.modules())
        # The rest of the tower (norms, GELU, attention) in the dtype the plan gives it on this CPU.
        rest = sizing.vision_rest_dtype(sizing.probe(use_libraries=False)["cpu"], dtype)[0]
        assert engine.loaded_as.vision_rest_dtype == rest
        assert engine.model.model.visual.patch_embed.proj.weight.dtype == getattr(torch, rest)
        layers = 7 * engine.model.config.text_config.num_hidden_layers
        deadline = time.monotonic() + 60
        while engine.prefill_copies_pending:
            assert time.monotonic() < deadline, "prefill copies never made"
            time.sleep(0.05)
        copies = [m for m in engine.model.modules() if isinstance(getattr(m, "prefill_weight", None), Int8Weight)]
        assert len(copies) == layers
        sequence, sink = run(engine, CONVERSATIONS[0], tokens=6, ignore_eos=True)
        assert sequence.prompt.tokens >= INT8_PREFILL_ROWS and sequence.prompt.image_grid_thw is not None
        assert sink.error is None and len(sequence.generated) == 6
    finally:
        engine.shutdown()


def test_without_x86_kernels_the_engine_falls_back_and_answers(tmp_path, monkeypatch, stock_kernels):
    """On a CPU without oneDNN's bf16 and int8 kernels (an Arm server), what asks for them loads the
    plain path instead of crashing: the capability checks answer as such a CPU would."""
    monkeypatch.setattr(vlserve.model.loader, "packing_supported", lambda dtype: False)
    monkeypatch.setattr(vlserve.model.loader, "int8_products_supported", lambda kernels: False)
    directory = tmp_path / "tiny"
    assert run_tool("vlserve", "make-test-model", str(directory), "--dtype", "bfloat16").returncode == 0
    engine = Engine(
        ModelSettings(
            model=directory,
            dtype="bfloat16",
            packed_weights=True,
            vision_dtype="int8",
            prefill_dtype="int8",
            native_kernels=stock_kernels,  # nor vlserve's own (x86 only): else AVX-512 BF16 takes the weights
        ),
        LimitSettings(max_batch_size=2, max_context_tokens=1024, request_timeout_s=30),
    )
    engine.load()
    try:
        engine.warmup()
        engine.mark_ready()
        assert (
            engine.loaded_as.dtype,
            engine.loaded_as.packed,
            engine.loaded_as.vision_dtype,
            engine.loaded_as.prefill_dtype,
        ) == (
            "bfloat16",
            False,
            "float32",
            "bfloat16",
        )
        assert not any(isinstance(m, Int8Linear) for m in engine.model.modules())
        assert engine.background_steps_pending == 0
        sequence, sink = run(engine, CONVERSATIONS[0], tokens=4, ignore_eos=True)
        assert sink.error is None and len(sequence.generated) == 4
    finally:
        engine.shutdown()


ONE_OPENMP_POOL = """
import os, sys, threading, time
import torch
from PIL import Image
from vlserve.runtime.engine import Engine
from vlserve.runtime.images import ImageInput
from vlserve.runtime.sampling import SamplingParams
from vlserve.settings import LimitSettings, ModelSettings

engine = Engine(ModelSettings(model=sys.argv[1], threads=2), LimitSettings(request_timeout_s=30))
engine.load()
engine.warmup()
engine.mark_ready()
while engine.background_steps_pending:
    time.sleep(0.05)
picture = Image.effect_mandelbrot((300, 200), (-2, -1, 1, 1), 50).convert("RGB")
prompt = engine.prepare(
    [{"role": "user", "content": [{"type": "image", "image": ImageInput(picture, "m")}, {"type": "text", "text": "?"}]}]
)
done = threading.Event()
sink = type("Sink", (), {"on_text": lambda s, t: None, "on_finish": lambda s, r, u: done.set(),
                         "on_error": lambda s, e: done.set()})()
engine.submit(prompt, SamplingParams(max_tokens=3), sink)
assert done.wait(60)
settled = len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
torch.ones(4096, 4096).sum()  # a parallel region on this thread: a new pool shows as a new OS thread
print(len(os.listdir("/proc/self/task")) - settled)
engine.shutdown()
"""


def test_only_the_scheduler_thread_runs_parallel_torch_work(tiny_model):
    """The thread that loads the engine and prepares requests has no OpenMP pool of its own: with a
    second pool alive libgomp stops spinning between parallel regions, which slowed decoding by a
    fifth (engine.py's docstring). Checked from outside, by the OS thread a first parallel region adds."""
    result = run_tool("python", "-c", ONE_OPENMP_POOL, str(tiny_model), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.parametrize("shape", ["plain", "outliers"])
@pytest.mark.parametrize("level", ["int8", "int4"])
def test_a_quantized_worker_loads_decodes_and_stays_close_to_the_exact_one(tmp_path, level, shape):
    """Each level converts every decoder layer and the head, keeps the vision tower's choice, answers, and its
    next-token distributions stay near the exact model's, with the same bound on a checkpoint whose
    residual streams carry outlier channels (kept exact) as on a plain one, on whichever ISA tier runs
    (random weights: a loose bound; the real figures come from `vlserve quant-check` on the real-size
    checkpoints, docs/quantization.md)."""
    directory = tmp_path / "tiny-bf16"
    outliers = ["--outlier-channels", "4"] if shape == "outliers" else []
    assert run_tool("vlserve", "make-test-model", str(directory), *outliers).returncode == 0
    limits = LimitSettings(max_batch_size=2, max_context_tokens=1024, request_timeout_s=30)
    exact = Engine(ModelSettings(model=directory, dtype="bfloat16", quantize="none", prefill_dtype="bfloat16"), limits)
    rounded = Engine(ModelSettings(model=directory, dtype="bfloat16", quantize=level, vision_dtype="bfloat16"), limits)
    for engine in (exact, rounded):
        engine.load()
        engine.mark_ready()
    try:
        assert rounded.loaded_as.quantize == level and not rounded.loaded_as.packed
        layers = [m for m in rounded.model.modules() if isinstance(m, PackedLinear)]
        decoder_layers = rounded.model.config.text_config.num_hidden_layers
        assert len(layers) == 7 * decoder_layers + 1

        def kind(weight):  # the rounded weight, inside the one that keeps outlier channels exact
            return type(getattr(weight, "inner", weight)).__name__

        kinds = {kind(m.stored) for m in layers if m is not rounded.model.lm_head}
        assert kinds == {"Int8Weight" if level == "int8" else "Int4Weight"}
        assert kind(rounded.model.lm_head.stored) == "Int8Weight"
        kept = {type(m.stored).__name__ == "ExactChannels" for m in layers}
        assert kept == ({True} if shape == "outliers" else {False})
        assert not any(isinstance(m, torch.nn.Linear) for m in rounded.model.model.language_model.modules())
        for conversation in CONVERSATIONS:
            sequence, _ = run(rounded, conversation, tokens=6, ignore_eos=True)
            assert len(sequence.generated) == 6
        ids = torch.arange(40)[None]
        with torch.inference_mode():
            logits = [e.model(input_ids=ids).logits.float().log_softmax(-1) for e in (exact, rounded)]
        kl = (logits[0].exp() * (logits[0] - logits[1])).sum(-1).mean()
        assert 0 < float(kl) < (0.05 if level == "int8" else 0.5)
    finally:
        for engine in (exact, rounded):
            engine.shutdown()
