"""extract.span: a row is read from the prompt's own text, not the chat template's tokens around it."""

import copy

import pytest
import torch

from steer.models import prompt

from steer.edits import vector
from steer.runs.extract import Recipe, cached_default, direction, extract_to, prompt_rows
from steer.config.schema import ExtractConf, ExtractSpan, TapConf
from steer.edits.tap import resolve

POS = ["I am happy and glad", "What a lovely bright day, we laughed"]
NEG = ["I am sad and tired", "What a grim dark day"]
# A template with a system prompt before the user's turn and a generation prompt after it, as SmolLM2's.
TEMPLATE = ("{{ bos_token }}[system] You are a kind assistant.\n{% for m in messages %}[{{ m['role'] }}] "
            "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def chat_engine(hf_engine):
    """The tiny engine with a chat template on a copy of its tokenizer (the model is shared, not changed)."""
    engine = copy.copy(hf_engine)
    engine.tokenizer = copy.deepcopy(hf_engine.tokenizer)
    engine.tokenizer.chat_template = TEMPLATE
    return engine


def states(engine, ids, layer):
    with torch.no_grad():
        return engine.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer + 1][0]


def user_positions(engine, text):
    """Where the prompt's text lies in its chat rendering, found directly: the tokens after '[user] ' up to the
    '\\n' before '[assistant]'."""
    fed, ids = engine.render(text, "true")
    head = fed.index("[user] ") + len("[user] ")
    pieces = [engine.tokenizer.decode(ids[:j]) for j in range(len(ids) + 1)]
    start = next(j for j in range(len(ids)) if len(pieces[j + 1]) > head)  # the first token reaching past the head
    end = next(j for j in range(len(ids)) if len(pieces[j]) >= head + len(text))
    return list(range(start, end))


def test_the_user_text_tokens_are_exactly_the_prompts(chat_engine):
    for text in POS + NEG:
        fed, ids = chat_engine.render(text, "true")
        flags = prompt.text_tokens(chat_engine.tokenizer, text, "true")
        kept = [j for j, f in enumerate(flags) if f]
        assert kept == user_positions(chat_engine, text)
        assert chat_engine.tokenizer.decode([ids[j] for j in kept]).strip() == text
        assert fed.startswith("<s>[system] You are") and fed.endswith("[assistant] ")
    # Raw prompts: the text's tokens, not the BOS the tokenizer adds.
    flags = prompt.text_tokens(chat_engine.tokenizer, POS[0], "false")
    assert flags[0] is False and all(flags[1:]) and len(flags) == len(chat_engine.encode(POS[0]))


@pytest.mark.parametrize("position", ["mean", "last"])
def test_span_user_averages_only_the_user_text(chat_engine, tiny_spec, position):
    tap = resolve(TapConf(layer=1), tiny_spec)
    special = chat_engine.tokenizer.all_special_ids

    def direct_rows(prompts, span):
        rows = []
        for text in prompts:
            ids = chat_engine.encode(text, "true")
            h = states(chat_engine, ids, 1)
            if span == "user":
                at = user_positions(chat_engine, text)
            else:  # every token fed; the mean leaves out the first and the special ones
                at = list(range(len(ids))) if position == "last" else \
                    [j for j in range(1, len(ids)) if ids[j] not in special]
            rows.append(h[at[-1]] if position == "last" else h[at].mean(0))
        return torch.stack(rows)

    for span in ("user", "all"):
        recipe = Recipe(chat="true", position=position, span=span)
        for prompts in (POS, NEG):
            torch.testing.assert_close(prompt_rows(chat_engine, tap, prompts, recipe), direct_rows(prompts, span),
                                       atol=1e-4, rtol=1e-4)
    # The direction: the user rows' difference of means, less its part along their mean (orthogonal_to_mean).
    pos, neg = direct_rows(POS, "user"), direct_rows(NEG, "user")
    d, m = pos.mean(0) - neg.mean(0), (pos.mean(0) + neg.mean(0)) / 2
    expected = d - (d @ m) / (m @ m) * m
    user = direction(chat_engine, tap, POS, NEG, Recipe(chat="true", position=position, span="user"))
    torch.testing.assert_close(user, expected, atol=1e-4, rtol=1e-4)
    whole = direction(chat_engine, tap, POS, NEG, Recipe(chat="true", position=position))  # span "all": the default
    assert not torch.allclose(whole, user, atol=1e-3)


def test_span_is_in_the_metadata_and_the_cache_key(chat_engine, tiny_spec, tmp_path):
    tap = resolve(TapConf(layer=1), tiny_spec)
    p = extract_to(tmp_path / "v.safetensors", "joy", chat_engine, tap, POS, NEG, Recipe(chat="auto", span="user"))
    assert {k: vector.metadata(p)[k] for k in ("span", "chat")} == {"span": "user", "chat": "true"}
    user = cached_default(str(tmp_path), chat_engine, tap, POS, NEG, Recipe(chat="auto", span="user"))
    whole = cached_default(str(tmp_path), chat_engine, tap, POS, NEG, Recipe(chat="auto"))
    assert not torch.allclose(user, whole)
    metas = sorted(vector.metadata(f)["span"] for f in (tmp_path / "vectors").glob("*.safetensors"))
    assert metas == ["all", "user"]
    torch.testing.assert_close(user[0], vector.load(p, "joy", tiny_spec.hidden)[0])


def test_a_bad_span_is_refused_as_the_config_composes():
    from hydra.errors import ConfigCompositionException

    from helpers import compose_conf, on_tiny
    from steer.errors import config_error_line

    with pytest.raises(ConfigCompositionException) as e:
        compose_conf("config", on_tiny(["extract.span=prompt"]))
    assert config_error_line(e.value).startswith("extract.span: 'prompt' is not one of auto, user, all")
    assert Recipe.from_conf(ExtractConf(span=ExtractSpan.user), "auto").span == "user"
