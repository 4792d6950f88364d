"""The HF transformers engine: runs compiled edits at taps through forward hooks, on CPU or one GPU.

It is the product's portable engine and the independent reference the vLLM engine is checked against. `generate`
and `score` run one request plainly (a KV cache, and hooks that edit the tap's output in place); `generate_many` and
`score_many` run many requests' rows in left-padded batches (steer/engine/hf_batch.py), each row edited as alone,
up to the engine's `Bound` (a bound of one row runs them one at a time, through `generate` and `score`). HF decoder
layers return the summed residual stream, so a residual tap sees exactly the `h` the edits are defined on
(steer/edits/edit.py).
"""

import gc
import inspect
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from steer.engine.base import Engine, Scores, stop_ids
from steer.engine.hf_batch import Batch, Bound, Forward, Row, _pick
from steer.engine.hf_marks import Decided, Marks, hook
from steer.models.spec import ModelSpec
from steer.edits.plan import Plan
from steer.config.schema import GenConf


class HFEngine(Engine):
    name = "hf"

    def __init__(self, spec: ModelSpec, device: str = "cpu", bound: Bound = Bound()):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.spec = spec
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.source, revision=spec.revision)
        self.model = AutoModelForCausalLM.from_pretrained(spec.source, revision=spec.revision, dtype=spec.dtype)
        self.model.to(self.device).eval()
        self.stop_ids = stop_ids(self.tokenizer, spec.source)
        self.bound = bound
        self._marks: Optional[Marks] = None  # the rows of the forward being run
        # transformers 5.2x renamed `past_key_values` to `cache`; earlier releases (5.17) know only the old name.
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @property
    def max_len(self) -> int:
        """Positions a request may use, prompt and continuation together."""
        return int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def close(self) -> None:
        """Drop the model (and, on a GPU, the cached memory it held)."""
        if self.model is None:
            return
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @contextmanager
    def _hooks(self, plan: Optional[Plan], capture: Optional[Dict[str, List[torch.Tensor]]] = None) -> Iterator[None]:
        """Install the plan's edits, its conditions' reading (after the edits at their taps) and, after them,
        captures of the tap values named in `capture`; each forward's rows are marked in `self._marks`."""
        handles = []
        modules = dict(self.model.named_modules())
        for path in (plan.edits if plan else {}):
            handles.append(hook(modules, path, lambda h, path=path: self._marks.edit(path, h)))
        for path in dict.fromkeys(c.path for c in (plan.conditions() if plan else ())):
            handles.append(hook(modules, path, lambda h, path=path: self._marks.condition(path, h)))
        for path, store in (capture or {}).items():
            handles.append(hook(modules, path, lambda h, store=store: store.append(h.detach().clone())))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def _forward(self, ids: List[int], is_prompt: bool | torch.Tensor, plan: Optional[Plan] = None, past=None,
                 cache: bool = True, decided: Optional[Decided] = None, start: int = 0, plen: int = 0):
        """One request's forward over `ids` (its rows marked prompt or generated), from position `start` of a
        sequence whose prompt is `plen` tokens, its conditions decided before in `decided`; the decisions it makes
        are left in `self._marks`."""
        x = torch.tensor([ids], device=self.device)
        mask = (torch.full((len(ids),), is_prompt, dtype=torch.bool) if isinstance(is_prompt, bool)
                else is_prompt).to(self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        self._marks = Marks([plan], mask[None], torch.ones_like(mask)[None], [decided], pos, [plen])
        return self.model(input_ids=x, use_cache=cache, **{self._cache_kw: past})

    def generate(self, prompt_ids: List[int], plan: Optional[Plan], gen: GenConf, seed: int) -> List[int]:
        """Continue one prompt with the plan's edits (None: unsteered); greedy when temperature is 0."""
        return list(self.generate_iter(prompt_ids, plan, gen, seed))

    def generate_iter(self, prompt_ids: List[int], plan: Optional[Plan], gen: GenConf, seed: int) -> Iterator[int]:
        """`generate`, token by token as each is picked. The plan's hooks stay on the model until the iterator ends
        or is closed: close it (contextlib.closing) when stopping early. (The server streams from the engine's
        continuous batch instead: steer/serve/worker.py.)"""
        rng = torch.Generator(device="cpu").manual_seed(seed)
        n = 0
        with self._hooks(plan):
            res = self._forward(prompt_ids, True, plan, plen=len(prompt_ids))
            decided = self._marks.decisions(1)[0]
            for _ in range(gen.max_new_tokens):
                tok = _pick(res.logits[0, -1].float().cpu(), gen, rng)
                if tok in self.stop_ids:
                    break
                yield tok
                n += 1
                if n == gen.max_new_tokens:
                    break
                res = self._forward([tok], False, plan, getattr(res, self._cache_kw), decided=decided,
                                    start=len(prompt_ids) + n - 1, plen=len(prompt_ids))

    def generate_many(self, jobs, gen: GenConf, progress=None) -> List[List[int]]:
        """Continue every (prompt ids, plan or None, seed) job: their rows in one running batch (each job joins as
        the bound allows and leaves when done), each job's tokens as `generate` gives them alone."""
        if self.bound.rows <= 1:
            out = []
            for ids, plan, seed in jobs:
                out.append(self.generate(ids, plan, gen, seed))
                if progress:
                    progress(1)
            return out
        rows = [Row(list(ids), plan, gen, seed, key=i) for i, (ids, plan, seed) in enumerate(jobs)]
        for r in rows:
            self.bound.check(r.need, f"prompt {r.key} ({len(r.ids)} tokens) with gen.max_new_tokens="
                                     f"{gen.max_new_tokens}")
        batch = Batch(self, self.bound)
        waiting = rows[::-1]
        while waiting or batch.rows:
            joining: List[Row] = []
            while waiting and batch.fits(waiting[-1], joining):
                joining.append(waiting.pop())
            finished = batch.join(joining) if joining else []
            if batch.rows:
                finished += [r for r, _ in batch.step() if r.done]
            if progress and finished:
                progress(len(finished))
        return [r.out for r in rows]

    def score_many(self, jobs) -> List[Scores]:
        """`score` for every (prompt, continuation, plan, capture) job, in left-padded batches up to the bound."""
        jobs = [(list(p), list(c), plan, tuple(cap)) for p, c, plan, cap in jobs]
        if self.bound.rows <= 1:
            return [self.score(*job) for job in jobs]
        for i, (p, c, _, _) in enumerate(jobs):
            self.bound.check(len(p) + len(c), f"scored sequence {i} ({len(p)} + {len(c)} tokens)")
        out: List[Scores] = []
        start = 0
        while start < len(jobs):
            end, longest = start, 0
            while end < len(jobs) and end - start < self.bound.rows:
                longest_next = max(longest, len(jobs[end][0]) + len(jobs[end][1]))
                if end > start and (end - start + 1) * longest_next > self.bound.tokens:
                    break
                end, longest = end + 1, longest_next
            out += self._score_batch(jobs[start:end])
            start = end
        return out

    def _score_batch(self, jobs) -> List[Scores]:
        capture = sorted({path for *_, cap in jobs for path in cap})
        fwd, plans = Forward(self), [plan for _, _, plan, _ in jobs]
        decided = None
        if any(plan is not None and plan.conditions() for plan in plans):  # the prompts' decisions first
            fwd.prompts([p for p, _, _, _ in jobs], plans, [len(p) for p, _, _, _ in jobs], cache=False,
                        last_only=True)
            decided = fwd.decided
        res, real, store = fwd.prompts([p + c for p, c, _, _ in jobs], plans, [len(p) for p, _, _, _ in jobs],
                                       cache=False, last_only=False, capture=capture, decided=decided)
        out = []
        length = real.shape[1]
        for b, (p, c, _, cap) in enumerate(jobs):
            start = length - len(p) - len(c)
            logprobs = torch.log_softmax(res.logits[b, start:].float().cpu(), -1)
            out.append(Scores(logprobs, {path: store[path][b, start:].float().cpu() for path in cap}))
        return out

    @torch.no_grad()
    def score(self, prompt_ids: List[int], cont_ids: List[int], plan: Optional[Plan],
              capture: Tuple[str, ...] = ()) -> Scores:
        """Teacher-force prompt + continuation in one pass (rows marked prompt/generated as in generation): the
        log-softmax of the logits `[len, vocab]`, in float32 on the CPU (vLLM's log-probs are its float32 logits'
        too), and each captured tap's `[len, hidden]` value after its edits."""
        store: Dict[str, List[torch.Tensor]] = {p: [] for p in capture}
        mask = torch.tensor([True] * len(prompt_ids) + [False] * len(cont_ids))
        decided = None
        if plan is not None and plan.conditions():  # the prompt's decisions, which the continuation's rows hold
            with self._hooks(plan):
                self._forward(list(prompt_ids), True, plan, cache=False, plen=len(prompt_ids))
            decided = self._marks.decisions(1)[0]
        with self._hooks(plan, store):
            res = self._forward(list(prompt_ids) + list(cont_ids), mask, plan, cache=False, decided=decided,
                                plen=len(prompt_ids))
        caps = {p: v[0].reshape(-1, v[0].shape[-1]).float().cpu() for p, v in store.items()}
        return Scores(torch.log_softmax(res.logits[0].float().cpu(), -1), caps)
