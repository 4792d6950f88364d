"""task=select: choose a layer and a strength for the config's edit.

Every (layer, scale) pair of `select.layers` x `select.scales` runs the edit at that layer and strength, all of
them one packed sweep on one engine (steer.runs.run.execute), each into a directory of its own under the run dir.
How a pair is chosen:
1. One probe reads every pair's text (steer/runs/probe.py): by default the direction at the grid layer of best
   held-out AUC, so gains at different layers are numbers on one ruler.
2. A pair's gain is the probe's reading of its steered text minus the baseline's, toward the pole its scale's sign
   points to (a negative scale gains by moving toward the negative set).
3. Each prompt is judged on its own (steer/runs/damage.py): its text loops, or its perplexity exceeds the cap; a
   pair is kept where at most `select.max_bad_prompts` of its prompts are damaged and its mean perplexity is within
   the cap.
4. The pair is chosen on one part of the prompts (`select.split`) and reported on the rest, beside the choosing
   part's numbers: the held-out figures are the ones to trust.
5. The kept pair of largest gain (or judge score, `select.rank_by=judge`) wins; only a positive gain is chosen.
The scales mean what `edit.scale_by` says at every layer: with `resid`, the same share of the stream's typical norm
there. The run dir gets selection.md (the tables and the chosen pair's texts side by side), selection.json and
selection.png (a layers x scales heat map of the gain, rejected cells marked).
"""

import io
import logging
import random
import shlex
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from steer import report as pages, results
from steer.results import read_rows

from steer.config import checks
from steer.edits.plan import build
from steer.report.heatmap import label_colour
from steer.runs import damage, grid, inputs, probe as probes, rundir, run as runner
from steer.runs.grid import cell_name
from steer.runs.job import Job
from steer.config.schema import NOT_RESULTS, SteerConf, Task
from steer.tasks.base import TaskDef

log = logging.getLogger(__name__)
MIN_SPLIT = 4  # prompts a split needs: two on either side


CELL = "cell.json"  # a pair's settings, written as it starts: a rerun keeps a finished pair made with the same
ROW_KEYS = ("probe_steered", "repeat_steered")  # a finished pair's rows hold these, or it is scored again


def _settings(cfg: SteerConf, probe=None) -> Dict:
    """A pair's config as a rerun compares it: what changes its results (steer.config.schema.NOT_RESULTS left out),
    and the probe that reads it."""
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    for key in (*NOT_RESULTS, "select"):  # the grid and the cap choose pairs; a pair's result is its own
        out.pop(key, None)
    if probe is not None:
        out["probe"] = probe.identity()
    return out


def check(cfg: SteerConf, engine: str) -> None:
    checks.run(cfg, engine)


def prepare(job: Job) -> Job:
    """Its grid checked against the model, and a steer job per pair (its plan, and the probe's tap where a probe
    file or layer names it; else the grid's layers choose it once the engine runs)."""
    cfg, spec = job.cfg, job.spec
    checks.select_grid(cfg, spec.layers)
    known = probes.tap(cfg, spec)
    cells = []
    for cell in grid.cells(cfg):
        digests = inputs.vectors(cell)
        plan = build(cell, spec)
        taps = list(plan.taps.values()) + ([known] if known and known.path not in plan.taps else [])
        cells.append(Job(cell, spec, job.out_dir / grid.cell_name(cell), job.engine, job.recipe, tuple(taps), plan,
                         vectors=digests, data=job.data))
    return replace(job, cells=tuple(cells))


def _done(cell) -> Optional[Dict]:
    """A pair's metrics where it finished before with these settings and probe, and its vector files, data files and
    model read as they did then (they then stand as its result); else None."""
    d = cell.out_dir
    got = results.read_json(d / "metrics.json")
    if got is None or "error" in got or results.read_json(d / CELL) != _settings(cell.cfg, cell.probe):
        return None
    rows = read_rows(d)
    if not rows or any(k not in rows[0] for k in ROW_KEYS):  # scored before the probe or the run length was read
        return None
    if inputs.recorded_changes(d, inputs.data_paths(cell.cfg)) is not None:
        return None
    return got


def split(n: int, share: float, seed: int) -> Tuple[List[int], List[int]]:
    """(the prompts a pair is chosen on, the prompts it is reported on), by index: a seeded shuffle cut at `share`,
    at least two on either side; every prompt chooses (and none reports) where `share` is 0 or there are fewer than
    MIN_SPLIT prompts."""
    if share <= 0 or n < MIN_SPLIT:
        return list(range(n)), []
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(max(round(share * n), 2), n - 2)
    return sorted(order[:k]), sorted(order[k:])


def run(job: Job, console: Console, engine=None, command: Optional[Callable[[Dict], str]] = None) -> Dict:
    """Run the grid of a prepared task=select job into its run directory (its pairs in packs, steer.runs.run), write
    the selection report and the run's page, and return the best pair (or none). `engine`: one already started for
    the job's model (steer.Lab's), else one is held for the grid. `command`: the rerun command of the best pair, where
    the run is not a command line's (steer.Lab's), else read from Hydra's."""
    summary = _select(job, console, engine, command)
    if pages.write_quietly(job.out_dir):  # after selection.json, whose pairs the page reads back
        console.print(f"report: [bold]{job.out_dir / pages.FILE}[/] (the heat map, each pair's texts)")
    return summary


def _select(job: Job, console: Console, engine, command: Optional[Callable[[Dict], str]]) -> Dict:
    from steer.runs.job import engine_for

    cfg, out_dir = job.cfg, job.out_dir
    with nullcontext(engine) if engine is not None else engine_for(job.cells) as engine:
        probe = probes.choose(cfg, job.spec, engine)  # the default directions it compares are the pairs' own
        jobs = [replace(cell, probe=probe) for cell in job.cells]
        got = {cell.out_dir: _done(cell) for cell in jobs}
        todo = [cell for cell in jobs if got[cell.out_dir] is None]
        for cell in todo:
            cell.out_dir.mkdir(parents=True, exist_ok=True)
            rundir.clear_stale(cell.out_dir)
            results.write_json(cell.out_dir / CELL, _settings(cell.cfg, probe))
        kept = len(jobs) - len(todo)
        kept = f"; {kept} done before with these settings and inputs, kept" if kept else ""
        n, layers, scales = len(jobs), len(cfg.select.layers), len(cfg.select.scales)
        say = (f"select: {n} pair{'s' * (n > 1)} ({layers} layer{'s' * (layers > 1)} x {scales} "
               f"scale{'s' * (scales > 1)}) in one packed sweep, each in its own directory here{kept}")
        console.print(say)
        log.info(say)  # the run's steer.log (each pair's own says how it ran)
        console.print(f"select: {_probe_line(probe)}", highlight=False, soft_wrap=True)
        try:
            for pack in runner.packs(todo):
                got.update(zip((cell.out_dir for cell in pack),
                               runner.execute(pack, console, summary=False, engine=engine)))
        except KeyboardInterrupt:
            done = sum(1 for cell in jobs if _done(cell) is not None)
            console.print(f"select: interrupted, {done} of {len(jobs)} pairs done; the same command with "
                          f"hydra.run.dir={out_dir} runs the rest and keeps these", soft_wrap=True)
            raise
    rows = {cell.out_dir: (read_rows(cell.out_dir) or []) if not (got[cell.out_dir] or {}).get("error") else []
            for cell in jobs}
    n_prompts = len(cfg.prompts.steer)
    choose, report = split(n_prompts, cfg.select.split, cfg.select.split_seed)
    table = [_cell(cell.cfg, got[cell.out_dir] or {}, rows[cell.out_dir], choose, report, cfg.select) for cell in jobs]
    best = _best(table, cfg.select.rank_by)
    summary = {"best": best, "cells": table, "max_ppl_ratio": cfg.select.max_ppl_ratio,
               "max_bad_prompts": cfg.select.max_bad_prompts, "max_run": cfg.select.max_run,
               "min_distinct_ratio": cfg.select.min_distinct_ratio, "rank_by": cfg.select.rank_by,
               "probe": probe.record(),
               "split": {"share": cfg.select.split, "seed": cfg.select.split_seed, "choose": choose, "report": report},
               "command": (command or _command)(best) if best else None}
    if best:
        log.info("best: layer %s, scale %g (gain %.3g, ppl x%.2f): %s", best["layer"], best["scale"], best["gain"],
                 best["ppl_ratio"], summary["command"])
    else:
        log.info("no pair passed: %s", NO_PAIR)
    texts = rows[next(c.out_dir for c in jobs if c.cfg.tap.layer == best["layer"] and
                      float(c.cfg.edit.scale) == best["scale"])] if best else []
    results.write_json(out_dir / "selection.json", summary)
    results.write_text(out_dir / "selection.md", _markdown(cfg, table, best, summary, texts))
    _heatmap(out_dir / "selection.png", cfg, table, best)
    # Last, as any job's: a sweep of selects (-m) reports and resumes them by it
    results.write_json(out_dir / "metrics.json", _metrics(table, best, probe))
    _print(console, cfg, table, best, summary, out_dir)
    return summary


NO_PAIR = ("none kept its prompts' perplexity within the cap and their text free of loops with a positive gain")


def _metrics(table: List[Dict], best: Optional[Dict], probe) -> Dict:
    """The select run's metrics.json: the chosen pair, on the choosing prompts and on the held-out ones."""
    def of(half, key):
        return best[half][key] if best and best.get(half) else None

    return {"best_layer": best and best["layer"], "best_scale": best and best["scale"],
            "best_gain": best and best["gain"], "best_ppl_ratio": best and best["ppl_ratio"],
            "best_prompts_looping": of("choose", "prompts_looping"),
            "best_prompts_ppl_over": of("choose", "prompts_ppl_over"),
            "heldout_gain": of("report", "gain"), "heldout_ppl_ratio": of("report", "ppl_ratio"),
            "heldout_prompts_looping": of("report", "prompts_looping"),
            "heldout_prompts_ppl_over": of("report", "prompts_ppl_over"),
            "probe_layer": probe.layer, "pairs": len(table), "pairs_kept": sum(c["ok"] for c in table)}


def _best(table: List[Dict], rank_by: str) -> Optional[Dict]:
    """The kept pair of largest gain (rank_by probe) or judge score (rank_by judge; a tie: the larger gain), among
    those with a positive gain."""
    kept = [c for c in table if c["ok"] and c["gain"] is not None and c["gain"] > 0]
    if rank_by == "judge":
        kept = [c for c in kept if c["choose"].get("judge") is not None]
        return max(kept, key=lambda c: (c["choose"]["judge"], c["gain"]), default=None)
    return max(kept, key=lambda c: c["gain"], default=None)


def _mean(rows: Sequence[Dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _diff(a: Optional[float], b: Optional[float], sign: float) -> Optional[float]:
    return None if a is None or b is None else sign * (a - b)


def stats(rows: Sequence[Dict], sign: float) -> Dict:
    """A pair's numbers over some of its prompts (judged rows): the probe's gain toward the scale's pole, the own
    layer's, the mean perplexity ratio and the damaged prompts' counts."""
    m = {k: _mean(rows, k) for k in ("probe_baseline", "probe_steered", "concept_baseline", "concept_steered",
                                     "ppl_baseline", "ppl_steered", "distinct2_baseline", "distinct2_steered",
                                     "rep_steered", "kl", "sentiment_baseline", "sentiment_steered", "judge")}
    ppl = m["ppl_steered"] / m["ppl_baseline"] if m["ppl_baseline"] and m["ppl_steered"] is not None else None
    return {"prompts": len(rows), "gain": _diff(m["probe_steered"], m["probe_baseline"], sign),
            "gain_layer": _diff(m["concept_steered"], m["concept_baseline"], sign), "ppl_ratio": ppl,
            **damage.counts(rows), **m}


def _cell(cfg: SteerConf, m: Dict, rows: List[Dict], choose: List[int], report: List[int], s) -> Dict:
    """A pair's line of selection.json: its numbers on the choosing prompts (`gain`, `ppl_ratio`, `ok`, `why`, and
    `choose`) and on the reporting ones (`report`), and its damaged prompts (`damaged`)."""
    scale = float(cfg.edit.scale)
    cell = {"layer": cfg.tap.layer, "scale": scale, "pole": "negative" if scale < 0 else "positive",
            "dir": cell_name(cfg), "error": m.get("error"), "gain": None, "gain_layer": None, "ppl_ratio": None,
            "ok": False, "why": None, "why_short": None, "choose": None, "report": None, "damaged": []}
    if cell["error"]:
        cell["why"] = cell["why_short"] = "failed"
        return cell
    if len(rows) != len(choose) + len(report) or all(r.get("probe_steered") is None for r in rows):
        cell["why"] = cell["why_short"] = "no continuation to score"
        return cell
    rules = damage.Rules.from_conf(s)
    judged = [{**r, **damage.judge(r, rules)} for r in rows]  # this run's thresholds, whatever the pair's run had
    sign = -1.0 if scale < 0 else 1.0
    cell["choose"] = stats([judged[i] for i in choose], sign)
    cell["report"] = stats([judged[i] for i in report], sign) if report else None
    for key in ("gain", "gain_layer", "ppl_ratio"):
        cell[key] = cell["choose"][key]
    half = {i: "choose" for i in choose} | {i: "report" for i in report}
    cell["damaged"] = [{"index": i, "prompt": r["prompt"], "half": half[i], "looping": r["looping"],
                        "ppl_over": r["ppl_over"], "damage": r["damage"]}
                       for i, r in enumerate(judged) if r["looping"] or r["ppl_over"]]
    why, short = [], []
    c = cell["choose"]
    if c["prompts_bad"] > s.max_bad_prompts:
        bits = [f"{c['prompts_looping']} loop" if c["prompts_looping"] else "",
                f"{c['prompts_ppl_over']} ppl over" if c["prompts_ppl_over"] else ""]
        why.append(f"{c['prompts_bad']} of {c['prompts']} prompts damaged ({', '.join(b for b in bits if b)}; "
                   f"max {s.max_bad_prompts})")
        short.append(f"{c['prompts_bad']} of {c['prompts']} damaged")
    if c["ppl_ratio"] is not None and c["ppl_ratio"] > s.max_ppl_ratio:
        why.append(f"ppl x{damage.shown_ratio(c['ppl_ratio'], s.max_ppl_ratio)} > {s.max_ppl_ratio:g}")
        short.append(why[-1])
    cell["ok"] = not why and c["gain"] is not None and c["ppl_ratio"] is not None
    cell["why"] = "; ".join(why) or (None if cell["ok"] else "no continuation to score")
    cell["why_short"] = "; ".join(short) or cell["why"]  # the heat map's label
    return cell


# Overrides a rerun of the chosen pair leaves out: the select task's own, the pair's tap and strength (given anew),
# and where this run and its sweep wrote (the rerun gets a directory of its own)
DROPPED = ("task", "edit.scale", "hydra/launcher")
DROPPED_UNDER = ("select", "tap", "hydra.run", "hydra.sweep", "hydra.launcher", "hydra.job.num", "hydra.job.id")


def _command(best: Dict) -> str:
    """The steer command that reruns the chosen pair: this run's config directory and name, its overrides less the
    select task's, task=steer and the pair's layer and scale."""
    args = []
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
    except ValueError:  # not under Hydra (called from Python)
        hc = None
    if hc is not None:
        # --config-dir, as Hydra recorded it (an absolute path): the rerun finds the same groups from anywhere
        for source in hc.runtime.config_sources:
            if source.provider == "command-line" and source.schema == "file":
                args += ["--config-dir", source.path]
        if hc.job.config_name and hc.job.config_name != "config":
            args += ["--config-name", hc.job.config_name]
        for o in hc.overrides.task:
            key = o.split("=")[0].lstrip("+~")
            if key not in DROPPED and not any(key == k or key.startswith(k + ".") for k in DROPPED_UNDER):
                args.append(o)
    args += ["task=steer", f"tap.layer={best['layer']}", f"edit.scale={best['scale']:g}"]
    return "python -m steer " + " ".join(shlex.quote(a) for a in args)


def _scale_note(cfg: SteerConf) -> str:
    """Which scale the layers are compared on (edit.scale_by)."""
    return {"vector": "Scales multiply the raw vector (edit.scale_by=vector): its length differs by layer, so a scale "
                      "means more at some layers than others; edit.scale_by=resid compares layers on a common scale.",
            "unit": "Scales multiply the unit direction (edit.scale_by=unit): the same length at every layer, not the "
                    "same share of the stream (edit.scale_by=resid).",
            "resid": "Scales are shares of the mean residual norm at each layer (edit.scale_by=resid): a common scale "
                     "across layers."}.get(cfg.edit.scale_by, "")


def _fmt(x: Optional[float], spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


HOW = ("How the pair is chosen: one probe reads every pair's text (so gains at different layers share a ruler); a "
       "pair's gain is that reading of its steered text minus the baseline's, toward the pole its scale's sign points "
       "to; each prompt is judged on its own (its text loops, or its perplexity exceeds the cap) and a pair is kept "
       "where at most select.max_bad_prompts prompts are damaged and its mean perplexity is within the cap; the pair "
       "is chosen on one part of the prompts and reported on the rest.")


def _probe_line(probe) -> str:
    auc = f" (held-out AUC {probe.auc:.3g})" if probe.auc is not None else ""
    by = ""
    if probe.aucs:
        by = "; by layer: " + ", ".join(f"{k}: {_fmt(v)}" for k, v in probe.aucs.items())
    return f"concept read by one probe for every pair: layer {probe.layer}{auc}, {probe.source}{by}"


def _half_line(summary: Dict, prompts: Sequence[str]) -> str:
    sp = summary["split"]
    if not sp["report"]:
        why = "select.split=0" if sp["share"] <= 0 else f"fewer than {MIN_SPLIT} prompts"
        return (f"Chosen and reported on all {len(sp['choose'])} prompts ({why}): the numbers are the choosing "
                "prompts' own, not held out.")
    return (f"Chosen on {len(sp['choose'])} of {len(prompts)} prompts (select.split={sp['share']:g}, seed "
            f"{sp['seed']}: prompts {', '.join(str(i + 1) for i in sp['choose'])}), reported on the other "
            f"{len(sp['report'])} (prompts {', '.join(str(i + 1) for i in sp['report'])}).")


def _half(c: Optional[Dict]) -> str:
    """A half's numbers in a sentence."""
    if not c:
        return "-"
    return (f"gain {_fmt(c['gain'])}, ppl x{_fmt(c['ppl_ratio'], '.2f')}, {c['prompts_looping']} of {c['prompts']} "
            f"looping, {c['prompts_ppl_over']} over the ppl cap" + (f", judge {c['judge']:.2f}" if c.get("judge")
                                                                    is not None else ""))


def _grid(s, table: List[Dict], value: Callable[[Dict], str]) -> List[str]:
    lines = ["| layer | " + " | ".join(f"{x:g}" for x in s.scales) + " |",
             "| ---: | " + " | ".join("---:" for _ in s.scales) + " |"]
    by = {(c["layer"], c["scale"]): c for c in table}
    for layer in s.layers:
        lines.append(f"| {layer} | " + " | ".join(value(by[(layer, float(x))]) for x in s.scales) + " |")
    return lines


def _markdown(cfg: SteerConf, table: List[Dict], best: Optional[Dict], summary: Dict, rows: List[Dict]) -> str:
    from steer.runs import texts

    s = cfg.select
    held = bool(summary["split"]["report"])
    lines = [f"# Layer and strength for `{cfg.edit.kind.value}` on {cfg.model.name}", "", HOW, "",
             f"Rules: a prompt loops where its distinct-2 < {s.min_distinct_ratio:g} x its baseline's or a token (or a "
             f"unit of up to {damage.UNIT} tokens) repeats {s.max_run} times in a row, more than in its baseline; its "
             f"perplexity is over where ppl_steered > {s.max_ppl_ratio:g} x its ppl_baseline. At most "
             f"{s.max_bad_prompts} damaged prompt{'s' * (s.max_bad_prompts != 1)} per kept pair; ranked by "
             f"{s.rank_by}.", "", f"Probe: {_probe_line(_Shown(summary['probe']))}.", "",
             _half_line(summary, cfg.prompts.steer), "", _scale_note(cfg), ""]
    if best:
        lines += [f"**Best: layer {best['layer']}, scale {best['scale']:g}** (toward the {best['pole']} set). "
                  f"Choosing prompts: {_half(best['choose'])}."]
        if held:
            lines += [f"Held-out prompts: {_half(best['report'])}."]
        lines += ["", f"Rerun it: `{summary['command']}`", ""]
    else:
        lines += [f"**No pair passed**: {NO_PAIR}.", ""]
    lines += ["## Gain by layer and scale (choosing prompts)", "",
              "The probe's gain toward each scale's pole; a rejected pair shows why.", ""]
    lines += _grid(s, table, lambda c: _fmt(c["gain"]) if c["ok"] else f"~~{_fmt(c['gain'])}~~ ({c['why']})")
    if held:
        lines += ["", "## Held-out prompts", "",
                  "Each pair's gain, perplexity ratio and damaged prompts (looping / ppl over) on the prompts it was "
                  "not chosen on.", ""]
        lines += _grid(s, table, lambda c: "-" if not c["report"] else
                       f"{_fmt(c['report']['gain'])} (x{_fmt(c['report']['ppl_ratio'], '.2f')}, "
                       f"{c['report']['prompts_looping']}/{c['report']['prompts_ppl_over']})")
    lines += ["", "## Every pair", "",
              "gain: the probe's; gain (own layer): read along the pair's own layer's direction, a ruler per layer "
              "(not comparable across layers, not used to rank). loop / ppl over: damaged prompts, choosing"
              + (" / held-out" if held else "") + ".", "",
              "| layer | scale | pole | gain | gain (own layer) | ppl x | loop | ppl over |"
              + (" held-out gain | held-out ppl x | held-out loop | held-out ppl over |" if held else "")
              + " distinct-2 steered / base | kl | kept | dir |",
              "|" + " ---: |" * (8 + 4 * held + 2) + " --- | --- |"]
    for c in table:
        ch, rp = c["choose"] or {}, c["report"] or {}
        cols = [str(c["layer"]), f"{c['scale']:g}", c["pole"], _fmt(c["gain"]), _fmt(c["gain_layer"]),
                _fmt(c["ppl_ratio"], ".2f"), str(ch.get("prompts_looping", "-")), str(ch.get("prompts_ppl_over", "-"))]
        if held:
            cols += [_fmt(rp.get("gain")), _fmt(rp.get("ppl_ratio"), ".2f"), str(rp.get("prompts_looping", "-")),
                     str(rp.get("prompts_ppl_over", "-"))]
        cols += [f"{_fmt(ch.get('distinct2_steered'), '.2f')} / {_fmt(ch.get('distinct2_baseline'), '.2f')}",
                 _fmt(ch.get("kl")), "yes" if c["ok"] else "no", c["dir"]]
        lines.append("| " + " | ".join(cols) + " |")
    damaged = [(c, d) for c in table for d in c["damaged"]]
    if damaged:
        lines += ["", "## Damaged prompts", "", "Each pair's prompts whose text loops or whose perplexity exceeds the "
                  "cap, and why.", "", "| pair | prompt | half | damage |", "| --- | --- | --- | --- |"]
        for c, d in damaged:
            lines.append(f"| {c['dir']} | {d['index'] + 1}: {texts.cell(d['prompt'])} | {d['half']} | "
                         f"{texts.cell('; '.join(d['damage']))} |")
    if best and rows:
        halves = {i: "choose" for i in summary["split"]["choose"]} | {i: "held out" for i in summary["split"]["report"]}
        judged = [{**r, **damage.judge(r, damage.Rules.from_conf(s))} for r in rows]
        lines += ["", f"## Texts of the chosen pair ({best['dir']})", ""]
        lines += texts.table(judged, halves if held else None)
    return "\n".join(lines) + "\n"


class _Shown:
    """A probe as selection.json records it, for `_probe_line`."""

    def __init__(self, rec: Dict):
        self.layer, self.auc, self.source = rec["layer"], rec["heldout_auc"], rec["source"]
        self.aucs = {int(k): v for k, v in rec["heldout_auc_by_layer"].items()}


REJECTED_FACE, REJECTED_HATCH = "#bdbdbd", "white"  # a rejected pair: hatched grey, outside the colour map


def _heatmap(path: Path, cfg: SteerConf, table: List[Dict], best: Optional[Dict]) -> None:
    fig = figure(cfg, table, best)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    results.write_bytes(path, buf.getvalue())


def figure(cfg: SteerConf, table: List[Dict], best: Optional[Dict]):
    """The layers x scales heat map of the gain: kept pairs on the colour map (its range theirs alone, so a
    rejected pair's gain cannot make a kept one look pale), rejected pairs hatched grey with why, the best pair
    framed; every label black or white, whichever stands out more from its cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = cfg.select
    by = {(c["layer"], c["scale"]): c for c in table}
    cells = [[by[(layer, float(x))] for x in s.scales] for layer in s.layers]
    gain = np.ma.masked_invalid(np.array([[c["gain"] if c["ok"] and c["gain"] is not None else np.nan for c in row]
                                          for row in cells], dtype=float))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=REJECTED_FACE)
    fig, ax = plt.subplots(figsize=(1.2 * len(s.scales) + 2.5, 0.6 * len(s.layers) + 1.8))
    im = ax.imshow(gain, cmap=cmap, aspect="auto")
    fig.colorbar(im, ax=ax, label="gain toward the scale's pole (kept pairs)")
    for i, row in enumerate(cells):
        for j, c in enumerate(row):
            if c["ok"]:
                face = cmap(im.norm(c["gain"]))
                label = _fmt(c["gain"], ".2g")
            else:
                face = matplotlib.colors.to_rgba(REJECTED_FACE)
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=REJECTED_FACE, hatch="//",
                                           edgecolor=REJECTED_HATCH, lw=0))
                label = f"{_fmt(c['gain'], '.2g')}\n{c.get('why_short') or c['why'] or 'rejected'}"
            ax.text(j, i, label, ha="center", va="center", fontsize=7, color=label_colour(face))
            if best is c:
                ax.add_patch(plt.Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, edgecolor="orange", lw=3))
    ax.set_xticks(range(len(s.scales)), [f"{x:g}" for x in s.scales])
    ax.set_yticks(range(len(s.layers)), [str(x) for x in s.layers])
    ax.set_xlabel("scale")
    ax.set_ylabel("layer")
    ax.set_title(f"{cfg.edit.kind.value}: probe gain toward each scale's pole, ppl cap x{s.max_ppl_ratio:g}\n"
                 "(hatched grey: rejected)", fontsize=9)
    fig.tight_layout()
    return fig


def _print(console: Console, cfg: SteerConf, table: List[Dict], best: Optional[Dict], summary: Dict,
           out_dir: Path) -> None:
    held = bool(summary["split"]["report"])
    t = Table(title="select: gain toward each scale's pole (ppl ratio) [prompts looping / ppl over]"
                    + (", on the choosing prompts" if held else ""))
    t.add_column("layer")
    for x in cfg.select.scales:
        t.add_column(f"scale {x:g}", justify="right")
    by = {(c["layer"], c["scale"]): c for c in table}
    for layer in cfg.select.layers:
        cells = [by[(layer, float(x))] for x in cfg.select.scales]
        t.add_row(str(layer), *[(f"{_fmt(c['gain'])} (x{_fmt(c['ppl_ratio'], '.2f')})" if c["ok"]
                                 else f"[red]{escape(c['why'])}[/]")
                                + (f" [{c['choose']['prompts_looping']}/{c['choose']['prompts_ppl_over']}]"
                                   if c["choose"] else "") for c in cells])
    console.print(t)
    console.print(_scale_note(cfg))
    console.print(_half_line(summary, cfg.prompts.steer), highlight=False, soft_wrap=True)
    if best:
        console.print(f"best: layer {best['layer']}, scale {best['scale']:g}; choosing prompts: {_half(best['choose'])}"
                      + (f"\n  held out: {_half(best['report'])}" if held else "")
                      + f"\n  {summary['command']}", highlight=False, soft_wrap=True)
    else:
        console.print(f"[bold red]no pair passed[/]: {NO_PAIR}")
    console.print(f"report in [bold]{out_dir / 'selection.md'}[/]")


TASK = TaskDef(Task.select, check, prepare, run, resumes_itself=True)
