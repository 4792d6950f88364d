"""report.html: one self-contained page (styles, scripts and images inline; nothing fetched) for a run directory,
a sweep's root or a selection, written from the files already there (steer.report.build)."""

from steer.report.build import FILE, write, write_quietly  # noqa: F401
