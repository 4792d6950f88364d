"""task=export: a run's edits written as a file another tool loads, with no engine.

llama.cpp adds one direction to the output of each decoder layer it steers, to every token, prompt and generated
alike. That is steer's `add` edit with `edit.tokens=both` at a `tap.layer`; each layer's file direction is the sum of
scale x vector over the run's add edits there, so `--control-vector FILE` (strength 1) steers as the run does.
"""

import json
from dataclasses import replace
from pathlib import Path
from typing import Dict

import torch
from rich.console import Console
from rich.markup import escape

from steer import report, results
from steer.config import checks
from steer.config.schema import SteerConf, Task
from steer.edits import formats, vector
from steer.edits.plan import Plan, build, spec_layer
from steer.errors import ConfigError
from steer.models.spec import ModelSpec
from steer.runs import inputs
from steer.runs.job import Job
from steer.tasks.base import TaskDef


def check(cfg: SteerConf, engine: str) -> None:
    checks.run(cfg, engine)
    checks.export(cfg)


def prepare(job: Job) -> Job:
    """Its plan, and the file it writes checked now: nothing is written on a bad one."""
    vectors = inputs.vectors(job.cfg)
    plan = build(job.cfg, job.spec)
    directions(plan, job.spec, job.cfg.export.format)
    return replace(job, vectors=vectors, plan=plan)


def run(job: Job, console: Console, engine=None) -> Dict:
    """The run's edits written as export.format (no engine: `engine` is not used)."""
    out = out_path(job.cfg, job.out_dir)
    result = write(job.cfg, job.plan, job.spec, out)
    results.write_json(job.out_dir / "metrics.json", result)
    report.write_quietly(job.out_dir)
    console.print(f"wrote [bold]{escape(str(out))}[/] ({result['format']}, layers {result['layers']})")
    return result


def out_path(cfg: SteerConf, out_dir: Path) -> Path:
    fmt = cfg.export.format
    return Path(cfg.export.out).expanduser() if cfg.export.out else Path(out_dir) / f"vector.{fmt}"


def directions(plan: Plan, spec: ModelSpec, fmt: str) -> Dict[int, torch.Tensor]:
    """Each decoder layer's added vector: the sum of scale x direction over the plan's edits there."""
    out: Dict[int, torch.Tensor] = {}
    for path, edits in plan.edits.items():
        tap = plan.taps[path]
        layer = spec_layer(tap, spec)
        if layer is None:
            raise ConfigError("tap.path", f"{tap.name} is no decoder layer's output; a control vector steers the "
                                          "output of decoder layers (tap.layer=k)")
        for e in edits:
            if e.basis.shape[0] != 1:
                raise ConfigError("edit.vector", f"holds {e.basis.shape[0]} directions at {tap.name}; a control "
                                                 "vector holds one per layer")
            v = e.strength * e.basis[0]
            out[layer] = out[layer] + v if layer in out else v
    if fmt == "gguf" and 0 in out:
        raise ConfigError("export.format", "gguf: llama.cpp refuses a direction at decoder layer 0; steer from "
                                           "layer 1 on, or export.format=safetensors")
    return dict(sorted(out.items()))


def model_hint(spec: ModelSpec) -> str:
    """What repeng writes as the model hint (the transformers model_type), else steer's model name."""
    config = Path(spec.source).expanduser() / "config.json"
    try:
        return str(json.loads(config.read_text()).get("model_type") or spec.name)
    except (OSError, ValueError):
        return spec.name


def write(cfg: SteerConf, plan: Plan, spec: ModelSpec, out: Path) -> Dict:
    found = directions(plan, spec, cfg.export.format)
    if cfg.export.format == "gguf":
        formats.write_gguf(out, found, model_hint(spec))
    else:
        vector.save_layers(out, found, model=spec.name, tap=",".join(f"layer{k}" for k in found),
                                 method="export")
    return {"vector": str(out), "format": cfg.export.format, "layers": list(found)}


TASK = TaskDef(Task.export, check, prepare, run)
