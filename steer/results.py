"""Atomic result files: written to a temporary name beside the target, then renamed over it, so a reader never
sees half a file and a failed run leaves none."""

import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Iterable


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically."""
    return write_bytes(path, text.encode())


def write_jsonl(path: str | Path, rows: Iterable[Dict]) -> Path:
    return write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def write_json(path: str | Path, obj: Dict) -> Path:
    return write_text(path, json.dumps(obj, indent=2) + "\n")
