"""The HF engine's batches: the rows of many requests, each with its own plan (or none), seed and prompt length, in
one left-padded forward per step with a KV cache.

A request's rows are marked prompt / generated as the edits select (`tokens=`), and padding rows get no edit. Each
edit changes a row from that row alone (interleaver/edit.py), so a request's rows are edited exactly as when it runs
by itself. Requests join the running batch between steps (their prompt runs as its own padded forward, and its
cache is laid beside the running one) and leave it as they finish; `Bound` caps how many rows, and how many padded
positions, a batch holds.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from steer.config.schema import GenConf
from steer.edits.plan import Plan
from steer.engine.hf_marks import Decided, Marks, hook
from steer.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """A batch's memory bound: at most `rows` requests, and `tokens` padded positions (rows x the longest row's
    prompt and continuation). `field`: the config key that sets `tokens`, for the error when one request alone
    needs more."""

    rows: int = 32
    tokens: int = 4096
    field: str = "hf.batch_tokens"

    def check(self, need: int, what: str) -> None:
        if need > self.tokens:
            raise ConfigError(self.field, f"{what} needs {need} positions, more than the batch bound of "
                                          f"{self.tokens}; raise {self.field} (memory grows with it) or shorten it")


@dataclass(eq=False)
class Row:
    """One request being generated: its prompt, plan, settings, sampler and the tokens it has so far."""

    ids: List[int]
    plan: Optional[Plan]
    gen: GenConf
    seed: int
    key: Any = None  # the caller's handle
    out: List[int] = field(default_factory=list)
    rng: Optional[torch.Generator] = None
    logits: Optional[torch.Tensor] = None  # the next token's distribution, float32 [vocab]
    done: bool = False
    decided: Optional[Decided] = None  # its plan's conditions, decided when its prompt ran

    @property
    def need(self) -> int:
        """Positions the row holds at its longest."""
        return len(self.ids) + self.gen.max_new_tokens


class Forward:
    """Left-padded forwards of the engine's model with the rows' edits, and the cache they keep."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model
        self.device = engine.device
        self.cache_kw = engine._cache_kw
        self.pad = 0

    @contextmanager
    def hooks(self, marks: Marks, capture: Sequence[str] = (), store: Optional[Dict[str, torch.Tensor]] = None
              ) -> Iterator[None]:
        """The rows' edits at their taps and, after them, the values of the `capture` taps into `store`."""
        modules = dict(self.model.named_modules())
        handles = []
        for path in marks.paths():
            handles.append(hook(modules, path, lambda h, path=path: marks.edit(path, h)))
        for path in marks.condition_paths():  # after the tap's edits: a condition reads the edited value
            handles.append(hook(modules, path, lambda h, path=path: marks.condition(path, h)))
        for path in capture:
            handles.append(hook(modules, path, lambda h, path=path: store.__setitem__(path, h.detach().clone())))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def prompts(self, seqs: Sequence[Sequence[int]], plans: Sequence[Optional[Plan]], n_prompt: Sequence[int],
                cache: bool, last_only: bool, capture: Sequence[str] = (),
                decided: Optional[Sequence[Optional[Decided]]] = None):
        """One forward over `seqs` left-padded to the longest: the model's output, the `[batch, length]` mask of
        real tokens, and the captured tap values. Token t of row b is a prompt token where t < n_prompt[b];
        `decided`: the rows' conditions decided before (for their generated tokens). The decisions this forward
        made are left in `self.decided`."""
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad, dtype=torch.long)
        real = torch.zeros(len(seqs), length, dtype=torch.bool)
        is_prompt = torch.zeros(len(seqs), length, dtype=torch.bool)
        for b, (s, n) in enumerate(zip(seqs, n_prompt)):
            start = length - len(s)
            ids[b, start:] = torch.tensor(list(s), dtype=torch.long)
            real[b, start:] = True
            is_prompt[b, start : start + n] = True
        ids, real, is_prompt = ids.to(self.device), real.to(self.device), is_prompt.to(self.device)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        store: Dict[str, torch.Tensor] = {}
        kw = {"logits_to_keep": 1} if last_only else {}
        marks = Marks(plans, is_prompt, real, decided, positions, n_prompt)
        with self.hooks(marks, capture, store):
            out = self.model(input_ids=ids, attention_mask=real.long(), position_ids=positions, use_cache=cache,
                             **kw)
        self.decided = marks.decisions(len(seqs))
        return out, real, store

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, plans: Sequence[Optional[Plan]], real: torch.Tensor, past,
             decided: Optional[Sequence[Optional[Decided]]] = None, plen: Optional[Sequence[int]] = None):
        """One decode step: `tokens` `[batch]` after the cached positions, whose real ones `real` marks;
        `decided`: each row's conditions, decided when its prompt ran; `plen`: each row's prompt length."""
        real = torch.cat([real, torch.ones(len(tokens), 1, dtype=torch.bool, device=self.device)], 1)
        positions = real.long().sum(-1, keepdim=True) - 1
        marks = Marks(plans, torch.zeros(len(tokens), 1, dtype=torch.bool, device=self.device),
                      torch.ones(len(tokens), 1, dtype=torch.bool, device=self.device), decided, positions,
                      plen if plen is not None else [0] * len(tokens))
        with self.hooks(marks):
            out = self.model(input_ids=tokens[:, None].to(self.device), attention_mask=real.long(),
                             position_ids=positions, use_cache=True, **{self.cache_kw: past})
        return out, real


def _cache_tensors(past) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in past.layers]


def _new_cache(kv: List[Tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


class Batch:
    """The running batch of a generation: requests join between steps and leave as they finish."""

    def __init__(self, engine, bound: Bound):
        self.fwd = Forward(engine)
        self.stop_ids = engine.stop_ids
        self.bound = bound
        self.rows: List[Row] = []
        self.past = None  # the model's cache: per layer `[batch, heads, L, dim]` keys and values
        self.real: Optional[torch.Tensor] = None  # `[batch, L]`: which cached positions hold tokens

    def fits(self, row: Row, joining: Sequence[Row] = ()) -> bool:
        """Whether `row` may join now, beside the rows `joining` with it, without the batch passing its bound
        (a row alone always may: `Bound.check` refused those that cannot)."""
        rows = self.rows + list(joining)
        if not rows:
            return True
        longest = max([row.need] + [r.need for r in rows])
        return len(rows) < self.bound.rows and (len(rows) + 1) * longest <= self.bound.tokens

    def join(self, rows: Sequence[Row]) -> List[Row]:
        """Run the new rows' prompts (one padded forward) and add them to the batch; those that generate nothing
        (max_new_tokens 0) are returned done at once."""
        for r in rows:
            r.rng = torch.Generator(device="cpu").manual_seed(r.seed)
        done = [r for r in rows if r.gen.max_new_tokens <= 0]
        for r in done:
            r.done = True
        rows = [r for r in rows if not r.done]
        if not rows:
            return done
        out, real, _ = self.fwd.prompts([r.ids for r in rows], [r.plan for r in rows], [len(r.ids) for r in rows],
                                        cache=True, last_only=True)
        logits = out.logits[:, -1].float().cpu()
        for r, lg, d in zip(rows, logits, self.fwd.decided):
            r.logits, r.decided = lg, d
        past = getattr(out, self.fwd.cache_kw)
        if self.past is None:
            self.past, self.real = past, real
        else:
            kv, self.real = _merge(_cache_tensors(self.past), self.real, _cache_tensors(past), real)
            self.past = _new_cache(kv)
        self.rows += rows
        return done

    def step(self) -> List[Tuple[Row, Optional[int]]]:
        """`pick`, then `advance`."""
        events = self.pick()
        self.advance()
        return events

    def pick(self) -> List[Tuple[Row, Optional[int]]]:
        """Pick each row's next token; rows that stop leave the batch. Returns (row, token) for each row, token None
        where the row stopped on a stop token (`row.done` once finished)."""
        picked = _pick_all(self.rows)
        events, gone = [], []
        for i, (r, tok) in enumerate(zip(self.rows, picked)):
            if tok in self.stop_ids:
                r.done = True
                events.append((r, None))
            else:
                r.out.append(tok)
                r.done = len(r.out) >= r.gen.max_new_tokens
                events.append((r, tok))
            if r.done:
                gone.append(i)
        self.drop(gone)
        return events

    def advance(self) -> None:
        """Run the rows' last picked tokens through the model: one decode step, the next distributions."""
        if not self.rows:
            return
        toks = torch.tensor([r.out[-1] for r in self.rows], dtype=torch.long)
        out, self.real = self.fwd.step(toks, [r.plan for r in self.rows], self.real, self.past,
                                       [r.decided for r in self.rows], [len(r.ids) for r in self.rows])
        self.past = getattr(out, self.fwd.cache_kw)
        for r, lg in zip(self.rows, out.logits[:, -1].float().cpu()):
            r.logits = lg

    def drop(self, gone: Sequence[int]) -> None:
        """Take rows out of the batch (finished, or nobody waits for them) and the positions no row uses."""
        if not gone:
            return
        gone = set(gone)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.past, self.real = None, None
            return
        idx = torch.tensor(keep, device=self.real.device)
        real = self.real[idx]
        first = int(real.any(0).nonzero()[0])  # the leading positions that are padding in every row left
        self.real = real[:, first:]
        for layer in self.past.layers:
            layer.keys, layer.values = layer.keys[idx, :, first:], layer.values[idx, :, first:]


def _merge(kv_a, real_a, kv_b, real_b):
    """Two batches' caches as one: each left-padded to the longer, then stacked."""
    la, lb = real_a.shape[1], real_b.shape[1]
    length = max(la, lb)

    def pad(x, n, dim):
        if n == 0:
            return x
        shape = list(x.shape)
        shape[dim] = n
        return torch.cat([x.new_zeros(shape), x], dim)

    kv = [(torch.cat([pad(ka, length - la, 2), pad(kb, length - lb, 2)]),
           torch.cat([pad(va, length - la, 2), pad(vb, length - lb, 2)])) for (ka, va), (kb, vb) in zip(kv_a, kv_b)]
    return kv, torch.cat([pad(real_a, length - la, 1), pad(real_b, length - lb, 1)])


def _pick_all(rows: Sequence[Row]) -> List[int]:
    """Each row's next token from its logits, as the one-request path picks it (`_pick`)."""
    greedy = [i for i, r in enumerate(rows) if r.gen.temperature <= 0]
    out: List[Optional[int]] = [None] * len(rows)
    if greedy:
        for i, tok in zip(greedy, torch.stack([rows[i].logits for i in greedy]).argmax(-1).tolist()):
            out[i] = int(tok)
    for i, r in enumerate(rows):
        if out[i] is None:
            out[i] = _pick(r.logits, r.gen, r.rng)
    return out


def _pick(logits: torch.Tensor, gen: GenConf, rng: torch.Generator) -> int:
    if gen.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / gen.temperature, dim=-1)
    if gen.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < gen.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=rng))
