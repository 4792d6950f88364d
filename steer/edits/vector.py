"""Steering vectors on disk: safetensors files whose metadata says where a vector came from.

A vector is `[hidden]` (one direction) or `[k, hidden]` (a subspace). Everything is checked here, against the
model's hidden size, before any engine starts.
"""

import datetime
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from steer import results
from steer.edits import formats
from steer.config.checks import F32_MAX
from steer.errors import ConfigError


def save(path: str | Path, tensors: Dict[str, torch.Tensor], *, model: str, tap: str, method: str,
         extra: Optional[Dict[str, str]] = None) -> Path:
    """Write `tensors` to `path` atomically, with metadata (model, tap, method, date, hidden)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden = {t.shape[-1] for t in tensors.values()}
    meta = {
        "model": model,
        "tap": tap,
        "method": method,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hidden": ",".join(str(h) for h in sorted(hidden)),
        **(extra or {}),
    }
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if _holds(path, tensors, meta):
        return path
    return results.write_bytes(path, save_bytes(tensors, metadata=meta))


def save_layers(path: str | Path, directions: Dict[int, torch.Tensor], *, model: str, tap: str, method: str,
                extra: Optional[Dict[str, str]] = None) -> Path:
    """A multi-layer file: key `direction.<k>` per decoder layer k and metadata `layers` (the ks, comma-separated),
    besides `save`'s metadata (steer.edits.formats reads it)."""
    tensors = {formats.LAYER_KEY.format(k): v.reshape(-1) for k, v in sorted(directions.items())}
    return save(path, tensors, model=model, tap=tap, method=method,
                extra={**formats.layers_meta(directions), **(extra or {})})


def _holds(path: Path, tensors: Dict[str, torch.Tensor], meta: Dict[str, str]) -> bool:
    """Whether `path` already holds these tensors with this metadata, its date aside. Such a file is kept as it
    is: the same direction extracted again (a resumed sweep) leaves its sha256 alone, and with it every job that
    steers with it (their inputs.json names it by sha256)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            old = dict(f.metadata() or {})
            if set(f.keys()) != set(tensors):
                return False
            same = all(_equal(f.get_tensor(k), v) for k, v in tensors.items())
    except Exception:  # none there, or not a safetensors file: written anew
        return False
    old.pop("date", None)
    return same and old == {k: v for k, v in meta.items() if k != "date"}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)  # torch.equal compares shapes, not dtypes


def metadata(path: str | Path) -> Dict[str, str]:
    """The metadata stored with a vector file ({} if it has none, or is another tool's format: gguf, npy, pt, an
    SAE directory)."""
    if formats.kind(Path(path).expanduser()) != "safetensors":
        return {}
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def resid_norm(meta: Dict[str, str], key: str) -> Tuple[Optional[float], Optional[str]]:
    """(the mean residual norm extraction recorded for `key`, the tap it was measured at), from a file's metadata:
    `diag.resid_norm` and `tap`, or, for key `direction.<k>` of a multi-layer file (metadata `layers`),
    `diag.<k>.resid_norm` at layer k. None where the file records none."""
    k = key[len("direction."):] if key.startswith("direction.") and "layers" in meta else None
    value = meta.get(f"diag.{k}.resid_norm" if k is not None else "diag.resid_norm")
    try:
        return float(value), (f"layer{k}" if k is not None else meta.get("tap"))
    except (TypeError, ValueError):  # absent, or "none"
        return None, None


def require(path: str | Path, field: str = "edit.vector") -> Path:
    """`path` expanded, or a ConfigError where nothing is there (a job checks it before reading the model's files,
    so the commonest mistake is said in a moment)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{field}.path", f"vector file {str(path)!r} does not exist")
    return path


def load(path: str | Path, key: str, hidden: int, field: str = "edit.vector", layer: Optional[int] = None,
         feature: Optional[int] = None, any_layer: bool = False, what: str = "the model's hidden size"
         ) -> torch.Tensor:
    """Load `key` from `path` as float32 `[k, hidden]`, or raise ConfigError naming what is wrong. A GGUF control
    vector or a multi-layer file gives its direction at decoder layer `layer` (the tap's), an SAE directory its
    feature `feature` (steer.edits.formats reads them all)."""
    path = require(path, field)
    kind = formats.kind(path)
    if kind == "sae":
        v = formats.read_sae(path, feature, hidden, layer, any_layer, field)
        return check(v, hidden, f"{field} ({path}: feature {feature})", what=what)
    if feature is not None:
        raise ConfigError(f"{field}.feature", f"names an SAE feature, and {str(path)!r} is a vector file, not an SAE "
                                              "directory; leave it unset")
    if not path.is_file():
        raise ConfigError(f"{field}.path", f"{str(path)!r} is not a regular file")
    if kind in ("npy", "pt"):
        v = formats.read_npy(path, key, field) if kind == "npy" else formats.read_pt(path, key, field)
        return check(v, hidden, f"{field} ({path})", what=what)
    if kind == "gguf" or formats.is_multi_layer(_metadata_or_none(path, field)):
        if layer is None and key.startswith("direction.") and key[len("direction."):].isdigit():
            layer = int(key[len("direction."):])  # no tap layer to pick by: the key names the layer
        return check(_at_layer(formats.read_layers(path, field), path, layer, field), hidden,
                     f"{field} ({path}:direction.{layer})", what=what)
    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ConfigError(f"{field}.path", f"{str(path)!r} is not a readable safetensors file ({e})") from e
    with f:
        keys = sorted(f.keys())
        if key not in keys:
            raise ConfigError(f"{field}.key", f"key {key!r} is not in {str(path)!r}; keys present: {keys}")
        v = f.get_tensor(key)
    return check(v, hidden, f"{field} ({path}:{key})", what=what)


def load_layers(path: str | Path, hidden: int, field: str = "edit.vector") -> Dict[int, torch.Tensor]:
    """Every direction of a multi-layer file by decoder layer, each checked as `load` checks one."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{field}.path", f"vector file {str(path)!r} does not exist or is not a file")
    return {k: check(v, hidden, f"{field} ({path}:direction.{k})")
            for k, v in formats.read_layers(path, field).items()}


def _at_layer(directions: Dict[int, torch.Tensor], path: Path, layer: Optional[int], field: str) -> torch.Tensor:
    if layer is None:
        raise ConfigError(f"{field}.path", f"{str(path)!r} holds one direction per decoder layer, and the tap is no "
                                           "decoder layer: tap one (tap.layer=k) or set edit.vector.layers")
    if layer not in directions:
        raise ConfigError(f"{field}.path", f"{str(path)!r} has no direction for layer {layer}; it holds layers "
                                           f"{list(directions)}")
    return directions[layer]


def _metadata_or_none(path: Path, field: str) -> Dict[str, str]:
    try:
        return metadata(path)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ConfigError(f"{field}.path", f"{str(path)!r} is not a readable safetensors file ({e})") from e




def check(v: torch.Tensor, hidden: int, where: str, what: str = "the model's hidden size") -> torch.Tensor:
    """Validate a vector's dtype, shape and values against the model (`hidden`: the width of the tap's rows, which
    `what` names); return it as float32 `[k, hidden]`."""
    if not v.is_floating_point():
        raise ConfigError(where, f"dtype {v.dtype} is not a floating-point type")
    expected = f"expected [{hidden}] (one direction) or [k, {hidden}] (a subspace of k directions)"
    if v.dim() not in (1, 2):
        raise ConfigError(where, f"shape {list(v.shape)} has {v.dim()} dimensions: {expected}")
    if v.shape[-1] != hidden:
        raise ConfigError(where, f"shape {list(v.shape)} does not fit the model: {expected} ({what} is {hidden}, "
                                 f"the vector's last dimension {v.shape[-1]})")
    if v.numel() == 0:
        raise ConfigError(where, f"shape {list(v.shape)} holds no direction: {expected}")
    # Checked as the edits hold it: a float64 1e39 is finite and float32's inf (and float8 has no isfinite)
    f = v.float()
    bad = ~torch.isfinite(f)
    if bad.any():
        nan = int(torch.isnan(f).sum())
        wide = int((bad & torch.isfinite(v.double())).sum())
        kinds = [f"{n} {what}" for n, what in ((nan, "NaN"), (int(bad.sum()) - nan - wide, "infinite"),
                                               (wide, f"beyond float32's range (|x| > {F32_MAX:.3g})")) if n]
        raise ConfigError(where, f"entries are {', '.join(kinds)}; a vector must be finite in float32")
    v = f.reshape(-1, hidden).clone()  # not the file's mapping: `cp` over it in place would change it mid-run
    zero = (v.norm(dim=-1) == 0).nonzero().flatten().tolist()
    if zero:
        rows = "the vector is" if v.shape[0] == 1 else f"rows {zero} are"
        raise ConfigError(where, f"{rows} all zeros; a direction needs a nonzero norm")
    return v
