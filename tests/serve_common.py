"""What the server tests share (tests/serve/ on the HF engine, tests/gpu/test_serve_vllm.py on vLLM): starting
`python -m steer.serve` in a subprocess, and the client checks both engines must pass, driven by the official
openai client (or httpx where a request must be malformed on purpose)."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import httpx

from helpers import cli_env, dies_with_parent
from steer.procgroup import free_port, running

MODEL = "steer-test"  # the served model name every test server is started with, whatever the model
PROMPTS = ["The weather today is", "When I opened the letter, I felt"]
MAX_TOKENS = 8
PRESETS = ["gloom", "joy", "joy_two_taps"]
# (steer, steer_scale) cases: single presets, compositions (in order), scales; None is unsteered.
CASES: List[Tuple[Optional[str], Optional[float]]] = [
    (None, None), ("joy", None), ("gloom", None), ("joy_two_taps", None), ("gloom,joy_two_taps", None),
    ("joy_two_taps,joy", None), ("joy", 3.0), ("joy", 0.0),
]
# steer_scale, weakest first, up to serve.max_steer_scale: a check that steering moved a text goes up it until the
# reference's text moves. The tiny model is trained where the tests run, and whether a preset at its own strength
# moves a greedy token differs between CPUs; at 100 x it dominates the residual stream on any of them.
LADDER = (1.0, 3.0, 10.0, 30.0, 100.0)


@contextmanager
def server(args: List[str], cache_dir, run_dir: Path, timeout: float = 900) -> Iterator[str]:
    """`python -m steer.serve *args` on a free port; yields its base URL once /health answers. The server runs in
    a process group of its own, ended (with any process it started) on exit, and sent SIGTERM should the test run
    die first."""
    port = free_port()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tiny = [] if any(a.startswith("model=") for a in args) else ["model=tiny"]  # the server's default is SmolLM2
    cmd = [sys.executable, "-m", "steer.serve", *args, *tiny, f"serve.port={port}", "serve.log_level=warning",
           f"serve.model_name={MODEL}", f"hydra.run.dir={run_dir}"]
    with running(cmd, port, run_dir / "server.log", timeout, env=cli_env(cache_dir), cwd=run_dir,
                 preexec_fn=dies_with_parent()) as url:
        yield url


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="steer", max_retries=0, timeout=300)


def xargs(steer: Optional[str], scale: Optional[float]) -> dict:
    if steer is None:
        return {}
    args = {"steer": steer} if scale is None else {"steer": steer, "steer_scale": scale}
    return {"extra_body": {"vllm_xargs": args}}


def complete(c, prompt: str, steer=None, scale=None, **kw) -> str:
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    out = c.completions.create(model=MODEL, prompt=prompt, **xargs(steer, scale), **kw)
    return out.choices[0].text


def chat(c, prompt: str, steer=None, scale=None, **kw) -> str:
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                    **xargs(steer, scale), **kw)
    return out.choices[0].message.content


Expected = Callable[[str, Optional[str], Optional[float]], str]


def token_logprobs(c, prompt: str, steer=None, scale=None, **kw) -> List[float]:
    """The greedy completion's log-probability of each token it chose (an engine that serves `logprobs`)."""
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                               **xargs(steer, scale), **kw)
    return out.choices[0].logprobs.token_logprobs


def check_against(c, expected: Expected, expected_chat: Optional[Expected] = None,
                  steers: Optional[Callable[[str, str, float], bool]] = None) -> None:
    """Greedy completions for every prompt and case equal `expected(prompt, steer, scale)`, chat completions
    `expected_chat(...)` (default: `expected`, for a model without a chat template, whose one user message is fed
    as the prompt), and every preset steers: at the weakest scale of LADDER where the expected text of some prompt
    differs from the unsteered one (there must be one), the server's text equals the expected, so a server that
    dropped the preset fails. A server with `logprobs` also passes `steers(prompt, preset, scale)`: whether the
    preset moves the answer's log-probs, at a strength asked for above."""
    expected_chat = expected_chat or expected
    for steer, scale in CASES:
        for p in PROMPTS:
            assert complete(c, p, steer, scale) == expected(p, steer, scale), (p, steer, scale)
            assert chat(c, p, steer, scale) == expected_chat(p, steer, scale), (p, steer, scale)
    for name in PRESETS:
        p, s = moved_text(lambda p, s, name=name: expected(p, name, s), lambda p: expected(p, None, None), name)
        assert complete(c, p, name, s) == expected(p, name, s), (p, name, s)
        if steers is not None:
            scales = [scale for steer, scale in CASES if steer == name and scale != 0.0]
            assert any(steers(p, name, s) for p in PROMPTS for s in scales), name


def moved_text(steered: Callable[[str, float], str], plain: Callable[[str], str], what: str,
               ladder=LADDER) -> Tuple[str, float]:
    """(prompt, scale): the weakest scale of `ladder` at which `steered(prompt, scale)` differs from `plain(prompt)`
    for some prompt of PROMPTS; an AssertionError where none does (the edit steers nothing)."""
    for s in ladder:
        for p in PROMPTS:
            if steered(p, s) != plain(p):
                return p, s
    raise AssertionError(f"{what} moves no text of {PROMPTS} at any scale up to {ladder[-1]}")


def check_streaming(c) -> None:
    """Streamed pieces add up to the non-streamed text (completion and chat); the last piece carries the
    finish_reason."""
    for steer in (None, "joy_two_taps"):
        for p in PROMPTS:
            whole = complete(c, p, steer)
            chunks = list(c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, **xargs(steer, None)))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")
            chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                    max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}, **xargs(steer, None)))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat(c, p, steer)
            assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def check_sse_done(url: str) -> None:
    """The raw event stream: `data: {json}` events, ending with `data: [DONE]`."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True,
            "vllm_xargs": {"steer": "joy"}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def check_listing(url: str, hidden: int = 256, model: str = "tiny") -> None:
    """GET /v1/steer/presets lists every preset with the edits its file gives `model` (model.name), each with its
    vector file and that file's metadata."""
    from steer.serve import presets
    from steer.serve.schema import ServeOptions

    data = httpx.get(f"{url}/v1/steer/presets", timeout=30).json()["data"]
    by = {p["name"]: p for p in data}
    assert sorted(by) == PRESETS
    want = presets.read(ServeOptions(), model)["joy_two_taps"].edits
    assert by["joy_two_taps"]["taps"] == [f"layer{te.tap.layer}" for te in want]
    two = by["joy_two_taps"]["edits"]
    assert [(e["tap"], e["kind"], e["scale"], e["tokens"]) for e in two] == [
        (f"layer{te.tap.layer}", te.edit.kind.value, te.edit.scale, te.edit.tokens.value) for te in want]
    assert (two[1]["lo"], two[1]["hi"]) == (want[1].edit.lo, want[1].edit.hi)
    for p in data:
        for e in p["edits"]:
            v = e["vector"]
            assert v["default"] is True and Path(v["path"]).is_file(), v
            assert v["metadata"]["tap"] == e["tap"] and v["metadata"]["hidden"] == str(hidden)
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL


# (JSON body, or raw bytes; the param the 400 must name; whether the param is checked on every engine: vLLM answers
# the non-steer ones with its own error body)
def bad_requests() -> list:
    ok = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
    raw = '{"model": "%s", "prompt": "x", "max_tokens": 4, "vllm_xargs": {"steer": "joy", "steer_scale": %%s}}' % MODEL
    return [
        ({**ok, "vllm_xargs": {"steer": "delight"}}, "vllm_xargs.steer", True),
        ({**ok, "vllm_xargs": {"steer": 3}}, "vllm_xargs.steer", True),
        ({**ok, "vllm_xargs": {"steer": "joy,,gloom"}}, "vllm_xargs.steer", True),
        ({**ok, "vllm_xargs": {"steer": "joy,joy"}}, "vllm_xargs.steer", True),
        ({**ok, "vllm_xargs": {"steer": "joy", "steer_scale": "strong"}}, "vllm_xargs.steer_scale", True),
        ({**ok, "vllm_xargs": {"steer": "joy", "steer_scale": True}}, "vllm_xargs.steer_scale", True),
        ({**ok, "vllm_xargs": {"steer": "joy", "steer_scale": 1e9}}, "vllm_xargs.steer_scale", True),
        ((raw % "NaN").encode(), "vllm_xargs.steer_scale", True),
        ((raw % "1e999").encode(), "vllm_xargs.steer_scale", True),
        ((raw % "-Infinity").encode(), "vllm_xargs.steer_scale", True),
        ({**ok, "vllm_xargs": {"steer_scale": 2.0}}, "vllm_xargs.steer_scale", True),
        ({**ok, "vllm_xargs": {"steer": "joy", "steer_scale": None}}, "vllm_xargs.steer_scale", True),
        ({**ok, "vllm_xargs": {"steer_scale": None}}, "vllm_xargs.steer_scale", True),
        ({**ok, "vllm_xargs": {"steer": "joy", "steer_layer": 2}}, "vllm_xargs.steer_layer", True),
        ({**ok, "vllm_xargs": {"steer_vector": "AAAA"}}, "vllm_xargs.steer_vector", True),
        ({**ok, "vllm_xargs": {"steer": "joy", "Steer_scale": 2}}, "vllm_xargs.Steer_scale", True),
        ({**ok, "vllm_xargs": "joy"}, "vllm_xargs", True),
        ({**ok, "steer": "joy"}, "steer", True),
        (b'{"model": "steer-test", "prompt": ', None, True),
        (b'["steer-test"]', None, True),
        (b'5', None, True),  # JSON, but no object
        (b'null', None, True),
        # nested past what json.loads can read, and past what the servers read further
        (raw.replace("%s", "[" * 100000 + "]" * 100000).encode(), None, True),
        (raw.replace("%s", "[" * 150 + "]" * 150).encode(), None, True),
        ({**ok, "max_tokens": "ten"}, "max_tokens", False),
        ({**ok, "temperature": -1}, "temperature", False),
        ({**ok, "prompt": 7}, "prompt", False),
    ]


def check_bad_requests(url: str, c, params_everywhere_only: bool) -> None:
    """Every bad request is a 400 with an OpenAI-style error body naming the field; the server keeps serving."""
    before = complete(c, PROMPTS[0], "joy")
    for body, param, everywhere in bad_requests():
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = httpx.post(f"{url}/v1/completions", timeout=60, **kw)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"]
        if everywhere or not params_everywhere_only:
            assert err["param"] == param, (body, err)
            assert err["type"] == "invalid_request_error" and err["code"] is None, err
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": {"steer": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.steer"
    from openai import BadRequestError

    try:
        complete(c, PROMPTS[0], "joy", float("inf"))
        raise AssertionError("an infinite steer_scale was served")
    except (BadRequestError, ValueError):  # the client may refuse to encode inf itself
        pass
    assert complete(c, PROMPTS[0], "joy") == before
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def check_idle_connection_kept(url: str) -> None:
    """One connection serves a request, stays idle 6 s, and serves another: the server keeps an idle connection
    open past httpx's (and the openai client's) 5 s keep-alive, so the client, not the server, closes it (both at
    5 s, a client reusing it as the server closed it was reset)."""
    import http.client
    import time
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        ends = []
        for wait in (6, 0):
            conn.request("GET", "/health")
            r = conn.getresponse()  # on a connection the server closed: RemoteDisconnected
            r.read()  # the whole response, so the connection is free for the next request
            assert r.status == 200
            ends.append(conn.sock.getsockname())
            time.sleep(wait)  # past the client's keep-alive; a server at uvicorn's default of 5 s has closed it
        assert ends[0] == ends[1]  # one connection served both
    finally:
        conn.close()


def check_concurrent(c, n: int = 32) -> None:
    """`n` requests at once, presets mixed, each equal to its answer alone."""
    jobs = [(PROMPTS[i % len(PROMPTS)], *CASES[i % len(CASES)], i % 3 == 2) for i in range(n)]

    def one(job):
        prompt, steer, scale, as_chat = job
        return (chat if as_chat else complete)(c, prompt, steer, scale)

    _together_as_alone(jobs, one)


def check_concurrent_own_vectors(url: str, c, n: int = 24) -> None:
    """`n` requests at once, each with a vector of its own (the joy vector times 0.5 .. 2, at layer 1 or 2; some
    shared) and some with a preset too, each equal to its answer alone: a worker's vectors come and go mid-batch."""
    from steer.serve.protocol import encode_vector

    scale, v = joy_vector(url)
    jobs = [(PROMPTS[i % len(PROMPTS)], 0.5 * (1 + i % 4), 1 + i % 2, "gloom" if i % 5 == 4 else None)
            for i in range(n)]

    def one(job):
        prompt, k, layer, steer = job
        more = {"steer": steer} if steer else {}
        return complete(c, prompt, **own(encode_vector(k * v), layer, scale, **more))

    _together_as_alone(jobs, one)


def _together_as_alone(jobs, one) -> None:
    """`one(job)` for every job at once equals `one(job)` alone (a chat request alone is a chat request: with a chat
    template it feeds other tokens than a completion)."""
    alone = {}
    for job in jobs:
        if job not in alone:
            alone[job] = one(job)
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(one, jobs))
    assert together == [alone[job] for job in jobs]


def own(vectors, layers, strengths=None, **more) -> dict:
    """The request arguments for vectors of its own (steer_vector, steer_layer, steer_strength; `more`: other
    vllm_xargs, e.g. steer)."""
    args = {"steer_vector": vectors, "steer_layer": layers, **more}
    if strengths is not None:
        args["steer_strength"] = strengths
    return {"extra_body": {"vllm_xargs": args}}


def joy_vector(url: str):
    """The joy preset's strength and vector (its one edit: add the default direction at layer 1), read from the
    file the presets listing names."""
    from safetensors.numpy import load_file

    joy = {p["name"]: p for p in httpx.get(f"{url}/v1/steer/presets", timeout=30).json()["data"]}["joy"]
    (edit,) = joy["edits"]
    assert (edit["tap"], edit["kind"], edit["tokens"]) == ("layer1", "add", "both")
    v = edit["vector"]
    return edit["scale"], load_file(v["path"])[v["key"]].reshape(-1)


def check_own_vectors(url: str, c, logprobs: bool = False) -> None:
    """A server with serve.inline_layers=[1, 2]: the joy preset's vector sent as steer_vector (at joy's layer, at
    joy's strength and 3 x) answers as steer=joy (at steer_scale 1 and 3), alone, in a list with a vector at
    strength 0, and in a chat (with `logprobs`, compared on the tokens' log-probs too); and it steers: at the
    weakest multiple of joy's strength (LADDER, within serve.max_steer_scale) where it moves some prompt's text,
    steer=joy at that scale gives the same moved text."""
    from steer.serve.protocol import encode_vector

    scale, v = joy_vector(url)
    for p in PROMPTS:
        for k in (1.0, 3.0):
            want = complete(c, p, "joy", k)
            assert complete(c, p, **own(encode_vector(v), 1, k * scale)) == want, (p, k)
            assert complete(c, p, **own([encode_vector(v), encode_vector(-v)], [1, 2], [k * scale, 0])) == want
            assert chat(c, p, **own(encode_vector(v), 1, k * scale)) == chat(c, p, "joy", k)
            if logprobs:
                mine = token_logprobs(c, p, **own(encode_vector(v), 1, k * scale))
                assert mine == token_logprobs(c, p, "joy", k), (p, k)
    ladder = [k for k in LADDER if k * abs(scale) < LADDER[-1]] + [LADDER[-1] / abs(scale)]  # up to strength 100
    p, k = moved_text(lambda p, k: complete(c, p, **own(encode_vector(v), 1, k * scale)), lambda p: complete(c, p),
                      "the joy vector sent as steer_vector", ladder)
    assert complete(c, p, "joy", k) == complete(c, p, **own(encode_vector(v), 1, k * scale)), (p, k)
    # with a preset: joy, then a vector of zeros at layer 2 (an add of nothing): joy's answer
    assert complete(c, PROMPTS[0], **own(encode_vector(v * 0), 2, 1.0, steer="joy")) == complete(c, PROMPTS[0], "joy")


def check_own_tokens(url: str, c, reference) -> None:
    """steer_tokens picks the rows a request's own vector is added to: for "prompt" and "generated", the joy
    vector at 3 x joy's strength answers as `reference(prompt, vector, layer 1, strength, tokens)`, the text an
    engine of the test's own gives with that one edit."""
    from steer.serve.protocol import encode_vector

    scale, v = joy_vector(url)
    for tokens in ("prompt", "generated"):
        for p in PROMPTS:
            got = complete(c, p, **own(encode_vector(v), 1, 3 * scale, steer_tokens=tokens))
            assert got == reference(p, v, 1, 3 * scale, tokens), (p, tokens)


def own_reference(engine, spec):
    """For check_own_tokens: `engine`'s greedy text with one add at a layer's residual stream on the given rows
    (an engine the test holds, not the server's)."""
    import torch

    from helpers import plan
    from steer.edits.edit import compile_edit
    from steer.config.schema import EditKind, GenConf, Tokens

    def text(prompt, v, layer, strength, tokens):
        one = plan(spec, layer, compile_edit(EditKind.add, strength, torch.from_numpy(v)[None], tokens=Tokens(tokens)))
        return engine.decode(engine.generate(engine.encode(prompt), one, GenConf(max_new_tokens=MAX_TOKENS), 0))

    return text


def check_own_condition(url: str, c, reference) -> None:
    """A server with serve.inline_layers=[1, 2]: the joy vector at layer 2, under a condition read at layer 1
    (steer_when): cosine above -1 (always met) answers as the vector alone, above 1 (never met) as unsteered; a
    cast condition against the joy direction answers, prompt by prompt, as `reference(prompt, v, when)` (an engine
    the test holds, with the same condition: met prompts steered, the others not)."""
    from steer.serve.protocol import encode_vector

    scale, v = joy_vector(url)
    k = 8 * scale
    for p in PROMPTS:
        plain, steered = complete(c, p), complete(c, p, **own(encode_vector(v), 2, k))
        assert steered != plain, p
        for threshold, want in ((-1.0, steered), (1.0, plain)):
            when = {"vector": encode_vector(v), "layer": 1, "threshold": threshold, "score": "cosine"}
            assert complete(c, p, **own(encode_vector(v), 2, k, steer_when=when)) == want, (p, threshold)
        when = {"vector": encode_vector(v), "layer": 1, "threshold": 0.0, "reduce": "last", "compare": "below"}
        assert complete(c, p, **own(encode_vector(v), 2, k, steer_when=when)) == reference(p, v, k, when), p


def own_condition_reference(engine, spec):
    """For check_own_condition: `engine`'s greedy text with the vector added at layer 2 under the request's
    condition read at layer 1 (an engine the test holds)."""
    import torch

    from helpers import plan
    from steer.config.schema import EditKind, GenConf, TapConf
    from steer.edits.condition import Condition
    from steer.edits.edit import compile_edit
    from steer.edits.tap import resolve

    def text(prompt, v, strength, when):
        d = torch.from_numpy(v)
        cond = Condition(resolve(TapConf(layer=1), spec).path, d, when.get("reduce", "mean"),
                         when.get("score", "cast"), when.get("compare", "above"), when["threshold"])
        one = plan(spec, 2, compile_edit(EditKind.add, strength, d[None], when=cond))
        return engine.decode(engine.generate(engine.encode(prompt), one, GenConf(max_new_tokens=MAX_TOKENS), 0))

    return text
