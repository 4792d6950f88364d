"""Runs: check the config, start the engine, generate baseline and steered continuations, write results.

Everything a user can get wrong is checked in `prepare`, before any weights load; result files are written
atomically at the end (metrics.json last), so a run that fails leaves no results.jsonl behind. `execute` runs
one job or a packed group of jobs that share an engine, through the same code.
"""

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

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


def _needs_vllm(engine: str, field: str, what: str) -> None:
    if engine != "vllm":
        raise ConfigError(field, f"{what} needs engine=vllm (this run resolves to engine={engine})")


def prepare(cfg: SteerConf) -> ModelSpec:
    """Validate everything that can be checked without weights; return the model's spec."""
    engine = engines.resolve(cfg.engine)
    tp = cfg.vllm.tensor_parallel_size
    if tp < 1:
        raise ConfigError("vllm.tensor_parallel_size", f"must be at least 1, got {tp}")
    if tp > 1:
        import torch

        _needs_vllm(engine, "vllm.tensor_parallel_size", f"{tp} GPUs per engine")
        if torch.cuda.device_count() < tp:
            raise ConfigError("vllm.tensor_parallel_size", f"{tp} GPUs per engine, but this machine has "
                                                           f"{torch.cuda.device_count()}")
    if cfg.vllm.edits_in_graph:
        raise ConfigError("vllm.edits_in_graph", "a steer run scores with the tap's values (projection metrics), "
                                                 "which an engine with its edits in the graph cannot keep; the mode "
                                                 "is for the bench and the API (VLLMEngine(..., declare=plans))")
    kv = cfg.vllm.kv_cache_memory_bytes
    if kv is not None and kv < 1:
        raise ConfigError("vllm.kv_cache_memory_bytes", f"must be a positive number of bytes or null, got {kv}")
    if cfg.vllm.tap_graphs:
        _needs_vllm(engine, "vllm.tap_graphs", "replaying CUDA graphs at vLLM's taps")
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
    # A multirun's jobs share one process: keep the last engine rather than reload it for every job. The vLLM
    # settings arrive as JSON only because the cache key must be hashable.
    from steer.schema import VllmConf

    return engines.make(name, spec, device, VllmConf(**json.loads(vllm_conf)), taps)


def start_engine(cfg: SteerConf, spec: ModelSpec, taps=()):
    """Build the tiny model if needed and start (or reuse) the engine with these taps fixed."""
    if cfg.model.source == "tiny":
        tiny.ensure_tiny(cfg.cache_dir, cfg.model.tiny)
    name = engines.resolve(cfg.engine)
    # Only an engine that records graphs fixes its taps at start; the HF engine serves any tap it is given.
    return _engine(name, spec, cfg.device, json.dumps(asdict(cfg.vllm)), tuple(taps) if name == "vllm" else ())


def run_taps(cfg: SteerConf, spec: ModelSpec):
    """Every tap a run touches, in config order (an engine that records graphs needs them up front)."""
    out = {}
    for prefix, tap_conf, _ in entries(cfg):
        tap = resolve(tap_conf, spec, f"{prefix}tap")
        out.setdefault(tap.path, tap)
    return list(out.values())


@dataclass
class Job:
    """A validated steer job: its config, its model's spec and the run directory it writes."""

    cfg: SteerConf
    spec: ModelSpec
    out_dir: Path


# Set by the packed launcher (hydra_plugins/steer_launcher): `main` then defers steer jobs here instead of
# running them, and the launcher runs each group of jobs that can share an engine with `execute`.
_deferred: Optional[List[Job]] = None


@contextmanager
def deferring() -> Iterator[List[Job]]:
    """Collect the steer jobs `main` is asked to run, validated but not run."""
    global _deferred
    _deferred = []
    try:
        yield _deferred
    finally:
        _deferred = None


def engine_key(job: Job) -> str:
    """Jobs with the same key can share one engine (same model, engine and engine settings)."""
    c = job.cfg
    return json.dumps([asdict(c.model), engines.resolve(c.engine), c.device, asdict(c.vllm)], sort_keys=True)


def main(cfg: SteerConf, out_dir: Path, console: Console) -> Dict:
    """Run the configured task into `out_dir`; return what it wrote as a dict (metrics, or the vector path)."""
    spec = prepare(cfg)
    if cfg.task == Task.extract:
        return extract(cfg, spec, out_dir, console)
    job = Job(cfg, spec, out_dir)
    if _deferred is not None:
        _deferred.append(job)
        return {"deferred": str(out_dir)}
    return execute([job], console)[0]


def extract(cfg: SteerConf, spec: ModelSpec, out_dir: Path, console: Console) -> Dict:
    tap = resolve(cfg.tap, spec)
    engine = start_engine(cfg, spec, [tap])
    out = Path(cfg.extract.out).expanduser() if cfg.extract.out else out_dir / "vector.safetensors"
    extract_to(out, cfg.extract.key, engine, tap, list(cfg.prompts.positive), list(cfg.prompts.negative),
               cfg.extract.position, cfg.extract.normalize)
    console.print(f"wrote [bold]{out}[/] (key {cfg.extract.key!r}, tap {tap.name})")
    return {"vector": str(out), "key": cfg.extract.key, "tap": tap.name}


@dataclass
class _Work:
    job: Job
    plan: Plan
    steering: Optional[Plan]
    prompts: List[str]
    encoded: List[List[int]]
    seeds: List[int]


def execute(jobs: Sequence[Job], console: Console, on_done: Optional[Callable[[Job], None]] = None) -> List[Dict]:
    """Run steer jobs that share an engine (see `engine_key`), every job's requests in the same batches, and
    write each job's run directory as if it had run alone. Returns each job's metrics."""
    taps = {t.path: t for job in jobs for t in run_taps(job.cfg, job.spec)}
    engine = start_engine(jobs[0].cfg, jobs[0].spec, list(taps.values()))
    work = []
    for job in jobs:
        cfg = job.cfg
        pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
        plan = build(cfg, job.spec,
                     default_vector=lambda tap, c=cfg, p=pos, n=neg: cached_default(c.cache_dir, engine, tap, p, n))
        active = plan.active()
        prompts = list(cfg.prompts.steer)
        work.append(_Work(job, plan, active if active.edits else None, prompts, [engine.encode(p) for p in prompts],
                          [cfg.gen.seed + i for i in range(len(prompts))]))

    conts: Dict[tuple, List[int]] = {}
    t0 = time.perf_counter()
    with _progress(console, jobs[0].cfg.progress) as progress:
        task = progress.add_task(f"generating ({engine.name}, {len(jobs)} job{'s' * (len(jobs) > 1)})",
                                 total=sum(2 * len(w.prompts) for w in work))
        by_gen: Dict[str, List[_Work]] = {}
        for w in work:
            by_gen.setdefault(_gen_key(w), []).append(w)
        for ws in by_gen.values():
            # A baseline depends only on (gen settings, prompt, seed): jobs of a sweep share theirs.
            requests: Dict[tuple, tuple] = {}
            for j, w in enumerate(ws):
                for ids, seed, i in zip(w.encoded, w.seeds, range(len(w.prompts))):
                    requests.setdefault(_base_key(w, ids, seed), (ids, None, seed))
                    requests[_steer_key(w, i)] = (ids, w.steering, seed)
            outs = engine.generate_many(list(requests.values()), ws[0].job.cfg.gen,
                                        progress=lambda k: progress.advance(task, k))
            conts.update(zip(requests.keys(), outs))
        progress.update(task, completed=progress.tasks[task].total)
    elapsed = time.perf_counter() - t0
    tokens_per_s = sum(len(o) for o in conts.values()) / elapsed if elapsed > 0 else 0.0

    scored = _score(engine, work, conts)
    out = []
    for w, rows in zip(work, scored):
        agg = metrics.aggregate(rows, tokens_per_s)
        results.write_jsonl(w.job.out_dir / "results.jsonl", rows)
        results.write_json(w.job.out_dir / "metrics.json", agg)  # last: its presence marks the job complete
        if len(jobs) == 1:
            _summary(console, w.job.cfg, w.plan, agg, w.job.out_dir)
        if on_done:
            on_done(w.job)
        out.append(agg)
    return out


def _gen_key(w: _Work) -> str:
    return json.dumps(asdict(w.job.cfg.gen), sort_keys=True)


def _base_key(w: _Work, ids, seed) -> tuple:
    return ("base", _gen_key(w), tuple(ids), seed)


def _steer_key(w: _Work, i: int) -> tuple:
    return ("steer", id(w), i)


def _score(engine, work: List[_Work], conts: Dict[tuple, List[int]]) -> List[List[Dict]]:
    """Score every job's steered continuations with and without its edits, in one batch: KL, changed tokens,
    projections at the first edit's tap."""
    jobs = []
    for w in work:
        cap = (w.plan.primary[0].path,)
        for i, ids in enumerate(w.encoded):
            st = conts[_steer_key(w, i)]
            jobs += [(ids, st, None, cap), (ids, st, w.steering, cap)]
    scored = iter(engine.score_many(jobs))
    out = []
    for w in work:
        tap, edit = w.plan.primary
        basis = edit.direction()
        rows = []
        for i, (prompt, ids, seed) in enumerate(zip(w.prompts, w.encoded, w.seeds)):
            b, s = conts[_base_key(w, ids, seed)], conts[_steer_key(w, i)]
            (base_logits, base_cap), (st_logits, st_cap) = next(scored), next(scored)
            # Logits at row t predict token t+1: the rows that predicted the steered continuation.
            span = slice(len(ids) - 1, len(ids) - 1 + max(len(s), 1))
            is_prompt = torch.tensor([True] * len(ids) + [False] * len(s))
            wt = edit.row_weight(is_prompt)
            selected = torch.ones_like(is_prompt) if wt is None else wt.bool()
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
        out.append(rows)
    return out


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
