"""steer.Vector: a steering direction in memory, with the metadata its file carries and what extraction says about
it. On disk it is the file `task=extract` writes (steer/edits/vector.py reads, checks and writes it)."""

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:  # torch loads with the first Vector, not with `import steer`
    import torch

DIAG = "diag."  # metadata keys extraction stores its diagnostics under (steer/runs/extract.py)


@dataclass
class Vector:
    """`tensor`: float32 `[hidden]` (one direction) or `[k, hidden]` (a subspace). `metadata`: what its file says
    (model, tap, method, prompt counts, ...). `key`: the tensor's key in the file."""

    tensor: "torch.Tensor"
    metadata: Dict[str, str] = field(default_factory=dict)
    key: str = "direction"

    @classmethod
    def load(cls, path, key: str = "direction") -> "Vector":
        """The vector under `key` in a safetensors file (checked as `edit.vector` is: ValueError naming it)."""
        from safetensors import safe_open

        from steer.edits import vector

        path = Path(path).expanduser()
        try:  # the hidden size is the file's own: the vector is checked against itself
            with safe_open(str(path), framework="pt") as f:
                hidden = f.get_slice(key).get_shape()[-1] if key in f.keys() else 1
        except Exception:  # no such file, or not safetensors: vector.load says which, naming the field
            hidden = 1
        t = vector.load(path, key, hidden, field="vector")
        return cls(t[0] if t.shape[0] == 1 else t, vector.metadata(path), key)

    def save(self, path) -> Path:
        """Write the vector and its metadata to `path` (a file `edit.vector.path=` takes)."""
        from steer.edits import vector

        meta = dict(self.metadata)
        fixed = {k: meta.pop(k, "") for k in ("model", "tap", "method")}
        meta.pop("date", None)  # the write's own
        meta.pop("hidden", None)
        return vector.save(path, {self.key: self.tensor}, **fixed, extra=meta)

    @property
    def diagnostics(self) -> Dict[str, object]:
        """What is known of the direction: its norm (rows' norms for a subspace), and every diagnostic the extraction
        stored in the metadata as a `diag.*` key (numbers as floats)."""
        norms = self.tensor.float().reshape(-1, self.tensor.shape[-1]).norm(dim=-1).tolist()
        out: Dict[str, object] = {"norm": norms[0] if len(norms) == 1 else norms}
        stored = {k[len(DIAG):]: _number(v) for k, v in self.metadata.items() if k.startswith(DIAG)}
        for k in sorted(stored, key=_diagnostic_order):  # a file's metadata comes back in no fixed order
            out[k] = stored[k]
        return out

    @property
    def layer(self) -> Optional[int]:
        """The decoder layer it was extracted after, where its tap was one (`layerN`)."""
        tap = self.metadata.get("tap", "")
        return int(tap[5:]) if tap.startswith("layer") and tap[5:].isdigit() else None

    def digest(self) -> str:
        """The sha256 of its values and key (the file name it is kept under for a run: steer.lab)."""
        t = self.tensor.detach().float().contiguous().cpu()
        return hashlib.sha256(self.key.encode() + str(list(t.shape)).encode() + t.numpy().tobytes()).hexdigest()

    def __repr__(self) -> str:
        d = self.diagnostics
        norm = f"{d['norm']:.4g}" if isinstance(d["norm"], float) else d["norm"]
        where = " ".join(f"{k}={self.metadata[k]}" for k in ("model", "tap", "method") if self.metadata.get(k))
        return f"Vector(shape={list(self.tensor.shape)}, norm={norm}{', ' + where if where else ''})"


def _diagnostic_order(name: str):
    """Diagnostics in extraction's order (steer/runs/diagnostics.py), a multi-layer file's layer by layer."""
    from steer.runs.diagnostics import KEYS

    layer, _, key = name.rpartition(".")
    return (int(layer) if layer.isdigit() else -1, layer, KEYS.index(key) if key in KEYS else len(KEYS), key)


def _number(v: str):
    try:
        return float(v)
    except ValueError:
        return v
