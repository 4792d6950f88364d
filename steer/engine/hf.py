"""The HF transformers engine: runs compiled edits at taps through forward hooks, on CPU or one GPU.

It is the product's portable engine and the independent reference the vLLM engine is checked against. Every request
runs in a left-padded batch with a KV cache (steer/engine/hf_batch.py), whose hooks edit each row's tap values in
place as if the row ran alone: `generate_many` and `score_many` batch many requests' rows up to the engine's `Bound`
(a bound of one row runs them one at a time), and `generate` and `score` run one request as a batch of one. HF
decoder layers return the summed residual stream, so a residual tap sees exactly the `h` the edits are defined on
(interleaver/edit.py).
"""

import gc
import inspect
from typing import Iterator, List, Optional, Tuple

import torch

from steer.engine.base import Engine, Scores, stop_ids
from steer.engine.hf_batch import Batch, Bound, Forward, Row
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

    def generate(self, prompt_ids: List[int], plan: Optional[Plan], gen: GenConf, seed: int) -> List[int]:
        """Continue one prompt with the plan's edits (None: unsteered); greedy when temperature is 0."""
        return list(self.generate_iter(prompt_ids, plan, gen, seed))

    def generate_iter(self, prompt_ids: List[int], plan: Optional[Plan], gen: GenConf, seed: int) -> Iterator[int]:
        """`generate`, token by token as each is picked: a batch of one row, run as every request is
        (steer/engine/hf_batch.py). The plan's hooks are on the model only while a forward runs, so an iterator
        left unfinished holds nothing. (The server streams from the engine's continuous batch instead:
        steer/serve/worker.py.)"""
        batch = Batch(self, self.bound)
        batch.join([Row(list(prompt_ids), plan, gen, seed)])
        while batch.rows:
            [(_, tok)] = batch.pick()
            if tok is not None:
                yield tok
            batch.advance()

    def generate_many(self, jobs, gen: GenConf, progress=None) -> List[List[int]]:
        """Continue every (prompt ids, plan or None, seed) job: their rows in one running batch (each job joins as
        the bound allows and leaves when done), each job's tokens as `generate` gives them alone."""
        rows = [Row(list(ids), plan, gen, seed, key=i) for i, (ids, plan, seed) in enumerate(jobs)]
        if self.bound.rows > 1:  # a bound of one row runs each request alone, whatever its length
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
        if self.bound.rows > 1:  # a bound of one row scores each sequence alone, whatever its length
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

    def score(self, prompt_ids: List[int], cont_ids: List[int], plan: Optional[Plan],
              capture: Tuple[str, ...] = ()) -> Scores:
        """Teacher-force prompt + continuation in one pass (rows marked prompt/generated as in generation), a batch
        of one: the log-softmax of the logits `[len, vocab]`, in float32 on the CPU (vLLM's log-probs are its float32
        logits' too), and each captured tap's `[len, hidden]` value after its edits."""
        return self._score_batch([(list(prompt_ids), list(cont_ids), plan, tuple(capture))])[0]

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
