"""How long a 100-job sweep's report takes to open in headless chromium, and its size (docs/sweeps.md, "Reports").

    python tests/report/open_bench.py [DIR]

Builds a synthetic 10 layers x 10 scales sweep (tests/report/synthetic.py) in DIR (a temporary directory by
default), writes its summary, plots and report.html, then opens the report five times in a fresh page and prints
each time from navigation to the load event, and their median. A benchmark, not a test: the time depends on the
machine."""

import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from browser import browser  # noqa: E402
from synthetic import make  # noqa: E402


def main() -> None:
    from steer import report
    from steer.runs import report as summary

    d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "sweep"
    make(d)
    summary.build(d)
    out = report.write(d)
    times = []
    with browser() as b:
        for _ in range(5):
            page = b.new_page(viewport={"width": 1280, "height": 900})
            page.goto(out.resolve().as_uri(), wait_until="load")
            times.append(page.evaluate("() => { const t = performance.getEntriesByType('navigation')[0];"
                                       " return t.loadEventEnd - t.startTime; }"))
            page.close()
    print(f"{out}: {out.stat().st_size / 1e6:.2f} MB; opened in " + ", ".join(f"{t:.0f}" for t in times)
          + f" ms (median {statistics.median(times):.0f} ms)")


if __name__ == "__main__":
    main()
