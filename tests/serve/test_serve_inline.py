"""Requests' own vectors on `python -m steer.serve engine=hf` (serve.inline_layers=[1, 2], tests/serve/conftest.py):
a vector sent as steer_vector steers exactly as the preset that adds the same vector at the same layer and strength;
bad vectors are 400s naming the field, and the server keeps serving."""

import httpx
import numpy as np
import pytest

from serve_common import (MODEL, PROMPTS, check_concurrent_own_vectors, check_own_condition, check_own_tokens,
                          check_own_vectors, complete, joy_vector, own_condition_reference, own_reference)
from steer.serve.protocol import MAX_INLINE, InlinePolicy, RequestError, encode_vector, parse_steer


def test_an_own_vector_steers_as_the_preset_with_that_vector(hf_url, hf_client):
    check_own_vectors(hf_url, hf_client)


def test_steer_tokens_picks_the_rows(hf_url, hf_client, hf_engine, tiny_spec):
    check_own_tokens(hf_url, hf_client, own_reference(hf_engine, tiny_spec))


def test_steer_when_gates_the_requests_own_vectors(hf_url, hf_client, hf_engine, tiny_spec):
    check_own_condition(hf_url, hf_client, own_condition_reference(hf_engine, tiny_spec))


def test_bad_vectors_are_400_and_the_server_keeps_serving(hf_url, hf_client):
    _, v = joy_vector(hf_url)
    ok, before = encode_vector(v), complete(hf_client, PROMPTS[0], "joy")
    cases = [
        ({"steer_vector": encode_vector(np.append(v, 0.0)), "steer_layer": 1}, "vllm_xargs.steer_vector"),
        ({"steer_vector": encode_vector(np.where(np.arange(v.size) == 3, np.nan, v)), "steer_layer": 1},
         "vllm_xargs.steer_vector"),
        ({"steer_vector": "not base64!", "steer_layer": 1}, "vllm_xargs.steer_vector"),
        ({"steer_vector": [ok] * (MAX_INLINE + 1), "steer_layer": 1}, "vllm_xargs.steer_vector"),
        ({"steer_vector": [], "steer_layer": 1}, "vllm_xargs.steer_vector"),
        ({"steer_vector": ok}, "vllm_xargs.steer_layer"),
        ({"steer_vector": ok, "steer_layer": 3}, "vllm_xargs.steer_layer"),  # a layer of the model not served
        ({"steer_vector": ok, "steer_layer": "1"}, "vllm_xargs.steer_layer"),
        ({"steer_vector": [ok, ok], "steer_layer": [1, 2, 1]}, "vllm_xargs.steer_layer"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_strength": 1e9}, "vllm_xargs.steer_strength"),
        ({"steer_vector": [ok, ok], "steer_layer": 1, "steer_strength": [1.0, "x"]}, "vllm_xargs.steer_strength[1]"),
        ({"steer_vector": encode_vector(v * 0 + 1e3), "steer_layer": 1, "steer_strength": 20},
         "vllm_xargs.steer_strength"),  # adds 2e4 to each element
        ({"steer_vector": ok * 3, "steer_layer": 1}, "vllm_xargs.steer_vector"),  # too long: never decoded
        ({"steer_vector": [encode_vector(v * 0 + 1e3)] * 8, "steer_layer": 1, "steer_strength": 9},
         "vllm_xargs.steer_vector"),  # 9e3 each, 7.2e4 together
        ({"steer_strength": 2.0}, "vllm_xargs.steer_strength"),
        ({"steer_vectors": ok}, "vllm_xargs.steer_vectors"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_tokens": "all"}, "vllm_xargs.steer_tokens"),
        ({"steer_tokens": "prompt"}, "vllm_xargs.steer_tokens"),
        ({"steer_when": {"vector": ok, "layer": 1, "threshold": 0.1}}, "vllm_xargs.steer_when"),  # no vector
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": [ok]}, "vllm_xargs.steer_when"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": {"layer": 1, "threshold": 0.1}},
         "vllm_xargs.steer_when.vector"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": {"vector": encode_vector(v[:-1]), "layer": 1,
                                                               "threshold": 0.1}}, "vllm_xargs.steer_when.vector"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": {"vector": ok, "layer": 3, "threshold": 0.1}},
         "vllm_xargs.steer_when.layer"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": {"vector": ok, "layer": 1, "threshold": 1.5}},
         "vllm_xargs.steer_when.threshold"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": {"vector": ok, "layer": 1, "threshold": 0.1,
                                                               "compare": "larger"}}, "vllm_xargs.steer_when.compare"),
        ({"steer_vector": ok, "steer_layer": 1, "steer_when": {"vector": ok, "layer": 1, "threshold": 0.1,
                                                               "redcue": "mean"}}, "vllm_xargs.steer_when.redcue"),
    ]
    for xargs, param in cases:
        r = httpx.post(f"{hf_url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "vllm_xargs": xargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
    for strength in ("NaN", "1" + "0" * 400):  # a JSON number no float holds
        raw = ('{"model": "%s", "prompt": "x", "max_tokens": 4, "vllm_xargs": {"steer_vector": "%s", "steer_layer": 1, '
               '"steer_strength": %s}}' % (MODEL, ok, strength)).encode()
        r = httpx.post(f"{hf_url}/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.steer_strength", r.text
    assert complete(hf_client, PROMPTS[0], "joy") == before


def test_concurrent_own_vectors_each_equal_their_answer_alone(hf_url, hf_client):
    check_concurrent_own_vectors(hf_url, hf_client, 12)


def test_vectors_are_limited_by_what_they_add_together_at_a_layer():
    big = encode_vector(np.full(8, 1e3, dtype=np.float32))
    policy = InlinePolicy(hidden=8, layers=(1, 2))

    def parse(strengths, layers):
        xargs = {"steer_vector": [big] * len(strengths), "steer_layer": layers, "steer_strength": strengths}
        return parse_steer({"vllm_xargs": xargs}, (), 100.0, inline=policy)

    assert len(parse([9, 9], [1, 2]).inline) == 2  # 9e3 at each of two layers
    assert len(parse([9, -9, 9], [1, 1, 1]).inline) == 3  # two cancel: 9e3 in all
    xargs = {"steer_vector": [big] * 2, "steer_layer": 1, "steer_strength": 9, "steer_tokens": ["prompt", "generated"]}
    assert len(parse_steer({"vllm_xargs": xargs}, (), 100.0, inline=policy).inline) == 2  # never on one row
    with pytest.raises(RequestError, match="vectors at layer 1"):
        parse_steer({"vllm_xargs": {**xargs, "steer_tokens": ["both", "generated"]}}, (), 100.0, inline=policy)
    with pytest.raises(RequestError, match="vectors at layer 1 add values up to 1.8e\\+04") as e:
        parse([9, 9], [1, 1])
    assert e.value.param == "vllm_xargs.steer_vector"
