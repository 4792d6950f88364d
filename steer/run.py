"""One run: check the config, start the engine, generate baseline and steered continuations, write results.

Everything a user can get wrong is checked in `prepare`, before any weights load; result files are written
atomically at the end, so a run that fails leaves no results.jsonl behind.
"""

import time
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from steer import engine as engines
from steer import metrics, results, tiny
from steer.errors import ConfigError
from steer.extract import cached_default, extract_to
from steer.model import ModelSpec, spec as model_spec
from steer.plan import Plan, build, entries
from steer.schema import SteerConf, Task
from steer.tap import resolve


def prepare(cfg: SteerConf) -> ModelSpec:
    """Validate everything that can be checked without weights; return the model's spec."""
    engines.resolve(cfg.engine)
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
def _engine(name: str, spec: ModelSpec, device: str, vllm_conf: str, taps: tuple):
    # A multirun's jobs share one process: keep the last engine rather than reload it for every job.
    from omegaconf import OmegaConf

    from steer.schema import VllmConf

    conf = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(VllmConf), OmegaConf.create(vllm_conf)))
    return engines.make(name, spec, device, conf, taps)


def start_engine(cfg: SteerConf, spec: ModelSpec, taps=()):
    """Build the tiny model if needed and start (or reuse) the engine with these taps fixed."""
    import json
    from dataclasses import asdict

    if cfg.model.source == "tiny":
        tiny.ensure_tiny(cfg.cache_dir, cfg.model.tiny)
    return _engine(engines.resolve(cfg.engine), spec, cfg.device, json.dumps(asdict(cfg.vllm)), tuple(taps))


def run_taps(cfg: SteerConf, spec: ModelSpec):
    """Every tap a run touches, in config order (an engine that records graphs needs them up front)."""
    out = {}
    for prefix, tap_conf, _ in entries(cfg):
        tap = resolve(tap_conf, spec, f"{prefix}tap")
        out.setdefault(tap.path, tap)
    return list(out.values())


def main(cfg: SteerConf, out_dir: Path, console: Console) -> Dict:
    """Run the configured task into `out_dir`; return what it wrote as a dict (metrics, or the vector path)."""
    spec = prepare(cfg)
    if cfg.task == Task.extract:
        return extract(cfg, spec, out_dir, console)
    return steer(cfg, spec, out_dir, console)


def extract(cfg: SteerConf, spec: ModelSpec, out_dir: Path, console: Console) -> Dict:
    tap = resolve(cfg.tap, spec)
    engine = start_engine(cfg, spec, [tap])
    out = Path(cfg.extract.out).expanduser() if cfg.extract.out else out_dir / "vector.safetensors"
    extract_to(out, cfg.extract.key, engine, tap, list(cfg.prompts.positive), list(cfg.prompts.negative),
               cfg.extract.position, cfg.extract.normalize)
    console.print(f"wrote [bold]{out}[/] (key {cfg.extract.key!r}, tap {tap.name})")
    return {"vector": str(out), "key": cfg.extract.key, "tap": tap.name}


def steer(cfg: SteerConf, spec: ModelSpec, out_dir: Path, console: Console) -> Dict:
    engine = start_engine(cfg, spec, run_taps(cfg, spec))
    pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
    plan = build(cfg, spec, default_vector=lambda tap: cached_default(cfg.cache_dir, engine, tap, pos, neg))
    active = plan.active()
    steering = active if active.edits else None
    prompts = list(cfg.prompts.steer)
    encoded = [engine.encode(p) for p in prompts]
    seeds = [cfg.gen.seed + i for i in range(len(prompts))]

    t0 = time.perf_counter()
    with _progress(console, cfg.progress) as progress:
        task = progress.add_task(f"generating ({engine.name})", total=2 * len(prompts))
        # Baseline and steered continuations of every prompt, in one batch where the engine batches.
        jobs = [(ids, None, s) for ids, s in zip(encoded, seeds)] + [(ids, steering, s) for ids, s in zip(encoded, seeds)]
        outs = engine.generate_many(jobs, cfg.gen, progress=lambda k: progress.advance(task, k))
    elapsed = time.perf_counter() - t0
    base, st = outs[: len(prompts)], outs[len(prompts):]
    n_tokens = sum(len(o) for o in outs)

    rows = _rows(engine, plan, steering, prompts, encoded, base, st)
    agg = metrics.aggregate(rows, n_tokens / elapsed if elapsed > 0 else 0.0)
    results.write_jsonl(out_dir / "results.jsonl", rows)
    results.write_json(out_dir / "metrics.json", agg)
    _summary(console, cfg, plan, agg, out_dir)
    return agg


def _rows(engine, plan: Plan, steering: Optional[Plan], prompts, encoded, base, st) -> List[Dict]:
    """Score each steered continuation with and without the edits: KL, changed tokens, projections."""
    tap, edit = plan.primary
    cap = (tap.path,)
    scored = engine.score_many([(ids, s, None, cap) for ids, s in zip(encoded, st)] +
                               [(ids, s, steering, cap) for ids, s in zip(encoded, st)])
    n = len(prompts)
    basis = edit.direction()
    rows = []
    for i, (prompt, ids, b, s) in enumerate(zip(prompts, encoded, base, st)):
        (base_logits, base_cap), (st_logits, st_cap) = scored[i], scored[n + i]
        # Logits at row t predict token t+1: the rows that predicted the steered continuation.
        span = slice(len(ids) - 1, len(ids) - 1 + max(len(s), 1))
        is_prompt = torch.tensor([True] * len(ids) + [False] * len(s))
        w = edit.row_weight(is_prompt)
        selected = torch.ones_like(is_prompt) if w is None else w.bool()
        proj = (lambda h: metrics.projection(h, basis, selected)) if basis is not None else (lambda h: None)
        rows.append({
            "prompt": prompt,
            "baseline": engine.decode(b),
            "steered": engine.decode(s),
            "baseline_tokens": len(b),
            "steered_tokens": len(s),
            "tokens_changed": metrics.tokens_changed(b, s),
            "kl": metrics.kl_mean(st_logits[span], base_logits[span]),
            "proj_baseline": proj(base_cap[tap.path]),
            "proj_steered": proj(st_cap[tap.path]),
        })
    return rows


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
