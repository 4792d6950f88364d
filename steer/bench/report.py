"""The bench's report: `bench.csv` (one row per cell), `bench.md` (a table per model and batch: throughput, each
configuration's ratio to a and b with its spread, the targets), `bench.png` (the ratios to a), written atomically.

    python -m steer.bench.report RUN_DIR   # rewrite a run's report from its records.jsonl, config and run.json

A ratio is the median, over the rounds both cells timed a pass in, of the one pass's throughput over the other's,
and its spread the least and greatest of those per-round ratios: passes of one round run seconds apart, so the
host's slow spells move both. Two cells that share no round (engines of different waves, neither a reference)
give the ratio of their medians instead, its spread the extremes of their passes, marked `*`.
"""

import csv
import io
import json
import sys
from pathlib import Path
from statistics import median
from typing import Dict, List, Optional, Tuple

from steer import results
from steer.bench.schema import CONFIGS, FAINT, PEERS, UNSTEERED, BenchConf

Ratio = Tuple[float, float, float, bool]  # median, least, greatest, paired by round
_FIELDS = ["model", "requests", "new_tokens", "scenario", "config", "tok_s", "passes", "vs_a", "vs_a_lo", "vs_a_hi",
           "vs_b", "vs_b_lo", "vs_b_hi", "status", "detail"]


def ratio(of: Optional[Dict], over: Optional[Dict]) -> Optional[Ratio]:
    """`of`'s throughput over `over`'s (two records of one model and batch), with its spread; None unless both
    were timed."""
    if not of or not over or of.get("status") != "ok" or over.get("status") != "ok":
        return None
    mine, theirs = (dict(zip(r.get("rounds") or [], r["walls_s"])) for r in (of, over))
    shared = sorted(mine.keys() & theirs.keys())
    if shared:  # the same batch: throughput over throughput is wall time over wall time, the other way up
        each = [theirs[k] / mine[k] for k in shared]
        return median(each), min(each), max(each), True
    return (median(over["walls_s"]) / median(of["walls_s"]), min(over["walls_s"]) / max(of["walls_s"]),
            max(over["walls_s"]) / min(of["walls_s"]), False)


def pairs(configs: List[str]) -> List[Tuple[str, str]]:
    """The ratios the report gives: every configuration over a (vLLM's default) and each of steer's steered ones
    over b; h over i (its own pipeline unsteered), j over f (the fold alone), b2 over b (the A/A control: the run's
    own noise), c over d (nnsight), and each of steer's steered ones over each peer (the same edits in its engine)."""
    out = [(c, "a") for c in configs if c != "a" and "a" in configs]
    ours = [c for c in configs if c not in UNSTEERED and c not in PEERS]
    out += [(c, "b") for c in ours if "b" in configs]
    out += [p for p in (("h", "i"), ("j", "f"), ("b2", "b"), ("c", "d")) if set(p) <= set(configs)]
    return out + [(c, peer) for peer in PEERS if peer in configs for c in ours if c not in ("d", "e")]


def cells(records: List[Dict], cfg: BenchConf) -> List[Dict]:
    """One row per (model, batch, scenario, configuration), with its record and its ratios (`pairs`): an unsteered
    configuration's one batch stands for every scenario of that batch."""
    by = {(r["model"], r["requests"], r["tokens"], r["scenario"], r["config"]): r for r in records}
    rows = []
    for model in cfg.run:
        for req, tok in cfg.batches:
            for scen in cfg.scenarios:
                def get(c):
                    return by.get((model, req, tok, "unsteered" if c in UNSTEERED else scen, c))

                for config in cfg.configs:
                    r = get(config) or {"status": "not run"}
                    row = {"model": model, "requests": req, "new_tokens": tok, "scenario": scen, "config": config,
                           "tok_s": r.get("tok_s"), "passes": len(r.get("walls_s") or ()) or None,
                           "status": r["status"], "detail": r.get("detail", ""), "record": get(config),
                           "ratios": {over: ratio(get(of), get(over)) for of, over in pairs(cfg.configs)
                                      if of == config}}
                    for base in ("a", "b"):
                        got = row["ratios"].get(base)
                        row.update(zip((f"vs_{base}", f"vs_{base}_lo", f"vs_{base}_hi"), got[:3] if got else ()))
                    rows.append(row)
    return rows


def targets(rows: List[Dict], cfg: BenchConf) -> List[Dict]:
    """Each target at each model and batch it covers: the ratio, and whether its median holds."""
    by = {(r["model"], r["requests"], r["new_tokens"], r["scenario"], r["config"]): r for r in rows}
    out = []
    for t in cfg.targets:
        for model in [m for m in ([t.model] if t.model else cfg.run) if m in cfg.run]:
            for req, new in cfg.batches:
                if t.scenario not in cfg.scenarios:
                    continue
                of, over = (by[model, req, new, t.scenario, c] if c in cfg.configs else None for c in (t.of, t.over))
                got = ratio(*(None if r is None else r["record"] for r in (of, over)))
                out.append({"target": f"{t.of}/{t.over} >= {t.at_least:g}", "scenario": t.scenario, "model": model,
                            "batch": f"{req}x{new}", "required": t.at_least, "ratio": got,
                            "holds": None if got is None else got[0] >= t.at_least})
    return out


def markdown(rows: List[Dict], goals: List[Dict], cfg: BenchConf, machine: Dict, when: str, command: str) -> str:
    """bench.md: how it was measured, a table per model and batch, the targets, and the cells without a figure."""
    lines = [f"Measured {when} on {machine.get('gpu', '?')} (torch {machine.get('torch', '?')}, vLLM "
             f"{machine.get('vllm', '?')}, nnsight {machine.get('nnsight', '?')}), one run: `{command}`.", "",
             f"Output tokens per second, the median of {cfg.repeats} timed rounds (a model's own `repeats` where "
             f"set; no further pass once a cell's add up to {cfg.max_timed_s:g} s), each cell's first pass after a "
             "warm-up pass of its batch and edits. A model's engines take turns, one pass of each cell per turn, "
             "and the references a and b time a pass in every round. `x/y`: the median over the rounds both timed "
             "of x's throughput over y's, and in brackets the least and greatest of those ratios; `*`: x and y "
             "shared no round, so the ratio of their medians and the extremes of their passes.", ""]
    if any(s.endswith(FAINT) for s in cfg.scenarios):
        lines += [f"`<scenario>{FAINT}`: the scenario's edits at {cfg.epsilon:g} of their strength, every kernel of "
                  "the full edit on the unsteered data: its ratio to b is the machinery's cost alone.", ""]
    lines += [f"- **{c}**: {CONFIGS[c]}" for c in cfg.configs] + [""]
    ratios = pairs(cfg.configs)
    for model in cfg.run:
        for req, tok in cfg.batches:
            mine = {(r["scenario"], r["config"]): r for r in rows
                    if (r["model"], r["requests"], r["new_tokens"]) == (model, req, tok)}
            head = ["scenario"] + [f"{c} tok/s" for c in cfg.configs] + [f"{of}/{over}" for of, over in ratios]
            lines += [f"**{model}**, {req} requests x {tok} new tokens", "", "| " + " | ".join(head) + " |",
                      "|---|" + "---:|" * (len(head) - 1)]
            for scen in cfg.scenarios:
                vals = [scen] + [_tok(mine[scen, c]) for c in cfg.configs]
                vals += [_ratio(mine[scen, of]["ratios"][over]) for of, over in ratios]
                lines.append("| " + " | ".join(vals) + " |")
            lines.append("")
    if goals:
        lines += ["Targets (the ratio's median decides; undecided: its spread reaches past the threshold):", "",
                  "| target | scenario | model | batch | ratio | holds |", "|---|---|---|---|---:|---|"]
        for g in goals:
            got, need = g["ratio"], g["required"]
            verdict = "not run" if got is None else "yes" if g["holds"] else f"**no** ({got[0] - need:+.3f})"
            if got is not None and got[1] < need <= got[2]:
                verdict += ", undecided"
            lines.append(f"| {g['target']} | {g['scenario']} | {g['model']} | {g['batch']} | {_ratio(got)} | "
                         f"{verdict} |")
        lines.append("")
    missing = dict.fromkeys(f"- {r['model']} {r['config']}: {r['status']} {r['detail']}".rstrip() for r in rows
                            if r["status"] != "ok")
    return "\n".join(lines + (["Cells without a figure:", "", *missing, ""] if missing else []))


def _tok(r: Dict) -> str:
    return f"{r['tok_s']:,.0f}" if r["tok_s"] is not None else {"not run": "-"}.get(r["status"], r["status"])


def _ratio(got: Optional[Ratio]) -> str:
    return "-" if got is None else f"{got[0]:.2f} ({got[1]:.2f}-{got[2]:.2f}){'' if got[3] else '*'}"


def bars(rows: List[Dict], cfg: BenchConf) -> bytes:
    """bench.png: per model and batch, each configuration's throughput over a's, scenario by scenario, with the
    spread of its per-round ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, r, t) for m in cfg.run for r, t in cfg.batches]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    shown = [c for c in cfg.configs if c != "a"]
    width = 0.8 / max(len(shown), 1)
    for ax, (model, req, tok) in zip(axes[0], panels):
        for k, c in enumerate(shown):
            got = [next((r for r in rows if (r["model"], r["requests"], r["new_tokens"], r["scenario"],
                                             r["config"]) == (model, req, tok, s, c)), {}).get("vs_a")
                   for s in cfg.scenarios]
            ax.bar([i + (k - (len(shown) - 1) / 2) * width for i in range(len(cfg.scenarios))],
                   [g or 0.0 for g in got], width, label=c)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(cfg.scenarios)), cfg.scenarios)
        ax.set_title(f"{model}, {req}x{tok}")
        ax.set_ylabel("output tok/s / a")
    axes[0][0].legend(title="config", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def publish(out_dir: Path, records: List[Dict], cfg: BenchConf, machine: Dict, when: str, command: str) -> str:
    """Write the whole report of these records, and run.json, which lets `rewrite` redo it; returns bench.md."""
    rows = cells(records, cfg)
    md = markdown(rows, targets(rows, cfg), cfg, machine, when, command)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_FIELDS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    results.write_text(out_dir / "bench.csv", buf.getvalue())
    results.write_text(out_dir / "bench.md", md)
    results.write_bytes(out_dir / "bench.png", bars(rows, cfg))
    results.write_text(out_dir / "run.json", json.dumps({"machine": machine, "when": when, "command": command}))
    return md


class Damaged(ValueError):
    """A bench run's file that cannot be what the run wrote."""


def rewrite(run_dir: Path) -> str:
    """Rewrite a bench run's report from what the run left: records.jsonl, .hydra/config.yaml and run.json."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    from steer.bench import schema

    missing = [p for p in ("records.jsonl", ".hydra/config.yaml", "run.json") if not (run_dir / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a bench run directory: it has no {', '.join(missing)}")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema.BenchConf),
                                                  OmegaConf.load(run_dir / ".hydra/config.yaml")))
    except (OmegaConfBaseException, YAMLError) as e:
        raise Damaged(f"{run_dir / '.hydra/config.yaml'}: {' '.join(str(e).split())}") from None
    meta = _json(run_dir / "run.json", (run_dir / "run.json").read_text())
    if not isinstance(meta, dict) or {"machine", "when", "command"} - set(meta):
        raise Damaged(f"{run_dir / 'run.json'}: expected an object with machine, when and command")
    lines = (run_dir / "records.jsonl").read_text().splitlines()
    records = [_json(run_dir / f"records.jsonl:{i + 1}", line) for i, line in enumerate(lines) if line.strip()]
    if not records:  # a report of nothing would write every cell "not run" over the one there
        raise Damaged(f"{run_dir / 'records.jsonl'} holds no record")
    return publish(run_dir, records, cfg, meta["machine"], meta["when"], meta["command"])


def _json(where: Path, text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise Damaged(f"{where}: not JSON ({e})") from None


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Rewrite a bench run's report from what the run left.")
    p.add_argument("run_dir", type=Path, help="the bench run's directory (records.jsonl, .hydra/, run.json)")
    try:
        print(rewrite(p.parse_args(argv).run_dir))
    except (FileNotFoundError, Damaged) as e:
        print(f"error run_dir: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
