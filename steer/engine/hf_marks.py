"""Which rows of an HF forward each edit acts on, read by the engine's hooks: per plan, the batch rows it owns, and
per edit the weight of each of their positions (its tokens and positions selectors, its condition's decision).

A condition (interleaver/edit.py's Condition) is decided for a row from its prompt, at the condition's tap, during the
forward that runs the prompt; from then on the row holds the decision (`Decided`). Within that forward the decision
is known from the condition's tap on: an edit it gates acts on the prompt's rows at later taps only (earlier taps
have run by then), and on generated rows wherever the row holds a decision. A row never decides again.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from steer.config.schema import Tokens
from steer.edits.condition import Condition
from steer.edits.plan import Plan
from steer.edits.tap import where

Decided = Dict[Condition, Tuple[float, bool]]  # a row's decisions: condition -> (score, met)


class _Group:
    """One plan's rows of a forward."""

    def __init__(self, plan: Plan, idx: Optional[torch.Tensor], prompt: torch.Tensor, real: torch.Tensor,
                 decided: Sequence[Optional[Decided]], pos: torch.Tensor, plen: torch.Tensor):
        self.plan, self.idx = plan, idx
        self.prompt, self.real = prompt, real  # [rows, positions] bool
        self.decided = decided
        self.pos, self.plen = pos, plen  # [rows, positions]: each token's place in its sequence; [rows]
        self._where: Dict[object, torch.Tensor] = {}  # edit.positions -> its flat weights
        self.now: Dict[Condition, Tuple[torch.Tensor, torch.Tensor]] = {}  # decided in this forward: (scores, met)
        padded = not bool(real.all())
        flat_p, flat_r = prompt.reshape(-1), real.reshape(-1)
        self.tokens = {Tokens.both: flat_r.float() if padded else None, Tokens.prompt: (flat_p & flat_r).float(),
                       Tokens.generated: (~flat_p & flat_r).float()}

    def weight(self, e) -> Optional[torch.Tensor]:
        """The flat `[rows x positions]` weights of edit `e` on this group's rows (None: every row, fully)."""
        w = self.tokens[e.tokens]
        if not e.positions.every:
            if e.positions not in self._where:
                at = e.positions.mask(self.pos, self.plen[:, None]) & self.real
                self._where[e.positions] = at.reshape(-1).float()
            where = self._where[e.positions]
            w = where if w is None else w * where
        if e.when is None:
            return w
        rows, length = self.prompt.shape
        held = torch.tensor([float(d[e.when][1]) if d and e.when in d else 0.0 for d in self.decided],
                            device=self.prompt.device)
        now = self.now.get(e.when)
        now = now[1].float() if now is not None else torch.zeros(rows, device=self.prompt.device)
        on = torch.where(self.prompt, now[:, None], held[:, None]).reshape(-1)
        return on if w is None else on * w


class Marks:
    """A forward's rows by plan. `is_prompt`, `real`: `[batch, positions]` bool; `decided`: each row's decisions so
    far (None where it holds none: a prompt being run)."""

    def __init__(self, plans: Sequence[Optional[Plan]], is_prompt: torch.Tensor, real: torch.Tensor,
                 decided: Optional[Sequence[Optional[Decided]]] = None, pos: Optional[torch.Tensor] = None,
                 plen: Optional[Sequence[int]] = None):
        self.groups: List[_Group] = []
        by: Dict[int, List[int]] = {}
        for b, plan in enumerate(plans):
            if plan is not None:
                by.setdefault(id(plan), []).append(b)
        decided = decided if decided is not None else [None] * len(plans)
        if pos is None:  # rows of a prompt, from its first token on
            pos = (real.long().cumsum(-1) - 1).clamp(min=0)
        plen_all = (torch.tensor(list(plen), device=real.device) if plen is not None
                    else (is_prompt & real).sum(-1))
        for rows in by.values():
            idx = None if len(rows) == len(plans) else torch.tensor(rows, device=real.device)
            p, r, at, n = ((is_prompt, real, pos, plen_all) if idx is None
                           else (is_prompt[idx], real[idx], pos[idx], plen_all[idx]))
            self.groups.append(_Group(plans[rows[0]], idx, p, r, [decided[b] for b in rows], at, n))
        self.rows = by

    def paths(self) -> set:
        return {path for g in self.groups for path in g.plan.edits}

    def condition_paths(self) -> set:
        return {c.path for g in self.groups for c in g.plan.conditions()}

    def edit(self, path: str, h: torch.Tensor) -> None:
        """Run every plan's edits at `path` on its rows of `h` (`[batch, positions, width]`), in place; at a tap of
        heads, on each head's slice of the rows by itself."""
        heads, dim = where(path)[2:]
        for g in self.groups:
            edits = g.plan.edits.get(path)
            if not edits:
                continue
            sub = h if g.idx is None else h[g.idx]
            if heads:
                for k in heads:  # a head's slice is strided: edited as a copy, written back
                    part = sub[..., k * dim : (k + 1) * dim]
                    flat = part.reshape(-1, dim).clone()
                    for e in edits:
                        e.apply_(flat, g.weight(e))
                    part.copy_(flat.view(part.shape))
            else:
                flat = sub.reshape(-1, h.shape[-1])  # a view of `sub`: edits land there
                for e in edits:
                    e.apply_(flat, g.weight(e))
            if g.idx is not None:
                h[g.idx] = sub

    def condition(self, path: str, h: torch.Tensor) -> None:
        """Decide, from `h` (the tap's value after its edits), the conditions read at `path` for the rows whose
        prompt this forward runs."""
        for g in self.groups:
            for c in g.plan.conditions():
                if c.path != path:
                    continue
                prompt = g.prompt & g.real
                if not bool(prompt.any(1).all()):  # a decode step: the rows decided when their prompts ran
                    continue
                sub = h if g.idx is None else h[g.idx]
                scores = c.scores(sub, prompt)
                g.now[c] = (scores, c.met(scores))

    def decisions(self, batch: int) -> List[Optional[Decided]]:
        """Each batch row's decisions made in this forward (None: a row with no plan, or a plan with none)."""
        out: List[Optional[Decided]] = [None] * batch
        for g, rows in zip(self.groups, self.rows.values()):
            if not g.now:
                continue
            for j, b in enumerate(rows):
                out[b] = {c: (float(s[j]), bool(m[j])) for c, (s, m) in g.now.items()}
        return out


def hook(modules: Dict[str, torch.nn.Module], path: str, fn):
    """Call `fn(h)` with the value at tap `path` of the model whose modules are `modules`: a module's output (its
    first tensor), or its input (its first positional argument: tap.input), which `fn` may edit in place. The
    hook's handle."""
    module, is_input, _, _ = where(path)
    if is_input:
        return modules[module].register_forward_pre_hook(lambda m, args: fn(args[0]))
    return modules[module].register_forward_hook(lambda m, args, out: fn(out[0] if isinstance(out, (tuple, list))
                                                                          else out))
