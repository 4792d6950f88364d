"""Old spellings, refused for one release with the name that replaced them: config keys, config values, config
group options and names of the Python API. The one table of them; steer/errors.py reads it where a composed config
is refused (an unknown key, a value outside its choices, a group option with no file), steer/__init__.py where a
name of the API is looked up, each making its own error of the message said here (for a key, a value or a group:
the rest of a ConfigError's line after the key). Imports nothing of steer: steer/errors.py imports it."""

from typing import Dict, Optional

# A key, or the last segments of one (under any prefix: `extra_edits[0].edit.kind`, a bench model's `tiny`), and
# what it is now. A key under a renamed one is renamed with it (`eval.judge.model` -> `metrics.judge.model`).
KEYS: Dict[str, str] = {
    "tiny.layers": "tiny.num_layers",  # a count; `layers` elsewhere selects layers
    "eval.sentiment": "metrics.sentiment",  # a metric of every run, not of task=eval
    "eval.judge": "metrics.judge",
}

# A key (or its last segments, as above) and its values that are now spelled otherwise (None: null).
VALUES: Dict[str, Dict[str, Optional[str]]] = {
    "edit.kind": {"scale": "rescale"},  # `scale` is an edit's strength
    "k_kinds": {"scale": "rescale"},  # the bench's edit kinds
    "prompts.chat": {"auto": None},  # a bool: null is "where the tokenizer has a chat template"
}

# A config group and its options that are now named otherwise (`edit=scale` -> `edit=rescale`).
GROUPS: Dict[str, Dict[str, str]] = {"edit": {"scale": "rescale"}}

# Names of `steer` (the Python API) and what they are now.
API: Dict[str, str] = {
    "scale": "rescale",  # the edit kind's new name
    "set": "set_projection",  # `set` is a builtin
}


def _segments(key: str):
    return str(key).split(".")


def _find(key: str, old: str) -> Optional[int]:
    """Where the segments of `old` start in dotted `key` (None: nowhere), matched whole segments at a time; a
    list index (`edits[0]`) is part of its segment."""
    have, want = _segments(key), _segments(old)
    for i in range(len(have) - len(want), -1, -1):
        if have[i:i + len(want)] == want:
            return i
    return None


def new_key(key: str) -> Optional[str]:
    """What a renamed `key` is now called (None: it was not renamed)."""
    for old, new in KEYS.items():
        at = _find(key, old)
        if at is not None:
            have = _segments(key)
            return ".".join(have[:at] + _segments(new) + have[at + len(_segments(old)):])
    return None


def key_message(key: str) -> Optional[str]:
    """What is said of a renamed `key` (None where it was not renamed)."""
    new = new_key(key)
    return None if new is None else f"was renamed; did you mean {new}?"


def value_message(key: str, value) -> Optional[str]:
    """What is said of `value` of `key` where it is an old spelling (None where it is not)."""
    if not isinstance(value, str):
        return None
    for tail, spellings in VALUES.items():
        if value in spellings and _ends_with(key, tail):
            new = spellings[value]
            return f"{value!r} was renamed; did you mean {'null' if new is None else repr(new)}?"
    return None


def group_message(group: str, option: str) -> Optional[str]:
    """What is said of a config group option that was renamed (`edit=scale`; None where it was not)."""
    new = GROUPS.get(group, {}).get(option)
    return None if new is None else f"{option!r} was renamed; did you mean {group}={new}?"


def api_message(name: str) -> Optional[str]:
    """What `steer.<name>` says where the name was renamed (None where it was not)."""
    new = API.get(name)
    return None if new is None else f"steer.{name} was renamed; did you mean steer.{new}?"


def _ends_with(key: str, tail: str) -> bool:
    have, want = [s.split("[")[0] for s in _segments(key)], _segments(tail)
    return have[-len(want):] == want
