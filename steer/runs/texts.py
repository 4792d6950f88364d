"""A run's texts side by side as a markdown table: prompt, baseline, steered, and the prompt's damage (steer/runs/
damage.py), one row per prompt of results.jsonl. selection.md shows the chosen pair's; a sweep's root texts.md each
job's."""

from typing import Dict, List, Optional, Sequence


def cell(text: Optional[str]) -> str:
    """`text` as one markdown table cell: pipes escaped, line breaks kept as <br>."""
    if text is None:
        return "-"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")


def damage_cell(row: Dict) -> str:
    """A row's damage flags and reasons, or `ok`."""
    why = row.get("damage")
    if why is None:  # a run from before damage was judged per prompt
        return "-"
    return "; ".join(why) if why else "ok"


def table(rows: Sequence[Dict], halves: Optional[Dict[int, str]] = None) -> List[str]:
    """The markdown lines of the table (a `half` column where `halves` maps a row's index to its half)."""
    head = ["#", "prompt"] + (["half"] if halves else []) + ["baseline", "steered", "damage"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, r in enumerate(rows):
        cols = [str(i + 1), cell(r.get("prompt"))] + ([halves.get(i, "")] if halves else [])
        cols += [cell(r.get("baseline")), cell(r.get("steered")), cell(damage_cell(r))]
        lines.append("| " + " | ".join(cols) + " |")
    return lines
