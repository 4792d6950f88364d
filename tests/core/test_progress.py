"""steer.progress: a line at each tenth of the work where the console is not a terminal."""

import io

from rich.console import Console
from rich.progress import Progress

from steer.progress import Lines, bar


def test_off_a_terminal_the_work_is_told_in_ten_lines():
    console = Console(file=io.StringIO())
    with bar(console) as progress:
        assert isinstance(progress, Lines)
        task = progress.add_task("generating", total=45)
        for _ in range(44):
            progress.advance(task)
        progress.update(task, completed=45)
    lines = console.file.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("generating: 5/45 (") and lines[-1].startswith("generating: 45/45")


def test_on_a_terminal_it_is_richs_bar_and_disabled_it_shows_nothing():
    assert isinstance(bar(Console(file=io.StringIO(), force_terminal=True)), Progress)
    quiet = bar(Console(file=io.StringIO()), enabled=False)
    assert isinstance(quiet, Progress) and quiet.disable
