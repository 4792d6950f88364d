"""`python -m steer.serve engine=vllm`: vLLM's own OpenAI server with the tap worker and the presets registered at
start, driven by the openai client through the same checks as the HF server (tests/serve/), in replay mode, with
the edits captured into the graphs (vllm.edits_in_graph), and compiled into vLLM's own graphs (vllm.compiled_edits,
what the server picks when no mode is set: the `compiled` case sets none).

Tolerance: greedy text identical to the HF engine's on the same GPU (the tiny model in float32: vLLM's greedy tokens
equal the HF engine's, tests/gpu/test_vllm_engine.py). Concurrent requests with mixed presets share vLLM's batches.
"""

import httpx
import pytest

from serve_common import (MAX_TOKENS, PROMPTS, check_against, check_bad_requests, check_concurrent,
                          check_concurrent_own_vectors, check_idle_connection_kept, check_listing, check_own_condition,
                          check_own_tokens, check_own_vectors, check_sse_done, check_streaming, client,
                          own_condition_reference, own_reference, server, token_logprobs)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["replay", "in_graph", "compiled"])
def vllm_url(request, cache_dir, tiny_spec, tmp_path_factory):
    args = ["engine=vllm", "device=cpu", "vllm.gpu_memory_utilization=0.15", "vllm.max_cudagraph_capture_size=128"]
    # compiled: the server's own pick (steer.serve.start.pick_mode); replay mode takes requests' own vectors
    args += {"in_graph": ["vllm.edits_in_graph=true"], "compiled": []}.get(request.param, ["serve.inline_layers=[1,2]"])
    with server(args, cache_dir, tmp_path_factory.mktemp(f"serve-vllm-{request.param}"), timeout=900) as url:
        yield url


@pytest.fixture(scope="module")
def vllm_client(vllm_url):
    return client(vllm_url)


@pytest.fixture(scope="module")
def expected(vllm_url, hf, tiny_spec, cache_dir):
    """(prompt, steer, scale) -> the HF engine's greedy text with those presets composed (as `python -m steer
    engine=hf` runs the same edits), default directions read from the cache the server wrote."""
    from helpers import compose
    from steer.runs.extract import cached_default
    from steer.config.schema import GenConf
    from steer.serve import presets
    from steer.serve.schema import ServeOptions

    prompts = compose().prompts
    pos, neg = list(prompts.positive), list(prompts.negative)
    compiled = presets.compile_all(presets.read(ServeOptions()), tiny_spec,
                                   lambda tap: cached_default(str(cache_dir), hf, tap, pos, neg), str(cache_dir))
    gen = GenConf(max_new_tokens=MAX_TOKENS)

    def text(prompt, steer, scale):
        plan = presets.compose(compiled, steer.split(","), 1.0 if scale is None else scale) if steer else None
        return hf.decode(hf.generate(hf.encode(prompt), plan, gen, 0))

    return text


def test_answers_equal_the_hf_engine(vllm_client, expected):
    unsteered = {p: token_logprobs(vllm_client, p) for p in PROMPTS}
    check_against(vllm_client, expected,
                  steers=lambda p, name, s: token_logprobs(vllm_client, p, name, s) != unsteered[p])


def test_streaming(vllm_client, vllm_url):
    check_streaming(vllm_client)
    check_sse_done(vllm_url)


def test_presets_listing(vllm_url):
    check_listing(vllm_url)
    assert httpx.get(f"{vllm_url}/health").status_code == 200


def test_an_idle_connection_outlives_the_clients_keep_alive(vllm_url):
    check_idle_connection_kept(vllm_url)  # serve.keep_alive_s reaches vLLM's api_server


def test_bad_requests_are_400_and_the_server_keeps_serving(vllm_url, vllm_client):
    check_bad_requests(vllm_url, vllm_client, params_everywhere_only=True)


def test_concurrent_requests_each_equal_their_answer_alone(vllm_client):
    check_concurrent(vllm_client, 32)


def test_own_vectors(request, vllm_url, vllm_client, hf, tiny_spec):
    """Replay mode: a request's own vector becomes a stage in the worker when it comes, and answers as the preset
    with that vector (token log-probs equal too). The in-graph modes refuse it: their edits are fixed at start."""
    if request.node.callspec.params["vllm_url"] == "replay":
        check_own_vectors(vllm_url, vllm_client, logprobs=True)
        check_own_tokens(vllm_url, vllm_client, own_reference(hf, tiny_spec))  # steer_tokens against the HF engine
        # steer_when: the request's own condition, decided in the worker, against the HF engine
        check_own_condition(vllm_url, vllm_client, own_condition_reference(hf, tiny_spec))
        check_concurrent_own_vectors(vllm_url, vllm_client)
        return
    r = httpx.post(f"{vllm_url}/v1/completions", timeout=60, json={
        "model": "steer-test", "prompt": PROMPTS[0], "max_tokens": 4, "vllm_xargs": {"steer_vector": "AAAAAA=="}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.steer_vector"
