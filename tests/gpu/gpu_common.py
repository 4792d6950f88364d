"""What the GPU tests share: prompts, generation settings, tolerances, and how they build engines and edits."""

from steer.edit import compile_edit
from steer.schema import EditKind, GenConf, Tokens, VllmConf

PROMPTS = ["The weather today is", "When I opened the letter, I felt", "My friend looked at me and said"]
GEN = GenConf(max_new_tokens=16)
LOGPROB_ATOL = 2e-3


def vllm_engine(spec, taps, declare=(), **kw):
    from steer.engine.vllm import VLLMEngine

    return VLLMEngine(spec, VllmConf(gpu_memory_utilization=0.12, **kw), taps, declare)


def edits(direction):
    return {
        "add": compile_edit(EditKind.add, 4.0, direction),
        "ablate": compile_edit(EditKind.ablate, 1.0, direction),
        "clamp": compile_edit(EditKind.clamp, 1.0, direction, lo=-5.0, hi=5.0),
        "set": compile_edit(EditKind.set, 1.0, direction, value=20.0),
        "scale": compile_edit(EditKind.scale, 0.5, None),
        "add_generated": compile_edit(EditKind.add, 6.0, direction, tokens=Tokens.generated),
    }
