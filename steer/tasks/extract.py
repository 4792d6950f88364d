"""task=extract: the default direction at the config's tap (or at each of extract.layers, read in one pass) from
prompts.positive and prompts.negative (steer/runs/extract.py), written to extract.out or the run directory with its
diagnostics. An out ending in .gguf is a llama.cpp control vector. The packed launcher runs a sweep's extractions
with the other jobs that share their engine."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from rich.console import Console
from rich.markup import escape

from steer import report, results
from steer.config import checks
from steer.config.schema import SteerConf, TapConf, Task
from steer.edits import formats
from steer.edits.plan import spec_layer
from steer.edits.tap import Tap, resolve
from steer.errors import ConfigError
from steer.models.spec import ModelSpec
from steer.runs import diagnostics, inputs, run as runner
from steer.runs.extract import extract, write, write_layers
from steer.runs.job import Job, model_files
from steer.runs.run import Outcome
from steer.tasks import export
from steer.tasks.base import TaskDef


def check(cfg: SteerConf, engine: str) -> None:
    checks.run(cfg, engine)
    if cfg.extract.out:
        checks.writable("extract.out", Path(cfg.extract.out).expanduser())


def prepare(job: Job) -> Job:
    """Its taps: extract.layers' (checked against the model), else the config's tap; each a control vector can name
    where extract.out is one."""
    cfg, spec = job.cfg, job.spec
    if cfg.extract.layers:
        checks.extract_layers(cfg, spec.layers)
        taps = tuple(resolve(TapConf(layer=k), spec, "extract.layers") for k in cfg.extract.layers)
    else:
        taps = (resolve(cfg.tap, spec),)
    if gguf_out(cfg):
        for tap in taps:
            gguf_layer(tap, spec)
    return replace(job, taps=taps)


def run(job: Job, console: Console, engine=None) -> Dict:
    if engine is None:
        from steer.runs.job import engine_for

        with engine_for([job]) as engine:
            return run(job, console, engine)
    return run_pack([job], console, engine)[0].value()


def run_pack(jobs: Sequence[Job], console: Console, engine, on_done=None, summary: Optional[bool] = None,
             say: Optional[bool] = None) -> List[Outcome]:
    """Each extraction in turn on the pack's engine (`summary` aside: an extraction always prints its table); one
    that fails gets error.txt and the others go on."""
    say = len(jobs) > 1 if say is None else say
    runner.started(jobs, engine)
    out = []
    for job in jobs:
        try:
            result = _extract(job, engine, console)
            _record(job, engine, result)
            if on_done:
                on_done(job)
        except Exception as e:
            out.append(runner.fail(job, e, console, say))
            continue
        out.append(Outcome(result))
    for job in jobs:  # a sweep of thousands of jobs in one process must not hold a file open for each
        runner.close_log(job.out_dir)
    return out


def gguf_out(cfg: SteerConf) -> bool:
    """An extraction written as a llama.cpp control vector (extract.out ending in .gguf)."""
    return bool(cfg.extract.out) and cfg.extract.out.lower().endswith(".gguf")


def gguf_layer(tap: Tap, spec: ModelSpec) -> int:
    """The decoder layer a control vector names `tap` by (its output, layer >= 1), or a ConfigError."""
    layer = spec_layer(tap, spec)
    if layer is None or layer == 0:
        raise ConfigError("extract.out", f"ends in .gguf, a llama.cpp control vector, which steers the output of "
                                         f"decoder layers 1..{spec.layers - 1}; the tap is {tap.name} (set "
                                         "tap.layer=k, k >= 1, or write .safetensors)")
    return layer


def _extract(job: Job, engine, console: Console) -> Dict:
    """The direction(s) written, the diagnostics printed and in the file's metadata; what it wrote where."""
    cfg = job.cfg
    out = Path(cfg.extract.out).expanduser() if cfg.extract.out else job.out_dir / "vector.safetensors"
    pos, neg, recipe = list(cfg.prompts.positive), list(cfg.prompts.negative), job.recipe
    found = extract(engine, job.taps, pos, neg, recipe, cfg.extract.folds)
    diags = [ex.diagnostics for ex in found]
    chosen = diagnostics.best(diags)
    console.print(diagnostics.table([ex.tap.name for ex in found], diags, chosen))
    if gguf_out(cfg):
        dirs = {gguf_layer(ex.tap, job.spec): ex.direction for ex in found}
        formats.write_gguf(out, dirs, export.model_hint(job.spec))
        keys = ",".join(f"direction.{k}" for k in dirs)
        console.print(f"wrote [bold]{escape(str(out))}[/] ({keys})")
        return {"vector": str(out), "keys": keys, "taps": [ex.tap.name for ex in found],
                **{f"diag.{k}.{name}": v for k, ex in zip(dirs, found) for name, v in ex.diagnostics.items()}}
    if cfg.extract.layers:
        layers = [int(k) for k in cfg.extract.layers]
        result = {"vector": str(out), **{f"diag.{k}.{name}": v for k, d in zip(layers, diags) for name, v in d.items()}}
        write_layers(out, engine, layers, found, pos, neg, recipe)
        best = None if chosen is None else layers[chosen]
        if best is not None:
            console.print(f"best separation: layer {best} (held-out AUC {diags[chosen]['heldout_auc']:.3g})")
        console.print(f"wrote [bold]{escape(str(out))}[/] (keys direction.<k> for layers "
                      f"{','.join(map(str, layers))})")
        runner.job_log(job).info("extracted layers %s, best separation %s: %s", layers, best, json.dumps(result))
        return {**result, "layers": layers, "best_layer": best}
    result = {"vector": str(out), **{f"diag.{name}": v for name, v in diags[0].items()}}
    write(out, cfg.extract.key, engine, found[0], pos, neg, recipe)
    console.print(f"wrote [bold]{escape(str(out))}[/] (key {cfg.extract.key!r}, tap {found[0].tap.name})")
    runner.job_log(job).info("extracted at %s: %s", found[0].tap.name, json.dumps(result))
    return {**result, "key": cfg.extract.key, "tap": found[0].tap.name}


def _record(job: Job, engine, result: Dict) -> None:
    """An extraction's record, as a steer job's: inputs.json (the model's files, its pairs' data files, and the vector
    it wrote: a sweep resumed after that file was changed or removed extracts it again), then metrics.json (where it
    wrote what), whose presence marks the job complete."""
    out = result["vector"]
    inputs.write(job.out_dir, {out: inputs.digest(out)}, model_files(job, engine), job.data, job.settings)
    results.write_json(job.out_dir / "metrics.json", result)
    report.write_quietly(job.out_dir)


TASK = TaskDef(Task.extract, check, prepare, run, run_pack=run_pack, edits=False, writes="extract.out")
