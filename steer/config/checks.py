"""Every rule across a config's fields, written once, for runs (`python -m steer`), the server and the bench.

The typed schema (schema.py) already refuses unknown keys, wrong types and values outside a closed choice (its
enums) at composition; what it cannot say lives here: ranges, fields that exclude one another, and what an engine or
machine must offer. Each function raises a
`ConfigError` naming the field and what was expected, and builds nothing: callers check first, then build (a job's
plan, the server's presets, the bench's workload). Checks that must read a file or a model's module tree live with
what reads them (edits/vector.py, edits/tap.py, models/spec.py) and are called from the same places.
"""

import math
import os
from pathlib import Path
from typing import Optional, Sequence

from steer.config.schema import (EditKind, ExtractMethod, GenConf, HfConf, PromptsConf, RankBy, ScaleBy, SteerConf,
                                 Task, Tokens, VllmConf)
from interleaver.select import Positions
from steer.errors import ConfigError, refuse_repeats

# float32's largest value (torch.finfo(torch.float32).max): what an edit's numbers and vectors must stay within
F32_MAX = 3.4028234663852886e38


# --- single values, named by the caller's field -------------------------------------------------------------

def at_least(field: str, value, low, unit: str = "") -> None:
    if value < low:
        raise ConfigError(field, f"must be at least {low}{unit}, got {value}")


def memory_share(field: str, value: float) -> None:
    """A share of GPU memory, as vLLM's gpu_memory_utilization takes it."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= 1):
        raise ConfigError(field, f"must be a share in (0, 1], got {value}")


def enough_gpus(field: str, n: int) -> None:
    """`n` GPUs per engine (tensor parallelism): this machine must have them."""
    import torch

    if n > 1 and torch.cuda.device_count() < n:
        raise ConfigError(field, f"{n} GPUs per engine, but this machine has {torch.cuda.device_count()}")


def optional_positive(field: str, value: Optional[int], what: str) -> None:
    if value is not None and value < 1:
        raise ConfigError(field, f"must be a positive {what} or null, got {value}")


def writable(field: str, path: Path) -> None:
    """Said before the engine, not once its work is done: `path` must name a file this process can write."""
    if path.is_dir():
        raise ConfigError(field, f"{str(path)!r} is a directory; name the file to write in it, e.g. "
                                 f"{str(path / 'vector.safetensors')!r}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # made on write
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or not _can_make_in(parent):
        raise ConfigError(field, f"{str(path)!r} cannot be written: {str(parent)!r} is not a directory this "
                                 "process may write in")


def _can_make_in(parent: Path) -> bool:
    """Whether a directory can be made in `parent` (and is, then removed): os.access answers yes to root for what
    the kernel refuses anyway (/proc, a read-only mount)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".steer-check-", dir=parent))
    except OSError:
        return False
    return True


def room_for_a_prompt(field: str, new_tokens: int, positions: Optional[int], model: str) -> None:
    """`new_tokens` must leave room for a prompt in the model's positions (vLLM's max_model_len where set)."""
    if positions is not None and new_tokens >= positions:
        raise ConfigError(field, f"{new_tokens} new tokens leave no room for a prompt: {model} has {positions} "
                                 "positions")


# --- sections shared by entry points ------------------------------------------------------------------------

def device(value: str, field: str = "device") -> None:
    """`cpu`, or `cuda` / `cuda:N` naming a GPU this process sees (where the HF engine runs, and where engine=vllm
    extracts a default direction)."""
    import torch

    kind, colon, index = str(value).partition(":")
    if kind == "cpu" and not colon:
        return
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ConfigError(field, f"{value!r} is not a device steer runs on; expected cpu, cuda or cuda:N")
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(index or 0) >= seen:
        raise ConfigError(field, f"{value!r}: this process sees {seen} CUDA device(s)"
                                 + ("" if seen else "; use device=cpu"))


def vllm(v: VllmConf, engine: str, who: str = "this run") -> None:
    """The `vllm` section, for a run and for the server alike (`engine`: what the config's `engine` resolves to)."""
    tp = v.tensor_parallel_size
    at_least("vllm.tensor_parallel_size", tp, 1)
    if tp > 1:
        _needs_vllm(engine, "vllm.tensor_parallel_size", f"{tp} GPUs per engine", who)
        enough_gpus("vllm.tensor_parallel_size", tp)
    memory_share("vllm.gpu_memory_utilization", v.gpu_memory_utilization)
    optional_positive("vllm.kv_cache_memory_bytes", v.kv_cache_memory_bytes, "number of bytes")
    optional_positive("vllm.max_model_len", v.max_model_len, "number of positions")
    at_least("vllm.max_num_seqs", v.max_num_seqs, 1)
    optional_positive("vllm.max_num_batched_tokens", v.max_num_batched_tokens, "number of tokens")
    # fold_norm: a run refuses it outright (run), the server judges it before its engine resolves (serve_modes)
    if v.in_graph_field():
        _needs_vllm(engine, f"vllm.{v.in_graph_field()}", "capturing edits into vLLM's graphs", who)
    if v.tap_graphs:
        _needs_vllm(engine, "vllm.tap_graphs", "replaying CUDA graphs at vLLM's taps", who)
    if v.in_graph_field() and v.tap_graphs:
        raise ConfigError("vllm.tap_graphs", "an engine with its edits in the graph has no breaks to replay graphs at; "
                                             "set one of the two")


def hf(h: HfConf, new_tokens: int = 1) -> None:
    """The `hf` section's batch bounds; a request needs room for one prompt token and `new_tokens` more."""
    at_least("hf.batch_size", h.batch_size, 1)
    at_least("hf.batch_tokens", h.batch_tokens, new_tokens + 1, f" (one prompt token and gen.max_new_tokens="
                                                                 f"{new_tokens})" if new_tokens > 1 else "")


def _needs_hf(engine: str, field: str) -> None:
    if engine != "hf":
        raise ConfigError(field, f"runs on engine=hf (this run resolves to engine={engine})")


def _needs_vllm(engine: str, field: str, what: str, who: str) -> None:
    if engine != "vllm":
        raise ConfigError(field, f"{what} needs engine=vllm ({who} resolves to engine={engine})")


def gen(g: GenConf) -> None:
    at_least("gen.max_new_tokens", g.max_new_tokens, 1)
    if g.temperature < 0:
        raise ConfigError("gen.temperature", f"must be >= 0 (0 is greedy), got {g.temperature}")
    if not 0 < g.top_p <= 1:
        raise ConfigError("gen.top_p", f"must be in (0, 1], got {g.top_p}")


# The files that stand for each prompt set (steer/runs/data.py's fill_prompts reads them into the lists)
FILES = {"steer": ("steer_file",), "positive": ("pairs_file", "positive_file"),
         "negative": ("pairs_file", "negative_file")}


def prompt_sets(p: PromptsConf, sets: Sequence[str], why: str = "give at least one prompt, or a file of them "
                                                                "(prompts.steer_file, prompts.pairs_file)") -> None:
    """Each named set holds at least one prompt or names a file that gives them (read, and checked not empty, as a
    job is prepared: steer/runs/data.py), and every prompt is text."""
    prompt_files(p)
    for name in sets:
        if not list(getattr(p, name)) and not any(getattr(p, f, None) is not None for f in FILES.get(name, ())):
            raise ConfigError(f"prompts.{name}", f"is empty; {why}")
    check_texts(p, tuple(sets))


def prompt_files(p: PromptsConf) -> None:
    """The files that give the contrastive pairs: a pairs file, or two .txt files (both), not both ways."""
    if p.pairs_file is not None and (p.positive_file is not None or p.negative_file is not None):
        raise ConfigError("prompts.pairs_file", "and prompts.positive_file / prompts.negative_file both give the "
                                                "contrastive pairs; set one")
    if p.pairs_file is None and (p.positive_file is None) != (p.negative_file is None):
        missing = "prompts.negative_file" if p.negative_file is None else "prompts.positive_file"
        raise ConfigError(missing, "is unset; the .txt pairs need both files (as cvector-generator's --positive-file "
                                   "and --negative-file)")


def extraction(method: str, positive: Optional[Sequence[str]] = None,
               negative: Optional[Sequence[str]] = None) -> None:
    """With the prompt sets, extract.method can pair them (pca pairs positive_i with negative_i)."""
    if method == ExtractMethod.pca and positive is not None and negative is not None and len(positive) != len(negative):
        raise ConfigError("extract.method", f"pca pairs positive_i with negative_i, but prompts.positive has "
                                            f"{len(positive)} prompts and prompts.negative {len(negative)}")


# --- entry points -------------------------------------------------------------------------------------------

def damage(cfg: SteerConf) -> None:
    """The per-prompt damage thresholds (select.*: every run flags its prompts with them)."""
    s = cfg.select
    if not (math.isfinite(s.max_ppl_ratio) and s.max_ppl_ratio > 0):
        raise ConfigError("select.max_ppl_ratio", f"must be a positive number, got {s.max_ppl_ratio}")
    if not (math.isfinite(s.min_distinct_ratio) and s.min_distinct_ratio >= 0):
        raise ConfigError("select.min_distinct_ratio", f"must be a number >= 0 (0 turns the check off), got "
                                                       f"{s.min_distinct_ratio}")
    at_least("select.max_run", s.max_run, 2, " (repeats in a row that mark a loop)")


def judge(j) -> None:
    """metrics.judge: an endpoint named with the model to ask and the concept to look for."""
    if not j.base_url:
        return
    if not str(j.base_url).startswith(("http://", "https://")):
        raise ConfigError("metrics.judge.base_url", f"{j.base_url!r} is no http(s) URL (e.g. "
                                                    "http://127.0.0.1:8000/v1)")
    for name in ("model", "concept"):
        if not getattr(j, name):
            raise ConfigError(f"metrics.judge.{name}", "is unset; the judge needs the endpoint's model name and the "
                                                       "concept in words (metrics.judge.concept=\"joy and happiness\")")
    if not j.timeout_s > 0:
        raise ConfigError("metrics.judge.timeout_s", f"must be positive, got {j.timeout_s}")
    at_least("metrics.judge.max_tokens", j.max_tokens, 1)


def run(cfg: SteerConf, engine: str, conditions: bool = True) -> None:
    """What every run's config must hold before its model is looked at (`engine`: what `cfg.engine` resolves to;
    `conditions`: check each edit's condition, unless the task chooses it); a task adds its own rules
    (steer/tasks/)."""
    # A steer run scores with the tap's values (projection metrics), which an engine with its edits in the graph
    # cannot keep: those modes are for the bench, the server and the API.
    if cfg.vllm.fold_norm:
        raise ConfigError("vllm.fold_norm", "folds edits captured into the graph (vllm.edits_in_graph), a mode a steer "
                                            "run cannot use (it scores with the tap's values); it is for the bench "
                                            "and the API")
    if cfg.vllm.in_graph_field():
        raise ConfigError(f"vllm.{cfg.vllm.in_graph_field()}",
                          "a steer run scores with the tap's values (projection metrics), which an engine with its "
                          "edits in the graph cannot keep; the mode is for the bench and the API "
                          "(VLLMEngine(..., declare=plans))")
    vllm(cfg.vllm, engine)
    device(cfg.device)
    gen(cfg.gen)
    hf(cfg.hf, cfg.gen.max_new_tokens)
    prompt_sets(cfg.prompts, ("steer", "positive", "negative"))
    edits = [("edit", cfg.edit)] + [(f"extra_edits[{i}].edit", te.edit) for i, te in enumerate(cfg.extra_edits)]
    taps = [("tap", cfg.tap)] + [(f"extra_edits[{i}].tap", te.tap) for i, te in enumerate(cfg.extra_edits)]
    for (prefix, e), (tap_field, tap) in zip(edits, taps):
        edit_numbers(prefix, e.scale, e.lo, e.hi, e.value)
        scale_by(prefix, e)
        if conditions:
            when(prefix, e, cfg.prompts)
        positions(e.positions, f"{prefix}.positions")
        if tap.input:  # the vLLM engine's taps read modules' outputs: an input tap runs on the HF engine
            _needs_hf(engine, f"{tap_field}.input")
    at_least("extract.folds", cfg.extract.folds, 2)
    damage(cfg)
    judge(cfg.metrics.judge)


def export(cfg: SteerConf) -> None:
    """task=export: edits a control vector can hold (an add at every token, from a file)."""
    if cfg.export.out:
        writable("export.out", Path(cfg.export.out).expanduser())
    edits = [("", cfg.edit)] + [(f"extra_edits[{i}].", te.edit) for i, te in enumerate(cfg.extra_edits)]
    for prefix, e in edits:
        if e.kind != EditKind.add:
            raise ConfigError(f"{prefix}edit.kind", f"is {e.kind.value}; a control vector only adds a direction "
                                                    "(edit.kind=add)")
        if e.tokens != Tokens.both:
            raise ConfigError(f"{prefix}edit.tokens", f"is {e.tokens.value}; llama.cpp adds the direction at every "
                                                      "token (edit.tokens=both)")
        if e.vector.path is None:
            raise ConfigError(f"{prefix}edit.vector.path", "task=export writes the vectors of files; extract one "
                                                           "first (task=extract; an extract.out ending in .gguf "
                                                           "writes a control vector)")


def preset(cfg: SteerConf, given: Sequence[str]) -> None:
    """preset=NAME runs the preset's edits as a steer run; `given`: the keys the command line set."""
    if cfg.task != Task.steer:
        raise ConfigError("preset", f"runs the preset's edits as task=steer, not task={cfg.task.value}; for "
                                    f"task={cfg.task.value}, write the edit as tap and edit")
    for key in given:
        if key.split(".")[0] in ("tap", "edit", "extra_edits"):
            raise ConfigError(key, "is set beside preset, whose edits take the place of tap, edit and extra_edits; "
                                   "leave it out, or drop preset and write every edit")


def edit_numbers(field: str, scale: float, lo: Optional[float] = None, hi: Optional[float] = None,
                 value: Optional[float] = 0.0) -> None:
    """An edit's scale, clamp bounds and set value (`field`: the edit's, e.g. `edit`): finite, within float32 (the
    edits run in it), and the bounds in order."""

    for name, x in (("scale", scale), ("lo", lo), ("hi", hi), ("value", value)):
        if x is not None and not math.isfinite(x):  # a NaN edit would turn every steered token into NaN logits
            raise ConfigError(f"{field}.{name}", f"must be a finite number, got {x}")
        if x is not None and abs(x) > F32_MAX:  # the edits run in float32, where this is inf
            raise ConfigError(f"{field}.{name}", f"{x:g} is beyond float32's range (|x| <= {F32_MAX:.3g})")
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError(f"{field}.lo", f"clamp bounds are reversed: lo={lo} > hi={hi}")


def edit_vectors(field: str, kind: EditKind, scale: float, vectors) -> None:
    """An edit's kind against its vectors (float32 `[k, hidden]`, or None: `rescale` about 0): the kinds that need
    one have it, one row where the kind takes one direction, no direction of norm 0, and an `add` whose push fits
    float32 (`field`: the edit's, e.g. `edit`)."""

    if kind != EditKind.rescale and vectors is None:
        raise ConfigError(f"{field}.vector", f"edit kind {kind.value!r} needs a vector")
    if vectors is None:
        return
    if kind == EditKind.add:
        push = abs(scale) * float(vectors.abs().max())
        if not push <= F32_MAX:
            raise ConfigError(f"{field}.scale", f"scale {scale:g} times the vector's largest entry is {push:.3g}, "
                                                f"beyond float32's range ({F32_MAX:.3g})")
    k = vectors.shape[0]
    if kind != EditKind.ablate and k != 1:
        raise ConfigError(f"{field}.vector", f"edit kind {kind.value!r} takes one vector [hidden], got {k} "
                                             "rows (only `ablate` takes a [k, hidden] subspace)")
    if kind not in (EditKind.add, EditKind.rescale) and float(vectors.norm(dim=-1).min()) == 0.0:
        raise ConfigError(f"{field}.vector", "a direction of norm 0 has no direction")


def scale_by(prefix: str, e) -> None:
    """An edit's `scale_by` (what its scale multiplies) other than `vector` only where the vector is a direction."""
    if e.scale_by != ScaleBy.vector and e.kind == EditKind.rescale:
        raise ConfigError(f"{prefix}.scale_by", "edit.kind=rescale multiplies the stream, whose vector is a centre, "
                                                "not a direction; leave scale_by=vector")


def when(prefix: str, e, prompts: Optional[PromptsConf] = None) -> None:
    """An edit's condition (`edit.when`): its threshold (a cosine), and a direction to read from a file or from the
    condition prompts (`prompts`: None where there are none, as in a server's preset)."""
    w, field = e.when, f"{prefix}.when"
    if not (isinstance(w.threshold, (int, float)) and -1.0 <= w.threshold <= 1.0):
        raise ConfigError(f"{field}.threshold", f"must be in [-1, 1] (both scores are cosines), got {w.threshold}")
    if w.layer is None:
        if w.vector is not None:
            raise ConfigError(f"{field}.layer", "is unset, and a condition reads the prompt at a decoder layer: set "
                                                f"{field}.layer=k")
        return
    if w.vector is None:
        sides = [] if prompts is None else [list(prompts.condition_positive), list(prompts.condition_negative)]
        if not sides or not all(sides):
            where = ("give prompts.condition_positive and prompts.condition_negative (or their _file forms) to "
                     "extract it from" if prompts is not None else "a preset's condition names its file")
            raise ConfigError(f"{field}.vector", f"the condition has no direction: set {field}.vector to a file, or "
                                                 f"{where}")
        check_texts(prompts, ("condition_positive", "condition_negative"))


def condition_task(cfg: SteerConf, layers: Optional[int] = None) -> None:
    """task=condition's grid and prompts (`layers`: the model's decoder layers, once known)."""
    c = cfg.condition
    if not c.layers:
        raise ConfigError("condition.layers", "is empty; give at least one decoder layer")
    if layers is not None:
        bad = [x for x in c.layers if not 0 <= x < layers]
        if bad:
            raise ConfigError("condition.layers", f"{bad} out of range: the model has {layers} decoder layers "
                                                  f"(0..{layers - 1})")
    refuse_repeats("condition.layers", [int(x) for x in c.layers])
    if not (math.isfinite(c.step) and 0 < c.step <= 1):
        raise ConfigError("condition.step", f"must be in (0, 1], got {c.step}")
    if not 0 < c.split < 1:
        raise ConfigError("condition.split", f"must be in (0, 1) (the share of prompts the direction is extracted "
                                             f"from), got {c.split}")
    least = 1 if cfg.edit.when.vector is not None else 2  # a side split in two needs two
    for side in ("condition_positive", "condition_negative"):
        if len(getattr(cfg.prompts, side)) < least:
            raise ConfigError(f"prompts.{side}", f"task=condition scores held-out prompts of both sides; give at "
                                                 f"least {least}")
    check_texts(cfg.prompts, ("condition_positive", "condition_negative"))


def extract_layers(cfg: SteerConf, layers: int) -> None:
    """extract.layers against a model of `layers` decoder layers."""
    bad = [x for x in cfg.extract.layers if not 0 <= x < layers]
    if bad:
        raise ConfigError("extract.layers", f"{bad} out of range: the model has {layers} decoder layers "
                                            f"(0..{layers - 1})")
    refuse_repeats("extract.layers", [int(x) for x in cfg.extract.layers])


def eval_task(cfg: SteerConf) -> None:
    """task=eval's scales and split (the dataset itself is read, and checked, by steer.tasks.evaluate.load)."""
    e = cfg.eval
    if not e.scales:
        raise ConfigError("eval.scales", "is empty; give at least one scale")
    if not all(math.isfinite(x) for x in e.scales):
        raise ConfigError("eval.scales", f"{list(e.scales)} holds a value that is not finite")
    refuse_repeats("eval.scales", [f"{float(x):g}" for x in e.scales])
    if not 0 <= e.split < 1:
        raise ConfigError("eval.split", f"must be in [0, 1) (the share of items the direction is extracted from), "
                                        f"got {e.split}")
    if e.split == 0 and cfg.edit.vector.path is None and cfg.edit.kind != EditKind.rescale:
        raise ConfigError("eval.split", "is 0, but edit.vector.path is null: the direction comes from the dataset's "
                                        "own pairs and needs a share of them (e.g. 0.5), or give a vector file")


def select_grid(cfg: SteerConf, layers: int) -> None:
    """task=select's grid against a model of `layers` decoder layers."""
    s = cfg.select
    if not s.layers:
        raise ConfigError("select.layers", "is empty; give at least one decoder layer")
    if not s.scales:
        raise ConfigError("select.scales", "is empty; give at least one scale")
    bad = [x for x in s.layers if not 0 <= x < layers]
    if bad:
        raise ConfigError("select.layers", f"{bad} out of range: the model has {layers} decoder layers "
                                           f"(0..{layers - 1})")
    if not all(math.isfinite(x) for x in s.scales):
        raise ConfigError("select.scales", f"{list(s.scales)} holds a value that is not finite")
    # one cell twice, or two whose directories' names (runs/grid.py's cell_name) are one
    refuse_repeats("select.layers", [int(x) for x in s.layers], " (as a pair's directory names it)")
    refuse_repeats("select.scales", [f"{float(x):g}" for x in s.scales], " (as a pair's directory names it)")
    if cfg.edit.kind == EditKind.rescale and cfg.edit.vector.path is None:
        raise ConfigError("edit.vector.path", "task=select scores each pair by the concept along the edit's "
                                              "direction, and edit.kind=rescale without a vector scales the whole "
                                              "stream: give it a direction (edit.vector.path)")
    at_least("select.max_bad_prompts", s.max_bad_prompts, 0, " (prompts a kept pair may damage)")
    if not 0 <= s.split < 1:
        raise ConfigError("select.split", f"must be in [0, 1) (the share of prompts.steer the pair is chosen on; 0: "
                                          f"chosen and reported on all), got {s.split}")
    if s.rank_by == RankBy.judge and not cfg.metrics.judge.base_url:
        raise ConfigError("select.rank_by", "is judge, but metrics.judge.base_url is unset: name an OpenAI-compatible "
                                            "endpoint (metrics.judge.base_url, metrics.judge.model), or rank_by=probe")
    if s.probe_layer is not None and not 0 <= s.probe_layer < layers:
        raise ConfigError("select.probe_layer", f"{s.probe_layer} out of range: the model has {layers} decoder "
                                                f"layers (0..{layers - 1})")
    if s.probe_path is None and not (cfg.prompts.positive and cfg.prompts.negative):
        raise ConfigError("select.probe_path", "is unset, and the probe that reads every pair's concept is extracted "
                                               "from prompts.positive and prompts.negative, which are empty: give "
                                               "the pairs, or a probe file (select.probe_path)")
    if cfg.extra_edits:
        raise ConfigError("extra_edits", "task=select chooses a layer and scale for `edit` alone; leave "
                                         "extra_edits empty")


def preset_edits(confs, engine: str) -> None:
    """A server's presets (`confs`: name -> PresetConf): a condition names its direction's file (a server has no
    condition prompts), and input taps run on engine=hf."""
    for name, conf in confs.items():
        for i, te in enumerate(list(conf.edits) + [te for tes in conf.models.values() for te in tes]):
            prefix = f"preset {name}: edits[{i}].edit"
            when(prefix, te.edit, None)
            positions(te.edit.positions, f"{prefix}.positions")
            if te.tap.input:
                _needs_hf(engine, f"preset {name}: edits[{i}].tap.input")


def serve_modes(conf) -> None:
    """The server's mode settings that need no engine to judge: said before the engine is even resolved."""
    if conf.vllm.fold_error():
        raise ConfigError("vllm.fold_norm", conf.vllm.fold_error())
    if list(conf.serve.inline_layers) and conf.vllm.in_graph_field():
        raise ConfigError("serve.inline_layers", f"vllm.{conf.vllm.in_graph_field()} captures every edit into the "
                                                 "graphs at start, and a request's own vector is not known then; "
                                                 "serve inline vectors in replay mode (vllm.edits_in_graph false, "
                                                 "vllm.compiled_edits unset or false)")


def serve(conf, engine: str) -> None:
    """The server's own options and its `vllm` section (`conf`: a steer.serve.schema.ServeConf)."""
    s = conf.serve
    vllm(conf.vllm, engine, "this server")
    hf(conf.hf)
    device(conf.device)
    if not 0 < s.port < 65536:
        raise ConfigError("serve.port", f"must be in 1..65535, got {s.port}")
    if not s.max_steer_scale > 0:
        raise ConfigError("serve.max_steer_scale", f"must be positive, got {s.max_steer_scale}")
    at_least("serve.chat_max_tokens", s.chat_max_tokens, 1)
    at_least("serve.keep_alive_s", s.keep_alive_s, 1, " (seconds)")


def check_texts(prompts, sets=("steer", "positive", "negative")) -> None:
    """ConfigError naming `prompts.<set>[i]` for an item that is no text: OmegaConf lets a mapping into a List[str]
    (`prompts.negative=[b,{k:v}]`), which the tokenizer would refuse only once the weights had loaded."""
    for name in sets:
        for i, p in enumerate(getattr(prompts, name)):
            if not isinstance(p, str):
                raise ConfigError(f"prompts.{name}[{i}]", f"must be a string (a prompt's text), got {p!r}")


def positions(value, field: str = "edit.positions") -> Positions:
    """`edit.positions` as a Positions, or a ConfigError naming the field and what it takes."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value)
    if value is None or value == "all":
        return Positions()
    if isinstance(value, str):
        if value in ("last_prompt", "first_generated"):
            return Positions(value)
        raise ConfigError(field, f"{value!r} is not one of all, last_prompt, first_generated, or a window "
                                 "{from: i, to: j}")
    if not isinstance(value, dict):
        raise ConfigError(field, f"expected all, last_prompt, first_generated or a window {{from: i, to: j}}, got "
                                 f"{value!r}")
    if "from" in value or "to" in value:
        extra = set(value) - {"from", "to"}
        if extra or not all(_whole(value.get(k)) for k in ("from", "to")):
            raise ConfigError(field, f"a window is {{from: i, to: j}}, two positions (0 is the first token), got "
                                     f"{value!r}")
        i, j = int(value["from"]), int(value["to"])
        if i < 0 or j < i:
            raise ConfigError(field, f"a window needs 0 <= from <= to, got from={i}, to={j}")
        return Positions("window", start=i, end=j)
    select = value.get("select")
    keys = {"last_prompt": "last_k", "first_generated": "n"}
    if select not in keys:
        raise ConfigError(f"{field}.select", f"{select!r} is not one of last_prompt, first_generated (a window is "
                                             "{from: i, to: j})")
    extra = set(value) - {"select", keys[select]}
    if extra:
        raise ConfigError(f"{field}.{sorted(extra)[0]}", f"is not a setting of {select} (it takes "
                                                         f"{keys[select]})")
    count = value.get(keys[select], 1)
    if not _whole(count) or int(count) < 1:
        raise ConfigError(f"{field}.{keys[select]}", f"must be a whole number >= 1, got {count!r}")
    return Positions(select, count=int(count))


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
