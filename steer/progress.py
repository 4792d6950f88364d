"""Progress of a run or a sweep: rich's bar on a terminal; elsewhere (output sent to a file, a job scheduler's log,
CI) a line at each tenth of the work, since rich draws nothing there until the work is done."""

import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator, Union

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def bar(console: Console, enabled: bool = True) -> Union[Progress, "Lines"]:
    """A progress display for `console` (disabled: nothing shown)."""
    if enabled and not console.is_terminal:
        return Lines(console)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not enabled, transient=False)


class Lines:
    """The part of rich's Progress that steer uses, as lines: `description: done/total (elapsed)`."""

    STEPS = 10

    def __init__(self, console: Console) -> None:
        self.console, self.tasks = console, []

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: float) -> int:
        self.tasks.append(SimpleNamespace(description=description, total=total, completed=0, shown=0,
                                          start=time.monotonic()))
        return len(self.tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, completed=self.tasks[task].completed + advance)

    def update(self, task: int, completed: float) -> None:
        t = self.tasks[task]
        t.completed = completed
        step = int(self.STEPS * completed / t.total) if t.total else self.STEPS
        if step > t.shown:
            t.shown = step
            line = f"{t.description}: {completed:g}/{t.total:g} ({time.monotonic() - t.start:.0f} s)"
            self.console.print(line, highlight=False, markup=False)


@contextmanager
def transformers_bars_off() -> Iterator[None]:
    """transformers' own bars ("Loading weights", "Writing model shards") off for a while, then as they were: a
    model steer prepares once (the tiny model's build, a GGUF's conversion) says so in one line of its own, and
    its loading bar would be a second "Loading weights" beside the engine's."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
