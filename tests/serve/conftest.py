"""Fixtures of the server tests: a client of the HF server (`hf_url`, tests/conftest.py) and the CLI's own texts
for the same prompts and edits, to hold its answers to."""

import pytest

from serve_cli import cli_edits, cli_run
from serve_common import client


@pytest.fixture(scope="session")
def hf_client(hf_url):
    return client(hf_url)


@pytest.fixture(scope="session")
def cli_text(hf_url, tmp_path_factory):
    """(prompt, steer, scale) -> the CLI's text for it: its steered text with those edits, or its baseline. Runs
    after the server started, so both read the same cached default direction."""
    runs = {}
    base = tmp_path_factory.mktemp("cli")

    def text(prompt, steer, scale):
        key = (steer or "joy", 1.0 if scale is None else scale) if steer else ("joy", 1.0)
        if key not in runs:
            runs[key] = {r["prompt"]: r for r in cli_run(cli_edits(*key), base / f"run{len(runs)}")}
        row = runs[key][prompt]
        return row["steered"] if steer else row["baseline"]

    return text
