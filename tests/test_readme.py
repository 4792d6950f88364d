"""Every `python -m steer` command the README shows composes and passes the run's checks, the ones that run before
any engine starts (steer.runs.job.prepare): a command a new user copies must not stop at a tap or an override. A
command on engine=vllm is checked on the HF engine (no GPU here; the engine is the one thing that changes), a
sweep at its first value, and SmolLM2's commands on the session's cache, where the model is converted once."""

import re
import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from helpers import compose_conf
from steer.errors import ConfigError
from steer.runs.job import prepare

README = Path(__file__).resolve().parents[1] / "README.md"
# Placeholders (`python -m steer -m ...`) and a model that only the Hugging Face hub serves are not runnable here.
LEFT_OUT = ("...", "model=llama")


def commands(text: str) -> list:
    """The `python -m steer` commands of the README's shell blocks (less their comments) and of its inline code (a
    span may wrap over lines), each once, in order."""
    found, fenced, prose = [], False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):  # a fence of any language opens or closes a block
            fenced = not fenced
        elif fenced and re.match(r"\s*python -m steer(\s|$)", line):
            found.append(line.split("  #")[0].strip())
        elif not fenced:
            prose.append(line)
    found += [" ".join(m.split()) for m in re.findall(r"`(python -m steer(?:\s[^`]*)?)`", "\n".join(prose), re.S)]
    return [c for c in dict.fromkeys(found) if not any(x in c for x in LEFT_OUT)]


def overrides(command: str) -> list:
    """The command's overrides as one job of it would get them: a sweep's first value, engine=hf."""
    args = [a for a in shlex.split(command)[3:] if a not in ("-m", "--multirun")]
    out = []
    for o in OverridesParser.create().parse_overrides(args):
        key = o.get_key_element()
        if key == "engine":
            out.append("engine=hf")
        elif o.is_sweep_override():
            out.append(f"{key}={next(iter(o.sweep_iterator()))}")
        else:
            out.append(o.input_line)  # as written: quoting and null stay the command's
    return out


COMMANDS = commands(README.read_text())


def test_the_readme_shows_the_commands_this_test_reads():
    assert "python -m steer" in COMMANDS and "python -m steer model=tiny tap=layer1 edit=ablate" in COMMANDS
    assert len(COMMANDS) >= 10
    assert commands("`python -m steer model=tiny\n  tap=layer1` and\n```yaml\na: 1\n```\n```bash\npython -m steer "
                    "-m a=1,2  # c\n```") == ["python -m steer -m a=1,2", "python -m steer model=tiny tap=layer1"]
    assert "python -m steer -m +experiment=clamp_sweep" in COMMANDS  # a block after a yaml one
    assert overrides("python -m steer -m engine=vllm 'edit.scale=range(0,16)' tap=layer1") \
        == ["engine=hf", "edit.scale=0", "tap=layer1"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_passes_the_checks_before_an_engine_starts(command, cache_dir, tiny_spec, tmp_path):
    cfg = OmegaConf.to_object(compose_conf("config", overrides(command) + [f"cache_dir={cache_dir}"]))
    try:
        job = prepare(cfg, tmp_path)
    except ConfigError as e:
        if e.field == "model.source" and cfg.model.name == "smollm2":  # as tests/test_smollm2.py: no wheel here
            pytest.skip(f"SmolLM2 is not available on this machine: {e}")
        raise
    assert job.taps or job.cells


def test_a_command_whose_tap_the_model_lacks_fails_here(cache_dir, tiny_spec, tmp_path):
    # the README once showed `python -m steer engine=vllm model=tiny`: the default tap, layer 12, of 4 layers
    cfg = OmegaConf.to_object(compose_conf("config", overrides("python -m steer engine=vllm model=tiny")
                                           + [f"cache_dir={cache_dir}"]))
    with pytest.raises(ConfigError, match="tap.layer"):
        prepare(cfg, tmp_path)
