"""A job: one run's config validated once, before any weights load, with what running it needs (the model's
spec, the engine it resolves to, the taps it touches, its edits compiled from their files). Jobs that can share
an engine (`engine_key`) run together on one engine, held for the group and closed after it (`engine_for`).
"""

import copy
import hashlib
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from steer import engine as engines
from steer.errors import ConfigError
from steer.runs import inputs
from steer.models import prompt
from steer.models import tiny
from steer.config import checks
from steer.runs import data, evaluate, grid
from steer.runs.extract import Recipe
from steer.models.spec import ModelSpec, spec as model_spec
from steer.edits import vector
from steer.edits.plan import Plan, build, entries, when_vector
from steer.config.schema import NOT_RESULTS, ExtractPosition, ExtractSpan, SteerConf, TapConf, Task
from steer.edits.tap import Tap, resolve


@dataclass
class Job:
    """A validated job. `cfg`: its settings resolved (prompts and pairs read from the files they name, "auto"
    extraction settings as `recipe` resolves them), a copy: the config it was prepared from stays as composed.
    `plan` holds the edits with vectors from files (a default direction is filled in once an engine can extract
    it); `taps` every tap the job touches, in config order."""

    cfg: SteerConf
    spec: ModelSpec
    out_dir: Path
    engine: str  # the engine `cfg.engine` resolves to
    recipe: Recipe  # how its default directions are extracted (extract.* and prompts.chat, resolved once)
    taps: List[Tap] = field(default_factory=list)
    plan: Optional[Plan] = None  # task=steer
    cells: List["Job"] = field(default_factory=list)  # task=select: a steer job per (layer, scale) of the grid
    items: Optional[tuple] = None  # task=eval: (A/B items to extract from, items to score) (steer/runs/evaluate.py)
    result: Optional[Dict] = None  # what it wrote once it ran, or {"error": message}
    vectors: Dict[str, Optional[str]] = field(default_factory=dict)  # its vector files' sha256, taken before loading
    data: Dict[str, Optional[str]] = field(default_factory=dict)  # its data files' sha256, taken before reading
    model_files: Optional[Dict] = None  # its model's files (inputs.model), taken as its engine starts
    probe: Optional[object] = None  # a task=select pair's: the Probe that reads its concept (steer/runs/probe.py)
    error: Optional[BaseException] = None

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


def prepare(cfg: SteerConf, out_dir: Path) -> Job:
    """The job, ready to run: its config checked (steer.config.checks) with everything that needs no weights, then
    its plan built (vectors loaded and checked against the model). `cfg` itself is left as it is: the job resolves a
    copy of it."""
    data_files = inputs.data(inputs.data_paths(cfg))  # first: a file rewritten while it loads then reads as changed
    cfg = copy.deepcopy(cfg)
    caa = data.fill_prompts(cfg.prompts)  # prompts and pairs from files replace the lists they stand for
    engine = engines.resolve(cfg.engine)
    checks.run(cfg, engine)
    # checked before the model's files are read; "auto" is resolved below, once the chat rendering is known
    checks.extraction(cfg.extract.method, cfg.prompts.positive, cfg.prompts.negative)
    if cfg.task != Task.extract:
        for prefix, _, e in entries(cfg):
            if e.vector.path is not None:
                vector.require(e.vector.path, f"{prefix}edit.vector")
            if e.when.vector is not None and e.when.layer is not None and not Path(e.when.vector).expanduser().exists():
                raise ConfigError(f"{prefix}edit.when.vector", f"vector file {e.when.vector!r} does not exist")
    spec = model_spec(cfg.model, cfg.cache_dir)
    limit = cfg.vllm.max_model_len if engine == "vllm" and cfg.vllm.max_model_len else spec.positions
    checks.room_for_a_prompt("gen.max_new_tokens", cfg.gen.max_new_tokens, limit, spec.name)
    prompt.check(cfg.prompts.chat, spec.chat_template)
    # task=eval renders its pairs itself and reads them raw, so only a pairs file's are in a chat rendering
    templated = cfg.task != Task.eval and prompt.renders_chat(cfg.prompts.chat, spec.chat_template)
    recipe = Recipe.from_conf(cfg.extract, cfg.prompts.chat, data.reads_ab(cfg.task, caa), templated)
    # "auto" resolved once for the job
    cfg.extract.position, cfg.extract.span = ExtractPosition(recipe.position), ExtractSpan(recipe.span)
    if cfg.task == Task.select:
        checks.select_grid(cfg, spec.layers)
    if cfg.task == Task.condition:
        checks.condition_task(cfg, spec.layers)
    job = Job(cfg, spec, Path(out_dir), engine, recipe, data=data_files)
    if cfg.task == Task.eval:
        job.items = evaluate.load(cfg)
        job.vectors = inputs.vectors(cfg)
        job.plan = build(cfg, spec)
        job.taps = list(job.plan.taps.values())
    elif cfg.task == Task.steer:
        job.vectors = inputs.vectors(cfg)  # first: a file rewritten while it loads then reads as changed on resume
        job.plan = build(cfg, spec)
        job.taps = list({**job.plan.taps, **job.plan.condition_taps}.values())
    elif cfg.task == Task.select:
        from steer.runs import probe

        known = probe.tap(cfg, spec)  # a probe file or layer, checked now; else the grid's layers choose it
        for cell in grid.cells(cfg):
            digests = inputs.vectors(cell)
            plan = build(cell, spec)
            taps = list(plan.taps.values()) + ([known] if known and known.path not in plan.taps else [])
            job.cells.append(Job(cell, spec, job.out_dir / grid.cell_name(cell), engine, recipe,
                                 taps, plan, vectors=digests, data=data_files))
    elif cfg.task == Task.condition:
        job.taps = [resolve(TapConf(layer=k), spec, "condition.layers") for k in cfg.condition.layers]
        if cfg.edit.when.vector is not None:
            for k in cfg.condition.layers:  # a file read now: a missing layer is said before the engine starts
                when_vector(cfg.edit.when.vector, cfg.edit.when.key, spec.hidden, "edit.when", k)
    elif cfg.task == Task.export:
        from steer.runs import export

        job.vectors = inputs.vectors(cfg)
        job.plan = build(cfg, spec)
        export.directions(job.plan, spec, cfg.export.format)  # checked now: nothing is written on a bad one
    else:
        if cfg.extract.layers:
            checks.extract_layers(cfg, spec.layers)
            job.taps = [resolve(TapConf(layer=k), spec, "extract.layers") for k in cfg.extract.layers]
        else:
            job.taps = [resolve(cfg.tap, spec)]
        if cfg.task == Task.extract and gguf_out(cfg):
            for tap in job.taps:
                gguf_layer(tap, spec)
    return job


def gguf_out(cfg: SteerConf) -> bool:
    """An extraction written as a llama.cpp control vector (extract.out ending in .gguf)."""
    return bool(cfg.extract.out) and cfg.extract.out.lower().endswith(".gguf")


def gguf_layer(tap: Tap, spec: ModelSpec) -> int:
    """The decoder layer a control vector names `tap` by (its output, layer >= 1), or a ConfigError."""
    from steer.edits.plan import spec_layer

    layer = spec_layer(tap, spec)
    if layer is None or layer == 0:
        raise ConfigError("extract.out", f"ends in .gguf, a llama.cpp control vector, which steers the output of "
                                         f"decoder layers 1..{spec.layers - 1}; the tap is {tap.name} (set "
                                         "tap.layer=k, k >= 1, or write .safetensors)")
    return layer


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
        for job in jobs:
            job.model_files = files
        yield engine


def _weights_bar(on: bool) -> None:
    """transformers' own bar as the weights load ("Loading weights: 100%"), on or off with `progress`."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar() if on else hf_logging.disable_progress_bar()
