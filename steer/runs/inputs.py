"""What a job reads beside its config, fingerprinted: its vector files and data files (prompts, pairs, an A/B
dataset; by content) and its model's files (by size and modification time; hashing gigabytes of weights on every
resume would cost more than the jobs).

A config names a vector or a data file by its path and a model by its directory or hub id, so a sweep resumed after
a vector file was rewritten, a prompts file edited, a checkpoint retrained in place or a hub model updated would
otherwise count its old jobs as done. Each job writes its fingerprint (inputs.json) before its metrics; a resume
re-reads exactly what the fingerprint names and reruns the job where anything differs.
"""

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from steer.models.spec import ModelSpec, cached_snapshot
from steer.edits.plan import entries
from steer.config.schema import SteerConf

FILE = "inputs.json"
_HASHED = 1 << 20  # model files up to this size (configs, tokenizers) are hashed too, not only stat'ed


def vectors(cfg: SteerConf) -> Dict[str, Optional[str]]:
    """Each vector file's sha256 by its configured path, for a job that runs its edits (an extraction records the
    file it writes instead): taken when the job is validated, just before its vectors load (a file rewritten while a
    sweep runs is then told apart from the one the job read)."""
    paths = [e.vector.path for _, _, e in entries(cfg) if e.vector.path is not None]
    paths += [e.when.vector for _, _, e in entries(cfg) if e.when.vector is not None and e.when.layer is not None]
    return {p: digest(p) for p in dict.fromkeys(paths)}


def data_paths(cfg: SteerConf, more: Iterable[str] = ()) -> List[str]:
    """The data files a job reads: its prompts and pairs files, and `more` (its task's own: task=eval's A/B dataset,
    steer.tasks.registry.data_paths); a job config, typed or as Hydra composed it."""
    p = cfg.prompts
    paths = [p.steer_file, p.pairs_file, p.positive_file, p.negative_file, p.condition_positive_file,
             p.condition_negative_file, *more]
    return [str(x) for x in dict.fromkeys(paths) if x is not None]


def data(paths: Iterable[Optional[str]]) -> Dict[str, Optional[str]]:
    """Each data file's sha256 by its configured path (None: not set): taken before the files are read, as
    vectors are."""
    return {str(p): digest(p) for p in dict.fromkeys(p for p in paths if p is not None)}


def model(cfg: SteerConf, spec: ModelSpec) -> Dict[str, Any]:
    """The model's files as they are now (job.engine_for takes them as the jobs' engine starts)."""
    return _model(*_where(cfg, spec), spec.revision)


def weights(spec: ModelSpec) -> Dict[str, Any]:
    """The files of the model an engine loaded from `spec` (its directory's, or a hub id's cached snapshot's)."""
    return _model("dir" if Path(spec.source).expanduser().is_dir() else "hub", spec.source, spec.revision)


def changes(recorded: Dict[str, Any], data_files: Iterable[str] = ()) -> Optional[str]:
    """None if every input `recorded` names reads as it did; else what changed, e.g. `vector v.safetensors`.
    `data_files`: the data files the job's config names; a record without data fingerprints (written before they
    were taken) cannot vouch for them."""
    now = {p: digest(p) for p in recorded.get("vectors", {})}
    diffs = [f"vector {p}{' (gone)' if now[p] is None else ''}" for p, was in recorded.get("vectors", {}).items()
             if now[p] != was]
    diffs += [f"data file {p}{' (gone)' if d is None else ''}" for p, was in recorded.get("data", {}).items()
              if (d := digest(p)) != was]
    if "data" not in recorded:
        diffs += [f"data file {p} (not fingerprinted)" for p in data_files]
    model = recorded.get("model", {})
    if _model(model.get("kind"), model.get("source"), model.get("revision")) != model:
        diffs.append(f"model {model.get('source')}")
    return ", ".join(diffs) or None


def write(out_dir: Path, vector_digests: Dict[str, Optional[str]], model_files: Dict[str, Any],
          data_digests: Optional[Dict[str, Optional[str]]] = None, settings: Optional[str] = None) -> None:
    """`settings`: the digest of the job's resolved settings (steer.runs.job.Job.settings), which a resume matches."""
    from steer import results

    record = {"vectors": vector_digests, "model": model_files, "data": data_digests or {}, "settings": settings}
    results.write_json(Path(out_dir) / FILE, record)


def recorded_settings(job_dir: Path) -> Optional[str]:
    """The settings digest the job in `job_dir` recorded (None: no record, or one written before they were)."""
    try:
        return json.loads((Path(job_dir) / FILE).read_text()).get("settings")
    except (OSError, ValueError, AttributeError):
        return None


def recorded_changes(job_dir: Path, data_files: Iterable[str] = ()) -> Optional[str]:
    """What changed since the job in `job_dir` ran (None: nothing); "no record" where it wrote no inputs.json.
    `data_files`: the data files its config names (data_paths)."""
    path = Path(job_dir) / FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return "no record of its inputs"
    return changes(recorded, data_files)


def _where(cfg: SteerConf, spec: ModelSpec):
    """(kind, source): ("tiny", None), ("hub", its id) or ("dir", the directory the weights load from)."""
    m = cfg.model
    if m.source == "tiny":
        return "tiny", None
    if m.source == "hub":
        return "hub", m.name
    if m.source != "gguf" and not Path(m.source).expanduser().is_dir():
        return "hub", m.source
    return "dir", spec.source


def _model(kind: Optional[str], source: Optional[str], revision: Optional[str]) -> Dict[str, Any]:
    """The model's files: those of its directory (the converted GGUF's, a local checkpoint's) or, for a hub id,
    of the snapshot its revision resolves to in the local cache now (a newer one once the hub's was fetched). The
    tiny model's are written from its recipe, which the config holds: nothing to read."""
    out: Dict[str, Any] = {"kind": kind, "source": source, "revision": revision}
    if kind == "tiny" or source is None:
        return out
    where: Optional[Path] = Path(source).expanduser()
    if kind == "hub":
        snapshot = cached_snapshot(source, revision)
        out["snapshot"] = snapshot
        where = Path(snapshot) if snapshot else None
    if where is not None and where.is_dir():
        out["files"] = {f.name: _stat(f) for f in sorted(where.iterdir()) if f.is_file()}
    return out


def _stat(f: Path) -> list:
    st = f.stat()
    return [st.st_size, st.st_mtime_ns] + ([digest(f)] if st.st_size <= _HASHED else [])


def digest(path) -> Optional[str]:
    """A file's (or a directory's) sha256 as inputs.json records it, None where it cannot be read. Memoised by the
    file's identity, size and modification time: a resumed sweep of a thousand jobs that share one vector file reads
    it once."""
    path = Path(path).expanduser()
    if path.is_dir():
        from steer.edits.formats import SAE_CONFIG, SAE_WEIGHTS

        if (path / SAE_CONFIG).is_file():  # an SAE directory: its two files (not its other statistics)
            parts = [digest(path / SAE_CONFIG), digest(path / SAE_WEIGHTS)]
        else:  # a `datasets` directory: every file in it, by name
            names = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())
            parts = [f"{n}:{d}" if (d := digest(path / n)) else None for n in names] or [None]
        return None if None in parts else hashlib.sha256(" ".join(parts).encode()).hexdigest()
    try:
        st = path.stat()
    except OSError:
        return None
    return _sha256_of(str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4096)
def _sha256_of(path: str, ino: int, size: int, mtime_ns: int) -> Optional[str]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()
