"""What the GPU tests share: prompts, generation settings, tolerances, and how they build engines and edits."""

from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, GenConf, Tokens, VllmConf

PROMPTS = ["The weather today is", "When I opened the letter, I felt", "My friend looked at me and said"]
GEN = GenConf(max_new_tokens=16)
LOGPROB_ATOL = 2e-3
# Where two engines' greedy tokens part, the HF engine's log-probs of the two candidates are at most this far apart:
# float32 kernels that sum in another order move a log-prob by about 1e-4 on SmolLM2; a real difference in an edit
# moves it by orders of magnitude more
TIE = 2e-3


def vllm_engine(spec, taps, declare=(), **kw):
    from steer.engine.vllm import VLLMEngine

    return VLLMEngine(spec, VllmConf(gpu_memory_utilization=0.12, **kw), taps, declare)


def edits(direction):
    return {
        "add": compile_edit(EditKind.add, 4.0, direction),
        "ablate": compile_edit(EditKind.ablate, 1.0, direction),
        "clamp": compile_edit(EditKind.clamp, 1.0, direction, lo=-5.0, hi=5.0),
        "set": compile_edit(EditKind.set, 1.0, direction, value=20.0),
        "rescale": compile_edit(EditKind.rescale, 0.5, None),
        "add_generated": compile_edit(EditKind.add, 6.0, direction, tokens=Tokens.generated),
    }


def near_tie(engine, ids, a, b, plan):
    """(tie, k, gap): whether the HF engine's next-token log-probs after prompt `ids` and the shared prefix of
    continuations `a` and `b` put their two differing tokens within TIE of each other, the first token k where
    they part, and the log-prob gap there."""
    k = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
    if k == min(len(a), len(b)):  # one stopped where the other went on: compare the stop (EOS) with the token
        longer = a if len(a) > len(b) else b
        pair = (longer[k], engine.tokenizer.eos_token_id)
    else:
        pair = (a[k], b[k])
    lp = engine.score(ids, a[:k], plan).logprobs[len(ids) + k - 1].double()
    return abs(float(lp[pair[0]] - lp[pair[1]])) < TIE, k, float(lp[pair[0]] - lp[pair[1]])
