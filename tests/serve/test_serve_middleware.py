"""engine=vllm's request path on the CPU: the stage table, the middleware in front of a stand-in app that echoes the
body vLLM would parse, and the worker's reading of what it wrote. No vLLM needed (the GPU test runs the real one)."""

import itertools
import json

import pytest
import torch
from starlette.testclient import TestClient

from interleaver.bank import EditBank, RequestEdits
from interleaver.edit import Edit
from interleaver.vllm_internals import tap_location
from interleaver.tap_worker import COMPILED_KEY, IN_GRAPH_KEY, STAGES_KEY, TAPS_KEY
from serve_common import bad_requests
from steer.models.spec import spec
from steer.config.schema import ModelConf
from steer.serve import presets
from steer.serve.middleware import SteerMiddleware
from steer.serve.schema import ServeConf, ServeOptions
from steer.serve.stages import StageTable


@pytest.fixture(scope="module")
def compiled():
    s = spec(ModelConf(name="tiny"), "/nonexistent")  # the tiny model's shape needs no files
    v = torch.randn(1, s.hidden, generator=torch.Generator().manual_seed(0))
    return presets.compile_all(presets.read(ServeOptions()), s, lambda tap: v, "/nonexistent")


@pytest.fixture(scope="module")
def table(compiled):
    return StageTable(compiled)


async def _echo(scope, receive, send):
    """Stands in for vLLM: says what body and length it was handed."""
    body, more = b"", True
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    out = json.dumps({"body": body.decode(), "length": dict(scope["headers"]).get(b"content-length", b"").decode(),
                      "path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def http(compiled, table):
    return TestClient(SteerMiddleware(_echo, table.translator(presets.listing(compiled), 100.0)))


def _program(stages, entries):
    """A request's edits as the worker runs them: per tap, in position order, (kind, vector, bounds, tokens,
    strength); and whether it holds one stage per position."""
    out, distinct = {}, True
    for sid, strength, tokens in entries:
        s = stages[sid]
        e = s.edit
        out.setdefault(s.location, []).append((s.index, e.kind.value, tuple(e.basis.flatten().tolist()), e.lo, e.hi,
                                               e.value, tokens, round(strength, 9)))
    for loc, rows in out.items():
        distinct &= len({r[0] for r in rows}) == len(rows)
        out[loc] = [r[1:] for r in sorted(rows)]
    return out, distinct


def test_every_composition_is_the_engines_own_registration(compiled, table):
    """For presets composed in any order and any scale, the entries the middleware sends run, at every tap, the same
    unit edits in the same order at the same strengths as VLLMEngine registers for the composed plan (the HF
    engine's plan for that request)."""
    stages = {s.id: s for s in table.bank.stages}
    names = sorted(compiled)
    translator = table.translator([], 100.0)
    for k in (1, 2, 3):
        for combo in itertools.permutations(names, k):
            for scale in (1.0, 0.5, -2.0, 0.0):
                got, distinct = _program(stages, translator.entries(combo, scale))
                assert distinct, combo
                plan = presets.compose(compiled, combo, scale)
                bank, ref = EditBank(), []
                for path, edits in (plan.edits.items() if plan else []):
                    ref += bank.register(tap_location(path), edits)
                want, _ = _program({s.id: s for s in bank.stages}, ref)
                assert got == want, (combo, scale)


def test_stages_positions(table):
    """A tap one preset edits alone keeps one position (and its fused kernel); a shared tap gets a position for each
    place a preset can take in a composition. Presets with the same unit edit share its stages."""
    by_loc = {}
    for s in table.bank.stages:
        by_loc.setdefault(s.location, []).append(s.index)
    assert by_loc == {tap_location("model.layers.1"): [0, 1, 2], tap_location("model.layers.2"): [0]}


def test_the_request_is_rewritten_for_the_worker(http, table):
    body = {"model": "tiny", "prompt": "hi", "vllm_xargs": {"steer": "joy_two_taps,joy", "steer_scale": 2,
                                                            "mine": "kept"}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    seen = r.json()
    got = json.loads(seen["body"])
    assert int(seen["length"]) == len(seen["body"].encode())
    assert set(got["vllm_xargs"]) == {"steer", "mine"} and got["vllm_xargs"]["mine"] == "kept"
    assert isinstance(got["vllm_xargs"]["steer"], str)  # vLLM's vllm_xargs take flat values only
    edits = RequestEdits.from_args(got["vllm_xargs"]["steer"])  # what the worker reads from extra_args
    want = table.translator([], 100.0).entries(["joy_two_taps", "joy"], 2.0)
    assert [list(e) for e in edits.entries] == want and len(want) == 3
    assert edits.prompt_len is None and edits.capture == []


def test_unsteered_and_scale_zero_reach_vllm_without_steering(http):
    raw = b'{"model": "tiny", "prompt": "hi",  "vllm_xargs": {"mine": 1}}'
    seen = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}).json()
    assert seen["body"].encode() == raw  # untouched, byte for byte
    seen = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [], "vllm_xargs": {
        "steer": "joy", "steer_scale": 0}}).json()
    assert "vllm_xargs" not in json.loads(seen["body"])


def test_bad_steer_arguments_are_refused_before_vllm(http):
    for body, param, everywhere in bad_requests():
        if not everywhere:
            continue  # vLLM's own validation answers those
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = http.post("/v1/completions", **kw)
        assert r.status_code == 400, (body, r.text)
        assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                      "param": param, "code": None}}


def test_no_way_around_the_names(http):
    """Entries of a client's own never reach the worker: not through extra_args (vLLM's token-in/token-out
    /inference/v1/generate takes raw SamplingParams), not nested in a batch, not with another content type."""
    forged = {"entries": [[0, 1e30, "both"]]}
    r = http.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"extra_args": {
        "steer": forged}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.extra_args"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "vllm_xargs": {"steer": json.dumps(forged)}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.steer"
    r = http.post("/v1/completions", content=json.dumps({"model": "t", "vllm_xargs": {"steer": "nope"}}),
                  headers={"content-type": "text/plain"})
    assert r.status_code == 400
    r = http.post("/v1/whatever", json=[{"vllm_xargs": {"steer": "nope"}}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "[0].vllm_xargs.steer"
    # a JSON schema whose properties start with "steer" is not a steer argument
    schema = {"type": "object", "properties": {"steering": {"type": "string"}}}
    r = http.post("/v1/chat/completions", json={"model": "t", "messages": [], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200


def test_bodies_of_other_routes_pass_through(http):
    """vLLM's own routes (an admin POST with no body, a bare JSON value) reach vLLM as they came."""
    for raw in (b"", b"5", b"null", b'"text"', b"[1, [2]]"):
        r = http.post("/reset_prefix_cache", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["body"].encode() == raw, (raw, r.text)


def test_presets_listing(http, compiled):
    r = http.get("/v1/steer/presets")
    assert r.status_code == 200 and [p["name"] for p in r.json()["data"]] == list(compiled)
    assert http.get("/health").status_code == 200  # everything else reaches the app


def test_engine_config_is_plain_data(compiled, table):
    from steer.serve.vllm_server import argv, engine_config

    conf = ServeConf()
    extra = engine_config(conf, table)
    assert json.loads(json.dumps(extra)) == extra  # nothing but JSON
    assert extra[TAPS_KEY] == [["model.layers.1", True], ["model.layers.2", True]]
    stages = extra[STAGES_KEY]
    assert [s[0] for s in stages] == list(range(len(stages)))
    for (_, loc, index, d), s in zip(stages, table.bank.stages):
        e = Edit.from_dict(d)
        assert (loc, index, e.kind, e.lo, e.hi) == (s.location, s.index, s.edit.kind, s.edit.lo, s.edit.hi)
        assert torch.equal(e.basis, s.edit.basis)
    conf.vllm.edits_in_graph = True
    assert engine_config(conf, table)[IN_GRAPH_KEY] == stages and STAGES_KEY not in engine_config(conf, table)
    assert COMPILED_KEY not in engine_config(conf, table)
    conf.vllm.edits_in_graph, conf.vllm.compiled_edits = False, True  # compiled edits are in-graph edits
    assert engine_config(conf, table)[IN_GRAPH_KEY] == stages and engine_config(conf, table)[COMPILED_KEY]
    s = spec(ModelConf(name="tiny"), "/nonexistent")
    flags = argv(conf, s, "tiny")
    for flag, value in (("--worker-cls", "interleaver.tap_worker.TapWorker"),
                        ("--middleware", "steer.serve.middleware.SteerMiddleware"), ("--served-model-name", "tiny"),
                        ("--host", "127.0.0.1"), ("--port", "8000")):
        assert flags[flags.index(flag) + 1] == value


def test_own_vectors_reach_the_worker_after_the_presets_edits(compiled):
    """steer_vector at the server's inline layers: each vector rides to the worker with its tap's location and
    the position after the request's preset edits there; strength 0 is left out; a layer not served is refused."""
    from steer.config.schema import TapConf
    from steer.serve.protocol import encode_vector
    from steer.edits.tap import resolve

    s = spec(ModelConf(name="tiny"), "/nonexistent")
    table = StageTable(compiled, {layer: resolve(TapConf(layer=layer), s) for layer in (1, 3)})
    assert ["model.layers.3", True] in table.tap_list()  # a tap with no stage until a request brings a vector
    http = TestClient(SteerMiddleware(_echo, table.translator([], 100.0, s.hidden)))
    v, u = encode_vector(torch.arange(s.hidden) / 7.0), encode_vector(torch.ones(s.hidden))

    def worker_reads(xargs):
        seen = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "vllm_xargs": xargs}).json()
        return RequestEdits.from_args(json.loads(seen["body"])["vllm_xargs"]["steer"])

    got = worker_reads({"steer": "joy", "steer_vector": [v, u], "steer_layer": [1, 3], "steer_strength": [2.5, 0],
                        "steer_tokens": ["generated", "both"]})
    assert [list(e) for e in got.entries] == table.translator([], 100.0, s.hidden).entries(["joy"], 1.0)
    assert got.inline == [(tap_location("model.layers.1"), 1, 2.5, "generated", v)]  # joy's add is position 0
    got = worker_reads({"steer_vector": u, "steer_layer": 3})
    assert got.entries == [] and got.inline == [(tap_location("model.layers.3"), 0, 1.0, "both", u)]
    for xargs, param in (({"steer_vector": v, "steer_layer": 2}, "vllm_xargs.steer_layer"),
                         ({"steer_vector": v[:-8], "steer_layer": 1}, "vllm_xargs.steer_vector"),
                         ({"steer_vector": [v, v], "steer_layer": [1]}, "vllm_xargs.steer_layer")):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "vllm_xargs": xargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
