"""The README a new user reads: every `python -m steer` command it shows composes and passes the run's checks (the
ones that run before any engine starts, steer.tasks.registry.prepare), its group file and `--config-dir` work as
shown, its fresh-machine commands are the ones CI runs, and every page it links to exists. A command on engine=vllm
is checked on the HF engine (no GPU here; the engine is the one thing that changes), a sweep at its first value, and
SmolLM2's commands on the tests' shared cache, where the model is converted once."""

import re
import shlex
from pathlib import Path

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from helpers import compose_conf
from steer.edits import vector
from steer.errors import ConfigError
from steer.tasks.registry import prepare

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
# Placeholders (`python -m steer -m ...`) and a model that only the Hugging Face hub serves are not runnable here.
LEFT_OUT = ("...", "model=llama")
LINK = r"\]\(([\w./-]+)(?:#[\w-]*)?\)"  # a markdown link to a file of the checkout (not a URL)


def commands(text: str, entry: str = r"python -m steer") -> list:
    """The commands of one entry point in the README's shell blocks (less their comments) and in its inline code (a
    span may wrap over lines), each once, in order."""
    found, fenced, prose = [], False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):  # a fence of any language opens or closes a block
            fenced = not fenced
        elif fenced and re.search(rf"(^|&& ){entry}(\s|$)", line.strip()):
            found.append(re.sub(r"^.*&& ", "", line.split("  #")[0].strip()))
        elif not fenced:
            prose.append(line)
    found += [" ".join(m.split()) for m in re.findall(rf"`({entry}(?:\s[^`]*)?)`", "\n".join(prose), re.S)]
    return [c for c in dict.fromkeys(found) if not any(x in c for x in LEFT_OUT)]


def split(command: str):
    """(config dir or None, the overrides as one job of the command would get them: a sweep's first value,
    engine=hf)."""
    args = [a for a in shlex.split(command)[3:] if a not in ("-m", "--multirun")]
    config_dir = None
    if args[:1] == ["--config-dir"]:
        config_dir, args = args[1], args[2:]
    out = []
    for o in OverridesParser.create().parse_overrides(args):
        key = o.get_key_element()
        if key == "engine":
            out.append("engine=hf")
        elif o.is_sweep_override():
            out.append(f"{key}={next(iter(o.sweep_iterator()))}")
        else:
            out.append(o.input_line)  # as written: quoting and null stay the command's
    return config_dir, out


def group_files(text: str) -> dict:
    """The group files the README writes out: a YAML block right after the prose that names its path
    (`my_conf/prompts/calm.yaml`), as {path: text}."""
    return {m.group(1): m.group(2) for m in re.finditer(r"`([\w./-]+/\w+/\w+\.yaml)`:?\s*\n+```yaml\n(.*?)```", text,
                                                       re.S)}


def data_files(text: str) -> dict:
    """The prompt files the README writes out: a text or JSON block right after the prose that names the file
    (`my_prompts.txt`:), as {path: text}."""
    block = r"`([\w./-]+\.(?:txt|jsonl|json|csv))`:?\s*\n+```(?:text|json)\n(.*?)```"
    return {m.group(1): m.group(2) for m in re.finditer(block, text, re.S)}


COMMANDS = commands(TEXT)
WRITTEN = {m.group(1) for c in COMMANDS for m in [re.search(r"extract\.out=(\S+)", c)] if m and "$" not in c}


def test_the_readme_shows_the_commands_this_test_reads():
    assert "python -m steer" in COMMANDS and "python -m steer model=tiny tap=layer1 edit=ablate" in COMMANDS
    assert len(COMMANDS) >= 10
    assert any(c.startswith("python -m steer --config-dir ") for c in COMMANDS)
    assert any("task=select" in c for c in COMMANDS) and any("task=extract" in c for c in COMMANDS)
    assert any(c.startswith("python -m steer -m ") for c in COMMANDS)
    assert commands("`python -m steer model=tiny\n  tap=layer1` and\n```yaml\na: 1\n```\n```bash\npython -m steer "
                    "-m a=1,2  # c\n```") == ["python -m steer -m a=1,2", "python -m steer model=tiny tap=layer1"]
    assert split("python -m steer -m engine=vllm 'edit.scale=range(0,16)' tap=layer1") \
        == (None, ["engine=hf", "edit.scale=0", "tap=layer1"])
    assert split("python -m steer --config-dir d prompts=x") == ("d", ["prompts=x"])
    assert "my_prompts.txt" in data_files(TEXT) and any("prompts.steer_file=" in c for c in COMMANDS)


def test_the_fresh_machine_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    for command in ("pip install 'torch==2.13.0' -e . && python -m steer",
                    'apt-get update && apt-get install -y chromium && CMAKE_ARGS="-DGGML_NATIVE=OFF" '
                    "pip install 'torch==2.13.0' -e '.[dev]' && ruff check && mypy && python -m pytest -q"):
        assert command in TEXT
        assert command.replace("pip install ", "pip install -q ") in ci


def test_the_readme_stays_short_and_links_only_to_pages_that_exist():
    assert len(TEXT.splitlines()) < 250
    links = re.findall(LINK, TEXT)
    assert "docs/configs.md" in links and "CONTRIBUTING.md" in links
    for page in [README] + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "CONTRIBUTING.md"]:
        for link in re.findall(LINK, page.read_text()):
            assert (page.parent / link).exists(), f"{page.relative_to(ROOT)} links to {link}, which does not exist"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_passes_the_checks_before_an_engine_starts(command, cache_dir, tiny_spec, tmp_path,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's relative paths (my_conf/, outputs/) land here
    config_dir, args = split(command)
    for path, text in data_files(TEXT).items():  # the prompt files the README shows, where it says
        (tmp_path / path).write_text(text)
    if config_dir:  # the group files the README shows, written where it says
        files = {p: t for p, t in group_files(TEXT).items() if p.startswith(config_dir + "/")}
        assert files, f"{command}: the README writes out no file under {config_dir}/"
        for path, text in files.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(text)
        args.append(f"hydra.searchpath=[file://{tmp_path / config_dir}]")  # what --config-dir adds
    cfg = OmegaConf.to_object(compose_conf("config", args + [f"cache_dir={cache_dir}"]))
    try:
        if cfg.edit.vector.path in WRITTEN:  # a file an earlier README command extracts: one of the model's size
            hidden = prepare(OmegaConf.to_object(compose_conf("config", [a for a in args if "vector.path" not in a]
                                                               + [f"cache_dir={cache_dir}"])), tmp_path).spec.hidden
            vector.save(cfg.edit.vector.path, {"direction": torch.ones(hidden)}, model=cfg.model.name,
                        tap="layer12", method="diffmean")
        job = prepare(cfg, tmp_path)
    except ConfigError as e:
        if e.field == "model.source" and cfg.model.name == "smollm2":  # as tests/models/test_smollm2.py: no wheel here
            pytest.skip(f"SmolLM2 is not available on this machine: {e}")
        raise
    assert job.taps or job.cells


def test_a_vector_file_no_command_writes_fails_here(cache_dir, tiny_spec, tmp_path, monkeypatch):
    # what the test above would catch if the README steered with a file that no command of it extracts
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.to_object(compose_conf("config", ["model=tiny", "tap=layer1", f"cache_dir={cache_dir}",
                                                      "edit.vector.path=outputs/nowhere.safetensors"]))
    with pytest.raises(ConfigError, match="edit.vector.path"):
        prepare(cfg, tmp_path)


def test_a_command_whose_tap_the_model_lacks_fails_here(cache_dir, tiny_spec, tmp_path):
    # a README once showed `python -m steer engine=vllm model=tiny`: the default tap, layer 12, of 4 layers
    cfg = OmegaConf.to_object(compose_conf("config", split("python -m steer engine=vllm model=tiny")[1]
                                           + [f"cache_dir={cache_dir}"]))
    with pytest.raises(ConfigError, match="tap.layer"):
        prepare(cfg, tmp_path)


@pytest.mark.parametrize("name,command", [(n, c) for n in ("serve", "bench")
                                          for c in commands(TEXT, rf"python -m steer\.{n}")])
def test_the_server_and_bench_commands_compose(name, command):
    from steer.config.schema import to_object

    args = shlex.split(command)[3:]
    to_object(compose_conf(name, args))
