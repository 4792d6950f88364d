"""Taps on a module's input, by attention head (`tap.input`, `tap.heads`), on SmolLM2: ablating a head, scaling it
and adding a head-sized vector to it generate what the model generates with a plain forward pre-hook on the
attention output projection doing the same to that head's slice."""

import pytest
import torch

from steer.config.schema import EditConf, EditKind, GenConf, TapConf
from steer.edits.plan import compile_entries

PROMPTS = ["Tell me about the weather in the mountains today", "What is a good breakfast?",
           "Write a short poem about the sea"]
LAYER, HEAD = 3, 5
NEW = 6  # the prompt's pass and five decoding steps: both kinds of forward the edit must match the hook in


def reference(engine, ids, change):
    """Greedy tokens from transformers' own generate with a pre-hook that applies `change` to the head's slice of
    o_proj's input."""
    spec = engine.spec
    dim = spec.head_dim
    o_proj = dict(engine.model.named_modules())[f"{spec.layer_path(LAYER)}.self_attn.o_proj"]

    def pre(module, args):
        x = args[0].clone()
        x[..., HEAD * dim : (HEAD + 1) * dim] = change(x[..., HEAD * dim : (HEAD + 1) * dim])
        return (x,) + args[1:]

    handle = o_proj.register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            out = engine.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                        pad_token_id=engine.tokenizer.eos_token_id)[0, len(ids):].tolist()
    finally:
        handle.remove()
    stop = [i for i, t in enumerate(out) if t in engine.stop_ids]
    return out[: stop[0]] if stop else out


def plan(spec, edit):
    tap = TapConf(path=f"{spec.layer_path(LAYER)}.self_attn.o_proj", input=True, heads=[HEAD])
    return compile_entries([("", tap, edit)], spec)


@pytest.mark.parametrize("case", ["ablate", "scale", "add"])
def test_a_head_edited_at_the_projection_input_equals_a_pre_hook(smollm2_engine, smollm2_spec, tmp_path, case):
    from steer.edits import vector

    dim = smollm2_spec.head_dim
    torch.manual_seed(0)
    v = 3.0 * torch.randn(dim)
    if case == "ablate":  # no vector: the head's whole slice
        edit, change = EditConf(kind=EditKind.ablate, scale=1.0), torch.zeros_like
    elif case == "scale":
        edit, change = EditConf(kind=EditKind.rescale, scale=0.25), lambda x: 0.25 * x
    else:
        vector.save(tmp_path / "v.safetensors", {"direction": v}, model="smollm2", tap="head", method="test")
        edit = EditConf(kind=EditKind.add, scale=2.0)
        edit.vector.path = str(tmp_path / "v.safetensors")
        change = lambda x: x + 2.0 * v  # noqa: E731
    p = plan(smollm2_spec, edit)
    gen = GenConf(max_new_tokens=NEW)
    ids = [smollm2_engine.encode(x, "auto") for x in PROMPTS]
    want = [reference(smollm2_engine, x, change) for x in ids]
    assert [smollm2_engine.generate(x, p, gen, 0) for x in ids] == want
    # the head's change shows in the model's next-token distributions
    moved = smollm2_engine.score(ids[0], want[0], p).logprobs - smollm2_engine.score(ids[0], want[0], None).logprobs
    assert float(moved.abs().max()) > 1e-3
