"""What an engine feeds for a prompt: the raw text, or the text as a user turn of the tokenizer's chat template.

Both engines encode through `render`, so they feed identical ids. Templated text already holds the model's
special tokens (a BOS, the turn markers), so it is tokenized with `add_special_tokens=False`: no doubled BOS.
"""

import json
from pathlib import Path
from typing import List, Optional, Tuple

from steer.errors import ConfigError

CHAT_MODES = ("auto", "true", "false")  # what an engine's `chat` argument names; prompts.chat's null is auto


def chat_mode(chat, field: str = "prompts.chat") -> str:
    """`chat` (prompts.chat: None, True or False; or a mode's name) as one of auto / true / false, or a
    ConfigError."""
    mode = "auto" if chat is None else str(chat).strip().lower()
    if mode not in CHAT_MODES:
        raise ConfigError(field, f"{chat!r} is not one of {', '.join(CHAT_MODES)}")
    return mode


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def renders_chat(chat, template: Optional[bool]) -> bool:
    """Whether prompts are chat-formatted under mode `chat` where the tokenizer has a chat template or not
    (`template`; None: not known yet, taken as one)."""
    mode = chat_mode(chat)
    return mode == "true" or (mode == "auto" and template is not False)


def uses_chat(tokenizer, chat) -> bool:
    """Whether prompts are chat-formatted under mode `chat` with this tokenizer (true without a template: error)."""
    template = has_template(tokenizer)
    if chat_mode(chat) == "true" and not template:
        raise ConfigError("prompts.chat", f"true, but the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} "
                                          "has no chat template; use prompts.chat=null or false")
    return renders_chat(chat, template)


def render(tokenizer, text: str, chat) -> Tuple[str, List[int]]:
    """The exact text fed for prompt `text` and its token ids. Chat: the text as the one user turn, then the
    assistant's generation prompt (`apply_chat_template(..., add_generation_prompt=True)`), tokenized without
    added special tokens. Raw: `text` itself, tokenized with the tokenizer's own special tokens (e.g. a BOS)."""
    # verbose=False: a prompt longer than the model's positions is refused (or truncated) by steer.runs.run with its
    # index and length; transformers' own "indexing errors" warning would only alarm.
    if uses_chat(tokenizer, chat):
        fed = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
        return fed, list(tokenizer(fed, add_special_tokens=False, verbose=False)["input_ids"])
    return text, list(tokenizer(text, verbose=False)["input_ids"])


_MARK = "\ue000steer-user-text\ue001"  # private-use characters: in no template, no prompt


def text_tokens(tokenizer, text: str, chat, field: str = "extract.span") -> List[bool]:
    """Which of `render(tokenizer, text, chat)`'s ids carry the prompt's own text (one flag per id): in a chat
    rendering the tokens of the user turn's content, not the system prompt, the turn markers or the generation
    prompt; raw, the text's tokens, not a BOS or other token the tokenizer adds. The content's place is found by
    rendering the same turn with a marker in its stead (what comes before and after it is the template's), and a
    token is the text's if its characters overlap it (tokenizer offsets, so a fast tokenizer)."""
    fed, ids = render(tokenizer, text, chat)
    if uses_chat(tokenizer, chat):
        marked, _ = render(tokenizer, _MARK, chat)
        before, _, after = marked.partition(_MARK)
        start, end = len(before), len(fed) - len(after)
        if not (fed.startswith(before) and fed.endswith(after) and start < end):
            raise ConfigError(field, f"cannot find prompt {text!r} in its chat rendering {fed!r}; use "
                                     f"{field}=all")
    else:
        start, end = 0, len(text)
    enc = None
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(fed, add_special_tokens=not uses_chat(tokenizer, chat), return_offsets_mapping=True,
                        verbose=False)
    if enc is None or list(enc["input_ids"]) != ids:
        raise ConfigError(field, f"user needs token offsets from a fast tokenizer, and "
                                 f"{getattr(tokenizer, 'name_or_path', '?')!r} gave none that match the ids fed; "
                                 f"use {field}=all")
    return [b > a and a < end and b > start for a, b in enc["offset_mapping"]]


def template_in_dir(path: str | Path) -> Optional[bool]:
    """Whether the tokenizer saved in directory `path` has a chat template; None if there is no tokenizer there."""
    path = Path(path)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return None


def check(chat, chat_template: Optional[bool]) -> str:
    """Validate `prompts.chat` before any engine starts, against whether the model's tokenizer has a chat template
    (`ModelSpec.chat_template`; None: not known yet, and the engine's `render` checks it then)."""
    mode = chat_mode(chat)
    if mode == "true" and chat_template is False:
        raise ConfigError("prompts.chat", "true, but the model's tokenizer has no chat template; use "
                                          "prompts.chat=null or false")
    return mode
