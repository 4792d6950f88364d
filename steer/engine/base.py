"""The one interface both engines offer (`Engine`), and what scoring hands back (`Scores`).

`Engine` is a typing.Protocol: whatever has these members is an engine, and run.py, extract.py, steer.serve and
the bench need nothing else. Both engines also subclass it, which gives them the shared members written out here
(render / encode / decode through steer.models.prompt, and `with` closing the engine), so the two feed identical ids.
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Protocol, Sequence,
                    Tuple, runtime_checkable)

from steer.models import prompt

if TYPE_CHECKING:
    import torch

    from steer.models.spec import ModelSpec
    from steer.edits.plan import Plan
    from steer.config.schema import GenConf

GenJob = Tuple[List[int], Optional["Plan"], int]  # (prompt ids, plan or None: unsteered, seed)
ScoreJob = Tuple[List[int], List[int], Optional["Plan"], Tuple[str, ...]]  # (prompt, continuation, plan, taps)


class Scores(NamedTuple):
    """One teacher-forced pass over prompt + continuation (T tokens).

    `logprobs`: float32 `[T, vocab]`, log-softmaxed; row t is the next-token distribution after token t (it
    predicts token t + 1), the plan's edits applied. `captured`: each asked tap path's float32 `[T, hidden]` value,
    after its edits. A tuple too: `logprobs, captured = engine.score(...)`."""

    logprobs: torch.Tensor
    captured: Dict[str, torch.Tensor]


@runtime_checkable
class Engine(Protocol):
    """A model with a Plan's edits at its taps: generation and teacher-forced scoring, unsteered (plan None) or
    steered, with the same token ids, stop tokens and row semantics on every engine."""

    name: str  # "hf" or "vllm"
    spec: ModelSpec
    tokenizer: Any  # the model's HF tokenizer
    stop_ids: FrozenSet[int]  # generation stops before any of these (steer.engine.stop_ids)

    @property
    def max_len(self) -> int:
        """Positions a request may use, prompt and continuation together."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold, and the width of `Scores.logprobs`."""
        ...

    def render(self, text: str, chat: str = "false") -> Tuple[str, List[int]]:
        """The exact text fed for prompt `text` and its ids: raw, or a user turn of the chat template (`chat`:
        auto / true / false, as prompts.chat). Every engine goes through steer.models.prompt.render: identical ids."""
        return prompt.render(self.tokenizer, text, chat)

    def encode(self, text: str, chat: str = "false") -> List[int]:
        return self.render(text, chat)[1]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt_ids: List[int], plan: Optional[Plan], gen: GenConf, seed: int) -> List[int]:
        """Continue one prompt with the plan's edits (None: unsteered); greedy when temperature is 0. The stop token
        is not part of the continuation."""
        ...

    def generate_many(self, jobs: Sequence[GenJob], gen: GenConf,
                      progress: Optional[Callable[[int], None]] = None) -> List[List[int]]:
        """`generate` for every (prompt ids, plan or None, seed) job; `progress(k)` as k more are done."""
        ...

    def score(self, prompt_ids: List[int], cont_ids: List[int], plan: Optional[Plan],
              capture: Tuple[str, ...] = ()) -> Scores:
        """Teacher-force prompt + continuation in one pass, rows marked prompt / generated as in generation."""
        ...

    def score_many(self, jobs: Sequence[ScoreJob]) -> List[Scores]:
        """`score` for every (prompt, continuation, plan, capture) job."""
        ...

    def close(self) -> None:
        """Let the model go and free the memory it held; the engine serves nothing after. Closing twice is a no-op."""
        ...

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
