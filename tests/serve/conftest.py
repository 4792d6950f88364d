"""Fixtures of the server tests: the HF server (`python -m steer.serve engine=hf` in a subprocess) and the CLI's
own texts for the same prompts and edits, to hold its answers to."""

import pytest

from serve_cli import cli_edits, cli_run
from serve_common import client, server


@pytest.fixture(scope="session")
def hf_url(cache_dir, tiny_spec, tmp_path_factory):
    # layers 1 and 2 take requests' own vectors (test_serve_inline.py); on the HF engine an unused one costs nothing
    with server(["engine=hf", "serve.inline_layers=[1,2]"], cache_dir, tmp_path_factory.mktemp("serve-hf")) as url:
        yield url


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
