"""task=select: choose a layer and a strength for the config's edit.

Every (layer, scale) pair of `select.layers` x `select.scales` runs the edit at that layer and strength, all of
them one packed sweep on one engine (steer.runs.run.execute), each into a directory of its own under the run dir.
A pair's score is its concept gain (concept_steered - concept_baseline: how much more of the direction the
unsteered model reads in the steered text) among pairs whose perplexity stays within `max_ppl_ratio` of the
baseline's and whose steered text does not loop (distinct2_steered at least `min_distinct_ratio` of the
baseline's: a loop such as "La la la ..." reads a low perplexity, the model predicting it well). A strength that
breaks the text is rejected however much concept it shows, and only a positive gain is chosen. The scales mean
what `edit.scale_by` says at every layer: with `resid`, the same share of the stream's typical norm there.
The run dir gets selection.md, selection.json and selection.png (a layers x scales heat map of the gain, rejected
cells marked).
"""

import io
import logging
import shlex
from pathlib import Path
from typing import Callable, Dict, List, Optional

from rich.console import Console
from rich.table import Table

from steer import results

from steer.runs import rundir
from steer.runs.grid import cell_name
from steer.config.schema import NOT_RESULTS, SteerConf

log = logging.getLogger(__name__)


CELL = "cell.json"  # a pair's settings, written as it starts: a rerun keeps a finished pair made with the same


def _settings(cfg: SteerConf) -> Dict:
    """A pair's config as a rerun compares it: what changes its results (steer.config.schema.NOT_RESULTS left out)."""
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    for key in (*NOT_RESULTS, "select"):  # the grid and the cap choose pairs; a pair's result is its own
        out.pop(key, None)
    return out


def _done(cell) -> bool:
    """Whether a pair finished before with these settings, and its vector files, data files and model read as they
    did then; its metrics then stand as its result."""
    from steer.runs import inputs

    d = cell.out_dir
    got = results.read_json(d / "metrics.json")
    if got is None or "error" in got or results.read_json(d / CELL) != _settings(cell.cfg):
        return False
    if "distinct2_steered" not in got:  # scored before repetition was measured: its text is judged again
        return False
    if inputs.recorded_changes(d, inputs.data_paths(cell.cfg)) is not None:
        return False
    cell.result = got
    return True


def run(job, console: Console, execute: Callable, engine=None, command: Optional[Callable[[Dict], str]] = None) -> Dict:
    """Run the grid of a prepared task=select job into its run directory with `execute` (steer.runs.run.execute_packs),
    write the selection report and return the best pair (or none). `engine`: one already started for the job's
    model (steer.Lab's), else one is held for the grid. `command`: the rerun command of the best pair, where the
    run is not a command line's (steer.Lab's), else read from Hydra's."""
    from contextlib import nullcontext

    from steer.runs.job import engine_for

    cfg, out_dir, jobs = job.cfg, job.out_dir, job.cells
    todo = [cell for cell in jobs if not _done(cell)]
    for cell in todo:
        cell.out_dir.mkdir(parents=True, exist_ok=True)
        rundir.clear_stale(cell.out_dir)
        results.write_json(cell.out_dir / CELL, _settings(cell.cfg))
    kept = len(jobs) - len(todo)
    kept = f"; {kept} done before with these settings and inputs, kept" if kept else ""
    n, layers, scales = len(jobs), len(cfg.select.layers), len(cfg.select.scales)
    say = (f"select: {n} pair{'s' * (n > 1)} ({layers} layer{'s' * (layers > 1)} x {scales} scale{'s' * (scales > 1)}) "
           f"in one packed sweep, each in its own directory here{kept}")
    console.print(say)
    log.info(say)  # the run's steer.log (each pair's own says how it ran)
    if todo:
        try:
            with nullcontext(engine) if engine is not None else engine_for(todo) as engine:
                execute(todo, console, engine=engine)
        except KeyboardInterrupt:
            done = sum(1 for cell in jobs if _done(cell))
            console.print(f"select: interrupted, {done} of {len(jobs)} pairs done; the same command with "
                          f"hydra.run.dir={out_dir} runs the rest and keeps these", soft_wrap=True)
            raise
    table = [_cell(job.cfg, job.result or {}, cfg.select.max_ppl_ratio, cfg.select.min_distinct_ratio)
             for job in jobs]
    best = max((c for c in table if c["ok"] and c["gain"] > 0), key=lambda c: c["gain"], default=None)
    summary = {"best": best, "cells": table, "max_ppl_ratio": cfg.select.max_ppl_ratio,
               "command": (command or _command)(best) if best else None}
    if best:
        log.info("best: layer %s, scale %g (gain %.3g, ppl x%.2f): %s", best["layer"], best["scale"], best["gain"],
                 best["ppl_ratio"], summary["command"])
    else:
        log.info("no pair passed: none kept perplexity within the cap and its text free of loops with a positive "
                 "gain")
    results.write_json(out_dir / "selection.json", summary)
    results.write_text(out_dir / "selection.md", _markdown(cfg, table, best, summary["command"]))
    _heatmap(out_dir / "selection.png", cfg, table, best)
    # Last, as any job's: a sweep of selects (-m) reports and resumes them by it
    results.write_json(out_dir / "metrics.json", {
        "best_layer": best and best["layer"], "best_scale": best and best["scale"], "best_gain": best and best["gain"],
        "best_ppl_ratio": best and best["ppl_ratio"], "pairs": len(table), "pairs_kept": sum(c["ok"] for c in table)})
    _print(console, cfg, table, best, summary["command"], out_dir)
    return summary


def _cell(cfg: SteerConf, m: Dict, cap: float, min_distinct: float = 0.0) -> Dict:
    cell = {"layer": cfg.tap.layer, "scale": cfg.edit.scale, "dir": cell_name(cfg), "error": m.get("error"),
            "gain": None, "ppl_ratio": None, "ok": False, "why": None}
    if cell["error"]:
        cell["why"] = "failed"
        return cell
    for k in ("concept_baseline", "concept_steered", "ppl_baseline", "ppl_steered", "distinct2_baseline",
              "distinct2_steered", "rep_steered", "sentiment_baseline", "sentiment_steered", "kl_mean"):
        cell[k] = m.get(k)
    if None in (m.get("concept_baseline"), m.get("concept_steered"), m.get("ppl_baseline"), m.get("ppl_steered")):
        cell["why"] = "no continuation to score"
        return cell
    cell["gain"] = m["concept_steered"] - m["concept_baseline"]
    cell["ppl_ratio"] = m["ppl_steered"] / m["ppl_baseline"]
    why = []
    if cell["ppl_ratio"] > cap:
        shown = f"{cell['ppl_ratio']:.2f}"
        if float(shown) <= cap:  # x2.0000001 against a cap of 2 must not read "x2.00 > 2"
            shown = f"{cell['ppl_ratio']:.8g}"
        why.append(f"ppl x{shown} > {cap:g}")
    base, steered = m.get("distinct2_baseline"), m.get("distinct2_steered")
    if base is not None and steered is not None and steered < min_distinct * base:
        why.append(f"repetitive: distinct-2 {steered:.2f} < {min_distinct:g} x {base:.2f}")
    cell["ok"] = not why
    cell["why"] = "; ".join(why) or None
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


def _markdown(cfg: SteerConf, table: List[Dict], best: Optional[Dict], command: Optional[str]) -> str:
    s = cfg.select
    lines = [f"# Layer and strength for `{cfg.edit.kind.value}` on {cfg.model.name}", "",
             f"Score: concept gain (concept_steered - concept_baseline) among pairs with ppl_steered <= "
             f"{s.max_ppl_ratio:g} x ppl_baseline and distinct2_steered >= {s.min_distinct_ratio:g} x "
             "distinct2_baseline; only a positive gain is chosen.", "", _scale_note(cfg), ""]
    if best:
        lines += [f"**Best: layer {best['layer']}, scale {best['scale']:g}** (gain {best['gain']:.3g}, "
                  f"ppl x{best['ppl_ratio']:.2f}). Rerun it: `{command}`", ""]
    else:
        lines += ["**No pair passed** (the perplexity cap, the repetition check and a positive gain).", ""]
    lines += ["Concept gain by layer (rows) and scale (columns); a rejected pair shows why.", "",
              "| layer | " + " | ".join(f"{x:g}" for x in s.scales) + " |",
              "| ---: | " + " | ".join("---:" for _ in s.scales) + " |"]
    by = {(c["layer"], c["scale"]): c for c in table}
    for layer in s.layers:
        row = []
        for scale in s.scales:
            c = by[(layer, float(scale))]
            row.append(_fmt(c["gain"]) if c["ok"] else f"~~{_fmt(c['gain'])}~~ ({c['why']})")
        lines.append(f"| {layer} | " + " | ".join(row) + " |")
    lines += ["", "| layer | scale | concept base | concept steered | ppl base | ppl steered | distinct-2 base | "
                  "distinct-2 steered | rep steered | sentiment base | sentiment steered | kl_mean | dir |",
              "|" + " ---: |" * 12 + " --- |"]
    for c in table:
        lines.append(f"| {c['layer']} | {c['scale']:g} | " + " | ".join(
            _fmt(c.get(k)) for k in ("concept_baseline", "concept_steered", "ppl_baseline", "ppl_steered",
                                     "distinct2_baseline", "distinct2_steered", "rep_steered", "sentiment_baseline",
                                     "sentiment_steered", "kl_mean")) + f" | {c['dir']} |")
    return "\n".join(lines) + "\n"


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
    fig.colorbar(im, ax=ax, label="concept gain (kept pairs)")
    for i, row in enumerate(cells):
        for j, c in enumerate(row):
            if c["ok"]:
                face = cmap(im.norm(c["gain"]))
                label = _fmt(c["gain"], ".2g")
            else:
                face = matplotlib.colors.to_rgba(REJECTED_FACE)
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=REJECTED_FACE, hatch="//",
                                           edgecolor=REJECTED_HATCH, lw=0))
                label = f"{_fmt(c['gain'], '.2g')}\n{c['why'] or 'rejected'}"
            ax.text(j, i, label, ha="center", va="center", fontsize=7, color=label_colour(face))
            if best is c:
                ax.add_patch(plt.Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, edgecolor="orange", lw=3))
    ax.set_xticks(range(len(s.scales)), [f"{x:g}" for x in s.scales])
    ax.set_yticks(range(len(s.layers)), [str(x) for x in s.layers])
    ax.set_xlabel("scale")
    ax.set_ylabel("layer")
    ax.set_title(f"{cfg.edit.kind.value}: concept gain, ppl cap x{s.max_ppl_ratio:g} (hatched grey: rejected)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def label_colour(face) -> str:
    """Black or white, whichever has the higher contrast ratio (WCAG 2) against the colour `face`."""
    def lum(rgb):
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    y = lum(face)
    return "black" if (y + 0.05) / 0.05 >= 1.05 / (y + 0.05) else "white"


def _print(console: Console, cfg: SteerConf, table: List[Dict], best: Optional[Dict], command: Optional[str],
           out_dir: Path) -> None:
    t = Table(title="select: concept gain (ppl ratio)")
    t.add_column("layer")
    for x in cfg.select.scales:
        t.add_column(f"scale {x:g}", justify="right")
    by = {(c["layer"], c["scale"]): c for c in table}
    for layer in cfg.select.layers:
        cells = [by[(layer, float(x))] for x in cfg.select.scales]
        t.add_row(str(layer), *[(f"{_fmt(c['gain'])} (x{_fmt(c['ppl_ratio'], '.2f')})" if c["ok"]
                                 else f"[red]{c['why']}[/]") for c in cells])
    console.print(t)
    console.print(_scale_note(cfg))
    if best:
        console.print(f"best: layer {best['layer']}, scale {best['scale']:g} (gain {best['gain']:.3g}, ppl "
                      f"x{best['ppl_ratio']:.2f})\n  {command}")
    else:
        console.print("[bold red]no pair passed[/] (the perplexity cap, the repetition check and a positive gain)")
    console.print(f"report in [bold]{out_dir / 'selection.md'}[/]")
