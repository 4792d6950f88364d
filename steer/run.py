"""One run: check the config, start the engine, generate baseline and steered continuations, write results.

Everything a user can get wrong is checked in `prepare`, before any weights load; result files are written
atomically at the end, so a run that fails leaves no results.jsonl behind.
"""

import time
from functools import lru_cache
from pathlib import Path
from typing import Dict, List

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from steer import engine as engines
from steer import metrics, results, tiny
from steer.errors import ConfigError
from steer.extract import cached_default, extract_to
from steer.model import ModelSpec, spec as model_spec
from steer.plan import Plan, build
from steer.schema import SteerConf, Task
from steer.tap import resolve


def prepare(cfg: SteerConf) -> ModelSpec:
    """Validate everything that can be checked without weights; return the model's spec."""
    engines.check(cfg.engine)
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
    spec = model_spec(cfg.model, cfg.cache_dir)
    if cfg.task == Task.steer:
        build(cfg, spec)
    else:
        resolve(cfg.tap, spec)
    return spec


@lru_cache(maxsize=1)
def _engine(name: str, spec: ModelSpec, device: str):
    # A multirun's jobs share one process: keep the last engine rather than reload it for every job.
    return engines.make(name, spec, device)


def start_engine(cfg: SteerConf, spec: ModelSpec):
    if cfg.model.source == "tiny":
        tiny.ensure_tiny(cfg.cache_dir, cfg.model.tiny)
    return _engine(cfg.engine, spec, cfg.device)


def main(cfg: SteerConf, out_dir: Path, console: Console) -> Dict:
    """Run the configured task into `out_dir`; return what it wrote as a dict (metrics, or the vector path)."""
    spec = prepare(cfg)
    if cfg.task == Task.extract:
        return extract(cfg, spec, out_dir, console)
    return steer(cfg, spec, out_dir, console)


def extract(cfg: SteerConf, spec: ModelSpec, out_dir: Path, console: Console) -> Dict:
    engine = start_engine(cfg, spec)
    tap = resolve(cfg.tap, spec)
    out = Path(cfg.extract.out).expanduser() if cfg.extract.out else out_dir / "vector.safetensors"
    extract_to(out, cfg.extract.key, engine, tap, list(cfg.prompts.positive), list(cfg.prompts.negative),
               cfg.extract.position, cfg.extract.normalize)
    console.print(f"wrote [bold]{out}[/] (key {cfg.extract.key!r}, tap {tap.name})")
    return {"vector": str(out), "key": cfg.extract.key, "tap": tap.name}


def steer(cfg: SteerConf, spec: ModelSpec, out_dir: Path, console: Console) -> Dict:
    engine = start_engine(cfg, spec)
    pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
    plan = build(cfg, spec, default_vector=lambda tap: cached_default(cfg.cache_dir, engine, tap, pos, neg))
    active = plan.active()
    prompts = list(cfg.prompts.steer)
    encoded = [engine.encode(p) for p in prompts]

    conts: List[tuple] = []
    n_tokens, t0 = 0, time.perf_counter()
    with _progress(console, cfg.progress) as progress:
        task = progress.add_task(f"generating ({engine.name})", total=len(prompts))
        for i, ids in enumerate(encoded):
            seed = cfg.gen.seed + i
            base = engine.generate(ids, None, cfg.gen, seed)
            st = engine.generate(ids, active if active.edits else None, cfg.gen, seed)
            conts.append((base, st))
            n_tokens += len(base) + len(st)
            progress.advance(task)
    elapsed = time.perf_counter() - t0

    rows = [_row(engine, plan, active, p, ids, b, s) for p, ids, (b, s) in zip(prompts, encoded, conts)]
    agg = metrics.aggregate(rows, n_tokens / elapsed if elapsed > 0 else 0.0)
    results.write_jsonl(out_dir / "results.jsonl", rows)
    results.write_json(out_dir / "metrics.json", agg)
    _summary(console, cfg, plan, agg, out_dir)
    return agg


def _row(engine, plan: Plan, active: Plan, prompt: str, ids: List[int], base: List[int], st: List[int]) -> Dict:
    """Score the steered continuation with and without the edits: KL, changed tokens, projections."""
    tap, edit = plan.primary
    cap = (tap.path,)
    base_logits, base_cap = engine.score(ids, st, None, cap)
    st_logits, st_cap = engine.score(ids, st, active if active.edits else None, cap)
    # Logits at row t predict token t+1: the rows that predicted the steered continuation.
    span = slice(len(ids) - 1, len(ids) - 1 + max(len(st), 1))
    is_prompt = torch.tensor([True] * len(ids) + [False] * len(st))
    w = edit.row_weight(is_prompt)
    selected = is_prompt | ~is_prompt if w is None else w.bool()
    basis = edit.direction()
    proj = (lambda h: metrics.projection(h, basis, selected)) if basis is not None else (lambda h: None)
    return {
        "prompt": prompt,
        "baseline": engine.decode(base),
        "steered": engine.decode(st),
        "baseline_tokens": len(base),
        "steered_tokens": len(st),
        "tokens_changed": metrics.tokens_changed(base, st),
        "kl": metrics.kl_mean(st_logits[span], base_logits[span]),
        "proj_baseline": proj(base_cap[tap.path]),
        "proj_steered": proj(st_cap[tap.path]),
    }


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not enabled, transient=False)


def _summary(console: Console, cfg: SteerConf, plan: Plan, agg: Dict, out_dir: Path) -> None:
    tap, edit = plan.primary
    t = Table(title=f"{cfg.model.name} | {tap.name} | {edit.kind.value} scale={edit.scale:g}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in agg.items():
        t.add_row(k, "-" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v))
    console.print(t)
    console.print(f"results in [bold]{out_dir}[/]")
