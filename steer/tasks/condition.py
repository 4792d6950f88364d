"""task=condition: choose the layer and threshold of an edit's condition (edit.when), as CAST's
find_best_condition_point does: at each layer of `condition.layers`, every held-out condition prompt is scored
(edit.when.score, edit.when.reduce), and the (layer, comparison, threshold) of the grid with the highest F1 at telling
prompts.condition_positive from prompts.condition_negative is the choice (the middle of the best thresholds' run,
farthest from both sides' scores).

The condition direction is edit.when.vector's (a multi-layer file gives each layer its own), or, where that is null,
extracted at each layer from a share `condition.split` of the prompts, the rest being the held-out ones scored. The
run dir gets condition.json (the choice, each layer's best, every prompt's score) and condition.png (F1 against the
threshold at each layer, the choice marked).
"""

import random
from contextlib import nullcontext
from dataclasses import replace
from typing import Dict, List, Tuple

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from steer import results
from steer.config import checks
from steer.config.schema import SteerConf, TapConf, Task
from steer.edits.condition import Condition
from steer.edits.plan import when_vector
from steer.edits.tap import resolve
from steer.runs.extract import Recipe, direction
from steer.runs.job import Job
from steer.tasks.base import TaskDef


def check(cfg: SteerConf, engine: str) -> None:
    checks.run(cfg, engine, conditions=False)  # the condition's layer and threshold are what it chooses
    checks.condition_task(cfg)


def prepare(job: Job) -> Job:
    """Its grid checked against the model, a tap per layer of it, and a condition file's layers read now (a missing
    one is said before the engine starts)."""
    cfg, spec = job.cfg, job.spec
    checks.condition_task(cfg, spec.layers)
    taps = tuple(resolve(TapConf(layer=k), spec, "condition.layers") for k in cfg.condition.layers)
    if cfg.edit.when.vector is not None:
        for k in cfg.condition.layers:
            when_vector(cfg.edit.when.vector, cfg.edit.when.key, spec.hidden, "edit.when", k)
    return replace(job, taps=taps)


def split(cfg: SteerConf) -> Tuple[Tuple[List[str], List[str]], Tuple[List[str], List[str]]]:
    """((positive, negative) to extract from, (positive, negative) held out): a seeded share of each side, or
    none to extract from where edit.when.vector names the direction."""
    pos, neg = list(cfg.prompts.condition_positive), list(cfg.prompts.condition_negative)
    if cfg.edit.when.vector is not None:
        return ([], []), (pos, neg)
    rng = random.Random(cfg.condition.seed)
    out = []
    for side in (pos, neg):
        order = list(range(len(side)))
        rng.shuffle(order)
        k = max(1, min(len(side) - 1, round(cfg.condition.split * len(side))))
        out.append(([side[i] for i in sorted(order[:k])], [side[i] for i in sorted(order[k:])]))
    return (out[0][0], out[1][0]), (out[0][1], out[1][1])


def f1(truth: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """F1 of each row of `predicted` (`[grid, n]` bool) against `truth` (`[n]` bool)."""
    tp = (predicted & truth).sum(-1)
    fp = (predicted & ~truth).sum(-1)
    fn = (~predicted & truth).sum(-1)
    denom = 2 * tp + fp + fn
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 0.0)


def middle(f: np.ndarray) -> int:
    """The index of the middle of the first run of thresholds where F1 is at its highest: the threshold farthest
    from both sides' scores among the best."""
    i = int(np.argmax(f))
    j = i
    while j + 1 < len(f) and f[j + 1] == f[i]:
        j += 1
    return (i + j) // 2


def grid(cfg: SteerConf) -> np.ndarray:
    c = cfg.condition
    return np.round(np.arange(-1.0, 1.0 + c.step / 2, c.step), 6)


def run(job: Job, console: Console, engine=None) -> Dict:
    """Score the held-out prompts at every layer of the grid (on `engine`, else one it holds), write condition.json,
    condition.png and metrics.json; the choice as metrics."""
    from steer.runs.job import engine_for

    cfg = job.cfg
    w = cfg.edit.when
    (fit_pos, fit_neg), (held_pos, held_neg) = split(cfg)
    recipe = Recipe.from_conf(cfg.extract, cfg.prompts.chat)
    thresholds = grid(cfg)
    truth = np.array([True] * len(held_pos) + [False] * len(held_neg))
    layers: Dict[int, Dict] = {}
    with nullcontext(engine) if engine is not None else engine_for([job]) as engine:
        held = held_pos + held_neg
        encoded = [engine.encode(p, cfg.prompts.chat) for p in held]
        taps = {k: resolve(TapConf(layer=k), job.spec, "condition.layers") for k in cfg.condition.layers}
        scored = engine.score_many([(ids, [], None, tuple(t.path for t in taps.values())) for ids in encoded])
        for k, tap in taps.items():
            if w.vector is not None:
                v = when_vector(w.vector, w.key, job.spec.hidden, "edit.when", k)[0]
            else:
                v = direction(engine, tap, fit_pos, fit_neg, recipe).reshape(-1)
            cond = Condition(tap.path, v, w.reduce, w.score)
            scores = np.array([float(cond.scores(s.captured[tap.path][None], torch.ones(1, len(ids), dtype=bool))[0])
                               for ids, s in zip(encoded, scored)])
            above = f1(truth, scores[None] > thresholds[:, None])
            below = f1(truth, scores[None] < thresholds[:, None])
            best = max((float(f.max()), how, float(thresholds[middle(f)])) for how, f in (("above", above),
                                                                                         ("below", below)))
            layers[k] = {"f1": best[0], "compare": best[1], "threshold": best[2], "scores": scores.tolist(),
                         "f1_above": above.tolist(), "f1_below": below.tolist()}
    k = max(layers, key=lambda x: (layers[x]["f1"], -x))  # ties: the earlier layer, decided sooner
    choice = {"layer": k, "threshold": layers[k]["threshold"], "compare": layers[k]["compare"],
              "f1": layers[k]["f1"], "score": w.score, "reduce": w.reduce, "held_out": len(held),
              "extracted_from": len(fit_pos) + len(fit_neg)}
    out = job.out_dir
    results.write_json(out / "condition.json", {"choice": choice, "thresholds": thresholds.tolist(),
                                                "prompts": held, "positive": len(held_pos),
                                                "layers": {str(x): d for x, d in layers.items()}})
    _plot(out / "condition.png", thresholds, layers, choice)
    table = Table(title=f"condition: F1 on {len(held)} held-out prompts ({w.score}, {w.reduce})")
    for name in ("layer", "f1", "compare", "threshold"):
        table.add_column(name, justify="right")
    for x, d in layers.items():
        mark = " *" if x == k else ""
        table.add_row(f"{x}{mark}", f"{d['f1']:.3f}", d["compare"], f"{d['threshold']:g}")
    console.print(table)
    console.print(f"chosen: edit.when.layer={k} edit.when.compare={choice['compare']} "
                  f"edit.when.threshold={choice['threshold']:g} (F1 {choice['f1']:.3f}); condition.json, "
                  f"condition.png in {out}", highlight=False, soft_wrap=True)
    metrics = {f"condition.{key}": v for key, v in choice.items()}
    results.write_json(out / "metrics.json", metrics)
    return metrics


def _plot(path, thresholds: np.ndarray, layers: Dict[int, Dict], choice: Dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, d in layers.items():
        f = np.array(d[f"f1_{d['compare']}"])
        ax.plot(thresholds, f, label=f"layer {k} ({d['compare']})", lw=2 if k == choice["layer"] else 1)
    ax.axvline(choice["threshold"], color="k", ls=":", lw=1)
    ax.set_xlabel("threshold")
    ax.set_ylabel("F1 (held-out condition prompts)")
    ax.set_title(f"condition: layer {choice['layer']}, {choice['compare']} {choice['threshold']:g}, "
                 f"F1 {choice['f1']:.3f}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


TASK = TaskDef(Task.condition, check, prepare, run)
