"""The one error type a user sees for bad input: it names the field, file or key and what was expected."""


class ConfigError(ValueError):
    """Bad input found before any engine starts. `field` is the config key at fault (e.g. `edit.vector.key`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def unknown_setting(key: str, kind) -> ConfigError:
    """The error for dotted `key`, which the config dataclass `kind` holding it does not declare: the name that
    replaced it where it was renamed (steer/renamed.py), else the nearest setting it does, and all of them."""
    import dataclasses
    import difflib

    from steer import renamed

    old = renamed.key_message(key)
    if old is not None:
        return ConfigError(key, old)
    known = sorted(f.name for f in dataclasses.fields(kind))
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f"did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{near[0]}? " if near else ""
    return ConfigError(key, f"is not a setting of this config; {hint}the settings there are: {', '.join(known)}")


def config_error_line(e: BaseException) -> "str | None":
    """One line for an error in the config itself (YAML syntax, an unknown key or group option, a wrong type,
    an override that does not parse), naming the file, line and column or the key; None for any other error."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    chain, seen = [], e
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for x in chain:
        if isinstance(x, yaml.MarkedYAMLError) and x.problem_mark is not None:
            m = x.problem_mark
            what = " ".join(p for p in (x.context, x.problem) if p)
            return f"{m.name}:{m.line + 1}:{m.column + 1}: invalid YAML: {what}"
    for x in chain:  # a key the schema lacks, in an override or a config file: Hydra's hint (`+key=`) would not do
        line = _unknown_key_line(x, chain)
        if line:
            return line
    for x in chain:  # a value its typed key does not take: an old spelling's new one, or an enum's members
        error = value_error(x)
        if error is not None:
            return _in_file(chain) + _in_override(chain, error.field) + str(error)
    for x in chain:  # a config group option with no file, where it was renamed (`edit=scale`)
        line = _renamed_option_line(x)
        if line:
            return line
    for x in chain:  # Hydra's sweep parser lets Python's own errors out of an override's function, e.g. range(0,4,0)
        if not isinstance(x, (HydraException, OmegaConfBaseException)) and _raised_in(x, "override_parser"):
            return f"an override does not evaluate: {' '.join(str(x).split())}"
    if not any(isinstance(x, (HydraException, OmegaConfBaseException, yaml.YAMLError)) for x in chain):
        return None
    parts = []
    for x in chain:
        text = " ".join(str(x).split())
        if isinstance(x, OmegaConfBaseException):
            text = text.split(" full_key:")[0]  # OmegaConf appends full_key/object_type lines; the key is named
        text = text.split(" Config search path:")[0]
        if "$VALUE" in text or text == "None":  # OmegaConf's unformatted template of the line before
            continue
        if text and not any(text in p for p in parts):
            parts.append(text)
    return ": ".join(parts)


def _unknown_key_line(x: BaseException, chain) -> "str | None":
    """unknown_setting's line where `x` is OmegaConf refusing a key its typed node lacks, after the config file
    it came from where Hydra names one (`In 'prompts/calm': ...`)."""
    import dataclasses

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from hydra.errors import HydraException

    kind, key, full = getattr(x, "object_type", None), getattr(x, "key", None), getattr(x, "full_key", None)
    if not (isinstance(x, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(kind) and key and full
            and key not in {f.name for f in dataclasses.fields(kind)}):
        return None
    if not any(isinstance(y, HydraException) for y in chain):  # composing the config, not steer's own code reading it
        return None
    return _in_file(chain) + str(unknown_setting(str(full), kind))


def _in_file(chain) -> str:
    """`<config file>: ` where Hydra names the file an error came from (`In 'prompts/calm': ...`), else ''."""
    import re

    where = next((m.group(1) for y in chain if (m := re.match(r"In '([^']+)':", str(y)))), None)
    return f"{where}: " if where else ""


def value_error(e: BaseException) -> "ConfigError | None":
    """The error for OmegaConf refusing a value of a typed key (`e`), naming the key: where the value is an old
    spelling, the one that replaced it (steer/renamed.py); where the key is an enum, its members; else
    OmegaConf's own words. None where `e` is no such refusal."""
    from enum import Enum

    from omegaconf import BooleanNode
    from omegaconf.errors import ValidationError

    from steer import renamed

    key, value = getattr(e, "full_key", None), getattr(e, "value", None)
    if not isinstance(e, ValidationError) or not key:
        return None
    old = renamed.value_message(key, value)
    if old is not None:
        return ConfigError(str(key), old)
    node = getattr(e, "child_node", None)
    kind = getattr(node, "enum_type", None)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return ConfigError(str(key), f"{value!r} is not one of {', '.join(kind.__members__)}")
    if isinstance(node, BooleanNode):
        return ConfigError(str(key), f"{value!r} is not one of true, false" + (", null" if node._is_optional() else ""))
    return ConfigError(str(key), " ".join(str(e).split("\n")[0].split()))


def _in_override(chain, key: str) -> str:
    """`<override's key>: ` where the error came from an override whose value holds `key` (the index of a list
    item is lost on the way: `extra_edits=[{..., edit: {kind: bogus}}]` names `edit.kind`), else ''."""
    import re

    for y in chain:
        m = re.match(r"Error merging override ([^=\s]+)=", str(y))
        given = m and m.group(1).lstrip("+~")
        if given and not (key == given or key.startswith((given + ".", given + "["))):
            return f"{given}: "
    return ""


def _renamed_option_line(x: BaseException) -> "str | None":
    """renamed.group_message's line where `x` is Hydra finding no file for a group option (`edit=scale`)."""
    from hydra.errors import MissingConfigException

    from steer import renamed

    missing = getattr(x, "missing_cfg_file", None)
    if not isinstance(x, MissingConfigException) or not missing or "/" not in str(missing):
        return None
    group, _, option = str(missing).rpartition("/")
    said = renamed.group_message(group, option)
    return None if said is None else str(ConfigError(group, said))


def refuse_repeats(field: str, items, said: str = "") -> None:
    """ConfigError naming `field` where `items` (compared as text) holds one twice."""
    items = [str(x) for x in items]
    twice = sorted({x for x in items if items.count(x) > 1})
    if twice:
        raise ConfigError(field, f"names {', '.join(twice)} twice{said}")


def _raised_in(e: BaseException, package: str) -> bool:
    """Whether `e` was raised from within a module of hydra.core.<package>."""
    import traceback

    return any(f"hydra/core/{package}/" in frame.filename.replace("\\", "/")
               for frame in traceback.extract_tb(e.__traceback__))


def run_app(app, on_interrupt=None) -> None:
    """Run a Hydra entry point; a config Hydra or OmegaConf rejects is one line naming the file or key, exit 2. Ctrl-C
    says "interrupted" (or what `on_interrupt()` returns, where it returns a line), exit 130."""
    import os
    import sys

    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Hydra prints its own errors (a traceback for a YAML error) and exits 1: let them reach us instead.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except KeyboardInterrupt:
        print((on_interrupt and on_interrupt()) or "interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        line = config_error_line(e)
        if line is None or full:
            raise
        print(f"error {line}", file=sys.stderr)
        sys.exit(2)
