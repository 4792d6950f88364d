"""`python -m steer.report DIR`: (re)write DIR/report.html from the files in DIR (a run directory, a sweep's root or
a task=select run); an older run gets its report so."""

import argparse
import sys
from pathlib import Path

from steer.report.build import NothingToReport, write


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m steer.report", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="a run directory, a sweep's root or a task=select run")
    args = p.parse_args(argv)
    if not args.dir.is_dir():
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    try:
        out = write(args.dir)
    except NothingToReport as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
