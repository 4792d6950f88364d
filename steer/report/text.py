"""How a report writes values and texts: numbers rounded for reading (the full value on hover), and a baseline and
a steered text with the words that differ between them marked."""

import difflib
import re
from typing import Any, List, Tuple

# Words, runs of spaces and single other characters (punctuation, emoji): the pieces the two texts are compared by.
# Joined in order they give the text back exactly.
PIECES = re.compile(r"\s+|\w+|[^\w\s]", re.UNICODE)


def number(v: Any) -> str:
    """A value as a table cell shows it: 4 significant digits for a float, as is otherwise, `-` for none."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def full(v: Any) -> str:
    """The value as its JSON file holds it (a cell's hover text)."""
    return "null" if v is None else repr(v) if isinstance(v, float) else str(v)


def pieces(text: str) -> List[str]:
    return PIECES.findall(text)


def diff(baseline: str, steered: str) -> Tuple[List[Tuple[str, bool]], List[Tuple[str, bool]]]:
    """(baseline's pieces, steered's pieces), each (text, changed): the pieces of one that the other lacks, by
    difflib's longest matching blocks over words. Each side's pieces join to its text unchanged."""
    a, b = pieces(baseline), pieces(steered)
    if "".join(a) != baseline or "".join(b) != steered:  # not expected: then the texts stand unmarked
        return [(baseline, False)], [(steered, False)]
    same_a, same_b = [False] * len(a), [False] * len(b)
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            same_a[block.a + k] = same_b[block.b + k] = True
    return _runs(a, same_a), _runs(b, same_b)


def _glue(piece: str) -> bool:
    """A space or a lone punctuation mark: between two changed words it is part of the change, whichever text it
    happens to match ("I'm" against "That's" shares the apostrophe alone)."""
    return piece.isspace() or (len(piece) == 1 and not piece.isalnum())


def _runs(parts: List[str], same: List[bool]) -> List[Tuple[str, bool]]:
    """Neighbouring pieces of the same kind joined, a space or a mark between two changed words counted as changed."""
    out: List[Tuple[str, bool]] = []
    for i, (p, s) in enumerate(zip(parts, same)):
        changed = not s
        if s and _glue(p) and 0 < i < len(parts) - 1 and not same[i - 1] and not same[i + 1]:
            changed = True
        if out and out[-1][1] == changed:
            out[-1] = (out[-1][0] + p, changed)
        else:
            out.append((p, changed))
    return out
