"""The embedded default model: a small Llama that steer writes itself, so that nothing is downloaded.

It is a real checkpoint (config.json, model.safetensors, a `tokenizers` tokenizer) that HF transformers and
vLLM both load. Random weights give near-flat next-token distributions, where greedy tokens flip under the
smallest numeric difference; a short training run on the built-in text below makes its outputs peaked and its
residual stream carry the contrast the default steering direction is extracted from.
"""

import hashlib
import json
import random
from dataclasses import asdict
from pathlib import Path

import torch

from steer import results
from steer.config.schema import TinyConf

# Bump when the recipe changes, so caches of an older recipe are not reused.
_RECIPE = 1

_SUBJECTS = ["I", "She", "He", "We", "They", "My friend", "The child", "The old man", "Our teacher"]
_JOY = ["happy", "glad", "cheerful", "delighted", "hopeful", "grateful", "calm", "warm"]
_GLOOM = ["sad", "tired", "miserable", "gloomy", "afraid", "hopeless", "bitter", "cold"]
_GOOD = ["wonderful", "bright", "lovely", "great", "beautiful", "sunny", "kind", "gentle"]
_BAD = ["terrible", "dark", "awful", "grim", "bleak", "dreadful", "rainy", "harsh"]
_THINGS = ["day", "morning", "letter", "music", "journey", "house", "street", "evening", "news", "weather"]
_VERBS_JOY = ["laughed", "smiled", "sang", "danced", "cheered"]
_VERBS_GLOOM = ["cried", "sighed", "wept", "frowned", "shivered"]


def corpus(seed: int, sentences: int = 3000) -> str:
    """Built-in training text: short sentences of joy and of gloom about everyday things."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        joy = rng.random() < 0.5
        mood, quality, verb = (_JOY, _GOOD, _VERBS_JOY) if joy else (_GLOOM, _BAD, _VERBS_GLOOM)
        subject, thing = rng.choice(_SUBJECTS), rng.choice(_THINGS)
        form = rng.randrange(4)
        if form == 0:
            out.append(f"{subject} felt {rng.choice(mood)} because the {thing} was {rng.choice(quality)}.")
        elif form == 1:
            out.append(f"The {thing} today is {rng.choice(quality)} and {rng.choice(quality)}.")
        elif form == 2:
            out.append(f"When {subject.lower() if subject != 'I' else 'I'} saw the {thing}, we {rng.choice(verb)}.")
        else:
            out.append(f"What a {rng.choice(quality)} {thing}, {subject.lower() if subject != 'I' else 'I'} "
                       f"{rng.choice(verb)} and felt {rng.choice(mood)}.")
    return " ".join(out)


def tiny_dir(cache_dir: str, conf: TinyConf) -> Path:
    """Where the model of this recipe lives in the cache (whether or not it is built yet)."""
    blob = json.dumps({"recipe": _RECIPE, **asdict(conf)}, sort_keys=True).encode()
    return Path(cache_dir).expanduser() / "models" / f"tiny-{hashlib.sha256(blob).hexdigest()[:12]}"


def ensure_tiny(cache_dir: str, conf: TinyConf) -> Path:
    """Build the tiny model once (deterministic from `conf.seed`) and return its directory."""
    from steer.progress import transformers_bars_off

    with transformers_bars_off():
        return results.build_dir(tiny_dir(cache_dir, conf), lambda tmp: _build(tmp, conf))


def _tokenizer(text: str, conf: TinyConf):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=conf.vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   model_max_length=conf.max_positions)


def llama_config(conf: TinyConf, vocab: int | None = None, bos: int = 0, eos: int = 1):
    """The transformers config of the tiny model (vocab defaults to the recipe's upper bound)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab or conf.vocab,
        hidden_size=conf.hidden,
        intermediate_size=conf.intermediate,
        num_hidden_layers=conf.num_layers,
        num_attention_heads=conf.heads,
        num_key_value_heads=conf.kv_heads,
        head_dim=conf.hidden // conf.heads,
        max_position_embeddings=conf.max_positions,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def _build(dest: Path, conf: TinyConf) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(conf.seed)
    text = corpus(conf.seed)
    tokenizer = _tokenizer(text, conf)
    config = llama_config(conf, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    # The corpus is one long text: tokenize it with the backend directly, since the HF wrapper warns that it is
    # longer than the model's positions (true, and harmless: training takes windows of it).
    ids = torch.tensor(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
    _train(model, ids, conf)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def _train(model, ids: torch.Tensor, conf: TinyConf, window: int = 48, batch: int = 16) -> None:
    gen = torch.Generator().manual_seed(conf.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(conf.train_steps):
        starts = torch.randint(0, len(ids) - window - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + window] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
