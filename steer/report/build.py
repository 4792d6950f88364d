"""report.html for a directory: which kind it is (a run, a sweep's root, a task=select run), what its files hold, and
the page rendered from them with Jinja2 (steer/report/templates/).

Every number on a page is one the directory's JSON files hold (metrics.json, results.jsonl, selection.json,
eval.json, vectors.json, summary.csv's rows as steer.report.jobs reads them from the jobs), shown rounded with the
full value on hover; the plots are drawn from those numbers or are the PNGs the run wrote. The page is one file: its
styles and script inline, its images as data URIs, so it opens offline and travels as an attachment.
"""

import base64
import io
import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from steer import results
from steer.report import jobs, text
from steer.report.meanings import meaning

log = logging.getLogger(__name__)
FILE = "report.html"
VECTORS = "vectors.json"  # a run's directions by tap: where each came from and its diagnostics (steer.runs.run)
TEXT_KEYS = ("prompt", "fed", "baseline", "steered")  # results.jsonl's texts; other fields are shown by their type


class NothingToReport(ValueError):
    """The directory holds no run, sweep or selection."""


def kind(d: Path) -> str:
    """`select`, `run` or `sweep`, by the files in `d`; NothingToReport where none fits."""
    if (d / "selection.json").is_file():
        return "select"
    if any((d / f).is_file() for f in ("metrics.json", "results.jsonl", "eval.json", "error.txt")):
        return "run"
    if jobs.job_dirs(d)[0]:
        return "sweep"
    raise NothingToReport(f"{d} holds no run (metrics.json, results.jsonl, error.txt), sweep (<job>/metrics.json) "
                          "or selection (selection.json)")


def write(d: Path) -> Path:
    """Render `d`'s report into d/report.html (atomically); its path."""
    d = Path(d)
    page = {"select": select_page, "run": run_page, "sweep": sweep_page}[kind(d)](d)
    return results.write_text(d / FILE, render(page))


def write_quietly(d: Path) -> Optional[Path]:
    """`write`, for the end of a run, sweep or selection: a report that cannot be written is a warning in the log,
    never the run's failure (its results are already on disk; `python -m steer.report DIR` writes it later)."""
    try:
        return write(d)
    except Exception as e:  # noqa: BLE001 - the run's own files stand whatever the report does
        log.warning("report.html not written in %s: %s: %s", d, type(e).__name__, e)
        return None


def render(page: Dict[str, Any]) -> str:
    env = _env()
    return env.get_template(f"{page['kind']}.html.j2").render(**page)


_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        import jinja2

        _ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
                                  autoescape=True, trim_blocks=True, lstrip_blocks=True,
                                  undefined=jinja2.StrictUndefined)
        _ENV.filters["num"] = text.number
        _ENV.filters["full"] = text.full
        _ENV.globals["meaning"] = meaning
    return _ENV


# --- what a run directory holds ------------------------------------------------------------------------------------


def read_config(d: Path) -> Optional[Dict[str, Any]]:
    """The run's composed config as Hydra saved it (.hydra/config.yaml), or None (a run saved from Python)."""
    path = d / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return None


def read_rows(path: Path) -> List[Dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def prompt_view(row: Dict[str, Any]) -> Dict[str, Any]:
    """One results.jsonl line as the page shows it: the texts with the words that differ marked, the flags (a field
    that is true, or a list of names) and the per-prompt numbers, every other field by its type, ids left out."""
    flags, numbers, other = [], [], []
    for key, value in row.items():
        if key in TEXT_KEYS:
            continue
        if isinstance(value, bool):
            if value:
                flags.append(key)
        elif isinstance(value, (int, float)) or value is None:
            numbers.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            flags += [f"{key}: {x}" for x in value]
        elif isinstance(value, list):
            continue  # token ids
        elif isinstance(value, dict):
            numbers += [(f"{key}.{k}", v) for k, v in value.items()
                        if (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None]
            flags += [f"{key}.{k}" for k, v in value.items() if v is True]
        else:
            other.append((key, value))
    base, steered = row.get("baseline", ""), row.get("steered", "")
    marked_base, marked_steered = text.diff(base, steered)
    return {"prompt": row.get("prompt", ""), "fed": row.get("fed"), "baseline": marked_base,
            "steered": marked_steered, "flags": flags, "numbers": numbers, "other": other,
            "baseline_text": base, "steered_text": steered}


def edits(cfg: Optional[Dict[str, Any]], grid: bool = False) -> List[str]:
    """The config's edits, one line each, as the run composed them (`layer 12: add, scale 4, tokens both`); `grid`:
    a task=select run's, whose first edit runs at each pair's layer and scale."""
    if not cfg:
        return []
    pairs = [(cfg.get("tap") or {}, cfg.get("edit") or {})]
    pairs += [(e.get("tap") or {}, e.get("edit") or {}) for e in cfg.get("extra_edits") or []]
    out = []
    for tap, edit in pairs:
        where = f"layer {tap['layer']}" if tap.get("layer") is not None else str(tap.get("path") or "?")
        bits = [f"{edit.get('kind', '?')}", f"scale {edit.get('scale')}"]
        if grid and not out:
            where, bits = "each pair's layer", [f"{edit.get('kind', '?')}", "each pair's scale"]
        if edit.get("scale_by") not in (None, "vector"):
            bits.append(f"scale_by {edit['scale_by']}")
        for k in {"clamp": ("lo", "hi"), "set": ("value",)}.get(str(edit.get("kind")), ()):
            if edit.get(k) is not None:
                bits.append(f"{k} {edit[k]}")
        bits.append(f"tokens {edit.get('tokens', 'both')}")
        vec = (edit.get("vector") or {}).get("path")
        bits.append(f"vector {vec}" if vec else "vector: the default direction at the tap")
        out.append(f"{where}: " + ", ".join(bits))
    return out


def vectors(d: Path) -> List[Dict[str, Any]]:
    """vectors.json: each tap's direction (where it came from, its diagnostics), as the run recorded it."""
    got = results.read_json(d / VECTORS)
    return list(got.get("vectors", [])) if isinstance(got, dict) else []


def run_page(d: Path) -> Dict[str, Any]:
    cfg = read_config(d)
    got = results.read_json(d / "metrics.json") or {}
    lines = edits(cfg)
    title = f"{_model(cfg)} · {(cfg or {}).get('task', 'run')}"
    title += f" · {lines[0].split(', vector')[0]}" if lines else ""
    page: Dict[str, Any] = {"kind": "run", "title": title, "dir": str(d), "config": cfg,
                            "config_text": _config_text(d), "edits": lines, "task": (cfg or {}).get("task"),
                            "model": _model(cfg), "metrics": list(got.items()), "paired": paired(got),
                            "vectors": vectors(d),
                            "prompts": [prompt_view(r) for r in read_rows(d / "results.jsonl")],
                            "error": _error(d), "images": [], "plots": []}
    layers = _extract_layers(got)
    if len(layers) > 1:
        page["plots"].append(("Extraction diagnostics per layer", diagnostics_plot(layers)))
    ev = results.read_json(d / "eval.json")
    if ev is not None:
        page["eval"] = ev
    for name, caption in (("eval.png", "p(matching answer) against the steering scale (eval.json)"),):
        if (d / name).is_file():
            page["images"].append((caption, data_uri((d / name).read_bytes())))
    return page


def paired(got: Dict[str, Any]) -> Dict[str, Any]:
    """metrics.json read as a researcher compares it: each `<name>_baseline` beside its `<name>_steered`, then the
    rest in file order."""
    pairs, used = [], set()
    for k in got:
        if k.endswith("_baseline") and f"{k[:-9]}_steered" in got:
            name = k[: -len("_baseline")]
            steered = f"{name}_steered"
            pairs.append({"name": name, "baseline": (k, got[k]), "steered": (steered, got[steered])})
            used |= {k, f"{name}_steered"}
    return {"pairs": pairs, "rest": [(k, v) for k, v in got.items() if k not in used]}


def _model(cfg: Optional[Dict[str, Any]]) -> str:
    m = (cfg or {}).get("model") or {}
    return str(m.get("name") or m.get("source") or "?")


def _config_text(d: Path) -> Optional[str]:
    path = d / ".hydra" / "config.yaml"
    return path.read_text() if path.is_file() else None


def _error(d: Path) -> Optional[str]:
    path = d / "error.txt"
    return path.read_text(errors="replace") if path.is_file() and not (d / "metrics.json").is_file() else None


def _extract_layers(got: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A task=extract run over extract.layers: each layer's diagnostics from metrics.json's diag.<k>.* keys."""
    layers = got.get("layers") if isinstance(got.get("layers"), list) else []
    out = []
    for k in layers:
        diag = {key.split(".", 2)[2]: v for key, v in got.items() if key.startswith(f"diag.{k}.")}
        out.append({"layer": k, "diagnostics": diag})
    return out


# --- a sweep -------------------------------------------------------------------------------------------------------


def sweep_page(d: Path) -> Dict[str, Any]:
    dirs, left_out = jobs.job_dirs(d)
    rows = jobs.read_jobs(dirs)
    params = jobs.swept(rows)
    names = _telling_first(jobs.metrics(rows), rows)
    table = [{"job": r["job"], "params": [r.get(p) for p in params], "status": r.get("status"),
              "error": r.get("error"), "metrics": [r.get(m) for m in names],
              "link": f"{r['job']}/{FILE}" if (d / r["job"] / FILE).is_file() else None} for r in rows]
    plots = [(m, data_uri((d / f"{m}.png").read_bytes())) for m in names if (d / f"{m}.png").is_file()]
    per_job = {r["job"]: read_rows(d / r["job"] / "results.jsonl") for r in rows}
    layers = [{"layer": v.get("layer"), "diagnostics": v.get("diagnostics") or {}, "job": r["job"]}
              for r in rows for v in vectors(d / r["job"])[:1] if v.get("layer") is not None]
    distinct = {x["layer"]: x for x in layers}
    diag_plots = [("Extraction diagnostics per layer (each job's first direction)",
                   diagnostics_plot(sorted(distinct.values(), key=lambda x: x["layer"])))] if len(distinct) > 1 else []
    title = f"steer sweep: {len(rows)} jobs over {', '.join(params) or 'nothing'}"
    return {"kind": "sweep", "title": title, "dir": str(d), "params": params, "metrics": names,
            "table": table, "plots": plots + diag_plots, "left_out": left_out,
            "failed": sum(r.get("status") == "failed" for r in rows), "texts": text_view(rows, params, per_job)}


def _telling_first(names: List[str], rows: List[Dict[str, Any]]) -> List[str]:
    """The table's metric columns: those that differ between jobs first (the steered side before the rest), the
    ones every job shares last."""
    ok = [r for r in rows if r.get("status", "ok") == "ok"]

    def key(i_name):
        i, name = i_name
        same = len({repr(r.get(name)) for r in ok}) <= 1
        return (same, not name.endswith("_steered"), i)

    return [n for _, n in sorted(enumerate(names), key=key)]


def text_view(rows: List[Dict[str, Any]], params: List[str], per_job: Dict[str, List[Dict]]) -> Dict[str, Any]:
    """Each prompt across every job: its steered text in each, on a grid of the first two swept parameters where
    there are two (layer x scale), else a list; the baseline once where every job's is the same."""
    prompts: List[str] = []
    for got in per_job.values():
        prompts += [r.get("prompt", "") for r in got if r.get("prompt", "") not in prompts]
    grid = len(params) == 2
    axes = [list(dict.fromkeys(str(r.get(p)) for r in rows)) for p in params[:2]] if grid else []
    if grid:
        axes = [sorted(a, key=_order) for a in axes]
    views = []
    for p in prompts:
        cells = []
        for r in rows:
            hit = next((x for x in per_job.get(r["job"], []) if x.get("prompt", "") == p), None)
            if hit is None:
                continue
            cells.append({"job": r["job"], "params": [(k, r.get(k)) for k in params], "view": prompt_view(hit),
                          "key": tuple(str(r.get(k)) for k in params[:2])})
        bases = {c["view"]["baseline_text"] for c in cells}
        at = {c["key"]: c for c in cells} if grid else {}
        views.append({"prompt": p, "cells": cells, "baseline": next(iter(bases)) if len(bases) == 1 else None,
                      "grid": [[at.get((a, b)) for b in axes[1]] for a in axes[0]] if grid else None})
    return {"prompts": views, "grid": grid, "axes": axes, "names": params[:2]}


def _order(v: str):
    try:
        return (0, float(v), v)
    except ValueError:
        return (1, 0.0, v)


# --- a selection ---------------------------------------------------------------------------------------------------


def select_page(d: Path) -> Dict[str, Any]:
    from steer.report import heatmap

    cfg = read_config(d)
    sel = results.read_json(d / "selection.json") or {}
    cells = sel.get("cells") or []
    sel_cfg = (cfg or {}).get("select") or {}
    layers = list(sel_cfg.get("layers") or dict.fromkeys(c["layer"] for c in cells))
    scales = [float(x) for x in (sel_cfg.get("scales") or dict.fromkeys(c["scale"] for c in cells))]
    best = sel.get("best")
    texts = {}
    for c in cells:
        cd = d / c["dir"]
        texts[c["dir"]] = {"prompts": [prompt_view(r) for r in read_rows(cd / "results.jsonl")],
                           "link": f"{c['dir']}/{FILE}" if (cd / FILE).is_file() else None,
                           "metrics": list((results.read_json(cd / "metrics.json") or {}).items())}
    diags = []
    for c in cells:
        for v in vectors(d / c["dir"])[:1]:
            if v.get("layer") is not None and all(x["layer"] != v["layer"] for x in diags):
                diags.append({"layer": v["layer"], "diagnostics": v.get("diagnostics") or {}})
    diags.sort(key=lambda x: x["layer"])
    plots = [("Extraction diagnostics per layer", diagnostics_plot(diags))] if len(diags) > 1 else []
    return {"kind": "select", "title": f"{_model(cfg)} · select: a layer and a strength", "dir": str(d),
            "model": _model(cfg),
            "edits": edits(cfg, grid=True), "config_text": _config_text(d), "best": best, "command": sel.get("command"),
            "max_ppl_ratio": sel.get("max_ppl_ratio"), "map": heatmap.grid(cells, layers, scales, best),
            "texts": texts, "plots": plots, "metrics": list((results.read_json(d / "metrics.json") or {}).items())}


# --- pictures ------------------------------------------------------------------------------------------------------


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def diagnostics_plot(layers: List[Dict[str, Any]]) -> str:
    """Held-out AUC and the norm ratio against the layer, one axis each (a data URI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [int(x["layer"]) for x in layers]
    auc = [x["diagnostics"].get("heldout_auc") for x in layers]
    ratio = [x["diagnostics"].get("norm_ratio") for x in layers]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(xs, [float("nan") if a is None else a for a in auc], marker="o", color="#1f5fa8", label="held-out AUC")
    ax.set_xlabel("layer")
    ax.set_ylabel("held-out AUC", color="#1f5fa8")
    ax.set_ylim(0.0, 1.05)
    ax.axhline(0.5, color="#777", lw=0.8, ls=":", label="chance (AUC 0.5)")
    ax2 = ax.twinx()
    ax2.plot(xs, [float("nan") if r is None else r for r in ratio], marker="s", color="#b35900", label="norm ratio")
    ax2.set_ylabel("norm / stream norm", color="#b35900")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="lower right")
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return data_uri(buf.getvalue())
