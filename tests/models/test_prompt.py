import pytest

from steer.models import prompt
from steer.errors import ConfigError

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture
def tokenizer(tiny_spec):
    """The tiny model's tokenizer (a fresh copy: the chat tests give it a template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_spec.source)


@pytest.mark.parametrize("given, mode", [("auto", "auto"), ("True", "true"), (False, "false"), (" AUTO ", "auto"),
                                         (None, "auto")])
def test_chat_mode_normalises(given, mode):
    assert prompt.chat_mode(given) == mode


@pytest.mark.parametrize("bad", ["yes", "", "chat"])
def test_bad_chat_mode_names_the_field(bad):
    with pytest.raises(ConfigError) as e:
        prompt.chat_mode(bad)
    assert e.value.field == "prompts.chat"


def test_raw_prompts_are_the_tokenizers_own_encoding(tokenizer):
    for chat in ("auto", "false"):  # no template: auto is raw
        fed, ids = prompt.render(tokenizer, "The weather today is", chat)
        assert fed == "The weather today is" and ids == tokenizer("The weather today is")["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
    with pytest.raises(ConfigError) as e:
        prompt.render(tokenizer, "The weather today is", "true")
    assert e.value.field == "prompts.chat"


def test_chat_prompts_are_a_user_turn_with_one_bos(tokenizer):
    tokenizer.chat_template = TEMPLATE
    for chat in ("auto", "true"):
        fed, ids = prompt.render(tokenizer, "The weather today is", chat)
        assert fed == "<s>[user] The weather today is\n[assistant] "
        assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
        assert ids == tokenizer(fed, add_special_tokens=False)["input_ids"]
    raw = tokenizer("The weather today is")["input_ids"]
    assert prompt.render(tokenizer, "The weather today is", "false")[1] == raw


def test_template_in_dir(tiny_spec, tmp_path):
    assert prompt.template_in_dir(tiny_spec.source) is False
    assert tiny_spec.chat_template is False
    assert prompt.template_in_dir(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert prompt.template_in_dir(tmp_path) is True


def test_check_before_any_engine(tiny_spec):
    assert prompt.check("auto", tiny_spec.chat_template) == "auto"
    assert prompt.check("true", None) == "true"  # not known yet: the engine's render checks it
    with pytest.raises(ConfigError) as e:
        prompt.check("true", tiny_spec.chat_template)
    assert e.value.field == "prompts.chat"


def test_both_engines_render_through_one_function(hf_engine):
    assert hf_engine.render("The weather today is", "auto") == prompt.render(hf_engine.tokenizer,
                                                                             "The weather today is", "auto")
    assert hf_engine.encode("The weather today is") == hf_engine.tokenizer("The weather today is")["input_ids"]


def test_text_tokens_are_the_user_turns_content(tokenizer):
    """Which ids carry the prompt's own text: not the template's tokens around it, whatever the template does to the
    content (here it trims it), and not a BOS of a raw prompt."""
    tokenizer.chat_template = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    fed, ids = prompt.render(tokenizer, "  The weather today is ", "true")
    flags = prompt.text_tokens(tokenizer, "  The weather today is ", "true")
    assert fed == "<s>[user] The weather today is\n[assistant] " and len(flags) == len(ids)
    assert tokenizer.decode([i for i, f in zip(ids, flags) if f]).strip() == "The weather today is"
    assert not any(flags[:3]) and not any(flags[-6:])  # '<s>', '[user] ' ... '\n[assistant] '
    raw = prompt.text_tokens(tokenizer, "The weather today is", "false")
    assert raw == [False] + [True] * (len(raw) - 1)  # the BOS is the tokenizer's, not the text's
    tokenizer.chat_template = "{{ bos_token }}[user] (hidden)\n"  # a template that drops the content
    with pytest.raises(ConfigError) as e:
        prompt.text_tokens(tokenizer, "The weather today is", "true")
    assert e.value.field == "extract.span"
