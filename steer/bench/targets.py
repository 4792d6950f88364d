"""The bench's targets and its A/A control: which ratios a run met, and how far its own noise moved a ratio.

The control is configuration b2: b's pipeline doing b's work in an engine process of its own. Nothing steer does
differs between b2 and b, so b2/b sits away from 1 only by the run's noise: the host's spells and each engine
process's own speed, which no resampling of one cell's passes sees (a process that runs 10% slow for its
lifetime slows every one of its passes). A target whose margin, either way and as a share of its threshold, is
within the control's distance from 1 in the same column at the same model and batch is marked so: the run could
not tell it from noise. One control is one draw of that noise: a control at 1.00 by chance marks nothing, and it
shares its wave of engines with b, so it does not see what moves between waves.
"""

import math
from typing import Dict, List, Optional, Tuple

from steer.bench import bootstrap, pairs
from steer.bench.fmt import num, ratio, span
from steer.bench.schema import BenchConf

CONTROL, REFERENCE = "b2", "b"
# The measure (below) that decides a target of each `between`; the control's in the same column sits beside it
_COLUMN = {"medians": "ratio", "fastest": "best", "paired": "paired"}


def targets(rows: List[Dict], cfg: BenchConf, found: Optional[Dict[Tuple[str, int, int], Dict]] = None) -> List[Dict]:
    """Each target at each model and batch it covers: the measured ratios (between medians, fastest passes, and
    where `over` was the run's pairing reference, paired passes), whether the one it is `between` holds, and the
    control's ratio in that column (`control`, None where b2 or b did not run). `found`: the run's `controls`,
    where the caller has them already."""
    by = _by_cell(rows)
    controls = _controls(by, cfg) if found is None else found
    out = []
    for t in cfg.targets:
        for model in ([t.model] if t.model else cfg.run):
            if model not in cfg.run or t.scenario not in cfg.scenarios:
                continue
            for req, new in cfg.batches:
                of, over = (by.get((model, req, new, t.scenario, c)) for c in (t.of, t.over))
                got = measure(of, over)
                decides = got[_COLUMN[t.between]]  # workload.check allows only _COLUMN's keys
                label = f"{t.of}/{t.over} >= {t.at_least:g}" + ("" if t.between == "medians" else f" ({t.between})")
                control = controls.get((model, req, new), {}).get(_COLUMN[t.between])
                out.append({"target": label, "scenario": t.scenario, "model": model, "batch": f"{req}x{new}",
                            "required": t.at_least, "between": t.between, "decided": decides, **got,
                            "holds": None if decides is None else decides >= t.at_least, "control": control,
                            "chance": _chance(of, over, t.at_least) if t.between == "fastest" else None,
                            "one_pass": one_pass(of, over, t.at_least) if decides is not None
                            and t.between == "fastest" and got["paired"] is None else None})
    return out


def one_pass(of: Optional[Dict], over: Optional[Dict], at_least: float) -> bool:
    """Whether a verdict between two cells' fastest passes turns on one pass: it flips with either cell's fastest
    pass left out (the next fastest in its place). One pass that caught the host in a rare fast spell decides
    every target it is the reference of; this says which verdicts stand on such a pass, whichever way they went."""
    mine, theirs = (sorted((c or {}).get("walls_s") or []) for c in (of, over))
    if len(mine) < 2 or len(theirs) < 2:
        return False
    holds = theirs[0] / mine[0] >= at_least  # throughput over the reference's: its time over mine
    return any((t / m >= at_least) != holds for m, t in ((mine[1], theirs[0]), (mine[0], theirs[1])))


def measure(of: Optional[Dict], over: Optional[Dict]) -> Dict:
    """`of` over `over` (two report rows of one model and batch): `ratio` between medians, `best` between fastest
    passes (in a paired run, among the reference passes beside of's, pairs.py), `paired` and `paired_interval`
    where `over` was the run's pairing reference, and `interval`, the medians' ratio's on the passes' noise."""
    of, over = of or {}, over or {}
    medians = ratio(of.get("tok_s"), over.get("tok_s"))
    pair = pairs.figures(of, over) if over.get("paired") and of.get("status") == "ok" else {}
    best = pair.get("paired_fastest") or ratio(of.get("best_tok_s"), over.get("best_tok_s"))
    got = {"ratio": medians, "best": best, "paired": pair.get("paired"),
           "paired_interval": pair.get("paired_interval"),
           "interval": bootstrap.interval(of.get("walls_s") or [], over.get("walls_s") or [])}
    if of.get("status") != "ok":
        return {**got, "steps": None, "steps_interval": None, "fast_steps": None, "fast_steps_interval": None}
    return {**got, **pairs.steps(of, over), **pairs.fast_steps(of, over)}


def controls(rows: List[Dict], cfg: BenchConf) -> Dict[Tuple[str, int, int], Dict]:
    """b2 over b (`measure`) at each model and batch where both were timed."""
    return _controls(_by_cell(rows), cfg)


def within_noise(goal: Dict) -> bool:
    """Whether a target's margin, either way and as a share of its threshold, is no larger than its control's
    distance from 1 (a share too: noise moves a ratio by a fraction of itself, whatever the threshold)."""
    if goal.get("control") is None or goal.get("decided") is None or not goal.get("required"):
        return False
    return abs(goal["decided"] / goal["required"] - 1.0) <= abs(goal["control"] - 1.0)


def control_lines(found: Dict[Tuple[str, int, int], Dict]) -> List[str]:
    """bench.md's control table, or nothing where the run had none."""
    if not found:
        return []
    lines = [f"The A/A control ({CONTROL}: {REFERENCE}'s pipeline and work in an engine process of its own, so "
             f"{CONTROL}/{REFERENCE} differs from 1 only by this run's noise, the host's and each process's own; a "
             "target whose margin is within it in its column is marked `within noise`):", "",
             f"| model | batch | {CONTROL}/{REFERENCE}: medians | fastest passes | paired | interval | steps | "
             "fastest steps |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (model, req, new), got in found.items():
        paired = "-" if got["paired"] is None else f"{num(got['paired'])} ({span(got['paired_interval'])})"
        lines.append(f"| {model} | {req}x{new} | {num(got['ratio'])} | {num(got['best'])} | {paired} | "
                     f"{span(got['interval'])} | {_steps(got)} | {_steps(got, 'fast_steps')} |")
    return lines + [""]


def table(goals: List[Dict]) -> List[str]:
    """bench.md's targets table; a `control` column where the run had the A/A control."""
    # By default the verdict is the medians'. A host-bound model's passes spread by half, so the fastest passes'
    # ratio and the paired one beside it tell a cost from noise; a target marked (fastest) or (paired) is decided
    # there. An interval (bootstrap.py) reaching past the threshold means the run did not decide it, whichever
    # side the ratio fell on; fastest passes have none (resampled, they only ever rise), so are never flagged.
    controlled = any(g.get("control") is not None for g in goals)
    chanced = any(g.get("chance") is not None for g in goals)
    left_out = any(g.get("one_pass") is not None for g in goals)  # unpaired verdicts between fastest passes
    head = ["target", "scenario", "model", "batch", "measured", "fastest passes", "paired", "interval", "steps",
            "fastest steps"]
    head += [f"control ({CONTROL}/{REFERENCE})"] if controlled else []
    head += ["miss by chance"] if chanced else []
    lines = ["Targets (measured: the medians' ratio; holds: decided on it, or for a target marked (fastest) or "
             "(paired) on that column's ratio; fastest passes: the same ratio between each cell's fastest pass (in"
             " a paired run, among the reference passes beside the cell's); paired: the median of each pass's "
             f"ratio to the reference passes beside it, and its {bootstrap.LEVEL:.0%} interval "
             "(steer/bench/pairs.py); interval: the medians' ratio's, resampling each cell's passes; steps: the "
             "ratio from the passes' median decode steps (the engine core's), paired where the run was, with its "
             f"interval; fastest steps: the ratio between the cells' fastest decode steps (the {pairs.FAST_Q:.0%} "
             "quantile of all their timed passes' steps; in a paired run, of the reference pass just before each of "
             "the cell's), "
             "with its interval; both shown beside the verdict and never deciding it; undecided: a "
             "target between medians or paired passes whose interval reaches past its threshold"
             + ("; turns on one pass: a verdict between fastest passes that flips with either cell's fastest pass "
                "left out" if left_out else "")
             + ("; control: the A/A control's ratio in the column that decides the target" if controlled else "")
             + ("; miss by chance: for a target decided between fastest passes, how often an engine exactly as fast "
                "as the reference, timed as many passes as the cell, would miss it (two draws of that many of the "
                f"reference's own passes, {bootstrap.RESAMPLES:,} times, with replacement where it has fewer than "
                "twice as many)" if chanced else "")
             + "):", "", "| " + " | ".join(head + ["holds"]) + " |",
             "|---|---|---|---|" + "---:|" * (len(head) - 4) + "---|"]
    for g in goals:
        reach = g["paired_interval"] if g["between"] == "paired" else g.get("interval")
        verdict = "not run" if g["holds"] is None else "yes" if g["holds"] else \
            f"**no** ({g['decided'] - g['required']:+.3f})"
        if g["holds"] is not None and g["between"] != "fastest" and reach and reach[0] < g["required"] <= reach[1]:
            verdict += ", undecided"
        if within_noise(g):
            verdict += ", within noise"
        if g.get("one_pass"):
            verdict += ", turns on one pass"
        paired = "-" if g["paired"] is None else f"{num(g['paired'])} ({span(g['paired_interval'])})"
        cols = [g["target"], g["scenario"], g["model"], g["batch"], num(g["ratio"]), num(g["best"]), paired,
                span(g.get("interval")), _steps(g), _steps(g, "fast_steps")] + \
            ([num(g.get("control"))] if controlled else []) + \
            ([_share(g.get("chance"))] if chanced else [])
        lines.append("| " + " | ".join(cols + [verdict]) + " |")
    return lines + [""] + _chance_line(goals)


def _chance_line(goals: List[Dict]) -> List[str]:
    # The run's power: with every engine exactly as fast as its reference, how many of the targets decided between
    # fastest passes would miss anyway, and how often all would hold (as if the draws were independent)
    odds = [g["chance"] for g in goals if g.get("chance") is not None and g["holds"] is not None]
    if not odds:
        return []
    every = math.prod(1.0 - p for p in odds)
    flags = [g["one_pass"] for g in goals if g.get("one_pass") is not None]
    single = f" {sum(flags)} of their verdicts turn on one pass." if flags else ""
    return [f"At no cost at all, the {len(odds)} targets decided between fastest passes would miss "
            f"{sum(odds):.1f} of them by chance at these passes a cell, and all {len(odds)} hold in "
            f"{every:.0%} of runs (their chances taken as independent).{single}", ""]


def _share(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0%}"


def _chance(of: Optional[Dict], over: Optional[Dict], at_least: float) -> Optional[float]:
    # An engine exactly as fast as `over`, timed as many passes as `of` was, drawn from over's own passes
    if not of or not over or of.get("status") != "ok":
        return None
    return bootstrap.chance_below(over.get("walls_s") or [], len(of.get("walls_s") or []), at_least)


def _steps(got: Dict, key: str = "steps") -> str:
    return "-" if got.get(key) is None else f"{num(got[key])} ({span(got.get(f'{key}_interval'))})"


def _by_cell(rows: List[Dict]) -> Dict[tuple, Dict]:
    return {(r["model"], r["requests"], r["new_tokens"], r["scenario"], r["config"]): r for r in rows}


def _controls(by: Dict[tuple, Dict], cfg: BenchConf) -> Dict[Tuple[str, int, int], Dict]:
    if CONTROL not in cfg.configs or REFERENCE not in cfg.configs or not cfg.scenarios:
        return {}
    found = {}
    for model in cfg.run:
        for req, new in cfg.batches:
            # unsteered configurations have one batch that every scenario's row repeats
            of, over = (by.get((model, req, new, cfg.scenarios[0], c)) or {} for c in (CONTROL, REFERENCE))
            if of.get("status") == "ok" and over.get("status") == "ok":
                found[(model, req, new)] = measure(of, over)
    return found
