"""A job: one run's config validated once, before any weights load, with what running it needs (the model's
spec, the engine it resolves to, the taps it touches, its edits compiled from their files). Jobs that can share
an engine (`engine_key`) run together on one engine, held for the group and closed after it (`engine_for`).
"""

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from steer import engine as engines
from steer.runs import inputs
from steer.models import prompt
from steer.models import tiny
from steer.errors import ConfigError
from steer.runs.extract import Recipe
from steer.models.spec import ModelSpec, spec as model_spec
from steer.edits.plan import Plan, build
from steer.config.schema import SteerConf, Task
from steer.edits.tap import Tap, resolve


@dataclass
class Job:
    """A validated job. `plan` holds the edits with vectors from files (a default direction is filled in once an
    engine can extract it); `taps` every tap the job touches, in config order."""

    cfg: SteerConf
    spec: ModelSpec
    out_dir: Path
    engine: str  # the engine `cfg.engine` resolves to
    taps: List[Tap] = field(default_factory=list)
    plan: Optional[Plan] = None  # task=steer
    cells: List["Job"] = field(default_factory=list)  # task=select: a steer job per (layer, scale) of the grid
    result: Optional[Dict] = None  # what it wrote once it ran, or {"error": message}
    vectors: Dict[str, Optional[str]] = field(default_factory=dict)  # its vector files' sha256, taken before loading
    model_files: Optional[Dict] = None  # its model's files (inputs.model), taken as its engine starts
    error: Optional[BaseException] = None


def validate(cfg: SteerConf, out_dir: Path) -> Job:
    """Check everything that can be checked without weights; the job, ready to run."""
    engine = engines.resolve(cfg.engine)
    _check_engine(cfg, engine)
    engines.check_device(cfg.device)
    _check_gen_and_prompts(cfg)
    spec = model_spec(cfg.model, cfg.cache_dir)
    _check_positions(cfg, spec, engine)
    prompt.check(cfg.prompts.chat, spec.chat_template)
    job = Job(cfg, spec, Path(out_dir), engine)
    if cfg.task == Task.steer:
        job.vectors = inputs.vectors(cfg)  # first: a file rewritten while it loads then reads as changed on resume
        job.plan = build(cfg, spec)
        job.taps = list(job.plan.taps.values())
    elif cfg.task == Task.select:
        from steer.runs import select

        for cell in select.grid(cfg, spec.layers):
            digests = inputs.vectors(cell)
            plan = build(cell, spec)
            job.cells.append(Job(cell, spec, job.out_dir / select.cell_name(cell), engine,
                                 list(plan.taps.values()), plan, vectors=digests))
    else:
        job.taps = [resolve(cfg.tap, spec)]
        if cfg.extract.out:
            _check_writable(Path(cfg.extract.out).expanduser(), "extract.out")
    return job


def _check_writable(path: Path, field: str) -> None:
    """Said before the engine, not once the extraction is done: `path` must name a file a run can write."""
    if path.is_dir():
        raise ConfigError(field, f"{str(path)!r} is a directory; name the file to write in it, e.g. "
                                 f"{str(path / 'vector.safetensors')!r}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # made on write
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(field, f"{str(path)!r} cannot be written: {str(parent)!r} is not a directory this "
                                 "process may write in")


def _needs_vllm(engine: str, field: str, what: str) -> None:
    if engine != "vllm":
        raise ConfigError(field, f"{what} needs engine=vllm (this run resolves to engine={engine})")


def _check_engine(cfg: SteerConf, engine: str) -> None:
    tp = cfg.vllm.tensor_parallel_size
    if tp < 1:
        raise ConfigError("vllm.tensor_parallel_size", f"must be at least 1, got {tp}")
    if tp > 1:
        import torch

        _needs_vllm(engine, "vllm.tensor_parallel_size", f"{tp} GPUs per engine")
        if torch.cuda.device_count() < tp:
            raise ConfigError("vllm.tensor_parallel_size", f"{tp} GPUs per engine, but this machine has "
                                                           f"{torch.cuda.device_count()}")
    if cfg.vllm.fold_norm:
        raise ConfigError("vllm.fold_norm", "folds edits captured into the graph (vllm.edits_in_graph), a mode a steer "
                                            "run cannot use (it scores with the tap's values); it is for the bench "
                                            "and the API")
    if cfg.vllm.in_graph_field():
        raise ConfigError(f"vllm.{cfg.vllm.in_graph_field()}",
                          "a steer run scores with the tap's values (projection metrics), which an engine with its "
                          "edits in the graph cannot keep; the mode is for the bench and the API "
                          "(VLLMEngine(..., declare=plans))")
    kv = cfg.vllm.kv_cache_memory_bytes
    if kv is not None and kv < 1:
        raise ConfigError("vllm.kv_cache_memory_bytes", f"must be a positive number of bytes or null, got {kv}")
    if cfg.vllm.tap_graphs:
        _needs_vllm(engine, "vllm.tap_graphs", "replaying CUDA graphs at vLLM's taps")


def _check_gen_and_prompts(cfg: SteerConf) -> None:
    g = cfg.gen
    if g.max_new_tokens < 1:
        raise ConfigError("gen.max_new_tokens", f"must be at least 1, got {g.max_new_tokens}")
    if g.temperature < 0:
        raise ConfigError("gen.temperature", f"must be >= 0 (0 is greedy), got {g.temperature}")
    if not 0 < g.top_p <= 1:
        raise ConfigError("gen.top_p", f"must be in (0, 1], got {g.top_p}")
    for name in ("steer", "positive", "negative"):
        if not list(getattr(cfg.prompts, name)):
            raise ConfigError(f"prompts.{name}", "is empty; give at least one prompt")
    prompt.check_texts(cfg.prompts)
    Recipe.from_conf(cfg.extract, cfg.prompts.chat).check(cfg.prompts.positive, cfg.prompts.negative)


def _check_positions(cfg: SteerConf, spec: ModelSpec, engine: str) -> None:
    """The continuation must leave room for a prompt in the model's positions (vLLM's max_model_len where set):
    said here, not once the weights have loaded (run._fit checks each prompt against the engine's own limit)."""
    limit = cfg.vllm.max_model_len if engine == "vllm" and cfg.vllm.max_model_len else spec.positions
    new = cfg.gen.max_new_tokens
    if limit is not None and new >= limit:
        raise ConfigError("gen.max_new_tokens", f"{new} new tokens leave no room for a prompt: {spec.name} has "
                                                f"{limit} positions")


def engine_key(job: Job) -> str:
    """Jobs with the same key can share one engine (same model, engine and engine settings)."""
    c = job.cfg
    return json.dumps([asdict(c.model), job.engine, c.device, asdict(c.vllm)], sort_keys=True)


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
    with engines.make(first.engine, first.spec, first.cfg.device, first.cfg.vllm, list(taps.values())) as engine:
        if files.get("kind") == "hub":
            files = inputs.model(first.cfg, first.spec)
        for job in jobs:
            job.model_files = files
        yield engine


def _weights_bar(on: bool) -> None:
    """transformers' own bar as the weights load ("Loading weights: 100%"), on or off with `progress`."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar() if on else hf_logging.disable_progress_bar()
