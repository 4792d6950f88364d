"""Difference-of-means directions: mean tap value over one prompt set minus the mean over another."""

import hashlib
import json
from pathlib import Path
from typing import List

import torch

from steer import vector
from steer.tap import Tap


def tap_means(engine, tap: Tap, prompts: List[str], position: str) -> torch.Tensor:
    """Mean over prompts of each prompt's tap value (its tokens' mean, or its last token's)."""
    rows = []
    for _, captured in engine.score_many([(engine.encode(p), [], None, (tap.path,)) for p in prompts]):
        h = captured[tap.path]
        rows.append(h[-1] if position == "last" else h.mean(0))
    return torch.stack(rows).mean(0)


def diff_of_means(engine, tap: Tap, positive: List[str], negative: List[str], position: str = "mean",
                  normalize: bool = False) -> torch.Tensor:
    """`mean(positive) - mean(negative)` at `tap`, as float32 `[hidden]` (unit norm if `normalize`)."""
    if position not in ("mean", "last"):
        from steer.errors import ConfigError
        raise ConfigError("extract.position", f"{position!r} is not 'mean' or 'last'")
    d = tap_means(engine, tap, positive, position) - tap_means(engine, tap, negative, position)
    return d / d.norm() if normalize else d


def extract_to(path: str | Path, key: str, engine, tap: Tap, positive: List[str], negative: List[str],
               position: str = "mean", normalize: bool = False) -> Path:
    """Extract a direction and write it to `path` under `key`, with metadata saying how it was made."""
    d = diff_of_means(engine, tap, positive, negative, position, normalize)
    return vector.save(path, {key: d}, model=engine.spec.name, tap=tap.name, method=f"diff-of-means/{position}",
                       extra={"positive": str(len(positive)), "negative": str(len(negative)),
                              "source": engine.spec.source})


def cached_default(cache_dir: str, engine, tap: Tap, positive: List[str], negative: List[str]) -> torch.Tensor:
    """The default direction at `tap`: extracted once per (model, tap, prompt sets), then read from cache."""
    blob = json.dumps([engine.spec.source, tap.path, positive, negative]).encode()
    path = Path(cache_dir).expanduser() / "vectors" / f"{hashlib.sha256(blob).hexdigest()[:16]}.safetensors"
    if not path.exists():
        extract_to(path, "direction", engine, tap, positive, negative)
    return vector.load(path, "direction", engine.spec.hidden, field="default vector")
