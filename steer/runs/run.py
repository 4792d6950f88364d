"""Running jobs on an engine: the machinery every task shares. Steer jobs (task=steer, a select's pairs) generate
baseline and steered continuations together, are scored and write their run directories; a job's failure, its log
and what it gave (`Outcome`) are kept here for every task.

Everything a user can get wrong is checked when the job is prepared (steer.tasks.registry.prepare), before any
weights load; result files are written atomically at the end (metrics.json last), so a run that fails leaves no
results.jsonl behind. `run_jobs` runs one job or a packed group of jobs that share an engine, through the same code.
"""

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, TypeVar

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from steer import report, results
from steer.config import checks
from steer.config.schema import PACK, SteerConf
from steer.edits import condition
from steer.edits.edit import direction, scale_of
from steer.edits.tap import head_rows
from steer.engine.base import Scores
from steer.edits.plan import Plan
from steer.errors import ConfigError
from steer.progress import bar as progress_bar
from steer.runs import damage, diagnostics, inputs, metrics
from steer.runs.extract import cache_defaults, cached_default
from steer.runs.job import Job, model_files

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What running one job gave: its result (its metrics, an extraction's vector, or `{"error": message}`) and,
    where it failed, the exception."""

    result: Optional[Dict] = None
    error: Optional[BaseException] = None

    def value(self) -> Dict:
        """The result; the failure raised, where the job failed."""
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass
class _Work:
    job: Job
    plan: Plan
    steering: Optional[Plan]
    prompts: List[str]
    fed: List[str]  # the exact text fed for each prompt (its chat rendering, or itself)
    encoded: List[List[int]]
    seeds: List[int]
    outcome: Outcome = field(default_factory=Outcome)  # what the job gives, once it has run


T = TypeVar("T")


def packs(jobs: Sequence[T], size: int = PACK) -> Iterator[Sequence[T]]:
    """`jobs` in packs of `size`, in order: a pack runs together and its files are written when it finishes, so a
    stopped sweep or grid loses at most the pack in flight."""
    for start in range(0, len(jobs), size):
        yield jobs[start : start + size]


def execute(jobs: Sequence[Job], console: Console, on_done: Optional[Callable[[Job], None]] = None,
            summary: Optional[bool] = None, engine=None) -> List[Dict]:
    """`run_jobs`, each job's result: its metrics, or `{"error": message}` for a job that failed."""
    return [o.result for o in run_jobs(jobs, console, on_done, summary, engine)]


def run_jobs(jobs: Sequence[Job], console: Console, on_done: Optional[Callable[[Job], None]] = None,
             summary: Optional[bool] = None, engine=None, say: Optional[bool] = None) -> List[Outcome]:
    """Run steer jobs that share an engine (see `engine_key`; `engine`: one already started for them, else one held
    for this call), every job's requests in the same batches, and write each job's run directory as if it had run
    alone. A job that fails gets error.txt in its directory and the others complete. `summary`: print each job's
    texts and metrics (default: when there is one job); `say`: print each failure (default: when there are
    several, where a failure does not end the run)."""
    if engine is None:
        from steer.runs.job import engine_for  # looked up when called: a stand-in for it stands in everywhere

        with engine_for(jobs) as engine:
            return run_jobs(jobs, console, on_done, summary, engine, say)
    summary = len(jobs) == 1 if summary is None else summary
    say = len(jobs) > 1 if say is None else say
    outcomes = [Outcome() for _ in jobs]
    work = _start(jobs, engine, console, say, summary, outcomes)
    conts: Dict[tuple, List[int]] = {}
    t0 = time.perf_counter()
    baselines: Dict[tuple, Scores] = {}
    try:
        _generate(engine, work, conts, console)
        elapsed = time.perf_counter() - t0
        baselines = _reread_baselines(engine, work, conts)
    except Exception as e:  # the engine failed for the whole batch: every job of it says so
        for w in work:
            fail(w.job, e, console, say, w.outcome)
        work, elapsed = [], time.perf_counter() - t0
    tokens_per_s = sum(len(o) for o in conts.values()) / elapsed if elapsed > 0 else 0.0
    for w in work:
        try:
            rows = _score(engine, w, conts, baselines)
            agg = metrics.aggregate(rows, tokens_per_s)
            if w.job.cfg.metrics.judge.base_url:  # off unless an endpoint is named: nothing leaves the machine
                from steer.runs import judge

                judge.rate(w.job.cfg.metrics.judge, rows)
                agg.update(judge.counts(rows))
            inputs.write(w.job.out_dir, w.job.vectors, model_files(w.job, engine), w.job.data, w.job.settings)
            results.write_jsonl(w.job.out_dir / "results.jsonl", rows)
            results.write_json(w.job.out_dir / "metrics.json", agg)  # last: its presence marks the job complete
        except Exception as e:
            fail(w.job, e, console, say, w.outcome)
            continue
        report.write_quietly(w.job.out_dir)
        job_log(w.job).info("%d prompts generated in %.1f s (%.0f tok/s, the pack's); wrote results.jsonl and "
                            "metrics.json: %s", len(rows), elapsed, tokens_per_s, json.dumps(agg))
        w.outcome.result = agg
        if summary:
            _summary(console, w.job.spec.name, w.plan, agg, rows, w.job.out_dir)
        if on_done:
            on_done(w.job)
    for job in jobs:  # a sweep of thousands of jobs in one process must not hold a file open for each
        close_log(job.out_dir)
    return outcomes


def started(jobs: Sequence[Job], engine) -> None:
    """Say in each job's steer.log which engine runs it, where, and the taps of its pack (whose requests share the
    batches)."""
    taps = sorted({t.path for job in jobs for t in job.taps})
    for job in jobs:
        job_log(job).info("engine %s on %s in pid %d, taps %s", engine.name, job.spec.source, os.getpid(), taps)


def _start(jobs: Sequence[Job], engine, console: Console, say: bool, summary: bool,
           outcomes: List[Outcome]) -> List[_Work]:
    """Set up each job's generation (a job that cannot be set up fails alone, in `outcomes`). `summary`: each job's
    default directions are printed (else only in its steer.log)."""
    started(jobs, engine)
    _cache_defaults(jobs, engine)
    work = []
    for job, outcome in zip(jobs, outcomes):
        try:
            w = _setup(job, engine, console, summary)
        except Exception as e:
            fail(job, e, console, say, outcome)
            continue
        w.outcome = outcome
        work.append(w)
    return work


def _cache_defaults(jobs: Sequence[Job], engine) -> None:
    """The default directions the pack's steer jobs need, extracted together where they share their pairs and
    recipe (a sweep over layers reads its pairs once). A direction that cannot be extracted here is extracted again
    by its own job, which then fails alone with the reason."""
    groups: Dict[str, tuple] = {}
    for job in jobs:
        cfg = job.cfg
        if not job.plan.pending:
            continue
        recipe = job.recipe
        pos, neg = list(cfg.prompts.positive), list(cfg.prompts.negative)
        key = json.dumps([cfg.cache_dir, pos, neg, asdict(recipe)], sort_keys=True)
        taps = groups.setdefault(key, (cfg.cache_dir, pos, neg, recipe, {}))[4]
        taps.update((path, job.plan.taps[path]) for path, *_ in job.plan.pending)
    for cache_dir, pos, neg, recipe, taps in groups.values():
        if len(taps) > 1:
            try:
                cache_defaults(cache_dir, engine, list(taps.values()), pos, neg, recipe)
            except Exception as e:
                log.info("default directions at %s not extracted together (%s): each job extracts its own",
                         ", ".join(taps), e)


def _setup(job: Job, engine, console: Console, summary: bool = True) -> _Work:
    """A job's compiled plan and encoded prompts, checked against the model's positions."""
    cfg = job.cfg
    pos, neg, recipe = list(cfg.prompts.positive), list(cfg.prompts.negative), job.recipe
    read: Dict[str, Dict[str, str]] = {}  # tap name: the default direction's metadata

    def default(tap):
        got = cached_default(cfg.cache_dir, engine, tap, pos, neg, recipe, True)
        read[tap.name] = got[1]
        return got

    plan = job.plan.with_defaults(default, job.spec.hidden)
    cpos, cneg = list(cfg.prompts.condition_positive), list(cfg.prompts.condition_negative)
    plan = plan.with_conditions(lambda tap: cached_default(cfg.cache_dir, engine, tap, cpos, cneg, recipe),
                                job.spec.hidden)
    for name, meta in read.items():  # how good the direction is, as task=extract says it
        said = diagnostics.line(f"default direction at {name}", diagnostics.from_metadata(meta))
        if summary:  # a sweep's or a grid's jobs say it in their steer.log alone, rather than once a job
            console.print(said, highlight=False, markup=False, soft_wrap=True)
        job_log(job).info(said)
    record_vectors(job, read)
    active = plan.active()
    prompts = list(cfg.prompts.steer)
    rendered = [engine.render(p, cfg.prompts.chat) for p in prompts]
    encoded = [_fit(ids, i, cfg, job, engine.max_len, console) for i, (_, ids) in enumerate(rendered)]
    job_log(job).info("edits: %s", describe(plan))
    return _Work(job, plan, active if active.edits else None, prompts, [fed for fed, _ in rendered], encoded,
                 [cfg.gen.seed + i for i in range(len(prompts))])


def record_vectors(job: Job, defaults: Dict[str, Dict[str, str]]) -> None:
    """vectors.json: each edit's direction, where it came from and the diagnostics its file records (the run's
    report shows them; the cache holds the default directions' files, which a run does not name otherwise)."""
    out = []
    for name, meta in defaults.items():
        out.append({"tap": name, "layer": _layer(name), "source": f"the default direction at {name}, extracted from "
                    f"{meta.get('positive', '?')} positive and {meta.get('negative', '?')} negative prompts "
                    f"({meta.get('method', '?')})", "diagnostics": diagnostics.from_metadata(meta)})
    from steer.edits import vector as vector_files
    from steer.edits.plan import entries

    for _, tap, edit in entries(job.cfg):
        path = edit.vector.path
        if path is None:
            continue
        try:
            meta = vector_files.metadata(path)
        except Exception:  # noqa: BLE001 - another tool's file, read by its own loader: no metadata to show
            meta = {}
        name = meta.get("tap") or (f"layer{tap.layer}" if tap.layer is not None else str(tap.path))
        diag = diagnostics.from_metadata(meta) if "diag.norm" in meta else {}
        out.append({"tap": name, "layer": tap.layer, "source": f"{path} (key {edit.vector.key})",
                    "diagnostics": diag})
    results.write_json(job.out_dir / "vectors.json", {"vectors": out})


def _layer(tap_name: str) -> Optional[int]:
    return int(tap_name[5:]) if tap_name.startswith("layer") and tap_name[5:].isdigit() else None


def _fit(ids: List[int], i: int, cfg: SteerConf, job: Job, limit: int, console: Console) -> List[int]:
    """The prompt's ids if they and the continuation fit the model's positions; else its last tokens that do
    (prompts.truncate) or an error naming the prompt."""
    new = cfg.gen.max_new_tokens
    checks.room_for_a_prompt("gen.max_new_tokens", new, limit, job.spec.name)  # the engine's own limit, now known
    room = limit - new
    if len(ids) <= room:
        return ids
    if not cfg.prompts.truncate:
        raise ConfigError(f"prompts.steer[{i}]", f"prompt {i} is {len(ids)} tokens; with gen.max_new_tokens={new} "
                                                 f"it needs {len(ids) + new} positions, but {job.spec.name} has "
                                                 f"{limit}. Shorten it, lower gen.max_new_tokens, or set "
                                                 f"prompts.truncate=true to keep its last {room} tokens")
    msg = f"prompt {i}: {len(ids)} tokens, truncated to its last {room} (prompts.truncate=true)"
    console.print(f"[yellow]warning[/] {msg}", highlight=False)
    job_log(job).warning(msg)
    return ids[-room:]


def _generate(engine, work: List[_Work], conts: Dict[tuple, List[int]], console: Console) -> None:
    """Generate every job's baseline and steered continuations into `conts`, jobs with the same generation
    settings in one batch."""
    if not work:
        return
    with progress_bar(console, work[0].job.cfg.progress) as progress:
        task = progress.add_task(f"generating ({engine.name}, {len(work)} job{'s' * (len(work) > 1)})",
                                 total=sum(2 * len(w.prompts) for w in work))
        by_gen: Dict[str, List[_Work]] = {}
        for w in work:
            by_gen.setdefault(_gen_key(w), []).append(w)
        for ws in by_gen.values():
            # A baseline depends only on (gen settings, prompt, seed): jobs of a sweep share theirs.
            requests: Dict[tuple, tuple] = {}
            for w in ws:
                for ids, seed, i in zip(w.encoded, w.seeds, range(len(w.prompts))):
                    requests.setdefault(_base_key(w, ids, seed), (ids, None, seed))
                    requests[_steer_key(w, i)] = (ids, w.steering, seed)
            outs = engine.generate_many(list(requests.values()), ws[0].job.cfg.gen,
                                        progress=lambda k: progress.advance(task, k))
            conts.update(zip(requests.keys(), outs))
        progress.update(task, completed=progress.tasks[task].total)


def fail(job: Job, e: BaseException, console: Console, say: bool = True, outcome: Optional[Outcome] = None) -> Outcome:
    """Record a job's failure: error.txt in its directory, the log, and in `outcome` (else a new one) the error and
    `{"error": ...}` as its result."""
    msg = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
    outcome = outcome if outcome is not None else Outcome()
    outcome.error, outcome.result = e, {"error": msg}
    record_failure(job.out_dir, e)
    if say:
        console.print(f"[bold red]job failed[/] {job.out_dir}: {escape(msg)}", highlight=False)
    return outcome


def record_failure(out_dir: Path, e: BaseException) -> None:
    """Say in the run directory why the run failed (error.txt, and steer.log)."""
    import traceback

    text = str(e) if isinstance(e, ConfigError) else "".join(traceback.format_exception(e))
    if Path(out_dir).is_dir():
        results.write_text(Path(out_dir) / "error.txt", text.rstrip() + "\n")
        _dir_log(Path(out_dir)).error("failed: %s", text.rstrip())
        close_log(Path(out_dir))


def job_log(job: Job) -> logging.Logger:
    """The logger whose lines land in the job's steer.log (a pack's jobs share a process, each its own file)."""
    return _dir_log(job.out_dir)


def _dir_log(out_dir: Path) -> logging.Logger:
    logger = logging.getLogger(f"steer.runs.job.{out_dir.resolve()}")
    if not logger.handlers:
        handler = logging.FileHandler(out_dir / "steer.log", delay=True)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] - %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # Hydra's root handler writes the same file in a single run
    return logger


def close_log(out_dir: Path) -> None:
    """Close the run directory's steer.log (a later line opens it again, appending)."""
    logger = logging.getLogger(f"steer.runs.job.{Path(out_dir).resolve()}")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


def describe(plan: Plan) -> str:
    """Every edit of a plan, in order: `layer1 add scale=4, layer2 clamp scale=1 lo=-40 hi=40 (generated)`."""
    parts = []
    for path, edits in plan.edits.items():
        for e in edits:
            bits = [plan.taps[path].name, e.kind.value, f"scale={scale_of(e):g}"]
            bits += [f"{k}={v:g}" for k, v in (("lo", e.lo), ("hi", e.hi)) if v is not None]
            if e.kind.value == "set":
                bits.append(f"value={e.value:g}")
            if e.tokens.value != "both":
                bits.append(f"({e.tokens.value})")
            if e.when is not None:
                names = {**plan.taps, **plan.condition_taps}
                bits.append(condition.describe(e.when, names[e.when.path].name if e.when.path in names
                                               else e.when.path))
            parts.append(" ".join(bits))
    return ", ".join(parts)


def _gen_key(w: _Work) -> str:
    return json.dumps(asdict(w.job.cfg.gen), sort_keys=True)


def _base_key(w: _Work, ids, seed) -> tuple:
    return ("base", _gen_key(w), tuple(ids), seed)


def _base_keys(w: _Work) -> List[tuple]:
    """Each of a job's prompts' baseline key, in prompt order."""
    return [_base_key(w, ids, seed) for ids, seed in zip(w.encoded, w.seeds)]


def _steer_key(w: _Work, i: int) -> tuple:
    return ("steer", id(w), i)


def _reread_baselines(engine, work: List[_Work], conts: Dict[tuple, List[int]]) -> Dict[tuple, Scores]:
    """The unsteered model's re-reading of every baseline, once for all the jobs that share it, capturing each of
    their first edits' taps (a sweep over layers re-reads a baseline once, not once a layer). Each job's new
    baselines are read in one batch, as they are when it runs alone: a row's numbers depend on its batch."""
    taps: Dict[tuple, set] = {}
    for w in work:
        for k in _base_keys(w):
            taps.setdefault(k, set()).update(_read_at(w))
    out: Dict[tuple, Scores] = {}
    for w in work:
        todo = {k: ids for k, ids in zip(_base_keys(w), w.encoded) if k not in out}
        out.update(zip(todo, engine.score_many([(ids, conts[k], None, tuple(sorted(taps[k])))
                                                for k, ids in todo.items()])))
    return out


def _read_at(w: _Work) -> tuple:
    """The taps whose values a job's scoring reads: its first edit's, and its probe's (task=select)."""
    paths = [w.plan.primary[0].path] + ([w.job.probe.tap.path] if w.job.probe is not None else [])
    return tuple(dict.fromkeys(paths))


def _score(engine, w: _Work, conts: Dict[tuple, List[int]], baselines: Dict[tuple, Scores]) -> List[Dict]:
    """Score a job's continuations. The unsteered model re-reads the baseline (`baselines`) and the steered
    continuation (perplexity, and the concept: the signed projection of its tap values on the edit's direction)
    and the steered model re-reads the steered one (KL against the unsteered reading, projections at the first
    edit's tap)."""
    tap, edit = w.plan.primary
    cap = _read_at(w)
    # the steered re-reading also keeps the conditions' taps, whose prompt rows give each prompt's score
    steer_cap = tuple(dict.fromkeys(cap + tuple(c.path for c in w.plan.conditions())))
    keys = _base_keys(w)
    jobs = []
    for i, ids in enumerate(w.encoded):
        st = conts[_steer_key(w, i)]
        jobs += [(ids, st, None, cap), (ids, st, w.steering, steer_cap)]
    scored = iter(engine.score_many(jobs))
    basis = direction(edit)
    return [_row(engine, w, i, conts, basis, baselines[keys[i]], next(scored), next(scored))
            for i in range(len(w.prompts))]


def _row(engine, w: _Work, i: int, conts: Dict[tuple, List[int]], basis: Optional[torch.Tensor], reread, base,
         steer) -> Dict:
    """Prompt i's line of results.jsonl, from the engine's Scores of its continuations: `reread`, the unsteered
    model's of the baseline; `base` and `steer`, the unsteered and the steered model's of the steered one."""
    tap, edit = w.plan.primary
    text, fed, ids, seed = w.prompts[i], w.fed[i], w.encoded[i], w.seeds[i]
    b, s = conts[_base_key(w, ids, seed)], conts[_steer_key(w, i)]
    direction = basis[0] if basis is not None else None
    # Log-probs at row t predict token t+1: the rows that predicted the steered continuation.
    n = len(ids)
    span = slice(n - 1, n - 1 + max(len(s), 1))
    is_prompt = torch.tensor([True] * n + [False] * len(s))
    wt = edit.row_weight(is_prompt)
    selected = torch.ones_like(is_prompt) if wt is None else wt.bool()
    proj = (lambda h: metrics.projection(h, basis, selected)) if basis is not None else (lambda h: None)
    baseline, steered = whole_chars(engine.decode, b), whole_chars(engine.decode, s)
    row = {
        "prompt": text, "fed": fed, "prompt_ids": list(ids), "baseline": baseline, "steered": steered,
        "baseline_ids": list(b), "steered_ids": list(s), "baseline_tokens": len(b), "steered_tokens": len(s),
        "tokens_changed": metrics.tokens_changed(b, s),
        "kl": metrics.kl_mean(steer.logprobs[span], base.logprobs[span]),
        "proj_baseline": proj(head_rows(tap.path, base.captured[tap.path])),
        "proj_steered": proj(head_rows(tap.path, steer.captured[tap.path])),
        "ppl_baseline": metrics.perplexity(reread.logprobs[n - 1:], b),
        "ppl_steered": metrics.perplexity(base.logprobs[n - 1:], s),
        "distinct2_baseline": metrics.distinct2(b),
        "distinct2_steered": metrics.distinct2(s),
        "rep_steered": metrics.repetition(s),
        "repeat_baseline": damage.longest_repeat(b),
        "repeat_steered": damage.longest_repeat(s),
        "concept_baseline": metrics.concept(head_rows(tap.path, reread.captured[tap.path])[n:], direction),
        "concept_steered": metrics.concept(head_rows(tap.path, base.captured[tap.path])[n:], direction),
    }
    probe = w.job.probe
    if probe is not None:  # task=select's one ruler for every pair (steer/runs/probe.py)
        row["probe_baseline"] = metrics.concept(reread.captured[probe.tap.path][n:], probe.direction)
        row["probe_steered"] = metrics.concept(base.captured[probe.tap.path][n:], probe.direction)
    row.update(damage.judge(row, damage.Rules.from_conf(w.job.cfg.select)))
    if w.job.cfg.metrics.sentiment:
        row["sentiment_baseline"] = metrics.sentiment(baseline)
        row["sentiment_steered"] = metrics.sentiment(steered)
    row.update(_decisions(w.plan, steer.captured, n))
    return row


def whole_chars(decode: Callable[[List[int]], str], ids: List[int], most: int = 4) -> str:
    """The text of `ids`, cut at its last whole character: a continuation that stops inside a character (the
    first byte tokens of an emoji) decodes to a replacement character there, which no reader wants; up to `most`
    trailing tokens are left out of the text until it ends in a whole one (the ids stay as generated)."""
    text = decode(ids)
    for k in range(1, min(most, len(ids)) + 1):
        if not text.endswith("\ufffd"):
            break
        shorter = decode(ids[:-k])
        if not shorter.endswith("\ufffd"):
            return shorter
    return text


def _decisions(plan: Plan, captured: Dict[str, torch.Tensor], n: int) -> Dict:
    """The prompt's score and decision for each condition of the plan, from its tap's prompt rows as the steered
    model read them: `when_score` and `when_met` (suffixed `.1`, `.2`, ... for a plan's later conditions)."""
    out = {}
    for k, c in enumerate(plan.conditions()):
        h = captured[c.path][:n][None]
        s = c.scores(h, torch.ones(1, n, dtype=torch.bool))
        suffix = f".{k}" if k else ""
        out[f"when_score{suffix}"] = float(s[0])
        out[f"when_met{suffix}"] = bool(c.met(s)[0])
    return out


def _summary(console: Console, model: str, plan: Plan, agg: Dict, rows: List[Dict], out_dir: Path,
             shown: int = 3) -> None:
    t = Table(title=f"{model} | {describe(plan) or 'no edits'}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in agg.items():
        t.add_row(k, "-" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v))
    texts = Table(title=f"baseline and steered, {min(shown, len(rows))} of {len(rows)} prompts (all in results.jsonl)")
    for name in ("prompt", "baseline", "steered"):
        texts.add_column(name, overflow="fold", ratio=1)
    for r in rows[:shown]:
        texts.add_row(escape(r["prompt"]), escape(r["baseline"]), escape(r["steered"]))
    console.print(texts)
    console.print(t)
    console.print(f"results in [bold]{out_dir}[/]")
    if (out_dir / report.FILE).is_file():
        console.print(f"report: [bold]{out_dir / report.FILE}[/] (texts side by side, metrics, plots)")
