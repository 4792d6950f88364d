"""A control vector exported by steer, run by llama.cpp itself (llama-cpp-python) on SmolLM2's own Q4_1 GGUF, on
the token ids steer fed, against steer's HF engine on the same weights (dequantised).

Agreement measured: greedy tokens equal from the start (baseline and steered), and the steered-minus-baseline
log-prob shift of the steered continuation, summed over its tokens, in each engine. The GGUF is read back with the
gguf package, not steer, and its `direction.<k>` placed where llama.cpp's buffer puts layer k (it starts at layer
1): one layer off moves the shift away from the HF engine's (at least twice as far as the right placement), which the
test asserts too."""

import ctypes

import numpy as np
import pytest
import torch

from steer.config.schema import GenConf, GgufConf, TapConf
from steer.edits import formats
from steer.edits.tap import resolve
from steer.models import gguf as gguf_model
from steer.runs.extract import Recipe, direction
from helpers import plan as one_edit_plan

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/vectors.md: "
                                                    "CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" pip install llama-cpp-python)")

POS = ["I am so happy and grateful, this is a wonderful day", "What a joy, everything is bright and lovely"]
NEG = ["I am so sad and tired, this is a terrible day", "What a misery, everything is dark and awful"]
PROMPTS = ["Tell me about your morning.", "Describe the weather today."]
LAYER, SCALE, NEW = 8, 6.0, 12


@pytest.fixture(scope="module")
def model_gguf(cache_dir):
    """SmolLM2's own GGUF file, the one steer converts for its HF engine."""
    return gguf_model.model_file(str(cache_dir), GgufConf())


@pytest.fixture(scope="module")
def llm(model_gguf):
    # one thread for prompts too (n_threads_batch defaults to every core): a second one spinning on the core the
    # other test worker holds made each prompt's pass three times as long
    llm = llama_cpp.Llama(model_path=str(model_gguf), n_ctx=256, n_threads=1, n_threads_batch=1, n_batch=256,
                          logits_all=True, verbose=False, seed=0)
    yield llm
    llm.close()


def cvec_buffer(path, n_embd, n_layer, shift=0):
    """The buffer llama_set_adapter_cvec takes (layer 1 at [0]), from the file as the gguf package reads it;
    `shift` moves every direction that many layers (a wrong convention)."""
    from gguf import GGUFReader

    buf = np.zeros(n_embd * n_layer, dtype=np.float32)
    for t in GGUFReader(str(path)).tensors:
        k = int(t.name.split(".")[1]) + shift
        buf[(k - 1) * n_embd:k * n_embd] += np.asarray(t.data, dtype=np.float32)
    return buf


def set_cvec(llm, buf, n_embd, n_layer):
    if buf is None:
        rc = llama_cpp.llama_set_adapter_cvec(llm.ctx, None, 0, n_embd, 1, n_layer)
    else:
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        rc = llama_cpp.llama_set_adapter_cvec(llm.ctx, ptr, buf.size, n_embd, 1, n_layer)
    assert rc == 0


def llama_greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        llm.eval([t])
    return out


def llama_logprob(llm, ids, n_prompt):
    """Sum of log p(token) over the continuation (tokens after `n_prompt`), teacher-forced."""
    llm.reset()
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[t - 1, ids[t]] for t in range(n_prompt, len(ids))))


def hf_logprob(engine, prompt, cont, plan):
    lp = engine.score(prompt, cont, plan).logprobs
    n = len(prompt)
    return float(sum(lp[n + i - 1, t] for i, t in enumerate(cont)))


def equal_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_llama_cpp_steers_as_the_hf_engine_with_an_exported_control_vector(smollm2_engine, llm, tmp_path, capsys):
    from steer.edits.edit import compile_edit
    from steer.config.schema import EditKind

    tap = resolve(TapConf(layer=LAYER), smollm2_engine.spec)
    d = direction(smollm2_engine, tap, POS, NEG, Recipe(chat="true"))
    plan = one_edit_plan(smollm2_engine.spec, LAYER, compile_edit(EditKind.add, SCALE, d[None]))
    path = formats.write_gguf(tmp_path / "joy.gguf", {LAYER: SCALE * d}, "llama")
    n_embd, n_layer = smollm2_engine.spec.hidden, smollm2_engine.spec.layers
    gen = GenConf(max_new_tokens=NEW)
    report = []
    for text in PROMPTS:
        ids = smollm2_engine.encode(text, "true")
        hf_base, hf_steer = smollm2_engine.generate(ids, None, gen, 0), smollm2_engine.generate(ids, plan, gen, 0)
        set_cvec(llm, None, n_embd, n_layer)
        ll_base = llama_greedy(llm, ids, NEW)
        set_cvec(llm, cvec_buffer(path, n_embd, n_layer), n_embd, n_layer)
        ll_steer = llama_greedy(llm, ids, NEW)
        assert hf_steer != hf_base  # the edit moves the text at all, else the comparison says nothing

        # the log-prob shift of HF's steered continuation: steered minus baseline, in each engine
        seq = ids + hf_steer
        shift_hf = hf_logprob(smollm2_engine, ids, hf_steer, plan) - hf_logprob(smollm2_engine, ids, hf_steer, None)
        steered_ll = llama_logprob(llm, seq, len(ids))
        set_cvec(llm, None, n_embd, n_layer)
        shift_ll = steered_ll - llama_logprob(llm, seq, len(ids))
        wrong = {}
        for off in (-1, 1):
            set_cvec(llm, cvec_buffer(path, n_embd, n_layer, shift=off), n_embd, n_layer)
            wrong[off] = llama_logprob(llm, seq, len(ids)) - (steered_ll - shift_ll)
        set_cvec(llm, None, n_embd, n_layer)
        report.append((text, equal_prefix(hf_base, ll_base), equal_prefix(hf_steer, ll_steer), shift_hf, shift_ll,
                       wrong[-1], wrong[1]))
        # llama.cpp multiplies Q4_1 weights by activations it quantizes to 8 bits, with kernels that differ by
        # CPU: a prompt's shift can be a quarter off HF's (float32 activations) on one machine and exact on another
        assert abs(shift_ll - shift_hf) <= 0.35 * abs(shift_hf), report[-1]
        assert equal_prefix(hf_steer, ll_steer) >= 2 and equal_prefix(hf_base, ll_base) >= 2, report[-1]
    # summed over the prompts, the shifts agree closely; one layer off is at least 1.5 x as far from HF's shift as
    # the right placement (adjacent layers steer alike, so the gap is a factor, not an order of magnitude)
    right = sum(abs(r[4] - r[3]) for r in report)
    assert right <= 0.15 * sum(abs(r[3]) for r in report), report
    for i, off in ((5, -1), (6, 1)):
        assert sum(abs(r[i] - r[3]) for r in report) > 1.5 * right, (off, report)
    with capsys.disabled():
        for r in report:
            print("\nllama.cpp vs HF: prompt %r: baseline tokens equal from the start %d/%d, steered %d/%d; "
                  "log-prob shift HF %.2f, llama.cpp %.2f, layer k-1 %.2f, layer k+1 %.2f"
                  % (r[0], r[1], NEW, r[2], NEW, r[3], r[4], r[5], r[6]))


def test_the_python_block_of_docs_vectors_runs_a_control_vector_steer_exported(smollm2_engine, model_gguf,
                                                                               tmp_path, monkeypatch, capsys):
    """docs/vectors.md's "From Python" block, run as written, in a directory holding a control vector exported by
    steer (joy.gguf): it prints llama.cpp's steered text, which differs from the unsteered one."""
    from helpers import ROOT

    block = (ROOT / "docs" / "vectors.md").read_text().split("### From Python")[1].split("```python\n")[1]
    block = block.split("```")[0]
    tap = resolve(TapConf(layer=LAYER), smollm2_engine.spec)
    d = direction(smollm2_engine, tap, POS, NEG, Recipe(chat="true"))
    formats.write_gguf(tmp_path / "joy.gguf", {LAYER: SCALE * d}, "llama")
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(block, "docs/vectors.md", "exec"), ns)
    steered = capsys.readouterr().out.strip()
    llm = ns["llm"]
    try:
        assert ns["gguf"] == model_gguf
        assert llama_cpp.llama_set_adapter_cvec(llm.ctx, None, 0, ns["n_embd"], 1, ns["n_layer"]) == 0
        plain = llm("The weather today is", max_tokens=24, temperature=0)["choices"][0]["text"].strip()
    finally:
        llm.close()
    assert steered and steered != plain, (steered, plain)
    assert np.array_equal(ns["buf"], cvec_buffer(tmp_path / "joy.gguf", ns["n_embd"], ns["n_layer"]))
