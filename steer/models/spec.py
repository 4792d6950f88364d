"""What a run needs to know about its model before any weights load: where it is, its shape, its modules.

The module tree is built on the meta device from the config alone, so a tap that names no module, or a layer
out of range, fails in a second even for an 8B model. A hub model is read from the hub when it answers within a
few seconds, else from the local cache, else the run fails at once with one message saying what to do.
"""

import os
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple, Union

import torch

from steer.models import gguf as gguf_model

from steer.models import prompt

from steer.models import tiny
from steer.errors import ConfigError
from steer.config.schema import ModelConf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # a local directory (the tiny model's, the converted GGUF's, a cached hub snapshot) or a hub id
    revision: str | None
    dtype: torch.dtype
    hidden: int
    layers: int
    layers_path: str  # the ModuleList holding the decoder layers, e.g. "model.layers"
    modules: FrozenSet[str]
    # Whether the tokenizer has a chat template, where that is known without loading it (None: known only once an
    # engine loads the tokenizer, e.g. a hub model read online).
    chat_template: Optional[bool] = None
    positions: Optional[int] = None  # the config's max_position_embeddings (None: it names none)
    # What each module outputs where known from the config alone: the width of its (first) output tensor's rows, or
    # what it is instead ("never called", a container; "a BaseModelOutputWithPast"). Absent: not known.
    # A plain dict (read-only by convention): a job's spec is pickled into the process of a later engine group.
    outputs: Dict[str, Union[int, str]] = field(default_factory=dict, compare=False, hash=False)
    # The width of each module's input rows (its first positional argument) where a forward passes it one, as
    # `outputs` (tap.input reads and edits it)
    inputs: Dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    # The attention output projections (a Linear of an attention block fed its heads side by side): where
    # tap.heads slices the input by head
    attn_out: FrozenSet[str] = frozenset()
    heads: int = 0  # attention heads, and the width of each one's slice of an attention output projection's input
    head_dim: int = 0

    def layer_path(self, i: int) -> str:
        return f"{self.layers_path}.{i}"


def check_dtype(field: str, value: str) -> None:
    """A dtype the engines load weights in (DTYPES), for a run's model and the bench's models alike."""
    if value not in DTYPES:
        raise ConfigError(field, f"{value!r} is not one of {sorted(DTYPES)}")


def spec(conf: ModelConf, cache_dir: str) -> ModelSpec:
    """Read the model's shape and module tree from its config (the tiny model's recipe needs no files)."""
    check_dtype("model.dtype", conf.dtype)
    if conf.source == "tiny":
        config = tiny.llama_config(conf.tiny)
        source, template = str(tiny.tiny_dir(cache_dir, conf.tiny)), False  # its tokenizer has no chat template
    elif conf.source == "gguf":
        # Converted on first use (models/gguf.py); later runs read config.json from the cache, no weights.
        source = str(gguf_model.ensure(cache_dir, conf.gguf))
        config, _ = _pretrained_config(source, None, "model.source")
        template = prompt.template_in_dir(source)
    else:
        field, where = ("model.name", conf.name) if conf.source == "hub" else ("model.source", conf.source)
        config, source = _pretrained_config(where, conf.revision, field)
        template = prompt.template_in_dir(source) if Path(source).is_dir() else None
    layers_path, modules, outputs, inputs, attn_out = _modules(config)
    positions = getattr(config, "max_position_embeddings", None)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0))
    return ModelSpec(conf.name, source, conf.revision, DTYPES[conf.dtype], config.hidden_size,
                     config.num_hidden_layers, layers_path, modules, template,
                     int(positions) if positions else None, outputs, inputs, attn_out, heads, head_dim)


def _pretrained_config(where: str, revision: str | None, field: str):
    """(config, where to load the model from) for a local directory or a hub id. A hub id is read from the hub if
    it answers within a few seconds, else (or with HF_HUB_OFFLINE=1) from the local cache, whose snapshot
    directory is then where the engines load from, with no network."""
    from transformers import AutoConfig

    local = Path(where).expanduser()
    if local.exists() or where.startswith(("/", ".", "~")):
        if not local.is_dir():
            raise ConfigError(field, f"{where!r} is not a directory (a local model, or a Hugging Face hub id "
                                     "such as org/name)")
        try:
            return AutoConfig.from_pretrained(str(local)), str(local)
        except Exception as e:  # transformers raises OSError or ValueError depending on the cause
            raise ConfigError(field, f"could not read the config of {where!r}: {_first_line(e)}") from e
    offline = _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE")
    endpoint = _hub_endpoint()
    if not offline and _reachable(endpoint):
        try:
            return AutoConfig.from_pretrained(where, revision=revision), where
        except Exception as e:  # hub errors: a gated model, a wrong id or revision
            raise ConfigError(field, f"could not read the config of {where!r} from {endpoint} (a gated model "
                                     f"needs `hf auth login` and its licence accepted): {_first_line(e)}") from e
    snapshot = cached_snapshot(where, revision)
    if snapshot is not None:
        try:
            return AutoConfig.from_pretrained(snapshot), snapshot
        except Exception as e:
            raise ConfigError(field, f"could not read the cached config of {where!r} at {snapshot!r}: "
                                     f"{_first_line(e)}") from e
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub ({endpoint}) does not answer"
    raise ConfigError(field, f"could not read the config of {where!r}: {why} and it is not in the local Hugging "
                             f"Face cache. Set model.source=<local dir> to a downloaded checkpoint, or download it "
                             f"once online (`hf download {where}`; a gated model needs `hf auth login` first) and "
                             f"run with HF_HUB_OFFLINE=1")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_endpoint() -> str:
    # Read at call time: huggingface_hub reads HF_ENDPOINT once, when it is imported.
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """Whether the hub answers an HTTP request within `timeout` seconds (any status counts). In a thread, so a
    name lookup that hangs is cut off too; huggingface_hub itself would retry for half a minute."""
    answered = []

    def ask():
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            answered.append(True)
        except urllib.error.HTTPError:  # an answer, whatever its status
            answered.append(True)
        except Exception:
            pass

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(answered)


def cached_snapshot(repo_id: str, revision: str | None) -> Optional[str]:
    """The cached snapshot directory of `repo_id` at `revision` if its config.json is in the local cache."""
    from huggingface_hub import try_to_load_from_cache

    cache = os.environ.get("HF_HUB_CACHE") or (str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME")
                                               else None)
    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision, cache_dir=cache)
    except Exception:  # an id that is not a valid repo id
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def _modules(config):
    layers_path, names, outputs, inputs, attn_out = _module_tree(config.to_json_string())
    return layers_path, names, dict(outputs), dict(inputs), attn_out  # copies: the cached ones are shared


@lru_cache(maxsize=8)
def _module_tree(config_json: str):
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads(config_json)
    config = AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {n: m for n, m in model.named_modules() if n}
    stacks = [n for n, m in names.items() if isinstance(m, torch.nn.ModuleList) and len(m) == config.num_hidden_layers]
    if not stacks:
        raise ConfigError("model", f"found no list of {config.num_hidden_layers} decoder layers in "
                                   f"{type(model).__name__}")
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0))
    inputs, attn_out = _inputs(model, names, heads * head_dim)
    return stacks[0], frozenset(names), _outputs(model, names), inputs, attn_out


def _inputs(model: torch.nn.Module, names: Dict[str, torch.nn.Module], width: int
            ) -> Tuple[Dict[str, int], FrozenSet[str]]:
    """The width of each module's first positional argument, from one forward pass on the meta device, and the
    attention output projections: the Linears fed `width` (heads x head_dim) whose output is what their attention
    block returns. Where the forward cannot run on meta tensors, Linears' in_features and the names o_proj /
    out_proj under an attention block."""
    seen: Dict[str, int] = {}
    out: Dict[str, object] = {}  # each module's (first) output, held: meta tensors, no memory, no reused ids

    def before(name):
        def record(module, args):
            if args and isinstance(args[0], torch.Tensor):
                seen[name] = int(args[0].shape[-1])
        return record

    def after(name):
        def record(module, args, output):
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            out[name] = first
        return record

    handles = [m.register_forward_pre_hook(before(n)) for n, m in names.items()]
    handles += [m.register_forward_hook(after(n)) for n, m in names.items()]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception:
        seen = {n: m.in_features for n, m in names.items() if isinstance(m, torch.nn.Linear)}
        found = {n for n, m in names.items() if isinstance(m, torch.nn.Linear) and m.in_features == width
                 and n.rsplit(".", 1)[-1] in ("o_proj", "out_proj") and "attn" in n}
    else:
        found = {n for n, m in names.items() if isinstance(m, torch.nn.Linear) and m.in_features == width
                 and "." in n and n in out and out.get(n.rsplit(".", 1)[0]) is out[n]
                 and "Attention" in type(names[n.rsplit(".", 1)[0]]).__name__}
    finally:
        for h in handles:
            h.remove()
    return seen, frozenset(found)


def _outputs(model: torch.nn.Module, names: Dict[str, torch.nn.Module]) -> Dict[str, Union[int, str]]:
    """What each module outputs, from one forward pass of the model on the meta device (shapes, no data): the
    width of a tensor's rows (the first element's, for a tuple, as the engines' hooks take it), else what it is.
    Where an architecture's forward cannot run on meta tensors, what the modules' own types say."""
    seen: Dict[str, Union[int, str]] = {}

    def hook(name):
        def record(module, args, output):
            first = output[0] if isinstance(output, (tuple, list)) and output else output
            seen[name] = first.shape[-1] if isinstance(first, torch.Tensor) else f"a {type(output).__name__}"
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in names.items()]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception:  # not every forward runs on meta tensors: what the module types say is still worth checking
        seen = {n: m.out_features if isinstance(m, torch.nn.Linear) else m.embedding_dim
                for n, m in names.items() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    else:
        seen.update({n: "never called in a forward pass" for n in names if n not in seen})
    finally:
        for h in handles:
            h.remove()
    for n, m in names.items():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            seen[n] = f"a {type(m).__name__}, never called in a forward pass"
    return seen
