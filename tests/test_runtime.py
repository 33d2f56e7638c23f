"""The engine's parts, each alone: prompts, the output stream, the background work, the model
runner and the scheduler, on the tiny checkpoint's real tokenizer, processor and model."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from PIL import Image

from vlserve.errors import ContextLengthExceeded, InvalidRequest, Overloaded, RequestTimeout
from vlserve.model.loader import load_model
from vlserve.model.processor import load_processor
from vlserve.runtime.background import BackgroundWork
from vlserve.runtime.caches import LRUCache
from vlserve.runtime.images import ImageInput
from vlserve.runtime.metrics import Metrics
from vlserve.runtime.prefixcache import MIN_TOKENS, Entry, PrefixCache, shared_prefix
from vlserve.runtime.prompts import build_prompt, image_tokens_only, resolve_max_tokens
from vlserve.runtime.requests import Prompt, Sequence
from vlserve.runtime.runner import ModelRunner, feature_bytes
from vlserve.runtime.sampling import SamplingParams
from vlserve.runtime.scheduler import Scheduler
from vlserve.runtime.streaming import OutputStream, answer_from_cache
from vlserve.settings import LimitSettings, ModelSettings


class Collect:
    def __init__(self):
        self.text, self.reason, self.usage, self.error = "", None, None, None

    def on_text(self, text):
        self.text += text

    def on_finish(self, reason, usage):
        self.reason, self.usage = reason, usage

    def on_error(self, error):
        self.error = error


@pytest.fixture(scope="module")
def processor(tiny_model):
    return load_processor(tiny_model)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    settings = ModelSettings(model=tiny_model, dtype="float32", quantize="none", threads=1)
    return load_model(settings, LimitSettings(max_batch_size=2), lambda message: None)


def picture(seed: int) -> ImageInput:
    image = Image.effect_noise((64, 64), 40 + seed).convert("RGB")
    return ImageInput(image, hashlib.sha256(image.tobytes()).hexdigest())


def ask(text: str, image: ImageInput | None = None) -> list[dict]:
    content = ([{"type": "image", "image": image}] if image else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def sequence(prompt, params, deadline_s: float = 60.0) -> Sequence:
    now = time.monotonic()
    return Sequence(prompt, params, Collect(), now, now + deadline_s, use_result_cache=params.greedy)


# -- prompts ----------------------------------------------------------------------------------


def test_a_prompt_holds_the_template_s_tokens_and_one_key_per_image(processor):
    image = picture(0)
    prompt = build_prompt(processor, ask("What is this?", image), max_images=1)
    assert prompt.image_keys == [image.key] and prompt.image_grid_thw.shape == (1, 3)
    text = processor.tokenizer.decode(prompt.input_ids)
    assert "What is this?" in text and text.rstrip().endswith("assistant")
    cut = image_tokens_only(prompt, processor)
    assert cut.input_ids[0] == processor.vision_start_token_id and cut.input_ids[-1] == processor.vision_end_token_id
    assert build_prompt(processor, ask("What is that?", image), 1).cache_key != prompt.cache_key


def test_a_prompt_refuses_more_images_than_allowed_and_a_budget_past_the_context(processor):
    with pytest.raises(InvalidRequest, match="2 images in one request; the limit is 1"):
        build_prompt(processor, ask("?", picture(0)) + ask("?", picture(1)), max_images=1)
    prompt = build_prompt(processor, ask("word " * 300), max_images=1)
    limits = LimitSettings(max_context_tokens=prompt.tokens + 4, max_tokens_default=64)
    assert resolve_max_tokens(prompt, None, limits) == 4  # the default, cut to the room left
    assert resolve_max_tokens(prompt, 3, limits) == 3
    with pytest.raises(ContextLengthExceeded, match="max_tokens 5 plus"):
        resolve_max_tokens(prompt, 5, limits)


# -- the output stream -----------------------------------------------------------------------


def test_the_stream_cuts_at_a_stop_string_and_never_sends_its_start(processor):
    tokenizer = processor.tokenizer
    prompt = build_prompt(processor, ask("Hello"), max_images=1)
    stream = OutputStream(tokenizer, set(), LimitSettings(), Metrics(), LRUCache(4))
    seq = sequence(prompt, SamplingParams(max_tokens=50, stop=("END",)))
    sent = []
    seq.sink.on_text = sent.append
    tokens = tokenizer.encode("one two END three", add_special_tokens=False)
    going = [stream.emit(seq, token) for token in tokens]
    assert going.index(False) < len(tokens) - 1 and seq.done  # finished at the stop string
    assert "".join(sent) == "one two " and seq.sink.reason == "stop"
    assert not any("E" in piece for piece in sent)  # the stop string's start was held back, then dropped


def test_the_stream_finishes_at_max_tokens_and_the_result_cache_answers_again(processor):
    tokenizer = processor.tokenizer
    prompt = build_prompt(processor, ask("Hello"), max_images=1)
    cache, metrics = LRUCache(4), Metrics()
    stream = OutputStream(tokenizer, set(), LimitSettings(), metrics, cache)
    seq = sequence(prompt, SamplingParams(max_tokens=3))
    for token in tokenizer.encode("a b c d e", add_special_tokens=False)[:3]:
        stream.emit(seq, token)
    assert seq.sink.reason == "length" and seq.sink.usage.completion_tokens == 3
    again = sequence(prompt, SamplingParams(max_tokens=3))
    assert answer_from_cache(again, cache, metrics)
    assert again.sink.text == seq.sink.text and again.sink.usage.answer_from_cache
    other = sequence(prompt, SamplingParams(max_tokens=4))  # another budget: another answer
    assert not answer_from_cache(other, cache, metrics) and not other.done


# -- the background work ---------------------------------------------------------------------


class Copy:
    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def make_prefill_copy(self):
        if self.fail:
            raise RuntimeError("out of memory")
        self.log.append(self.name)

    def drop_prefill_source(self):
        self.log.append("dropped " + self.name)


def test_background_work_runs_page_rereads_then_layouts_then_copies_one_step_at_a_time():
    log = []
    work = BackgroundWork(
        [lambda: log.append("pages 1"), lambda: log.append("pages 2")],
        [lambda: log.append("layout 1"), lambda: log.append("layout 2")],
        [Copy(log, "copy 1"), Copy(log, "copy 2")],
        "float32",
    )
    counts = []
    while work.pending:
        counts.append(work.pending)
        work.step()
    assert counts == [6, 5, 4, 3, 2, 1]
    assert log == ["pages 1", "pages 2", "layout 2", "layout 1", "copy 2", "copy 1"]


def test_background_work_that_runs_out_of_memory_gives_up_its_kind_only():
    log = []

    def layout_out_of_memory():
        raise RuntimeError("out of memory")

    def unreadable_file():
        raise OSError("gone")

    work = BackgroundWork(
        [unreadable_file, lambda: log.append("pages")],
        [layout_out_of_memory],
        [Copy(log, "copy 1"), Copy(log, "copy 2", fail=True)],
        None,
    )
    work.step()  # the failing page step: the pages stay as they are, the rest still waits
    assert log == [] and work.pending == 3
    work.step()  # the failing layout: the layouts are given up, the copies still wait
    assert log == [] and work.pending == 2
    work.step()  # the failing copy: every copy is given up, their sources dropped
    assert log == ["dropped copy 1", "dropped copy 2"] and work.pending == 0


# -- the model runner ------------------------------------------------------------------------


def test_the_runner_prefills_a_group_as_the_model_alone_would_and_caches_images(loaded):
    metrics, cache = Metrics(), LRUCache(1 << 30, cost=feature_bytes)
    runner = ModelRunner(loaded.model, "float32", loaded.pad_id, cache, metrics)
    image = picture(3)
    prompts = [
        build_prompt(loaded.processor, ask("Describe it.", image), 1),
        build_prompt(loaded.processor, ask("A much longer question, with more words in it?"), 1),
    ]
    with torch.inference_mode():
        batch, tokens = runner.prefill([sequence(p, SamplingParams(max_tokens=4)) for p in prompts])
        assert batch.size == 2
        for row, prompt in enumerate(prompts):  # each prompt alone, no padding: the same first token
            _, first = runner.prefill([sequence(prompt, SamplingParams(max_tokens=4))])
            assert int(first[0]) == int(tokens[row])
        again = sequence(prompts[0], SamplingParams(max_tokens=4))
        runner.prefill([again])
        assert again.images_from_cache == 1 and len(cache) == 1
        step = runner.decode(batch, [SamplingParams(max_tokens=4)] * 2)
    assert step.shape == (2,) and batch.size == 2


# -- the scheduler ---------------------------------------------------------------------------


def scheduler_for(loaded, prefix_cache: PrefixCache | None = None, **limits) -> Scheduler:
    limits = LimitSettings(**limits)
    metrics = Metrics()
    scheduler = Scheduler(limits, metrics)
    vision_cache = LRUCache(1 << 30, cost=feature_bytes)
    runner = ModelRunner(loaded.model, "float32", loaded.pad_id, vision_cache, metrics, prefix_cache=prefix_cache)
    scheduler.attach(runner, OutputStream(loaded.processor.tokenizer, loaded.eos_ids, limits, metrics, LRUCache(4)))
    return scheduler


def run_until_idle(scheduler: Scheduler, passes: int = 200) -> None:
    with torch.inference_mode():
        for _ in range(passes):
            if not scheduler.queue and not scheduler.running:
                return
            scheduler.run_pass(wait=False)
    raise AssertionError("the scheduler did not finish")


def test_the_scheduler_batches_within_its_slots_and_finishes_every_request(loaded):
    scheduler = scheduler_for(loaded, max_batch_size=2, max_queue=4)
    prompt = build_prompt(loaded.processor, ask("Hi"), 1)
    seqs = [sequence(prompt, SamplingParams(max_tokens=3, ignore_eos=True)) for _ in range(3)]
    for seq in seqs:
        scheduler.enqueue(seq)
    with torch.inference_mode():
        scheduler.run_pass(wait=False)
    assert len(scheduler.running) == 2 and len(scheduler.queue) == 1  # two slots: the third waits
    run_until_idle(scheduler)
    assert [s.sink.reason for s in seqs] == ["length"] * 3
    assert len({s.sink.text for s in seqs}) == 1  # greedy: the same answer whatever its batch


def test_the_scheduler_refuses_past_its_queue_drops_the_cancelled_and_times_out_the_late(loaded):
    scheduler = scheduler_for(loaded, max_batch_size=1, max_queue=1)
    prompt = build_prompt(loaded.processor, ask("Hi"), 1)
    cancelled = sequence(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    late = sequence(prompt, SamplingParams(max_tokens=50, ignore_eos=True), deadline_s=-1)
    scheduler.enqueue(cancelled)
    scheduler.enqueue(late)  # one waits, one more fits the free slot
    with pytest.raises(Overloaded):
        scheduler.enqueue(sequence(prompt, SamplingParams(max_tokens=2)))
    with torch.inference_mode():
        scheduler.run_pass(wait=False)  # the cancelled one runs, the late one waits past its deadline
    cancelled.cancel()
    run_until_idle(scheduler)
    assert cancelled.done and cancelled.sink.reason is None and cancelled.sink.error is None
    assert isinstance(late.sink.error, RequestTimeout)
    assert scheduler.metrics.cancelled._value.get() == 1


def test_a_request_in_its_prefill_holds_its_slot(loaded):
    """Admitted requests leave the queue before they join the batch: one that arrives during their
    prefill finds no free slot (a worker of one slot and no queue once took it and made it wait)."""
    scheduler = scheduler_for(loaded, max_batch_size=1, max_queue=0)
    prompt = build_prompt(loaded.processor, ask("Hi"), 1)
    scheduler.enqueue(sequence(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    refused = []
    prefill = scheduler._prefill

    def arriving_during_prefill(group):
        with pytest.raises(Overloaded) as raised:
            scheduler.enqueue(sequence(prompt, SamplingParams(max_tokens=2)))
        refused.append(raised.value)
        prefill(group)

    scheduler._prefill = arriving_during_prefill
    with torch.inference_mode():
        scheduler.run_pass(wait=False)
    assert len(refused) == 1 and len(scheduler.running) == 1 and not scheduler.queue
    scheduler._prefill = prefill
    run_until_idle(scheduler)
    scheduler.enqueue(sequence(prompt, SamplingParams(max_tokens=2)))  # the slot is free again


# -- the prefix cache --------------------------------------------------------------------------


def token_prompt(ids: list[int], images: list[tuple[int, int, str]] = ()) -> Prompt:
    """A prompt of these token ids, its images' tokens at (start, end) with their keys (no model)."""
    types = torch.zeros(len(ids), dtype=torch.long)
    for start, end, _ in images:
        types[start:end] = 1
    return Prompt(torch.tensor(ids), types, None, None, [key for _, _, key in images], "")


def stored(ids: list[int], images: list[tuple[int, int, str]] = ()) -> Entry:
    """An entry of these tokens: 2 layers of one key/value head of width 1 (16 bytes a token), the
    token's id as its key and value."""
    kv = torch.tensor(ids, dtype=torch.float32).view(1, 1, 1, -1, 1).expand(2, 2, 1, len(ids), 1).clone()
    return Entry(torch.tensor(ids), list(images), kv)


def test_a_stored_prefix_serves_equal_tokens_and_images_never_a_part_of_an_image_or_the_last_token():
    base = list(range(100, 160))  # 60 tokens, an image at 10-30
    image = [(10, 30, "photo")]
    entry = stored(base, image)
    assert shared_prefix(torch.tensor([*base, 7, 8]), image, entry) == 60
    assert shared_prefix(torch.tensor(base[:45] + [1] * 20), image, entry) == 45  # the first other token
    assert shared_prefix(torch.tensor(base), [(10, 30, "another photo")], entry) == 10  # same ids, not the same image
    assert shared_prefix(torch.tensor(base[:20] + [1] * 40), image, entry) == 10  # never half an image
    assert shared_prefix(torch.tensor(base), image, entry, limit=25) == 10
    cache = PrefixCache(1 << 20)
    cache.store(entry, live=0)
    hit = cache.lookup(token_prompt(base, image))  # the whole prompt: its last token is left to compute
    assert hit.entry is entry and hit.tokens == 59
    assert cache.lookup(token_prompt(base[: MIN_TOKENS - 1] + [1] * 40, image)) is None  # too short to be worth it
    assert cache.lookup(token_prompt(base, [(10, 30, "another photo")])) is None


def test_the_prefix_cache_keeps_the_longest_turn_and_gives_way_to_running_sequences():
    first = stored(list(range(100, 140)))  # 40 tokens, 640 bytes
    follow_up = stored(list(range(100, 180)))  # the same conversation, one turn on: 80 tokens
    cache = PrefixCache(budget_bytes=4000)
    cache.store(first, live=0)
    cache.store(follow_up, live=0)  # it serves everything `first` served
    assert len(cache) == 1 and cache.cost == follow_up.bytes == 1280
    cache.store(stored(list(range(100, 150))), live=0)  # a prefix of what is kept: nothing new
    assert len(cache) == 1
    other = stored(list(range(200, 260)))
    cache.store(other, live=0)
    assert len(cache) == 2 and cache.cost == 1280 + 960
    cache.lookup(token_prompt(list(range(100, 170))))  # the follow-up is used: the other is older now
    cache.fit(live=2000)  # running sequences take 2000 of the 4000: the least recently used goes
    assert len(cache) == 1 and cache.lookup(token_prompt(list(range(200, 250)))) is None
    cache.store(stored(list(range(300, 400))), live=3000)  # 1600 bytes do not fit beside 3000
    assert cache.cost == 1280
    assert not PrefixCache(4000, max_bytes=0).enabled and PrefixCache(4000, max_bytes=10**9).max_bytes == 4000


def big_picture(seed: int) -> ImageInput:
    image = Image.effect_noise((224, 224), 40 + seed).convert("RGB")  # tens of image tokens
    return ImageInput(image, hashlib.sha256(image.tobytes()).hexdigest())


def answer(scheduler: Scheduler, messages: list[dict], loaded, max_tokens: int = 4) -> Sequence:
    seq = sequence(build_prompt(loaded.processor, messages, 2), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.enqueue(seq)
    run_until_idle(scheduler)
    assert seq.sink.error is None, seq.sink.error
    return seq


def test_a_follow_up_turn_computes_only_what_follows_the_first_turn_and_answers_the_same(loaded):
    image = big_picture(1)
    cached = scheduler_for(loaded, prefix_cache=PrefixCache(1 << 30), max_batch_size=2)
    plain = scheduler_for(loaded, max_batch_size=2)
    first = answer(cached, ask("Describe it.", image), loaded)
    assert first.cached_tokens == 0 and len(cached.runner.prefix_cache) == 1
    turns = [
        *ask("Describe it.", image),
        {"role": "assistant", "content": first.sink.text},
        {"role": "user", "content": "And the colours?"},
    ]
    encoded = cached.metrics.image_encode_seconds._sum.get()
    follow_up = answer(cached, turns, loaded)
    fed = torch.tensor(first.prompt.input_ids.tolist() + first.generated[:-1])  # what the first turn's cache holds
    shared = shared_prefix(follow_up.prompt.input_ids, [], stored(fed.tolist()))
    assert follow_up.cached_tokens == shared >= first.prompt.tokens
    assert follow_up.sink.usage.cached_tokens == shared and follow_up.sink.usage.images_from_cache == 1
    assert cached.metrics.image_encode_seconds._sum.get() == encoded  # the image was not encoded again
    assert follow_up.sink.text == answer(plain, turns, loaded).sink.text
    # The same conversation about another picture: nothing of the first image's is reused.
    elsewhere = turns[:]
    elsewhere[0] = ask("Describe it.", big_picture(2))[0]
    other = answer(cached, elsewhere, loaded)
    assert other.cached_tokens < other.prompt.input_ids.tolist().index(loaded.processor.image_token_id)
    assert other.sink.text == answer(plain, elsewhere, loaded).sink.text


def test_a_group_prefills_rows_with_and_without_a_stored_prefix_as_each_alone(loaded):
    image = big_picture(3)
    cached = scheduler_for(loaded, prefix_cache=PrefixCache(1 << 30), max_batch_size=2)
    answer(cached, ask("Describe it.", image), loaded)
    second = build_prompt(loaded.processor, ask("What is in the corner, at the top left?", image), 1)
    fresh = build_prompt(loaded.processor, ask("Hello there, how are you today?"), 1)
    runner = cached.runner
    params = SamplingParams(max_tokens=4)
    with torch.inference_mode():
        group = [sequence(second, params), sequence(fresh, params)]
        batch, tokens = runner.prefill(group)
        assert group[0].cached_tokens > 0 and group[1].cached_tokens == 0
        steps = [runner.decode(batch, [params] * 2) for _ in range(2)]
        for row, prompt in enumerate((second, fresh)):  # each alone, without the cache
            alone = scheduler_for(loaded).runner
            one, first = alone.prefill([sequence(prompt, params)])
            assert int(first[0]) == int(tokens[row])
            assert [int(alone.decode(one, [params])[0]) for _ in range(2)] == [int(step[row]) for step in steps]
