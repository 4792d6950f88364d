"""A job: one run's config validated once, before any weights load, with what running it needs (the model's
spec, the engine it resolves to, the taps it touches, its edits compiled from their files): steer.tasks.registry
prepares it, each task its own part. Jobs that can share an engine (`engine_key`) run together on one engine, held
for the group and closed after it (`engine_for`).
"""

import hashlib
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from steer import engine as engines
from steer.runs import inputs
from steer.models import tiny
from steer.runs.extract import Recipe
from steer.models.spec import ModelSpec
from steer.edits.plan import Plan
from steer.config.schema import NOT_RESULTS, SteerConf
from steer.edits.tap import Tap


class ReadOnly(dict):
    """A dict that refuses changes: what a job recorded as prepare took it."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a prepared job's mapping is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self):  # pickled (a spawned engine group's jobs) and copied whole, not key by key
        return type(self), (dict(self),)


@dataclass(frozen=True)
class Job:
    """A validated job, read-only once prepared: later steps read it and none rewrites it (a select's pairs take
    their probe as new jobs, dataclasses.replace). `cfg`: its settings resolved (prompts and pairs read from the files
    they name, "auto" extraction settings as `recipe` resolves them), a copy: the config it was prepared from stays
    as composed. `plan` holds the edits with vectors from files (a default direction is filled in once an engine can
    extract it); `taps` every tap the job touches, in config order. What running it gives is not part of it
    (steer.runs.run.Outcome)."""

    cfg: SteerConf
    spec: ModelSpec
    out_dir: Path
    engine: str  # the engine `cfg.engine` resolves to
    recipe: Recipe  # how its default directions are extracted (extract.* and prompts.chat, resolved once)
    taps: Tuple[Tap, ...] = ()
    plan: Optional[Plan] = None  # task=steer's edits (and task=eval's, task=export's)
    cells: Tuple["Job", ...] = ()  # task=select: a steer job per (layer, scale) of the grid
    items: Optional[tuple] = None  # task=eval: (A/B items to extract from, items to score) (steer/tasks/evaluate.py)
    vectors: Mapping[str, Optional[str]] = field(default_factory=ReadOnly)  # its vector files' sha256, before loading
    data: Mapping[str, Optional[str]] = field(default_factory=ReadOnly)  # its data files' sha256, before reading
    probe: Optional[object] = None  # a task=select pair's: the Probe that reads its concept (steer/runs/probe.py)

    def __post_init__(self):
        # sequences as tuples and digests read-only, whatever the caller built them as
        for name in ("taps", "cells"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("vectors", "data"):
            object.__setattr__(self, name, ReadOnly(getattr(self, name)))

    @property
    def settings(self) -> str:
        """A digest of what the job computes from, resolved: its prepared config (prompts as its files held them,
        "auto" as resolved) and the engine it runs on, less the settings that change how it runs and not what it
        computes (NOT_RESULTS). A resume takes a finished job with the same digest as done (inputs.json)."""
        out = asdict(self.cfg)
        for key in NOT_RESULTS:
            out.pop(key, None)
        out["engine"] = self.engine
        return hashlib.sha256(json.dumps(out, sort_keys=True, default=str).encode()).hexdigest()


ENGINE_FIELDS = "model, engine, device, vllm.* and hf.*"  # what engine_settings holds, as a message names it


def engine_settings(cfg: SteerConf, engine: str) -> Dict[str, object]:
    """What chooses and sets up the engine `cfg` runs on (`engine`: the one `cfg.engine` resolves to), as plain data
    by config key: configs equal in it can share one engine."""
    return {"model": asdict(cfg.model), "engine": engine, "device": cfg.device, "vllm": asdict(cfg.vllm),
            "hf": asdict(cfg.hf)}


def engine_changes(a: Dict[str, object], b: Dict[str, object], prefix: str = "") -> List[str]:
    """The dotted keys whose values differ between two engine_settings."""
    out = []
    for key in a:
        if isinstance(a[key], dict) and isinstance(b.get(key), dict):
            out += engine_changes(a[key], b[key], f"{prefix}{key}.")
        elif a[key] != b.get(key):
            out.append(f"{prefix}{key}")
    return out


def engine_key(job: Job) -> str:
    """Jobs with the same key share one engine (the same engine_settings)."""
    return json.dumps(engine_settings(job.cfg, job.engine), sort_keys=True)


@contextmanager
def engine_for(jobs: Sequence[Job]) -> Iterator[object]:
    """One engine for jobs of one `engine_key`, with every tap they touch fixed at its start (an engine that
    records graphs needs them up front; the HF engine serves any tap it is given); closed on exit."""
    first = jobs[0]
    if first.cfg.model.source == "tiny":
        tiny.ensure_tiny(first.cfg.cache_dir, first.cfg.model.tiny)
    taps = {t.path: t for job in jobs for t in job.taps} if first.engine == "vllm" else {}
    # A local model's files before they load: a checkpoint saved in place while the jobs run then reads as changed
    # on resume, as it should (taken after, the jobs' record would name weights they never saw). A hub model's once
    # the engine holds it: the start may fetch them into a snapshot that validation left with its config alone.
    files = inputs.model(first.cfg, first.spec)
    _weights_bar(first.cfg.progress)
    with engines.make(first.engine, first.spec, first.cfg.device, first.cfg.vllm, list(taps.values()),
                      first.cfg.hf) as engine:
        if files.get("kind") == "hub":
            files = inputs.model(first.cfg, first.spec)
        _FOUND[id(engine)] = files
        try:
            yield engine
        finally:
            _FOUND.pop(id(engine), None)


_FOUND: Dict[int, Dict] = {}  # each engine engine_for holds open, by id: its model's files as found at its start


def model_files(job: Job, engine) -> Dict:
    """The model's files (inputs.model) as `engine` found them at its start (engine_for), else as they are now (an
    engine a caller made itself): what the job's inputs.json records."""
    found = _FOUND.get(id(engine))
    return found if found is not None else inputs.model(job.cfg, job.spec)


def _weights_bar(on: bool) -> None:
    """transformers' own bar as the weights load ("Loading weights: 100%"), on or off with `progress`."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar() if on else hf_logging.disable_progress_bar()
