"""Steering directions from two contrastive prompt sets, read at a tap.

Each prompt gives one row: the mean of its tap values over the tokens of its span (position "mean"), or the
span's last token's ("last"). The span (extract.span) is "all" by default, every token fed (the last: the chat
rendering's generation prompt); "user" reads only the prompt's own text, which in a chat rendering is the user
turn's content, not the system prompt, turn markers and generation prompt around it. The tokens before the text
are the same in every prompt, and so (the model being causal) are their values: they dilute a difference more than
they turn it. On SmolLM2's joy prompts the two spans' directions have cosine >= 0.99 at layers 6-18, the "user"
one 3.3-3.4 x longer, so an edit's scale means 3.3-3.4 x more with it. The mean leaves out the first token and
special tokens by default: on SmolLM2 the first token carries a massive activation at layers 12 and 18 (an
attention sink, GUIDE.md section 9), and a mean over all tokens makes the direction mostly that token's.

With orthogonal_to_mean (the default) the direction loses its part along the rows' mean (the midpoint of the two
sets' means). The residual stream has a large mean that every token shares (|mean| 78-144 at SmolLM2's layers
6-18, against 3.8-9.5 for the joy direction), and a difference of means picks up a little of it (|cosine| 0.17-0.19
at layers 6, 8 and 14). Ablating such a direction does not only remove the concept: it moves every token by its
share of the mean (at layer 14 by about 20 along the unit direction, toward joy; at layer 6 by 17, toward gloom),
which steers the text instead of leaving it (ppl x2.4 and x2.2 there before; x1.04-1.16 at every layer 6-18 now).

- diffmean: mean(positive rows) - mean(negative rows).
- pca: the first principal component of the paired differences positive_i - negative_i (uncentred: the top
  right singular vector, i.e. the first component of the set {+-(positive_i - negative_i)}), its sign fixed so
  it points toward the positive set, scaled by the mean difference's projection on it so that an edit's scale
  means about what it means for diffmean.
"""

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from steer.edits import vector
from steer.errors import ConfigError
from steer.models.prompt import chat_mode, text_tokens, uses_chat
from steer.config.schema import ExtractConf
from steer.edits.tap import Tap

log = logging.getLogger(__name__)

METHODS = ("diffmean", "pca")
POSITIONS = ("mean", "last")
SPANS = ("user", "all")


@dataclass(frozen=True)
class Recipe:
    """How a direction is made (extract.* and prompts.chat); every field keys the cached default direction and is
    recorded in the vector file's metadata."""

    method: str = "diffmean"
    position: str = "mean"
    chat: str = "false"  # auto / true / false, as prompts.chat
    skip_first: bool = True
    skip_special: bool = True
    normalize: bool = False
    span: str = "all"
    orthogonal_to_mean: bool = True

    @classmethod
    def from_conf(cls, conf: ExtractConf, chat="false") -> "Recipe":
        """The recipe of a run's `extract` settings and `prompts.chat`, validated."""
        return cls(conf.method, conf.position, str(chat), bool(conf.skip_first), bool(conf.skip_special),
                   bool(conf.normalize), conf.span, bool(conf.orthogonal_to_mean)).check()

    def check(self, positive: Optional[Sequence[str]] = None, negative: Optional[Sequence[str]] = None) -> "Recipe":
        """Validate (before any engine starts): ConfigError naming the field. With the prompt sets, also that pca
        can pair them."""
        if self.method not in METHODS:
            raise ConfigError("extract.method", f"{self.method!r} is not one of {', '.join(METHODS)}")
        if self.position not in POSITIONS:
            raise ConfigError("extract.position", f"{self.position!r} is not one of {', '.join(POSITIONS)}")
        if self.span not in SPANS:
            raise ConfigError("extract.span", f"{self.span!r} is not one of {', '.join(SPANS)}")
        if self.method == "pca" and positive is not None and negative is not None and len(positive) != len(negative):
            raise ConfigError("extract.method", f"pca pairs positive_i with negative_i, but prompts.positive has "
                                                f"{len(positive)} prompts and prompts.negative {len(negative)}")
        return replace(self, chat=chat_mode(self.chat))

    def metadata(self) -> Dict[str, str]:
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in asdict(self).items()}


def prompt_rows(engine, tap: Tap, prompts: List[str], recipe: Recipe = Recipe()) -> torch.Tensor:
    """One float32 row per prompt at `tap`, `[len(prompts), hidden]`: the mean over the kept tokens of its span, or
    the span's last token (position "last", whatever the skip settings)."""
    encoded = [engine.encode(p, recipe.chat) for p in prompts]
    spans = [torch.tensor(text_tokens(engine.tokenizer, p, recipe.chat), dtype=torch.bool) if recipe.span == "user"
             else torch.ones(len(ids), dtype=torch.bool) for p, ids in zip(prompts, encoded)]
    special = set(engine.tokenizer.all_special_ids) if recipe.skip_special else set()
    rows = []
    scored = engine.score_many([(ids, [], None, (tap.path,)) for ids in encoded])
    for i, (ids, span, (_, captured)) in enumerate(zip(encoded, spans, scored)):
        h = captured[tap.path]
        if not span.any():
            raise ConfigError("extract.span", f"prompt {prompts[i]!r} has no token of its own text; give it some, or "
                                              "set extract.span=all")
        if recipe.position == "last":
            rows.append(h[span.nonzero()[-1, 0]])
            continue
        keep = span & torch.tensor([t not in special for t in ids], dtype=torch.bool)
        if recipe.skip_first:
            keep[0] = False
        if not keep.any():
            raise ConfigError("extract.skip_first", f"prompt {prompts[i]!r} has no token left once the first token "
                                                    "and special tokens are left out; lengthen it, or set "
                                                    "extract.skip_first=false / extract.skip_special=false")
        rows.append(h[keep].mean(0))
    return torch.stack(rows)


def direction(engine, tap: Tap, positive: List[str], negative: List[str], recipe: Recipe = Recipe()) -> torch.Tensor:
    """The direction at `tap` by `recipe`, as float32 `[hidden]`: less its part along the rows' mean if
    `recipe.orthogonal_to_mean`, unit norm if `recipe.normalize`."""
    recipe = resolve(recipe, engine, positive, negative)
    pos, neg = prompt_rows(engine, tap, positive, recipe), prompt_rows(engine, tap, negative, recipe)
    mean_diff = pos.mean(0) - neg.mean(0)
    _check_contrast(pos, neg, mean_diff, recipe, tap)
    if recipe.method == "diffmean":
        d = mean_diff
    else:
        u = torch.linalg.svd((pos - neg).double(), full_matrices=False).Vh[0].float()
        along = float(mean_diff @ u)
        if along < 0:
            u, along = -u, -along
        d = u * along if along > 0 else u
    m = (pos.mean(0) + neg.mean(0)) / 2
    if recipe.orthogonal_to_mean and float(m.norm()) > 0:
        m = m / m.norm()
        d = d - (d @ m) * m
    return d / d.norm() if recipe.normalize else d


def _check_contrast(pos: torch.Tensor, neg: torch.Tensor, mean_diff: torch.Tensor, recipe: Recipe, tap: Tap) -> None:
    """ConfigError where the sets hold no direction: identical sets make a zero vector (NaN once normalised),
    and identical pca pairs an arbitrary one."""
    size = max(float(pos.norm(dim=-1).mean()), float(neg.norm(dim=-1).mean()), 1e-30)
    gap = float(mean_diff.norm()) if recipe.method == "diffmean" else float((pos - neg).norm(dim=-1).max())
    if gap <= 1e-6 * size:
        what = "mean activations" if recipe.method == "diffmean" else "activations, pair by pair"
        raise ConfigError("prompts.positive", f"and prompts.negative give the same {what} at {tap.name} (a "
                                              f"difference of {gap:.3g} against activations of {size:.3g}): there is "
                                              "no direction between them; give sets that differ in the concept")


def diff_of_means(engine, tap: Tap, positive: List[str], negative: List[str], position: str = "mean",
                  normalize: bool = False, **recipe) -> torch.Tensor:
    """`mean(positive) - mean(negative)` at `tap` (other Recipe fields as keywords)."""
    return direction(engine, tap, positive, negative, Recipe(position=position, normalize=normalize, **recipe))


def resolve(recipe: Recipe, engine, positive: List[str], negative: List[str]) -> Recipe:
    """`recipe` validated, its chat mode resolved against the engine's tokenizer ("true" if prompts are
    chat-formatted, else "false"): what the direction is keyed on and what its metadata says."""
    recipe = recipe.check(positive, negative)
    return replace(recipe, chat="true" if uses_chat(engine.tokenizer, recipe.chat) else "false")


def _legacy(recipe, normalize: Optional[bool]) -> Recipe:
    if isinstance(recipe, str):  # the older (position, normalize) arguments
        recipe = Recipe(position=recipe)
    return replace(recipe, normalize=normalize) if normalize is not None else recipe


def extract_to(path: str | Path, key: str, engine, tap: Tap, positive: List[str], negative: List[str],
               recipe: Recipe = Recipe(), normalize: Optional[bool] = None) -> Path:
    """Extract a direction and write it to `path` under `key`, with metadata saying how it was made (method,
    position, span, chat, skip_first, skip_special, normalize, orthogonal_to_mean, the prompt counts, the model's
    source)."""
    recipe = resolve(_legacy(recipe, normalize), engine, positive, negative)
    d = direction(engine, tap, positive, negative, recipe)
    meta = recipe.metadata()
    return vector.save(path, {key: d}, model=engine.spec.name, tap=tap.name, method=meta.pop("method"),
                       extra={**meta, "positive": str(len(positive)), "negative": str(len(negative)),
                              "source": engine.spec.source})


def cached_default(cache_dir: str, engine, tap: Tap, positive: List[str], negative: List[str],
                   recipe: Recipe = Recipe()) -> torch.Tensor:
    """The default direction at `tap`: extracted once per (model, tap, prompt sets, recipe with its chat mode
    resolved), then read from cache. The model is its weights as loaded: its files (a checkpoint retrained in
    place, a hub revision's newer snapshot make a new direction) and dtype."""
    from steer.runs import inputs

    recipe = resolve(recipe, engine, positive, negative)
    model = [engine.spec.source, engine.spec.revision, str(engine.spec.dtype), inputs.weights(engine.spec)]
    blob = json.dumps([model, tap.path, positive, negative, asdict(recipe)], sort_keys=True).encode()
    path = Path(cache_dir).expanduser() / "vectors" / f"{hashlib.sha256(blob).hexdigest()[:16]}.safetensors"
    if path.exists():
        try:
            return vector.load(path, "direction", engine.spec.hidden, field="default vector")
        except ConfigError as e:  # the cache's own file, damaged (a disk filled, a copy cut short): made again
            log.warning("the cached default direction %s is unreadable (%s): extracting it again", path, e)
    extract_to(path, "direction", engine, tap, positive, negative, recipe)
    return vector.load(path, "direction", engine.spec.hidden, field="default vector")
