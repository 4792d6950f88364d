"""The select report's heat map as an HTML grid: layers down, scales across, each cell its concept gain. Kept pairs
are coloured by gain (viridis over the kept pairs' range alone, as selection.png); a rejected pair is grey with a
short mark whose reason is in the legend and the cell's tooltip, never over the cells."""

import string
from typing import Any, Dict, List, Optional

from steer.report.text import number

REJECTED = "#d4d4d4"  # a rejected pair's background: black text on it reads at 13:1


def grid(cells: List[Dict[str, Any]], layers: List[Any], scales: List[float], best: Optional[Dict]) -> Dict[str, Any]:
    import matplotlib
    from matplotlib.colors import Normalize, to_hex

    by = {(c["layer"], float(c["scale"])): c for c in cells}
    kept = [c["gain"] for c in cells if c.get("ok") and c.get("gain") is not None]
    norm = Normalize(min(kept), max(kept)) if kept else None
    cmap = matplotlib.colormaps["viridis"]
    marks: Dict[str, str] = {}
    rows = []
    for layer in layers:
        row = []
        for scale in scales:
            c = by.get((layer, float(scale)))
            if c is None:
                row.append(None)
                continue
            chosen = best is not None and best.get("dir") == c["dir"]
            if c.get("ok") and c.get("gain") is not None:
                face = cmap(norm(c["gain"]) if norm.vmax > norm.vmin else 0.5)
                bg, fg, mark = to_hex(face), label_colour(face), None
            else:
                why = c.get("why") or "rejected"
                mark = marks.setdefault(why, _letter(len(marks)))
                bg, fg = REJECTED, "black"
            row.append({"dir": c["dir"], "layer": c["layer"], "scale": c["scale"], "gain": c.get("gain"),
                        "label": number(c.get("gain")), "ok": bool(c.get("ok")), "why": c.get("why"),
                        "mark": mark, "bg": bg, "fg": fg, "best": chosen, "ppl_ratio": c.get("ppl_ratio")})
        rows.append({"layer": layer, "cells": row})
    return {"scales": scales, "rows": rows, "reasons": [(m, why) for why, m in marks.items()],
            "range": (min(kept), max(kept)) if kept else None}


def _letter(i: int) -> str:
    letters = string.ascii_uppercase
    return letters[i] if i < len(letters) else f"{letters[i // 26 - 1]}{letters[i % 26]}"


def label_colour(face) -> str:
    """Black or white, whichever has the higher contrast ratio (WCAG 2) against the colour `face`."""
    def lum(rgb):
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    y = lum(face)
    return "black" if (y + 0.05) / 0.05 >= 1.05 / (y + 0.05) else "white"
