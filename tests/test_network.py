"""vlserve's own Qwen3-VL network and processor (model/network.py, model/processor.py) against
transformers': the same logits bit for bit, the same tokens, patches and text; and a worker that
loads and answers without importing transformers at all."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from conftest import VENV_BIN
from vlserve.errors import ModelDirectoryError
from vlserve.model import attention
from vlserve.model.checkpoint import load_network, mapped_tensors
from vlserve.model.config import load_config, model_config
from vlserve.model.loader import check_model_directory
from vlserve.model.network import prompt_pass
from vlserve.model.processor import load_processor
from vlserve.runtime.kvcache import new_cache

SIZES = [(100, 150), (37, 500), (480, 640), (33, 33), (1000, 20)]
CONVERSATION = [
    {"role": "system", "content": "Be brief. ä ü 日本"},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this? It's  a test , ok ."}]},
    {"role": "assistant", "content": "A picture."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
]


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def reference_processor(tiny_model):
    from transformers import AutoImageProcessor, AutoTokenizer  # noqa: PLC0415

    from vlserve.model.testmodel import _image_only_processor  # noqa: PLC0415

    template = (tiny_model / "chat_template.jinja").read_text()
    return _image_only_processor(
        AutoImageProcessor.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model), template
    )


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_the_processor_makes_what_transformers_makes(tiny_model, reference_processor, index):
    ours = load_processor(tiny_model)
    images = [picture(*SIZES[index], index), picture(*SIZES[-1 - index], index + 10)]
    text = reference_processor.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False) == text
    expected = reference_processor(text=[text], images=images, return_tensors="pt")
    got = ours(text=[text], images=images)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    ids = expected["input_ids"][0].tolist()
    for skip in (True, False):
        assert ours.tokenizer.decode(ids, skip_special_tokens=skip) == reference_processor.tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.tokenizer.eos_token_id == reference_processor.tokenizer.eos_token_id
    assert ours.tokenizer.pad_token_id == reference_processor.tokenizer.pad_token_id


def test_the_processor_refuses_an_extreme_aspect_ratio_as_transformers_does(tiny_model):
    ours = load_processor(tiny_model)
    text = ours.apply_chat_template(CONVERSATION[1:2])
    with pytest.raises(ValueError, match="aspect ratio"):
        ours(text=[text], images=[picture(2, 500, 0)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_network_computes_transformers_logits_bit_for_bit(tiny_model, reference_processor, dtype):
    """A prompt with two images (vision tower, deepstack, M-RoPE), then decode steps of a batch whose
    second row is left-padded: every logit equal. Attention through torch's sdpa as transformers'
    runs it (vlserve's own decode attention is held to sdpa in test_attention.py)."""
    from transformers import Qwen3VLForConditionalGeneration  # noqa: PLC0415

    reference = Qwen3VLForConditionalGeneration.from_pretrained(tiny_model, dtype=dtype).eval()
    ours = load_network(tiny_model, dtype)
    for module in ours.modules():
        if hasattr(module, "attend"):
            module.attend = plain_sdpa
    text = reference_processor.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    inputs = dict(
        reference_processor(text=[text], images=[picture(90, 140, 1), picture(60, 60, 2)], return_tensors="pt")
    )
    with torch.inference_mode():
        expected = reference(**inputs).logits
        got = prompt_pass(ours, inputs, new_cache(ours.config.text_config.num_hidden_layers)).logits
        assert torch.equal(got, expected)
        ids = torch.tensor([[0, 0, 0, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27, 28]])
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
        caches = [new_cache(ours.config.text_config.num_hidden_layers), None]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        got = ours(ids, mask, positions.expand(4, -1, -1), caches[0])
        expected = reference(
            input_ids=ids, attention_mask=mask, position_ids=positions.expand(4, -1, -1), use_cache=True
        )
        assert torch.equal(got.logits, expected.logits)
        cache = expected.past_key_values
        for step in range(3):
            token = expected.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            step_positions = (positions[:, -1:] + 1 + step).expand(4, -1, -1)
            got = ours(token, mask, step_positions, got.cache)
            expected = reference(
                input_ids=token, attention_mask=mask, position_ids=step_positions, past_key_values=cache
            )
            cache = expected.past_key_values
            assert torch.equal(got.logits, expected.logits), step


def plain_sdpa(module, query, key, value, mask, *, scaling=None, is_causal=None):
    return attention.sdpa(module, query, key, value, mask, scaling=scaling, is_causal=is_causal), None


def test_the_hub_layout_of_config_json_reads_as_the_new_one(tiny_model):
    """The hub's Qwen3-VL configs (written by transformers 4.57) keep the text rope in `rope_scaling`
    with `rope_theta` beside it and leave the vision rope to its default."""
    data = json.loads((tiny_model / "config.json").read_text())
    text, vision = data["text_config"], data["vision_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    vision.pop("rope_parameters", None)
    assert model_config(data) == load_config(tiny_model)


def test_a_worker_loads_and_answers_without_importing_transformers_httpx_or_dynamo(tiny_model):
    """transformers' model and processor classes cost a start 1.35 s, httpx 0.1 s (only image URLs
    fetch with it), torch._dynamo 1.1 s (the first of torch's Python decompositions to run imports it:
    an initialisation or a computed table on the meta device): a worker's app and engine import none."""
    script = (
        "import sys\n"
        "import vlserve.api.app\n"
        "from vlserve.runtime.engine import Engine\n"
        "from vlserve.settings import LimitSettings, ModelSettings\n"
        "engine = Engine(ModelSettings(model=%r), LimitSettings(max_batch_size=2))\n"
        "engine.load(); engine.warmup()\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('transformers', 'httpx')"
        " or name == 'torch._dynamo'))\n"
        "engine.shutdown()\n" % str(tiny_model)
    )
    result = subprocess.run(
        [str(VENV_BIN / "python"), "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_config_or_weights_the_network_cannot_take_fail_with_what_is_wrong(tiny_model, tmp_path):
    """Before anything loads: a config.json the network cannot be built from; at load: a tensor the
    files lack, named."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    data = json.loads((broken / "config.json").read_text())
    data["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 4]
    (broken / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelDirectoryError, match="mrope_section"):
        check_model_directory(broken)
    shutil.copytree(tiny_model, broken, dirs_exist_ok=True)  # the good config again
    tensors = {name: tensor.clone() for name, tensor in mapped_tensors(broken / "model.safetensors").items()}
    del tensors["model.language_model.norm.weight"]
    (broken / "model.safetensors").unlink()  # a new file, not one rewritten under its own map
    save_file(tensors, str(broken / "model.safetensors"))
    check_model_directory(broken)
    with pytest.raises(ModelDirectoryError, match=r"no tensor model\.language_model\.norm\.weight"):
        load_network(broken, torch.bfloat16)
