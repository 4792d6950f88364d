"""Atomic result files: written to a temporary name beside the target, then renamed over it, so a reader never
sees half a file and a failed run leaves none."""

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional


def umask() -> int:
    """The process umask: from /proc where Linux gives it; else by setting it and setting it back (os's only
    way), a moment in which another thread's new file would get 0o022's mode."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_dir(parent: str | Path, prefix: str) -> Path:
    """A fresh temporary directory under `parent` with the mode a plain mkdir would give it (mkdtemp's is
    0700), for building something that is then renamed into place."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    d.chmod(0o777 & ~umask())
    return d


def build_dir(dest: Path, build) -> Path:
    """Make directory `dest` once: `build(tmp)` fills a fresh directory beside it, which is then renamed into place
    (atomic: a half-built directory is never seen under `dest`). A directory with a config.json already there is
    kept. Builders of the same `dest` take turns on a lock file, so processes that start on a fresh cache together
    (a sweep's engine groups, parallel test workers) build it once and the others wait for it. The lock files live
    in `locks/` one level up (the cache's own folder for `<cache>/models/<name>`), not among what they guard."""
    from filelock import FileLock

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    locks = dest.parent.parent / "locks"
    locks.mkdir(exist_ok=True)
    with FileLock(locks / f"{dest.name}.lock"):
        if (dest / "config.json").exists():  # built while this process waited
            return dest
        tmp = make_dir(dest.parent, ".building-")
        try:
            build(tmp)
            try:
                os.rename(tmp, dest)
            except OSError:
                if not (dest / "config.json").exists():  # one that took no lock got there first
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically. The temporary file's name is chosen before it exists, so a Ctrl-C at any
    point (mkstemp's own open included) leaves no temporary file behind."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}"
    try:
        # O_EXCL: a name another writer holds is never shared; 0o666 under the process umask, as `open` makes files
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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


def read_json(path: str | Path) -> Optional[Dict]:
    """The JSON object in `path`, or None where it is missing or holds no JSON object (a file damaged by hand or by
    the disk: what steer writes is whole, being written atomically)."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def read_rows(d: str | Path) -> Optional[List[Dict]]:
    """A run directory's results.jsonl (a steer job's, a selection pair's), or None where it has none (or a damaged
    one)."""
    try:
        return [json.loads(line) for line in (Path(d) / "results.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
