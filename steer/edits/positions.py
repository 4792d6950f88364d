"""Where in a request's sequence an edit acts (`edit.positions`), beside which kind of row (`edit.tokens`):

    all                                   every row (the default)
    last_prompt  / {select: last_prompt, last_k: k}       the prompt's last k rows (k = 1 by default)
    first_generated / {select: first_generated, n: n}     the first n generated rows (n = 1 by default)
    {from: i, to: j}                      the rows at absolute positions i..j of the sequence (both included)

A row's weight is 1 where it is selected, else 0, from its position alone (its index in the request's sequence) and
the request's prompt length, so it is the same in a batch as alone, and under chunked prefill as in one pass.
"""

from dataclasses import dataclass
from typing import Any, Optional

from interleaver import select as selectors
from steer.errors import ConfigError

SELECTS = selectors.SELECTS


@dataclass(frozen=True)
class Positions:
    select: str = "all"
    count: int = 1  # last_prompt: k; first_generated: n
    start: int = 0  # window: the first and last positions, both included
    end: int = 0

    @property
    def every(self) -> bool:
        return self.select == "all"

    def mask(self, pos, plen):
        """Bool, shaped as `pos` (each row's absolute position), `plen` broadcast against it (the request's prompt
        length)."""
        return selectors.mask(self.where(), pos, plen)

    def where(self) -> selectors.Where:
        """The selector as the interleaver's request entries carry it (interleaver/select.py)."""
        if self.select == "window":
            return ("window", self.start, self.end)
        return (self.select, self.count, 0)

    def describe(self) -> str:
        if self.select == "last_prompt":
            return f"last {self.count} prompt"
        if self.select == "first_generated":
            return f"first {self.count} generated"
        if self.select == "window":
            return f"positions {self.start}..{self.end}"
        return ""


EVERY = Positions()


def parse(value: Any, field: str = "edit.positions") -> Positions:
    """`edit.positions` as a Positions, or a ConfigError naming the field and what it takes."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
    if value is None or value == "all":
        return Positions()
    if isinstance(value, str):
        if value in ("last_prompt", "first_generated"):
            return Positions(value)
        raise ConfigError(field, f"{value!r} is not one of all, last_prompt, first_generated, or a window "
                                 "{from: i, to: j}")
    if not isinstance(value, dict):
        raise ConfigError(field, f"expected all, last_prompt, first_generated or a window {{from: i, to: j}}, got "
                                 f"{value!r}")
    if "from" in value or "to" in value:
        extra = set(value) - {"from", "to"}
        if extra or not all(_whole(value.get(k)) for k in ("from", "to")):
            raise ConfigError(field, f"a window is {{from: i, to: j}}, two positions (0 is the first token), got "
                                     f"{value!r}")
        i, j = int(value["from"]), int(value["to"])
        if i < 0 or j < i:
            raise ConfigError(field, f"a window needs 0 <= from <= to, got from={i}, to={j}")
        return Positions("window", start=i, end=j)
    select = value.get("select")
    keys = {"last_prompt": "last_k", "first_generated": "n"}
    if select not in keys:
        raise ConfigError(f"{field}.select", f"{select!r} is not one of last_prompt, first_generated (a window is "
                                             "{from: i, to: j})")
    extra = set(value) - {"select", keys[select]}
    if extra:
        raise ConfigError(f"{field}.{sorted(extra)[0]}", f"is not a setting of {select} (it takes "
                                                         f"{keys[select]})")
    count = value.get(keys[select], 1)
    if not _whole(count) or int(count) < 1:
        raise ConfigError(f"{field}.{keys[select]}", f"must be a whole number >= 1, got {count!r}")
    return Positions(select, count=int(count))


def _whole(x: Optional[Any]) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
