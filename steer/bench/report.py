"""The bench's report: `bench.csv` (one row per cell), `bench.md` (a table per model and batch, ratios to a and
b, the targets), `bench.png` (each configuration's ratio to b per scenario), all written atomically.

    python -m steer.bench.report RUN_DIR   # rewrite a run's report from its records.jsonl, config and run.json
"""

import csv
import io
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from steer import results
from steer.bench import cpu, plot, spells
from steer.bench.fmt import num, ratio
from steer.bench.pairs import STEP, STEP_GAPS
from steer.bench.schema import CONFIGS, FAINT, UNSTEERED, BenchConf
from steer.bench.targets import control_lines, controls, targets
from steer.bench.targets import table as targets_table

_FIELDS = ["model", "requests", "new_tokens", "scenario", "config", "tok_s", "vs_a", "vs_b", "wall_s", "spread",
           "passes", "best_tok_s", "best_vs_b", "vs_eps", "best_vs_eps", "sm_mhz", "power_w", "cpu_busy", "cpu_steal",
           "host_us", "status", "detail"]


def cells(records: List[Dict], cfg: BenchConf) -> List[Dict]:
    """One row per (model, batch, scenario, configuration): a and b measure the unsteered batch, which stands
    for every scenario of that batch. `vs_eps`: a scenario's figure over its faint twin's (`<name>@eps`, the same
    configuration), the effect of the edit's data alone."""
    by = {(r["model"], r["requests"], r["tokens"], r["scenario"], r["config"]): r for r in records}
    rows = []
    for model in cfg.run:
        for req, tok in cfg.batches:
            for scen in cfg.scenarios:
                def get(config, scen=scen):
                    return by.get((model, req, tok, "unsteered" if config in UNSTEERED else scen, config))

                twin = scen + FAINT if scen + FAINT in cfg.scenarios else None
                for config in cfg.configs:
                    faint = get(config, twin) if twin and config not in UNSTEERED else None
                    rows.append({"model": model, "requests": req, "new_tokens": tok, "scenario": scen,
                                 "config": config, **_figures(get(config), get("a"), get("b"), faint)})
    return rows


def _figures(r: Optional[Dict], a: Optional[Dict], b: Optional[Dict], faint: Optional[Dict]) -> Dict:
    """A cell's columns: its figure, its ratios to a and b (and to its faint twin), its GPU's clock and power."""
    r = r or {"status": "not run", "detail": ""}
    t, best = _tok(r), _best(r)
    return {"tok_s": t, "vs_a": ratio(t, _tok(a)), "vs_b": ratio(t, _tok(b)), "wall_s": r.get("wall_s"),
            "spread": r.get("spread"), "passes": len(r.get("walls_s") or ()) or None, "best_tok_s": best,
            "best_vs_b": ratio(best, _best(b)), "vs_eps": ratio(t, _tok(faint)),
            "best_vs_eps": ratio(best, _best(faint)), "sm_mhz": r.get("sm_mhz"), "power_w": r.get("power_w"),
            "cpu_busy": r.get("cpu_busy"), "cpu_steal": r.get("cpu_steal"), "host_us": r.get("host_us"),
            "status": r["status"], "detail": r.get("detail", ""), "walls_s": r.get("walls_s") or [],
            "started_s": r.get("started_s") or [], "paired": bool(r.get("paired")),
            f"{STEP}_passes": r.get(f"{STEP}_passes") or [], f"{STEP_GAPS}_passes": r.get(f"{STEP_GAPS}_passes") or []}


def markdown(rows: List[Dict], goals: List[Dict], cfg: BenchConf, machine: Dict, when: str, command: str,
             records: Sequence[Dict] = (), found: Optional[Dict] = None) -> str:
    """bench.md: how it was measured, a table per model and batch, how pass times followed the host (from the
    cells' `records`), the A/A control (`found`: the run's `controls`, where the caller has them already), the
    targets, and the cells without a figure."""
    lines = _preamble(cfg, machine, when, command) + _tables(rows, cfg) + _host_lines(records, cfg)
    lines += control_lines(controls(rows, cfg) if found is None else found)
    if goals:
        lines += targets_table(goals)
    lines += _missing(rows)
    return "\n".join(lines)


def _own(cfg: BenchConf, which: str = "min_timed_s", unit: str = " s") -> str:
    """The models of the run with a `min_timed_s` (or another setting, `which`, in `unit`) of their own, as the
    preamble names them."""
    own = [f"{name} {getattr(m, which):g}{unit}" for name, m in cfg.models.items()
           if name in cfg.run and getattr(m, which) is not None]
    return f" ({', '.join(own)})" if own else ""


def _preamble(cfg: BenchConf, machine: Dict, when: str, command: str) -> List[str]:
    warm = "a whole pass" if cfg.warmup_tokens is None else f"{cfg.warmup_tokens} new tokens"
    lines = [f"Measured {when} on {machine.get('gpu', '?')} (torch {machine.get('torch', '?')}, vLLM "
             f"{machine.get('vllm', '?')}, nnsight {machine.get('nnsight', '?')}), one run: `{command}`.",
             f"Output tokens per second, the median of the timed passes (at least {cfg.repeats}"
             f"{_own(cfg, 'repeats', '')}, and at least {cfg.min_timed_s:g} s of them{_own(cfg)}, at most "
             f"{cfg.max_repeats}, and none once "
             f"{cfg.max_timed_s:g} s{_own(cfg, 'max_timed_s')} are "
             f"timed) after a warm-up pass ({warm}), timed in rounds: a model's engines that start together take "
             "turns, one pass of each cell an engine still needs per turn, so they sample the same stretch of the "
             "run; `x/a`, `x/b`: ratio to configuration a, b; bench.csv has each cell's passes and spread "
             "((max - min) / median), and its fastest pass (`best_tok_s`).", ""]
    if len(cfg.lanes) > 1:
        lines[-1:-1] = ["Lanes, each starting and timing its own engines as above, side by side with the other: "
                        + "; ".join(f"GPU {ln.gpus} runs {', '.join(ln.runs)}" for ln in cfg.lanes) + "."]
    pinned = [f"lane {i}'s on CPUs {ln.cpus}" if len(cfg.lanes) > 1 else f"on CPUs {ln.cpus}"
              for i, ln in enumerate(cfg.lanes) if ln.cpus is not None]
    if pinned:
        lines[-1:-1] = ["Engines pinned (their processes and threads, `lanes[].cpus`): " + "; ".join(pinned) + "."]
    envs = [f"{name}'s with " + ", ".join(f"{k}={v}" for k, v in m.env.items())
            for name, m in cfg.models.items() if name in cfg.run and m.env]
    if envs:
        lines[-1:-1] = ["Engine processes' own environment (`models.<name>.env`): " + "; ".join(envs) + "."]
    paired = [f"{name}'s over {m.paired}" for name, m in cfg.models.items() if name in cfg.run and m.paired]
    if paired:
        lines[-1:-1] = ["Paired (`models.<name>.paired`), " + "; ".join(paired) + ": in a wave holding that "
                        "configuration, a round goes batch by batch and it times a pass before and after every other "
                        "engine's, so each pass has two of its passes beside it (the targets' `paired`)."]
    if any(s.endswith(FAINT) for s in cfg.scenarios):
        lines[-1:-1] = [f"`<scenario>{FAINT}`: the scenario's edits at {cfg.epsilon:g} of their strength, every "
                        "kernel of the full edit run on the unsteered data: its ratio to b is the machinery's cost, "
                        "and the full scenario's ratio to it the data's effect (on random weights the data moves the "
                        "GPU's power and clock, which the MHz / W tables show)."]
    return lines + [f"- **{c}**: {CONFIGS[c]}" for c in cfg.configs] + [""]


def _tables(rows: List[Dict], cfg: BenchConf) -> List[str]:
    """Per model and batch: each configuration's tok/s and its ratios, machinery against data where a scenario
    has its faint twin, and the GPU's clock and power through each cell's passes."""
    clocked = any(r["sm_mhz"] is not None for r in rows)
    lines = []
    for model in cfg.run:
        for req, tok in cfg.batches:
            mine = {(r["scenario"], r["config"]): r for r in rows
                    if (r["model"], r["requests"], r["new_tokens"]) == (model, req, tok)}
            lines += [f"**{model}**, {req} requests x {tok} new tokens", ""] + _speed_table(mine, cfg)
            lines += _split_table(mine, cfg)
            if clocked:
                lines += _readings_table(mine, cfg, "SM clock (MHz) and power (W)", "MHz / W", "sm_mhz", "power_w",
                                         ",.0f")
            if any(r["cpu_busy"] is not None for r in mine.values()):
                lines += _readings_table(mine, cfg, "The host's busy CPUs and the percent of its CPU time stolen",
                                         "CPUs / % stolen", "cpu_busy", "cpu_steal", ".1f")
    if not clocked:
        lines += ["SM clock and power: not read (no NVML in the engine processes; the bench log says why).", ""]
    return lines


def _speed_table(mine: Dict, cfg: BenchConf) -> List[str]:
    """A row per scenario: each configuration's tok/s and its ratios to a and b (and c over d)."""
    configs = cfg.configs
    steered = [c for c in configs if c not in UNSTEERED]
    ratios = [(c, base) for c in steered for base in ("a", "b") if base in configs]
    ratios += [("h", "i")] if "h" in configs and "i" in configs else []
    ratios += [("j", "f")] if "j" in configs and "f" in configs else []  # the fold alone
    ratios += [("b2", "b")] if "b2" in configs and "b" in configs else []  # the A/A control: the run's noise
    c_over_d = "c" in configs and "d" in configs
    head = ["scenario"] + [f"{c} tok/s" for c in configs] + [f"{c}/{base}" for c, base in ratios]
    if c_over_d:
        head.append("c/d")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for scen in cfg.scenarios:
        vals = [scen] + [_fmt_tok(mine[scen, c]) for c in configs]
        vals += [num(ratio(mine[scen, c]["tok_s"], mine[scen, base]["tok_s"])) for c, base in ratios]
        if c_over_d:
            vals.append(num(ratio(mine[scen, "c"]["tok_s"], mine[scen, "d"]["tok_s"])))
        lines.append("| " + " | ".join(vals) + " |")
    return lines + [""]


def _split_table(mine: Dict, cfg: BenchConf) -> List[str]:
    # On random weights an edit changes the numbers every GEMM multiplies and with them the GPU's power and clock;
    # the faint twin runs every kernel of the edit on the unsteered data, so the two ratios part the costs.
    pairs = [s for s in cfg.scenarios if s + FAINT in cfg.scenarios]
    base = {c: _baseline(c, cfg.configs) for c in cfg.configs if c not in UNSTEERED}
    steered = [c for c, b in base.items() if b is not None]
    if not pairs or not steered:
        return []
    head = ["scenario"] + [f"{c}: {what}" for c in steered for what in (f"machinery (/{base[c]})", "data")]
    lines = [f"Machinery (the edits at {cfg.epsilon:g} of their strength, over the unsteered baseline of the same "
             f"pipeline) and data (the full edits over those), between medians (between fastest passes):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for scen in pairs:
        vals = [scen]
        for c in steered:
            faint, full, b = mine[scen + FAINT, c], mine[scen, c], mine[scen, base[c]]
            vals += [_pair(ratio(faint["tok_s"], b["tok_s"]), ratio(faint["best_tok_s"], b["best_tok_s"])),
                     _pair(full["vs_eps"], full["best_vs_eps"])]
        lines.append("| " + " | ".join(vals) + " |")
    return lines + [""]


def _baseline(config: str, configs) -> Optional[str]:
    """The unsteered configuration whose pipeline `config` runs: i for compiled edits (a where i is not run: the
    model runner differs too), b for the breakable ones; None if that one is not run."""
    if config == "h":
        return "i" if "i" in configs else "a" if "a" in configs else None
    return "b" if "b" in configs else None


def _readings_table(mine: Dict, cfg: BenchConf, title: str, label: str, first: str, second: str,
                    form: str) -> List[str]:
    """A row per scenario: each configuration's two readings through its passes (the medians of the passes')."""
    head = [label] + list(cfg.configs)
    lines = [f"{title} through the timed passes:", "", "| " + " | ".join(head) + " |",
             "|" + "---|" + "---:|" * (len(head) - 1)]
    for scen in cfg.scenarios:
        vals = [scen]
        for c in cfg.configs:
            r = mine[scen, c]
            vals.append("-" if r[first] is None else f"{r[first]:{form}} / {r[second]:{form}}")
        lines.append("| " + " | ".join(vals) + " |")
    return lines + [""]


# Per-pass host readings the report correlates pass times with (steer/bench/cpu.py, placement.py, pauses.py)
_HOST = (("cpu_busy", "busy CPUs"), ("cpu_steal", "steal"),
         ("cpu_apart", "the engine's processes on more than one L3 cache"),
         ("cpu_shared_core", "two of them on one physical core"), ("cpu_moved", "its processes moved"),
         ("gc_s", "the timing process's garbage collections' time"), ("gc_full", "its full collections"),
         ("host_us", "the host-speed probe's time on a CPU of its own (probe_cpu)"))


def _host_lines(records: Sequence[Dict], cfg: BenchConf) -> List[str]:
    """Per model, how its pass times followed the host's CPUs (cpu.follows), the next pass and the CPU that ran
    them (spells.said): whether other work on the machine, the hypervisor, where the engine's processes ran, or
    the engine process itself made a host-bound model's passes slow."""
    lines = []
    for model in cfg.run:
        mine = [r for r in records if r.get("model") == model and r.get("status") == "ok"]
        found = {key: cpu.follows(mine, key) for key, _ in _HOST}
        if any(found.values()):
            said = [f"{what} r = {found[key][0]:+.2f} ({found[key][1]} passes of {found[key][2]} cells)"
                    for key, what in _HOST if found[key]]
            lines.append(f"- {model}: each pass's time over its cell's median, against the host through it: "
                         + "; ".join(said))
        lines += [f"- {model}: {finding}" for finding in spells.said(mine)]
    if not lines:
        return []
    return ["How pass times followed the host (over every timed pass, each pass's time and reading less its cell's "
            "mean; steer/bench/spells.py for the next pass and the CPU):", ""] + lines + [""]


def _missing(rows: List[Dict]) -> List[str]:
    """Why cells have no figure, once per model, configuration and reason."""
    errors = [r for r in rows if r["status"] not in ("ok",)]
    if not errors:
        return []
    lines = ["Cells without a figure:", ""]
    seen = set()
    for r in errors:
        key = (r["model"], r["config"], r["status"], r["detail"])
        if key not in seen:
            seen.add(key)
            lines.append(f"- {r['model']} {r['config']}: {r['status']} {r['detail']}".rstrip())
    return lines + [""]


def write(out_dir, rows: List[Dict], goals: List[Dict], md: str, cfg: BenchConf) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=_FIELDS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    results.write_text(out_dir / "bench.csv", buf.getvalue())
    results.write_text(out_dir / "bench.md", md)
    results.write_bytes(out_dir / "bench.png", plot.bars(rows, cfg))


def _tok(r: Optional[Dict]) -> Optional[float]:
    return r.get("tok_s") if r and r.get("status") == "ok" else None


def _best(r: Optional[Dict]) -> Optional[float]:
    """Output tokens per second of the cell's fastest timed pass."""
    if not r or r.get("status") != "ok" or not r.get("walls_s"):
        return None
    return r["requests"] * r["tokens"] / min(r["walls_s"])


def _pair(median: Optional[float], fastest: Optional[float]) -> str:
    return f"{num(median)} ({num(fastest)})"


def _fmt_tok(r: Dict) -> str:
    if r["tok_s"] is not None:
        return f"{r['tok_s']:,.0f}"
    return {"not run": "-", "skipped": "skipped"}.get(r["status"], r["status"])


def rewrite(run_dir: Path) -> str:
    """Rewrite a bench run's report from what the run left: records.jsonl, .hydra/config.yaml and run.json (the
    machine, the time and the command), e.g. after the report's layout changed."""
    from omegaconf import OmegaConf

    from steer.bench import schema

    schema.register()
    missing = [p for p in ("records.jsonl", ".hydra/config.yaml", "run.json") if not (run_dir / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a bench run directory: it has no {', '.join(missing)}")
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

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


class Damaged(ValueError):
    """A bench run's file that cannot be what the run wrote."""


def _json(where: Path, text: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise Damaged(f"{where}: not JSON ({e})") from None


def publish(out_dir: Path, records: List[Dict], cfg: BenchConf, machine: Dict, when: str, command: str) -> str:
    """Write the whole report of these records, and run.json, which lets `rewrite` redo it; returns bench.md."""
    rows = cells(records, cfg)
    found = controls(rows, cfg)  # the control's bootstraps, once for both tables
    goals = targets(rows, cfg, found)
    md = markdown(rows, goals, cfg, machine, when, command, records, found)
    write(out_dir, rows, goals, md, cfg)
    results.write_text(out_dir / "run.json", json.dumps({"machine": machine, "when": when, "command": command}))
    return md


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Rewrite a bench run's report from what the run left.")
    p.add_argument("run_dir", type=Path, help="the bench run's directory (records.jsonl, .hydra/, run.json)")
    a = p.parse_args(argv)
    try:
        print(rewrite(a.run_dir))
    except (FileNotFoundError, Damaged) as e:
        print(f"error run_dir: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
