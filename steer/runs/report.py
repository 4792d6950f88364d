"""Sweep reports, rebuilt from the job directories alone: `summary.csv`, one PNG per metric and `texts.md`.

    python -m steer.runs.report outputs/multirun/<date>/<time>

A job directory counts once its metrics.json exists (written last, atomically): status `ok`. One that holds
error.txt and no metrics.json failed: its row has status `failed` and the error, and no metrics. The swept
parameters are the overrides that differ between jobs: each plot puts the first on the x axis and draws one line
per combination of the others; a metric that is the same for every job gets no plot, and a `<x>_baseline` metric
is drawn as a dashed reference line on its `<x>_steered` plot rather than on a plot of its own. texts.md puts each
job's texts side by side (a select job's: its chosen pair's), with each prompt's damage. A directory with no such
job is an error (exit 2), and nothing is written.

A sweep run again into the same directory with fewer jobs leaves the earlier sweep's other job directories there;
the packed launcher lists its own sweep's in `.jobs`, and the report then holds those alone.
"""

import argparse
import csv
import io
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from steer import results
from steer.report.jobs import job_dirs, job_order, read_jobs, metrics, swept


class NoJobs(ValueError):
    """The directory holds no finished or failed job."""


def write_summary(sweep_dir: Path, rows: List[Dict[str, Any]]) -> Path:
    fields: List[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields and k != "error"]
    fields.append("error")  # last, and always there: empty for a job that finished
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return results.write_text(Path(sweep_dir) / "summary.csv", buf.getvalue())


def plot(sweep_dir: Path, rows: List[Dict[str, Any]], params: List[str]) -> List[Path]:
    """One PNG per metric that varies between the finished jobs, against the first swept parameter, a line per
    combination of the others (summary.csv holds every metric, the constant ones too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not params:
        return []
    names = metrics(rows)
    x_key, others = params[0], params[1:]
    rows = [r for r in rows if r.get("status", "ok") == "ok"]  # a failed job has no metrics to draw
    partner = {m: m.removesuffix("_steered") + "_baseline" for m in names
               if m.endswith("_steered") and m.removesuffix("_steered") + "_baseline" in names}
    out = []
    for metric in names:
        if metric in partner.values():
            continue  # drawn as the reference line on its steered metric's plot
        if not _varies(rows, metric):
            continue  # no value, or the same for every job (a pack's tokens_per_s): nothing to plot
        base = partner.get(metric)
        fig, ax = plt.subplots(figsize=(6, 4))
        lines: Dict[str, list] = {}
        for r in rows:
            label = ", ".join(f"{k}={r.get(k)}" for k in others) or metric
            lines.setdefault(label, []).append((_num(r.get(x_key)), r.get(metric), r.get(base) if base else None))
        for label, pts in lines.items():
            pts = sorted((p for p in pts if p[1] is not None), key=lambda p: (isinstance(p[0], str), p[0]))
            xs = [str(p[0]) if any(isinstance(q[0], str) for q in pts) else p[0] for p in pts]
            drawn = ax.plot(xs, [p[1] for p in pts], marker="o", label=label)[0]
            refs = [(x, p[2]) for x, p in zip(xs, pts) if p[2] is not None]
            if refs:  # the same jobs unsteered: what the steered value is to be judged against
                ax.plot([x for x, _ in refs], [y for _, y in refs], ls="--", lw=1, color=drawn.get_color(),
                        label=f"{label}: {base}" if len(lines) > 1 or others else base)
        xs = [_num(r.get(x_key)) for r in rows]
        if all(isinstance(x, float) and x.is_integer() for x in xs):  # layers, seeds: no half ticks between them
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(x_key)
        ax.set_ylabel(metric)
        if len(lines) > 1 or others or base:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        out.append(results.write_bytes(Path(sweep_dir) / f"{metric}.png", buf.getvalue()))
    return out


def _varies(rows: List[Dict[str, Any]], metric: str) -> bool:
    return len({r.get(metric) for r in rows if r.get(metric) is not None}) > 1


TEXTS = "texts.md"  # every job's texts side by side (steer/runs/texts.py)


def write_texts(sweep_dir: Path, jobs, params: List[str]) -> Optional[Path]:
    """texts.md: per finished job with a results.jsonl (a select job: its chosen pair's), its swept values and its
    texts side by side with each prompt's damage; None where no job has texts."""
    from steer.runs import texts

    lines = ["# Texts side by side", "", "Each job's prompts, baseline and steered text, and each prompt's damage "
             "(loops; perplexity over select.max_ppl_ratio).", ""]
    shown = 0
    for job in sorted(jobs, key=lambda p: job_order(p.name)):
        found = _texts_of(job)
        if found is None:
            continue
        where, rows = found
        over = job / ".hydra" / "overrides.yaml"
        given = [str(o) for o in (yaml.safe_load(over.read_text()) or [] if over.exists() else [])]
        said = [o for o in given if o.partition("=")[0] in params] or given
        lines += [f"## job {job.name}: {', '.join(f'`{o}`' for o in said) or 'no overrides'}"
                  + (f" (chosen pair {where})" if where else ""), ""]
        lines += texts.table(rows) + [""]
        shown += 1
    return results.write_text(Path(sweep_dir) / TEXTS, "\n".join(lines)) if shown else None


def _texts_of(job: Path):
    """(the pair a select job chose, or None; the rows of results.jsonl to show), or None where there are none."""
    import json

    from steer.results import read_rows

    chosen = (results.read_json(job / "selection.json") or {}).get("best") if (job / "selection.json").is_file() \
        else None
    where = job / chosen["dir"] if chosen else job
    if not (where / "results.jsonl").is_file():
        return None
    try:
        rows = read_rows(where)
    except json.JSONDecodeError:
        return None
    return (chosen["dir"] if chosen else None), rows or []


def build(sweep_dir: Path) -> Dict[str, Any]:
    """Rebuild summary.csv and the plots of `sweep_dir`; return what was written, with the rows summary.csv holds
    (`rows`, as read: numbers as numbers). NoJobs, and nothing written, where no job finished or failed."""
    jobs, others = job_dirs(Path(sweep_dir))
    rows = read_jobs(jobs)
    if not rows:
        raise NoJobs(f"{sweep_dir} holds no finished or failed job: no <job>/metrics.json or <job>/error.txt in it")
    params = swept(rows)
    before = _report_files(Path(sweep_dir))
    out = {"summary": write_summary(sweep_dir, rows), "plots": plot(sweep_dir, rows, params), "jobs": len(rows),
           "swept": params, "left_out": others, "rows": rows, "texts": write_texts(sweep_dir, jobs, params)}
    for p in before - set(out["plots"]) - {out["summary"], out["texts"]}:  # a metric no job has now, or no texts
        p.unlink(missing_ok=True)
    return out


def clear(sweep_dir: Path) -> None:
    """Remove the report last written into `sweep_dir`: a sweep starting there must not leave an earlier one's
    summary and plots looking like its own if it is stopped before writing its own."""
    for p in _report_files(Path(sweep_dir)) | {Path(sweep_dir) / "report.html"}:  # steer.report's page too
        p.unlink(missing_ok=True)


def _report_files(sweep_dir: Path) -> set:
    """summary.csv and the plots it was written with (one per column that was a metric: `<column>.png`)."""
    summary = sweep_dir / "summary.csv"
    try:
        with open(summary, newline="") as f:
            header = next(csv.reader(f), [])
    except (OSError, csv.Error, UnicodeDecodeError):
        return set()
    # The metrics' columns: after `status`, before `error` (write_summary); an override's column is no plot
    metrics = header[header.index("status") + 1:-1] if "status" in header and header[-1:] == ["error"] else []
    plots = {sweep_dir / f"{c}.png" for c in metrics if c and "/" not in c and c not in (".", "..")}
    return {summary} | {p for p in plots | {sweep_dir / TEXTS} if p.is_file()}


def left_out(out: Dict[str, Any]) -> str:
    """What a report line adds where the directory holds job directories of an earlier sweep."""
    n = out.get("left_out", 0)
    return f"; {n} job director{'y' if n == 1 else 'ies'} of an earlier sweep here left out" if n else ""


def _num(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m steer.runs.report", description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path)
    args = p.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(f"error: {args.sweep_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        out = build(args.sweep_dir)
    except NoJobs as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out['jobs']} jobs, swept {out['swept']}: {out['summary']}, {len(out['plots'])} plots{left_out(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
