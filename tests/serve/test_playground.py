"""The playground at / of the HF server (tests/serve/conftest.py's, on the tiny model with serve.inline_layers
[1, 2]) in a real headless browser, held to the openai client's answers for the same requests; and its routes as
engine=vllm's middleware serves them, on the CPU."""

import base64
import json

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from browser import Page, axe_violations, browser, keyboard_reach
from serve_common import MODEL, client
from steer.config.schema import ExtractConf, ModelConf, PromptsConf
from steer.runs.extract import Recipe, extract
from steer.serve import playground
from steer.serve.protocol import encode_vector

PROMPT = "When I opened the letter, I felt"
MAX_TOKENS = 12
# The dev extra installs Playwright; a GPU host's run (pytest -m gpu, which collects every module) may lack it.
expect = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the dev extra has it)").expect

POSITIVE = ["What a joy, everything is bright and wonderful", "I am so happy and grateful today"]
NEGATIVE = ["What a misery, everything is dark and hopeless", "I am so sad and tired of everything"]


@pytest.fixture(scope="module")
def page(hf_url):
    """The playground, loaded; every request it makes recorded, and each streamed response's content type."""
    with browser() as b:
        p = Page(b, 1400, 1000)
        p.streams = []
        p.page.on("response", lambda r: p.streams.append((r.url, r.headers.get("content-type", ""))))
        p.page.goto(f"{hf_url}/")
        expect(p.page.locator("#model")).to_contain_text("decoder layers")
        yield p
        p.close()


def generate(p: Page, preset: str, scale: str) -> None:
    p.page.fill("#prompt", PROMPT)
    p.page.fill("#max_tokens", str(MAX_TOKENS))
    p.page.select_option("#preset", preset)
    p.page.fill("#scale-value", scale)
    p.page.click("#run")
    expect(p.page.locator("#status")).to_have_text("Done.", timeout=120_000)


def openai_text(url: str, vllm_xargs=None) -> str:
    extra = {"extra_body": {"vllm_xargs": vllm_xargs}} if vllm_xargs else {}
    out = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=MAX_TOKENS, temperature=0, seed=0, **extra)
    return out.choices[0].message.content


def test_both_continuations_stream_and_equal_the_openai_clients(page, hf_url):
    generate(page, "joy", "3")
    base, steered = page.page.text_content("#out-base"), page.page.text_content("#out-steer")
    assert base == openai_text(hf_url)
    assert steered == openai_text(hf_url, {"steer": "joy", "steer_scale": 3.0})
    assert base and steered
    chat = [kind for url, kind in page.streams if url == f"{hf_url}/v1/chat/completions"]
    assert len(chat) >= 2 and all(kind.startswith("text/event-stream") for kind in chat)  # both streamed
    assert page.page.locator(".error").count() == 0
    assert "finish_reason" in page.page.text_content("#meta-steer")


def test_a_server_error_is_shown_as_a_message(page, hf_url):
    generate(page, "joy", "1000")  # over serve.max_steer_scale (100)
    alert = page.page.locator("#pane-steer [role=alert]")
    assert alert.count() == 1
    assert "steer_scale" in alert.text_content() and "100" in alert.text_content()
    assert page.page.text_content("#out-base") == openai_text(hf_url)  # the unsteered side is served as ever


def test_a_direction_from_lines_takes_the_inline_vector_path(page, hf_url, hf_engine):
    page.page.fill("#positive", "\n".join(POSITIVE))
    page.page.fill("#negative", "\n".join(NEGATIVE))
    page.page.select_option("#layer", "1")
    page.page.click("#build")
    expect(page.page.locator("#dir-state")).to_contain_text("Using a direction at layer 1", timeout=60_000)
    page.page.fill("#strength", "6")
    generate(page, "", "1")
    sent = json.loads(page.page.text_content("#requests").split("\n\n")[1].split("\n", 1)[1])
    assert sent["vllm_xargs"]["steer_layer"] == 1 and "steer" not in sent["vllm_xargs"]
    # The direction the server built is the one steer.runs.extract reads from the same lines at layer 1
    from steer.edits.tap import resolve
    from steer.config.schema import TapConf

    got = page.page.evaluate("""async () => (await (await fetch('/v1/steer/direction', {method: 'POST',
        headers: {'Content-Type': 'application/json'},
        body: JSON.stringify({positive: %s, negative: %s, layer: 1})})).json())""" % (json.dumps(POSITIVE),
                                                                                       json.dumps(NEGATIVE)))
    v = np.frombuffer(base64.b64decode(got["vector"]), dtype="<f4")
    recipe = Recipe.from_conf(ExtractConf(), PromptsConf().chat)
    want = extract(hf_engine, resolve(TapConf(layer=1), hf_engine.spec), POSITIVE, NEGATIVE, recipe).direction
    torch.testing.assert_close(torch.from_numpy(v.copy()), want.float(), rtol=1e-4, atol=1e-5)
    steered = openai_text(hf_url, {"steer_vector": encode_vector(v), "steer_layer": 1, "steer_strength": 6.0})
    assert page.page.text_content("#out-steer") == steered


def test_requests_stay_on_the_servers_origin_and_controls_are_accessible(page, hf_url):
    assert page.requests and all(u.startswith(f"{hf_url}/") for u in page.requests), page.requests
    assert not axe_violations(page.page)
    assert not keyboard_reach(page.page, "button, select, input, textarea, summary")
    assert not page.errors


def test_direction_requests_are_checked(hf_url):
    import httpx

    for body, param in (({"positive": POSITIVE, "negative": NEGATIVE, "layer": 3}, "layer"),
                        ({"positive": [], "negative": NEGATIVE, "layer": 1}, "positive"),
                        ({"positive": POSITIVE, "negative": ["ok", ""], "layer": 1}, "negative[1]"),
                        ({"positive": ["x" * 2001], "negative": NEGATIVE, "layer": 1}, "positive[0]"),
                        ({"positive": POSITIVE, "negative": NEGATIVE, "layer": 1, "path": "/etc"}, "path")):
        r = httpx.post(f"{hf_url}/v1/steer/direction", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_playground_false_serves_no_page(hf_engine):
    from steer.serve.hf_app import HFServer, build_app

    server = HFServer(hf_engine, {}, [], MODEL, 100.0, 16, playground=False)
    try:
        http = TestClient(build_app(server))
        assert http.get("/").status_code == 404 and http.get("/v1/steer/info").status_code == 404
        assert http.get("/v1/models").status_code == 200
    finally:
        server.worker.close(timeout=30)


# --- engine=vllm: the middleware serves the same page and routes ---------------------------------------------------


@pytest.fixture(scope="module")
def middleware(tmp_path_factory, cache_dir, tiny_spec):
    from omegaconf import OmegaConf

    from steer.config.schema import TapConf
    from steer.edits.tap import resolve
    from steer.serve.middleware import SteerMiddleware
    from steer.serve.schema import ServeConf, ServeOptions
    from steer.serve.stages import StageTable

    conf = ServeConf(model=ModelConf(name="tiny"), prompts=PromptsConf(), cache_dir=str(cache_dir),
                     serve=ServeOptions(inline_layers=[1, 3]))
    path = tmp_path_factory.mktemp("vllm-playground") / "serve_conf.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(conf)))
    table = StageTable({}, {k: resolve(TapConf(layer=k), tiny_spec) for k in (1, 3)})

    def app(enabled: bool):
        t = table.translator([], 100.0, tiny_spec.hidden)
        t.table["playground"] = {**playground.section(conf, tiny_spec, "tiny", str(path)), "enabled": enabled}

        async def vllm(scope, receive, send):  # stands in for vLLM's app: what reaches it says so
            await send({"type": "http.response.start", "status": 418, "headers": []})
            await send({"type": "http.response.body", "body": b"vllm"})

        return TestClient(SteerMiddleware(vllm, t))

    return app


def test_the_vllm_middleware_serves_the_page_and_builds_directions(middleware, hf_engine):
    http = middleware(True)
    page = http.get("/")
    assert page.status_code == 200 and page.text == playground.page().decode()
    assert http.get("/v1/steer/info").json() == {"object": "steer.info", "model": "tiny", "layers": 4, "hidden":
                                                  hf_engine.spec.hidden, "inline_layers": [1, 3],
                                                  "max_steer_scale": 100.0, "direction": True}
    r = http.post("/v1/steer/direction", json={"positive": POSITIVE, "negative": NEGATIVE, "layer": 3})
    assert r.status_code == 200, r.text
    v = np.frombuffer(base64.b64decode(r.json()["vector"]), dtype="<f4")
    from steer.edits.tap import resolve
    from steer.config.schema import TapConf

    recipe = Recipe.from_conf(ExtractConf(), PromptsConf().chat)
    want = extract(hf_engine, resolve(TapConf(layer=3), hf_engine.spec), POSITIVE, NEGATIVE, recipe).direction
    torch.testing.assert_close(torch.from_numpy(v.copy()), want.float(), rtol=1e-4, atol=1e-5)
    bad = http.post("/v1/steer/direction", json={"positive": POSITIVE, "negative": NEGATIVE, "layer": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "layer"
    off = middleware(False)
    assert off.get("/").status_code == 418 and off.get("/v1/steer/info").status_code == 418  # vLLM's to answer
