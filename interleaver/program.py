"""A tap's compiled edits as one replay callable: the vectorised in-place program a replayed step runs.

On vLLM's Llama-family layers a residual tap's value is the pair `(hidden, residual)` and the stream is their
sum (the next layer's fused add-norm forms it). Each stage's delta is computed on the summed stream, in float32,
and the sum of the deltas lands on `hidden` alone: the next layer then sees exactly `h + delta`, the HF engine's
semantics, and a row whose weights are all 0 is left bit for bit as it was.
"""

from typing import Any, Dict, List

import torch

from interleaver.bank import Stage, StepRows


class TapProgram:
    def __init__(self, location: str, stages: List[Stage], residual: bool):
        self.location = location
        self.stages = stages
        self.residual = residual
        # request key -> row blocks kept for it (scoring passes only; clones, since the graph rewrites the slab)
        self.kept: Dict[str, List[torch.Tensor]] = {}

    def __call__(self, live: Any, step: StepRows) -> None:
        """Edit the step's rows of `live` in place (`live` already trimmed to the step's real rows)."""
        stages = [s for s in self.stages if s.id in step.active]
        keep = step.capturing.get(self.location)
        if not stages and not keep:
            return
        hidden, residual = _split(live, self.residual)
        x = hidden.float() if residual is None else hidden.float() + residual.float()
        if stages:
            acc = torch.zeros_like(x)
            for s in stages:
                d = s.edit.delta(x) * step.weights[s.id, : x.shape[0], None]
                x = x + d
                acc += d
            hidden.copy_((hidden.float() + acc).to(hidden.dtype))
        for sp in keep or ():
            self.kept.setdefault(sp.edits.key, []).append(x[sp.start : sp.start + sp.count].detach().cpu().clone())


def _split(live: Any, residual: bool):
    if isinstance(live, (tuple, list)):
        if residual and len(live) > 1 and isinstance(live[1], torch.Tensor):
            return live[0], live[1]
        return live[0], None
    return live, None
