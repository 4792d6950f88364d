"""How the bench's report computes and writes a ratio: the same in every table, so none reads differently."""

from typing import Optional, Sequence


def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
    """x over y; None where either is missing (or y is 0)."""
    return None if x is None or not y else x / y


def num(x: Optional[float]) -> str:
    """A ratio to two places, `-` where there is none."""
    return "-" if x is None else f"{x:.2f}"


def span(interval: Optional[Sequence[float]]) -> str:
    """An interval as `lo-hi`, `-` where there is none."""
    return "-" if not interval else f"{interval[0]:.2f}-{interval[1]:.2f}"
