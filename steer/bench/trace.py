"""Configurations d and e: the bench's edits written as nnsight 0.8.1 traces, the way an nnsight user steers.

Each request is one invoke whose block runs at every generated step (`tracer.all()`) and edits the layer's output
in place: `add` as `output[0][:] += v`, the others on the stream (vLLM's layer returns `(hidden, residual)`, summed)
in steer's float32 math. nnsight reads a trace's source, so this file stays plain Python on disk.
"""

from typing import List, Optional, Sequence

import torch

from steer.edits.edit import Edit
from steer.config.schema import EditKind


def generate(model, prompts: Sequence[List[int]], edits: Sequence[Optional[Edit]], layers: List[int],
             max_tokens: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Generate `max_tokens` greedy tokens per prompt, request i running `edits[i]` at each of `layers`."""
    with model.trace(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False) as tracer:
        for ids, edit in zip(prompts, edits):
            if edit is None:
                raise ValueError("the nnsight configurations only run steered scenarios")
            if edit.kind == EditKind.add:
                v = (edit.strength * edit.basis[0]).to(dtype)
                with tracer.invoke(ids):
                    vd = v.to("cuda")
                    for _ in tracer.all():
                        for i in layers:
                            model.model.layers[i].output[0][:] += vd
            else:
                with tracer.invoke(ids):
                    ed = edit.to("cuda")
                    for _ in tracer.all():
                        for i in layers:
                            h, r = model.model.layers[i].output
                            x = h.float() + r.float()
                            h[:] = (h.float() + ed.delta(x)).to(h.dtype)
