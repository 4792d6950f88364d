"""The HF server on SmolLM2 (real weights, CPU): the committed presets serve SmolLM2's own edits (layer 12, the pair
task=select chose), and a greedy chat completion with `joy` is the CLI's steered text for the same prompt
(`python -m steer +experiment=smollm2_joy`), without it the CLI's baseline."""

import io
import json

import pytest
from rich.console import Console

from helpers import compose
from serve_common import chat, check_listing, client, server
from steer.runs import run
from steer.tasks import registry

PROMPT = "The weather today is"
TOKENS = 12


@pytest.fixture(scope="module")
def smol_url(smollm2_spec, cache_dir, tmp_path_factory):  # converted here first: the server loads it, or this skips
    with server(["engine=hf", "model=smollm2"], cache_dir,
                tmp_path_factory.mktemp("serve-smollm2"), timeout=600) as url:
        yield url


def test_presets_serve_smollm2s_layer_and_equal_the_cli(smol_url, tmp_path):
    check_listing(smol_url, hidden=576, model="smollm2")
    c = client(smol_url)
    steered, plain = chat(c, PROMPT, "joy", max_tokens=TOKENS), chat(c, PROMPT, max_tokens=TOKENS)
    cfg = compose("+experiment=smollm2_joy", "engine=hf", "progress=false", "metrics.sentiment=false",
                  f"gen.max_new_tokens={TOKENS}", f"prompts.steer=['{PROMPT}']", tiny=False)
    run.execute([registry.prepare(cfg, tmp_path)], Console(file=io.StringIO()))
    row = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    assert (steered, plain) == (row["steered"], row["baseline"])
    assert steered != plain
