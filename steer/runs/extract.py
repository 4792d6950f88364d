"""Steering directions from two contrastive prompt sets, read at a tap.

Each prompt gives one row: the mean of its tap values over the tokens of its span (position "mean"), or the
span's last token's ("last"). The span (extract.span) "all" is every token fed (the last: the chat rendering's
generation prompt); "user" reads only the prompt's own text, which in a chat rendering is the user turn's content,
not the system prompt, turn markers and generation prompt around it. Both default to "auto" (`auto`): mean over
all, but CAA A/B pairs at the last token of their own text, the answer's. The tokens before the text
are the same in every prompt, and so (the model being causal) are their values: they dilute a difference more than
they turn it. On SmolLM2's joy prompts the two spans' directions have cosine >= 0.99 at layers 6-18, the "user"
one 3.3-3.4 x longer, so an edit's scale means 3.3-3.4 x more with it. The mean leaves out the first token and
special tokens by default: on SmolLM2 the first token carries a massive activation at layers 12 and 18 (an
attention sink), and a mean over all tokens makes the direction mostly that token's.

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
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from steer.config import checks
from steer.edits import vector
from steer.runs import diagnostics
from steer.errors import ConfigError
from steer.models.prompt import chat_mode, text_tokens, uses_chat
from steer.config.schema import ExtractConf
from steer.edits.tap import Tap

log = logging.getLogger(__name__)

FOLDS = 5  # k of the held-out separation (steer/runs/diagnostics.py)


def auto(ab: bool, templated: bool) -> Tuple[str, str]:
    """(position, span) that extract.position and extract.span "auto" read: CAA A/B pairs (`ab`), which differ
    only in the answer, at the last token of the prompt's own text (`templated`, a chat rendering: the answer's,
    not the generation prompt's); other pairs as a mean over every token fed."""
    return ("last" if ab else "mean"), ("user" if ab and templated else "all")


@dataclass(frozen=True)
class Recipe:
    """How a direction is made (extract.* and prompts.chat); every field keys the cached default direction and is
    recorded in the vector file's metadata."""

    method: str = "diffmean"
    position: str = "mean"
    chat: str = "false"  # auto / true / false: prompts.chat null / true / false (steer.models.prompt.chat_mode)
    skip_first: bool = True
    skip_special: bool = True
    normalize: bool = False
    span: str = "all"
    orthogonal_to_mean: bool = True

    @classmethod
    def from_conf(cls, conf: ExtractConf, chat="false", ab: bool = False, templated: bool = False) -> "Recipe":
        """The recipe of a run's `extract` settings and `prompts.chat`, "auto" as `auto` resolves it."""
        position, span = auto(ab, templated)
        return cls(str(conf.method), str(position if conf.position == "auto" else conf.position), chat_mode(chat),
                   bool(conf.skip_first), bool(conf.skip_special), bool(conf.normalize),
                   str(span if conf.span == "auto" else conf.span), bool(conf.orthogonal_to_mean)).check()

    def check(self, positive: Optional[Sequence[str]] = None, negative: Optional[Sequence[str]] = None) -> "Recipe":
        """The recipe with "auto" resolved and its chat mode normalised; with the prompt sets, also that its method
        can pair them (steer.config.checks.extraction: a ConfigError naming the field)."""
        checks.extraction(self.method, positive, negative)
        plain = auto(False, False)  # "auto" given here, not through from_conf: pairs that are not A/B
        position = plain[0] if self.position == "auto" else self.position
        span = plain[1] if self.span == "auto" else self.span
        return replace(self, chat=chat_mode(self.chat), position=position, span=span)

    def metadata(self) -> Dict[str, str]:
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in asdict(self).items()}


def prompt_rows(engine, tap: Tap, prompts: List[str], recipe: Recipe = Recipe()) -> torch.Tensor:
    """One float32 row per prompt at `tap`, `[len(prompts), hidden]`: the mean over the kept tokens of its span, or
    the span's last token (position "last", whatever the skip settings)."""
    return read_taps(engine, [tap], prompts, recipe)[tap.path].rows


@dataclass(frozen=True)
class TapReading:
    """What a set of prompts gives at one tap: a row per prompt (`prompt_rows`), and the residual norms of the
    tokens a mean keeps (their sum and count, so readings of two sets pool)."""

    rows: torch.Tensor
    norm_sum: float
    tokens: int


def read_taps(engine, taps: Sequence[Tap], prompts: List[str], recipe: Recipe = Recipe()) -> Dict[str, TapReading]:
    """`prompt_rows` at every tap of `taps` from one forward pass per prompt (each pass captures every tap)."""
    encoded = [engine.encode(p, recipe.chat) for p in prompts]
    spans = [torch.tensor(text_tokens(engine.tokenizer, p, recipe.chat), dtype=torch.bool) if recipe.span == "user"
             else torch.ones(len(ids), dtype=torch.bool) for p, ids in zip(prompts, encoded)]
    special = set(engine.tokenizer.all_special_ids) if recipe.skip_special else set()
    paths = tuple(dict.fromkeys(t.path for t in taps))
    rows: Dict[str, list] = {p: [] for p in paths}
    norms = {p: 0.0 for p in paths}
    count = 0
    scored = engine.score_many([(ids, [], None, paths) for ids in encoded])
    for i, (ids, span, (_, captured)) in enumerate(zip(encoded, spans, scored)):
        if not span.any():
            raise ConfigError("extract.span", f"prompt {prompts[i]!r} has no token of its own text; give it some, or "
                                              "set extract.span=all")
        keep = span & torch.tensor([t not in special for t in ids], dtype=torch.bool)
        if recipe.skip_first:
            keep[0] = False
        if not keep.any() and recipe.position == "mean":
            raise ConfigError("extract.skip_first", f"prompt {prompts[i]!r} has no token left once the first token "
                                                    "and special tokens are left out; lengthen it, or set "
                                                    "extract.skip_first=false / extract.skip_special=false")
        kept = keep if keep.any() else span  # the residual norm of a "last" row's prompt: its span, at worst
        count += int(kept.sum())
        for path in paths:
            h = captured[path]
            norms[path] += float(h[kept].double().norm(dim=-1).sum())
            rows[path].append(h[span.nonzero()[-1, 0]] if recipe.position == "last" else h[keep].mean(0))
    return {p: TapReading(torch.stack(rows[p]), norms[p], count) for p in paths}


def direction(engine, tap: Tap, positive: List[str], negative: List[str], recipe: Recipe = Recipe()) -> torch.Tensor:
    """The direction at `tap` by `recipe`, as float32 `[hidden]`: less its part along the rows' mean if
    `recipe.orthogonal_to_mean`, unit norm if `recipe.normalize`."""
    recipe = resolve(recipe, engine, positive, negative)
    pos, neg = prompt_rows(engine, tap, positive, recipe), prompt_rows(engine, tap, negative, recipe)
    _check_contrast(pos, neg, pos.mean(0) - neg.mean(0), recipe, tap)
    return fit(pos, neg, recipe)


def fit(pos: torch.Tensor, neg: torch.Tensor, recipe: Recipe = Recipe()) -> torch.Tensor:
    """The direction `recipe` makes of rows `pos` and `neg` (`[n, hidden]` each; paired row by row for pca)."""
    mean_diff = pos.mean(0) - neg.mean(0)
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


def resolve(recipe: Recipe, engine, positive: List[str], negative: List[str]) -> Recipe:
    """`recipe` validated, its chat mode resolved against the engine's tokenizer ("true" if prompts are
    chat-formatted, else "false"): what the direction is keyed on and what its metadata says."""
    recipe = recipe.check(positive, negative)
    return replace(recipe, chat="true" if uses_chat(engine.tokenizer, recipe.chat) else "false")


@dataclass(frozen=True)
class Extraction:
    """A direction at a tap and its diagnostics (steer/runs/diagnostics.py: norm, resid_norm, norm_ratio,
    heldout_acc, heldout_auc, heldout_effect, folds)."""

    tap: Tap
    direction: torch.Tensor
    diagnostics: Dict[str, Optional[float]]

    def metadata(self, prefix: str = "diag.") -> Dict[str, str]:
        return diagnostics.metadata(self.diagnostics, prefix)


def extract(engine, taps: Union[Tap, Sequence[Tap]], positive: List[str], negative: List[str],
            recipe: Recipe = Recipe(), folds: int = FOLDS) -> Union[Extraction, List[Extraction]]:
    """The direction at `taps` (one Tap, or several read in one forward pass per prompt) with its diagnostics:
    an Extraction, or one per tap in order."""
    single = isinstance(taps, Tap)
    taps = [taps] if single else list(taps)
    recipe = resolve(recipe, engine, positive, negative)
    pos, neg = read_taps(engine, taps, positive, recipe), read_taps(engine, taps, negative, recipe)
    out = []
    for tap in taps:
        p, n = pos[tap.path], neg[tap.path]
        _check_contrast(p.rows, n.rows, p.rows.mean(0) - n.rows.mean(0), recipe, tap)
        d = fit(p.rows, n.rows, recipe)
        resid = (p.norm_sum + n.norm_sum) / (p.tokens + n.tokens)
        diag = diagnostics.measure(d, resid, p.rows, n.rows, lambda a, b: fit(a, b, recipe), folds)
        out.append(Extraction(tap, d, diag))
    return out[0] if single else out


def extract_to(path: str | Path, key: str, engine, tap: Tap, positive: List[str], negative: List[str],
               recipe: Recipe = Recipe(), folds: int = FOLDS) -> Path:
    """Extract a direction and write it to `path` under `key`, with metadata saying how it was made (method,
    position, span, chat, skip_first, skip_special, normalize, orthogonal_to_mean, the prompt counts, the model's
    source) and how good it is (`diag.*`, steer/runs/diagnostics.py)."""
    return write(path, key, engine, extract(engine, tap, positive, negative, recipe, folds), positive, negative,
                 recipe)


def write(path: str | Path, key: str, engine, ex: Extraction, positive: List[str], negative: List[str],
          recipe: Recipe) -> Path:
    """An Extraction's file: its direction under `key`, the recipe and its diagnostics in the metadata."""
    meta = resolve(recipe, engine, positive, negative).metadata()
    return vector.save(path, {key: ex.direction}, model=engine.spec.name, tap=ex.tap.name, method=meta.pop("method"),
                       extra={**meta, "positive": str(len(positive)), "negative": str(len(negative)),
                              "source": engine.spec.source, **ex.metadata()})


def write_layers(path: str | Path, engine, layers: List[int], exs: List[Extraction], positive: List[str],
                 negative: List[str], recipe: Recipe) -> Path:
    """Several layers' directions in one file: key `direction.<k>` per layer k, metadata `layers` (the ks, comma
    separated), each layer's diagnostics as `diag.<k>.*` and `diag.best_layer` (the best-separating one)."""
    meta = resolve(recipe, engine, positive, negative).metadata()
    chosen = diagnostics.best([ex.diagnostics for ex in exs])
    extra = {**meta, "positive": str(len(positive)), "negative": str(len(negative)), "source": engine.spec.source,
             "layers": ",".join(str(k) for k in layers),
             "diag.best_layer": "none" if chosen is None else str(layers[chosen])}
    for k, ex in zip(layers, exs):
        extra.update(ex.metadata(f"diag.{k}."))
    return vector.save(path, {f"direction.{k}": ex.direction for k, ex in zip(layers, exs)}, model=engine.spec.name,
                       tap=",".join(ex.tap.name for ex in exs), method=extra.pop("method"), extra=extra)


def cached_default(cache_dir: str, engine, tap: Tap, positive: List[str], negative: List[str],
                   recipe: Recipe = Recipe(), with_metadata: bool = False):
    """The default direction at `tap`: extracted once per (model, tap, prompt sets, recipe with its chat mode
    resolved), then read from cache. The model is its weights as loaded: its files (a checkpoint retrained in
    place, a hub revision's newer snapshot make a new direction) and dtype. With `with_metadata`, the pair
    (direction, the file's metadata: its diagnostics among them)."""
    recipe = resolve(recipe, engine, positive, negative)
    path = _cache_path(cache_dir, engine, tap, positive, negative, recipe)
    d = _cached(path, engine)
    if d is None:
        extract_to(path, "direction", engine, tap, positive, negative, recipe)
        d = vector.load(path, "direction", engine.spec.hidden, field="default vector")
    return (d, vector.metadata(path)) if with_metadata else d


def cache_defaults(cache_dir: str, engine, taps: Sequence[Tap], positive: List[str], negative: List[str],
                   recipe: Recipe = Recipe()) -> None:
    """Put the default direction at every tap of `taps` into the cache (`cached_default` then reads it), the
    missing ones read in one forward pass per prompt: a sweep over layers reads its pairs once, not once a layer."""
    recipe = resolve(recipe, engine, positive, negative)
    paths = {t.path: (t, _cache_path(cache_dir, engine, t, positive, negative, recipe)) for t in taps}
    missing = [(t, path) for t, path in paths.values() if _cached(path, engine) is None]
    if not missing:
        return
    for (_, path), ex in zip(missing, extract(engine, [t for t, _ in missing], positive, negative, recipe)):
        write(path, "direction", engine, ex, positive, negative, recipe)


def default_path(cache_dir: str, engine, tap: Tap, positive: List[str], negative: List[str],
                 recipe: Recipe = Recipe()) -> Path:
    """Where `cached_default` keeps the default direction at `tap`."""
    return _cache_path(cache_dir, engine, tap, positive, negative, resolve(recipe, engine, positive, negative))


def _cache_path(cache_dir: str, engine, tap: Tap, positive: List[str], negative: List[str], recipe: Recipe) -> Path:
    from steer.runs import inputs

    model = [engine.spec.source, engine.spec.revision, str(engine.spec.dtype), inputs.weights(engine.spec)]
    blob = json.dumps([model, tap.path, positive, negative, asdict(recipe)], sort_keys=True).encode()
    return Path(cache_dir).expanduser() / "vectors" / f"{hashlib.sha256(blob).hexdigest()[:16]}.safetensors"


def _cached(path: Path, engine) -> Optional[torch.Tensor]:
    """The cached direction at `path`, or None where it must be made (again)."""
    if not path.exists():
        return None
    try:
        d = vector.load(path, "direction", engine.spec.hidden, field="default vector")
    except ConfigError as e:  # the cache's own file, damaged (a disk filled, a copy cut short): made again
        log.warning("the cached default direction %s is unreadable (%s): extracting it again", path, e)
        return None
    return d if "diag.resid_norm" in vector.metadata(path) else None  # a file from before diagnostics: made again
