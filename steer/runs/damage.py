"""Damage judged per prompt: whether one prompt's steered text loops or collapses, and whether its perplexity costs
more than the cap. A mean over prompts hides a collapse (one prompt turned into `💡💡💡💡` reads a low perplexity and,
averaged with five clean ones, passes); each prompt is judged on its own, against its own baseline.

A prompt *loops* where its steered text's distinct bigrams fall under `min_distinct_ratio` x its baseline's, or
where a token (or a unit of up to UNIT tokens: an emoji is several) repeats `max_run` times in a row and more times
than anywhere in its baseline. Its perplexity is *over* where ppl_steered > `max_ppl_ratio` x ppl_baseline. The
thresholds are task=select's (`select.*`); every run flags its prompts with them (results.jsonl) and counts them
(metrics.json: prompts_looping, prompts_ppl_over).
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

UNIT = 4  # the longest unit, in tokens, whose back-to-back repeats count as a run


def longest_repeat(tokens: List[int], unit: int = UNIT) -> int:
    """The most times one unit of 1..`unit` tokens occurs back to back in `tokens` ("a a a a": 4; "ab ab ab": 3);
    0 for an empty continuation, 1 where nothing repeats."""
    if not tokens:
        return 0
    best = 1
    for p in range(1, unit + 1):
        run = 0  # consecutive positions j with tokens[j] == tokens[j + p]
        for j in range(len(tokens) - p):
            run = run + 1 if tokens[j] == tokens[j + p] else 0
            best = max(best, run // p + 1)
    return best


@dataclass(frozen=True)
class Rules:
    """The per-prompt thresholds (select.min_distinct_ratio, select.max_run, select.max_ppl_ratio)."""

    min_distinct_ratio: float = 0.7
    max_run: int = 6
    max_ppl_ratio: float = 2.0

    @classmethod
    def from_conf(cls, select) -> "Rules":
        return cls(float(select.min_distinct_ratio), int(select.max_run), float(select.max_ppl_ratio))


def judge(row: Dict, rules: Rules) -> Dict:
    """One prompt's flags from its row of results.jsonl: `looping`, `ppl_over` (booleans), `ppl_ratio`, and
    `damage`, the reasons in words (empty where it has none)."""
    why: List[str] = []
    base, steered = row.get("distinct2_baseline"), row.get("distinct2_steered")
    looping = False
    if base is not None and steered is not None and steered < rules.min_distinct_ratio * base:
        looping = True
        why.append(f"distinct-2 {steered:.2f} < {rules.min_distinct_ratio:g} x {base:.2f}")
    run, base_run = row.get("repeat_steered"), row.get("repeat_baseline") or 0
    if run is not None and run >= rules.max_run and run > base_run:
        looping = True
        why.append(f"a unit repeated {run} times in a row (max_run {rules.max_run}; baseline {base_run})")
    ppl_b, ppl_s = row.get("ppl_baseline"), row.get("ppl_steered")
    ratio = ppl_s / ppl_b if ppl_b and ppl_s is not None else None
    over = ratio is not None and ratio > rules.max_ppl_ratio
    if over:
        why.append(f"ppl x{shown_ratio(ratio, rules.max_ppl_ratio)} > {rules.max_ppl_ratio:g}")
    return {"looping": looping, "ppl_over": over, "ppl_ratio": ratio, "damage": why}


def shown_ratio(ratio: float, cap: float) -> str:
    """The ratio as a comparison with the cap can print it: x2.0000001 against a cap of 2 must not read x2.00."""
    shown = f"{ratio:.2f}"
    return shown if float(shown) > cap else f"{ratio:.8g}"


def counts(rows: Iterable[Dict]) -> Dict[str, int]:
    """How many of `rows` (judged: `judge`'s keys in them) loop, cost perplexity over the cap, or either."""
    rows = list(rows)
    return {"prompts_looping": sum(bool(r.get("looping")) for r in rows),
            "prompts_ppl_over": sum(bool(r.get("ppl_over")) for r in rows),
            "prompts_bad": sum(bool(r.get("looping") or r.get("ppl_over")) for r in rows)}


def flags(row: Dict) -> Optional[str]:
    """A row's damage as one short cell of a table ("loops; ppl over"), or None where it has none."""
    parts = [name for key, name in (("looping", "loops"), ("ppl_over", "ppl over")) if row.get(key)]
    return "; ".join(parts) or None
