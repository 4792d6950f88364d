"""`python -m steer.serve engine=hf` driven by the official openai client: answers equal the CLI's, streaming,
the presets listing, bad requests, concurrency. Greedy unless said; the tiny model, 8 new tokens."""

import httpx

from serve_cli import cli_edits, cli_run
from steer.config.schema import TinyConf
from serve_common import (MAX_TOKENS, MODEL, PROMPTS, chat, check_against, check_bad_requests, check_concurrent,
                          check_idle_connection_kept, check_listing, check_sse_done, check_streaming, complete)

LEN = TinyConf().max_positions  # the tiny model's positions, prompt and continuation together


def test_answers_equal_the_cli(hf_client, cli_text):
    check_against(hf_client, cli_text)


def test_sampling_with_a_seed_equals_the_cli(hf_client, tmp_path):
    rows = cli_run(cli_edits("joy", None), tmp_path / "run", "gen.temperature=1.0", "gen.seed=5", "gen.top_p=0.9")
    for i, row in enumerate(rows):  # the CLI seeds prompt i with gen.seed + i
        kw = {"temperature": 1.0, "top_p": 0.9, "seed": 5 + i}
        assert complete(hf_client, row["prompt"], **kw) == row["baseline"]
        assert complete(hf_client, row["prompt"], "joy", **kw) == row["steered"]
    many = hf_client.completions.create(model=MODEL, prompt=[r["prompt"] for r in rows], max_tokens=MAX_TOKENS,
                                        temperature=1.0, top_p=0.9, seed=5)  # a batch: prompt i gets seed + i
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == [r["baseline"] for r in rows]


def test_token_ids_and_usage(hf_client):
    from transformers import AutoTokenizer

    text = complete(hf_client, PROMPTS[0], "joy")
    out = hf_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"vllm_xargs": {"steer": "joy"}})
    tok = AutoTokenizer.from_pretrained(hf_client.models.list().data[0].root)
    ids = tok(PROMPTS[0])["input_ids"]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == MAX_TOKENS
    assert out.choices[0].finish_reason == "length"
    by_ids = hf_client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"vllm_xargs": {"steer": "joy"}})
    assert by_ids.choices[0].text == text


def test_stop_strings(hf_client):
    full = complete(hf_client, PROMPTS[0], "joy")
    stop = full.split()[2]
    want = full[: full.find(stop)]
    out = hf_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       stop=[stop], extra_body={"vllm_xargs": {"steer": "joy"}})
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    pieces = hf_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                          stop=stop, stream=True, extra_body={"vllm_xargs": {"steer": "joy"}})
    assert "".join(p.choices[0].text for p in pieces) == want
    assert chat(hf_client, PROMPTS[0], "joy", stop=[stop]) == want


def test_streaming(hf_client, hf_url):
    check_streaming(hf_client)
    check_sse_done(hf_url)


def test_presets_models_health(hf_url):
    check_listing(hf_url)
    assert httpx.get(f"{hf_url}/health").json() == {"status": "ok", "generations": 0}


def test_bad_requests_are_400_and_the_server_keeps_serving(hf_url, hf_client):
    check_bad_requests(hf_url, hf_client, params_everywhere_only=False)
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 3}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 0}, "logprobs"),  # the sampled token's
        ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["x", ""], "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 2, "stream": True}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [999999]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10 ** 6}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        # too long whatever max_tokens says: the prompt is named
        ("/v1/completions", {"model": MODEL, "prompt": [5] * LEN}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [[5], [5] * (LEN + 1)]}, "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": [5] * (LEN - 12), "max_tokens": 13}, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * LEN}]},
         "messages"),
    ]
    for path, body, param in cases:
        r = httpx.post(f"{hf_url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for path, raw, param in [  # JSON's escapes spell a lone surrogate, which no client's encoder sends
            ("/v1/completions", '{"model": "%s", "prompt": "\\ud800abc"}', "prompt"),
            ("/v1/completions", '{"model": "%s", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
            ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi \\udfff"}]}',
             "messages[0].content")]:
        r = httpx.post(f"{hf_url}{path}", content=(raw % MODEL).encode(), timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (raw, r.text)
    r = httpx.post(f"{hf_url}/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for method, path, status in (("GET", "/v1/nothing", 404), ("PUT", "/v1/models", 405)):  # OpenAI's error shape
        r = httpx.request(method, f"{hf_url}{path}", timeout=60)
        assert r.status_code == status and r.json()["error"]["message"].startswith(f"{method} {path}: "), r.text
    assert complete(hf_client, PROMPTS[1]) == complete(hf_client, PROMPTS[1])


def test_concurrent_requests_each_equal_their_answer_alone(hf_client):
    check_concurrent(hf_client, 32)


def test_an_idle_connection_outlives_the_clients_keep_alive(hf_url):
    check_idle_connection_kept(hf_url)
