"""task=eval: behaviour on an A/B benchmark, as in the CAA paper's figure of p(matching answer) against the
steering multiplier.

Each item of a CAA A/B dataset is a question that shows both options, answered by a letter ("(A)" or "(B)"). The
question is fed as the run feeds a prompt (its chat rendering where the model has one); the two answers are
teacher-forced after it, and at the first token where they differ (the letter) the model's probabilities of the
two tokens are normalised over the pair: p(matching) = p(m) / (p(m) + p(n)). That is read from the engine's
log-probs (Engine.score_many), unsteered and with the config's edit at each of `eval.scales`, so both engines
compute it the same way.

With `edit.vector.path` null the direction comes from the dataset's own pairs: a share `eval.split` of the items
(drawn with `eval.seed`) gives the contrastive prompts, each the fed question followed by its matching answer
(positive) or the other (negative), the tokens the scoring reads; only the other items are scored, so the
direction is never judged on what it was fitted on. With a vector file every item is scored.

The run dir gets eval.json (per item and per scale), metrics.json (the means, for sweeps) and eval.png; the
mean shift of p(matching) from the baseline at each scale comes with a 95% interval (a paired bootstrap over
items).
"""

import copy
import io
import json
import logging
import random
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from steer import report, results
from steer.config import checks
from steer.config.schema import SteerConf, Task
from steer.edits.plan import Plan, build
from steer.errors import ConfigError
from steer.runs import data, inputs
from steer.runs.data import ABItem, dataset_path, shipped
from steer.runs.extract import extract
from steer.runs.job import Job, model_files
from steer.tasks.base import TaskDef

log = logging.getLogger(__name__)
RESAMPLES = 10000
CHUNK = 8  # items scored per engine call: each holds a [tokens, vocab] log-prob table until read
FEW_ITEMS = 10  # scored items below which the bootstrap's intervals are said to mean little


def check(cfg: SteerConf, engine: str) -> None:
    checks.run(cfg, engine)
    checks.eval_task(cfg)


def prepare(job: Job) -> Job:
    """Its items (the dataset read and split), and its plan."""
    items = load(job.cfg)
    vectors = inputs.vectors(job.cfg)
    plan = build(job.cfg, job.spec)
    return replace(job, items=items, vectors=vectors, plan=plan, taps=tuple(plan.taps.values()))


def dataset_file(cfg) -> Sequence[str]:
    """The A/B dataset it reads (a job config, typed or as Hydra composed it)."""
    return [str(dataset_path(cfg.eval.dataset))]


def load(cfg: SteerConf) -> Tuple[List[ABItem], List[ABItem]]:
    """(items to extract the direction from, items to score) of the run's dataset; the first is empty where the
    edit's vector comes from a file."""
    path = dataset_path(cfg.eval.dataset)
    if not path.exists():
        raise ConfigError("eval.dataset", f"{cfg.eval.dataset!r} is neither a dataset shipped with steer "
                                          f"({', '.join(shipped())}) nor a file or directory")
    items = data.load_ab(path)
    if cfg.edit.vector.path is not None or cfg.eval.split == 0:
        return [], items
    return split(items, cfg.eval.split, cfg.eval.seed)


def split(items: Sequence[ABItem], share: float, seed: int = 0) -> Tuple[List[ABItem], List[ABItem]]:
    """(fit, held out): a share `share` of the items, drawn with `seed`, and the rest; neither side empty."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    k = round(share * len(items))
    if not 0 < k < len(items):
        raise ConfigError("eval.split", f"{share} of {len(items)} items leaves {k} to extract from and "
                                        f"{len(items) - k} to score; both need at least one")
    return [items[i] for i in sorted(order[:k])], [items[i] for i in sorted(order[k:])]


def pair_prompts(engine, items: Sequence[ABItem], chat: str) -> Tuple[List[str], List[str]]:
    """The contrastive prompts of A/B items as raw text (extract them with chat "false"): each question's fed
    rendering followed by its matching answer, and by the other."""
    fed = [engine.render(x.question, chat)[0] for x in items]
    return [f + x.matching for f, x in zip(fed, items)], [f + x.not_matching for f, x in zip(fed, items)]


def letters(tokenizer, item: ABItem, where: str = "eval.dataset") -> Tuple[List[int], int, int]:
    """(the answers' shared first tokens, the matching answer's next token, the other's): the tokens the two
    answers are told apart by."""
    a = tokenizer(item.matching, add_special_tokens=False)["input_ids"]
    b = tokenizer(item.not_matching, add_special_tokens=False)["input_ids"]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        raise ConfigError(where, f"the answers {item.matching!r} and {item.not_matching!r} tokenize so that one "
                                 "begins with the other; they must differ at some token (e.g. \"(A)\" and \"(B)\")")
    return list(a[:k]), int(a[k]), int(b[k])


def p_matching(engine, items: Sequence[ABItem], plan: Optional[Plan], chat: str) -> Tuple[List[float], List[float]]:
    """Per item: p(matching) normalised over the two answers' distinguishing tokens, and the probability mass
    the two hold together, under `plan` (None: unsteered)."""
    p, mass = [], []
    for start in range(0, len(items), CHUNK):
        chunk = items[start : start + CHUNK]
        jobs, reads = [], []
        for x in chunk:
            ids = engine.encode(x.question, chat)
            prefix, m, n = letters(engine.tokenizer, x)
            jobs.append((ids, prefix + [m], plan, ()))
            reads.append((len(ids) + len(prefix) - 1, m, n))  # log-prob row t predicts token t + 1
        for (row, m, n), scores in zip(reads, engine.score_many(jobs)):
            lp = scores.logprobs[row].double()
            pair = torch.stack([lp[m], lp[n]])
            p.append(float(torch.softmax(pair, 0)[0]))
            mass.append(float(pair.exp().sum()))
    return p, mass


def evaluate(engine, items: Sequence[ABItem], plan_for_scale: Callable[[float], Optional[Plan]],
             scales: Sequence[float], chat: str = "auto", seed: int = 0) -> Dict:
    """p(matching) of every item unsteered and at each scale (`plan_for_scale(s)`: the edits at strength s), with
    the mean shift from the baseline and its 95% bootstrap interval."""
    base, mass = p_matching(engine, items, None, chat)
    out = {"n": len(items), "baseline": {"p_matching": _mean(base), "ci95": _ci(base, seed),
                                         "letter_mass": _mean(mass)},
           "scales": [], "items": [{"question": x.question, "matching": x.matching, "p_baseline": b}
                                   for x, b in zip(items, base)]}
    for s in scales:
        p, _ = p_matching(engine, items, plan_for_scale(float(s)), chat)
        shift = [a - b for a, b in zip(p, base)]
        out["scales"].append({"scale": float(s), "p_matching": _mean(p), "ci95": _ci(p, seed),
                              "shift": _mean(shift), "shift_ci95": _ci(shift, seed)})
        for row, v in zip(out["items"], p):
            row.setdefault("p_steered", {})[f"{float(s):g}"] = v
    return out


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs))


def _ci(xs: Sequence[float], seed: int) -> List[float]:
    """The 95% percentile bootstrap interval of the mean of `xs`."""
    x = np.asarray(xs, dtype=np.float64)
    means = x[np.random.default_rng(seed).integers(0, len(x), (RESAMPLES, len(x)))].mean(1)
    return [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]


def plans(cfg: SteerConf, spec, direction: Optional[torch.Tensor],
          meta: Optional[Dict[str, str]] = None) -> Callable[[float], Optional[Plan]]:
    """The run's edits at each strength: `edit.scale` set to it (a vector from the dataset where `direction`, with
    the metadata an extraction records, `diag.resid_norm` for edit.scale_by=resid)."""
    def at(scale: float) -> Optional[Plan]:
        c = copy.deepcopy(cfg)
        c.edit.scale = scale
        plan = build(c, spec, (lambda tap: (direction, meta)) if direction is not None else None).active()
        return plan if plan.edits else None

    return at


def run(job: Job, console: Console, engine=None) -> Dict:
    """Run a prepared task=eval job into its run directory (on `engine`, else one it holds) and its report; return
    its metrics."""
    from steer.runs.job import engine_for

    cfg = job.cfg
    fit, held = job.items
    with nullcontext(engine) if engine is not None else engine_for([job]) as engine:
        vec, meta, diag = None, None, None
        if job.plan.pending:
            pos, neg = pair_prompts(engine, fit, cfg.prompts.chat)
            recipe = replace(job.recipe, chat="false")  # the prompts are rendered already
            ex = extract(engine, job.taps[0], pos, neg, recipe, cfg.extract.folds)
            vec, diag = ex.direction, ex.diagnostics
            meta = {"tap": ex.tap.name, **ex.metadata()}
        console.print(f"eval: {len(held)} items of {cfg.eval.dataset}"
                      + (f", direction extracted from {len(fit)} others" if vec is not None else "")
                      + f", scales {', '.join(f'{s:g}' for s in cfg.eval.scales)}")
        if len(held) < FEW_ITEMS:
            few = (f"only {len(held)} item{'s' * (len(held) != 1)} scored: a bootstrap over fewer than {FEW_ITEMS} "
                   f"gives intervals that understate the uncertainty")
            console.print(f"[yellow]warning[/] {few}", highlight=False)
            log.warning(few)
        out = evaluate(engine, held, plans(cfg, job.spec, vec, meta), cfg.eval.scales, cfg.prompts.chat, cfg.eval.seed)
        files = model_files(job, engine)
    out = {"dataset": str(dataset_path(cfg.eval.dataset)), "tap": job.taps[0].name, "edit": cfg.edit.kind.value,
           "fit_items": len(fit), "direction_norm": float(vec.norm()) if vec is not None else None,
           "diagnostics": diag, **out}
    metrics = {"n": out["n"], "p_matching_baseline": out["baseline"]["p_matching"]}
    for s in out["scales"]:
        metrics[f"p_matching_scale{s['scale']:g}"] = s["p_matching"]
        metrics[f"shift_scale{s['scale']:g}"] = s["shift"]
    d = job.out_dir
    inputs.write(d, job.vectors, files, job.data, job.settings)
    results.write_json(d / "eval.json", out)
    results.write_bytes(d / "eval.png", plot(out))
    results.write_json(d / "metrics.json", metrics)  # last: its presence marks the job complete
    _table(console, out)
    console.print(f"results in [bold]{d}[/]")
    report.write_quietly(d)  # the page reads eval.json and eval.png back
    return metrics


def plot(out: Dict) -> bytes:
    """Mean p(matching) against scale (0: unsteered), with 95% intervals, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted([(0.0, out["baseline"]["p_matching"], out["baseline"]["ci95"])]
                    + [(s["scale"], s["p_matching"], s["ci95"]) for s in out["scales"]])
    x = [p[0] for p in points]
    y = [p[1] for p in points]
    err = np.array([[p[1] - p[2][0] for p in points], [p[2][1] - p[1] for p in points]])
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3)
    ax.axhline(out["baseline"]["p_matching"], color="grey", lw=0.8, ls="--", label="unsteered")
    ax.axhline(0.5, color="lightgrey", lw=0.8)
    ax.set_ylim(0, 1)
    ax.set_xlabel(f"scale ({out['edit']} at {out['tap']})")
    ax.set_ylabel("p(matching answer)")
    ax.set_title(f"{Path(out['dataset']).stem}: {out['n']} items", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _table(console: Console, out: Dict) -> None:
    t = Table(title=f"p(matching) on {out['n']} items ({out['edit']} at {out['tap']})")
    for name in ("scale", "p(matching)", "shift", "95% interval"):
        t.add_column(name, justify="right")
    b = out["baseline"]
    t.caption = (f"letter mass {b['letter_mass']:.3f}: the probability the two answer letters hold together "
                 "unsteered (near 1: the model reads each question as a choice between them)")
    t.add_row("unsteered", f"{b['p_matching']:.3f}", "", "")
    for s in out["scales"]:
        lo, hi = s["shift_ci95"]
        t.add_row(f"{s['scale']:g}", f"{s['p_matching']:.3f}", f"{s['shift']:+.3f}", f"[{lo:+.3f}, {hi:+.3f}]")
    console.print(t)
    log.info("eval: %s", json.dumps({k: v for k, v in out.items() if k != "items"}))


TASK = TaskDef(Task.eval, check, prepare, run, ab_items=True, data_files=dataset_file)
