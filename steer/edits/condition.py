"""Conditions on the prompt (conditional activation steering, CAST): the record and its math are the tap layer's
(interleaver/edit.py's `Condition`, which a vLLM worker runs too); here, how a run describes one."""

from typing import Optional

from interleaver.edit import Condition

__all__ = ["Condition", "describe"]


def describe(c: Optional[Condition], name: str) -> str:
    """`when(cast@layer4 mean > 0.1)`, for the run's description of its edits."""
    if c is None:
        return ""
    sign = ">" if c.compare == "above" else "<"
    return f"when({c.score}@{name} {c.reduce} {sign} {c.threshold:g})"
