"""The serving benchmark: steer's vLLM server against a stock `vllm serve` with the same settings, under vLLM's own
serving benchmark (vllm.benchmarks.serve, what `vllm bench serve` runs), on Llama-3-8B's shape with dummy weights.
GPU only.

    python -m steer.bench.serving --out bench-serve [--modes replay,in_graph,compiled] [--repeats 3]

Loads (256 random prompts of 256 tokens, 128 new tokens, EOS ignored, greedy, 16 in flight): `unsteered`; `mixed`,
a third each unsteered, on preset add8 and on clamp16; `ablate_all`, every request ablating at all 32 layers; and on
the `replay_when` server (replay mode with `serve.inline_layers=[8,12]`, the one that takes a request's own vectors)
`when`: half the requests unsteered, half adding their own vector after layer 12 under their own condition
(`steer_when`: the prompt's mean after layer 8 against a direction, cosine above 0). The
stock servers run `unsteered`: `stock` on vLLM's own choice of model runner and `stock_v1` on the V1 runner steer's
worker hooks, which holds the runner fixed. Every load runs --repeats times, the loads in turn; a row is the median
of its runs with the throughput's range, against each stock server's unsteered load (bench-serve.md, .json).
"""

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file

from steer.results import write_json, write_text
from steer.procgroup import free_port, running

SERVED = "llama3_8b_shape"
LAYERS = 32
PRESETS = {  # name -> (kind, layers, scale, extra edit fields)
    "add8": ("add", [8], 4.0, {}),
    "clamp16": ("clamp", [16], 1.0, {"lo": -2.0, "hi": 2.0}),
    "ablate_all": ("ablate", list(range(LAYERS)), 1.0, {}),
}
LOADS = {"unsteered": [None], "mixed": [None, "add8", "clamp16"], "ablate_all": ["ablate_all"]}
# The server that takes requests' own vectors (and their conditions) runs these: its unsteered load beside `when`
WHEN_LOADS = {"unsteered": [None], "when": [None, "when"]}
WHEN_LAYERS = (8, 12)  # where a `when` request's condition reads the prompt, and where its vector is added
# name -> environment over the caller's (None: unset, so a variable exported in the shell cannot pick stock's runner)
BASELINES = {"stock": {"VLLM_USE_V2_MODEL_RUNNER": None}, "stock_v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
MEDIANS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
# steer's servers: mode -> its overrides (each explicit: with none the server picks compiled edits)
MODES = {"replay": ["vllm.compiled_edits=false"], "in_graph": ["vllm.edits_in_graph=true"],
         "compiled": ["vllm.compiled_edits=true"],
         "replay_when": ["vllm.compiled_edits=false", f"serve.inline_layers=[{','.join(map(str, WHEN_LAYERS))}]"]}


def write_presets(work: Path, hidden: int) -> Path:
    """Random unit directions (one file, a key per preset) and a preset directory naming them."""
    gen = torch.Generator().manual_seed(0)
    vectors = {}
    for name in PRESETS:
        v = torch.randn(hidden, generator=gen)
        vectors[name] = v / v.norm()
    vec_path = work / "vectors.safetensors"
    save_file(vectors, str(vec_path))
    pdir = work / "presets"
    pdir.mkdir(parents=True, exist_ok=True)
    for name, (kind, layers, scale, extra) in PRESETS.items():
        edits = [{"tap": {"layer": layer},
                  "edit": {"kind": kind, "scale": scale, "vector": {"path": str(vec_path), "key": name}, **extra}}
                 for layer in layers]
        (pdir / f"{name}.yaml").write_text(json.dumps({"description": f"bench: {kind} at {len(layers)} layer(s)",
                                                       "edits": edits}))
    (work / "when.json").write_text(json.dumps(when_xargs(vectors["add8"], torch.randn(hidden, generator=gen))))
    return pdir


def when_xargs(vector: torch.Tensor, condition: torch.Tensor) -> dict:
    """A `when` request's vllm_xargs: its own vector after layer 12 under its own condition read after layer 8."""
    from steer.serve.protocol import encode_vector

    read, add = WHEN_LAYERS
    return {"steer_vector": encode_vector(vector.numpy()), "steer_layer": add, "steer_strength": 4.0,
            "steer_when": {"vector": encode_vector(condition.numpy()), "layer": read, "threshold": 0.0,
                           "score": "cosine"}}


def stock_cmd(model: Path, port: int, gpu_util: float) -> List[str]:
    """`vllm serve` with the settings steer's server passes (steer/serve/vllm_server.py argv), nothing of steer's."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name", SERVED,
            "--load-format", "dummy", "--dtype", "bfloat16", "--gpu-memory-utilization", str(gpu_util),
            "--max-num-seqs", "256", "--seed", "0", "--port", str(port), "--no-enable-prefix-caching",
            "--generation-config", "vllm", "--uvicorn-log-level", "warning"]


def steer_cmd(model: Path, presets: Path, port: int, gpu_util: float, mode: str) -> List[str]:
    out = [sys.executable, "-m", "steer.serve", "engine=vllm", "device=cuda", f"model.source={model}",
           f"model.name={SERVED}", "model.dtype=bfloat16", "vllm.load_format=dummy", "vllm.max_num_seqs=256",
           f"vllm.gpu_memory_utilization={gpu_util}", f"serve.preset_dir={presets}", f"serve.port={port}",
           f"serve.presets=[{','.join(PRESETS)}]",  # its own only: a preset_dir's are served beside the built-in ones
           "serve.log_level=warning", f"hydra.run.dir={presets.parent / ('serve-' + mode)}"]
    return out + MODES[mode]


def load(url: str, tokenizer: Path, cycle: List[Optional[str]], out: Path, args) -> dict:
    """vLLM's serving benchmark against `url`, request i on preset cycle[i % len(cycle)] (None: none; "when": its own
    vector and condition, written beside the presets); its result."""
    from vllm.benchmarks import serve as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    ns = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED,
        "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.requests), "--max-concurrency",
        str(args.concurrency), "--temperature", "0", "--seed", "0", "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--num-warmups",
        str(args.concurrency), "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name])
    samples = bench.get_samples
    own = json.loads((out.parent / "when.json").read_text()) if "when" in cycle else None

    def with_presets(a, tok):  # the one seam: each request's preset rides its own extra body (vllm_xargs)
        reqs = samples(a, tok)
        for i, r in enumerate(reqs):
            name = cycle[i % len(cycle)]
            if name is not None:
                xargs = own if name == "when" else {"steer": name}
                r.request_overrides = {**(r.request_overrides or {}), "vllm_xargs": xargs}
        return reqs

    bench.get_samples = with_presets
    try:
        return bench.main(ns)
    finally:
        bench.get_samples = samples


def summary(result: dict) -> dict:
    return {k: result.get(k) for k in ("completed", "failed", "duration", "output_throughput", "median_ttft_ms",
                                       "p99_ttft_ms", "median_tpot_ms", "median_itl_ms")}


def row(runs: List[dict]) -> dict:
    """One load's repeated runs: the median of each of MEDIANS, the throughput's range, failures summed, the runs."""
    out = {k: statistics.median(r[k] for r in runs) for k in MEDIANS}
    tput = [r["output_throughput"] for r in runs]
    return {**out, "throughput_range": [min(tput), max(tput)], "failed": sum(r["failed"] for r in runs),
            "runs": runs}


def markdown(rows: Dict[str, dict], meta: dict) -> str:
    """The report's table: each row against each stock server's unsteered row present."""
    bases = [b for b in BASELINES if f"{b}/unsteered" in rows]
    head = ["server / load", "output tok/s", "range"] + [f"x {b}" for b in bases] + ["TTFT p50 ms"] + \
        [f"x {b}" for b in bases] + ["TPOT p50 ms", "failed"]
    lines = [f"Serving benchmark, {meta['date']}, {meta['machine']}: `{meta['command']}`", "",
             f"Llama-3-8B shape (dummy weights, bf16), {meta['requests']} requests, {meta['concurrency']} in flight, "
             f"{meta['input_len']} prompt tokens, {meta['output_len']} new tokens, greedy, EOS ignored; medians of "
             f"{meta['repeats']} runs of each load.", "",
             "| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name, r in rows.items():
        lo, hi = r["throughput_range"]
        cells = [name, f"{r['output_throughput']:,.0f}", f"{lo:,.0f}-{hi:,.0f}"]
        cells += [f"{r['output_throughput'] / rows[f'{b}/unsteered']['output_throughput']:.3f}" for b in bases]
        cells += [f"{r['median_ttft_ms']:.1f}"]
        cells += [f"{r['median_ttft_ms'] / rows[f'{b}/unsteered']['median_ttft_ms']:.2f}" for b in bases]
        lines.append("| " + " | ".join(cells + [f"{r['median_tpot_ms']:.2f}", str(r["failed"])]) + " |")
    return "\n".join(lines) + "\n"


def require_gpu() -> None:
    """Stop with a clear message, before any server starts, where the benchmark cannot run."""
    if not torch.cuda.is_available():
        raise SystemExit("steer.bench.serving drives vLLM servers on a GPU: it needs CUDA")
    try:
        import vllm.benchmarks.serve  # noqa: F401  (the load generator, vLLM's own)
    except ImportError as e:
        raise SystemExit(f"steer.bench.serving needs vLLM (pip install -e '.[vllm]'): {e}")


def servers(args) -> List[str]:
    """The servers the run starts, checked before any starts: the stock baselines, then steer's modes."""
    out = []
    for flag, known in (("baselines", list(BASELINES)), ("modes", list(MODES))):
        for name in filter(None, getattr(args, flag).split(",")):
            if name not in known:
                raise SystemExit(f"--{flag}: unknown server {name!r}; expected some of {', '.join(known)}")
            if name in out:
                raise SystemExit(f"--{flag}: {name!r} named twice; each server runs once")
            out.append(name)
    if not out:
        raise SystemExit("--baselines and --modes: both empty; name at least one server")
    return out


def environment(name: str) -> Dict[str, str]:
    """A stock server's environment: the caller's, with BASELINES' settings for `name`, and steer's server's
    keep-alive (serve.keep_alive_s; vLLM's own default is 5 s)."""
    from steer.serve.schema import ServeOptions
    from steer.serve.vllm_server import KEEP_ALIVE_ENV

    env = dict(os.environ, **{KEEP_ALIVE_ENV: str(ServeOptions().keep_alive_s)}, **BASELINES[name])
    return {k: v for k, v in env.items() if v is not None}


def measure(name: str, model: Path, presets: Path, out: Path, args) -> Dict[str, dict]:
    """One server's loads (a stock server's: unsteered only), each --repeats times, the loads in turn."""
    port, stock = free_port(), name in BASELINES
    cmd = stock_cmd(model, port, args.gpu_memory_utilization) if stock else \
        steer_cmd(model, presets, port, args.gpu_memory_utilization, name)
    loads = {k: v for k, v in (WHEN_LOADS if name == "replay_when" else LOADS).items() if k == "unsteered" or not stock}
    runs: Dict[str, List[dict]] = {k: [] for k in loads}
    with running(cmd, port, out / f"server-{name}.log", env=environment(name) if stock else None) \
            as url:
        for rep in range(args.repeats):
            for load_name, cycle in loads.items():
                r = summary(load(url, model, cycle, out / f"{name}-{load_name}-{rep}.json", args))
                runs[load_name].append(r)
                print(f"[serve-bench] {name}/{load_name} run {rep}: {json.dumps(r)}", flush=True)
    return {f"{name}/{k}": row(v) for k, v in runs.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m steer.bench.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-serve")
    p.add_argument("--modes", default="replay,compiled",
                   help="steer servers to run: replay, in_graph, compiled, replay_when (comma-separated)")
    p.add_argument("--baselines", default="stock,stock_v1", help="stock servers to run: stock, stock_v1")
    p.add_argument("--repeats", type=int, default=3, help="runs of each load on its server (the row: their median)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--cache-dir", default=os.environ.get("STEER_CACHE", str(Path.home() / ".cache" / "steer")))
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: {args.repeats}; expected at least 1 run of each load")
    names = servers(args)
    require_gpu()
    from steer.bench.schema import BenchModelConf
    from steer.bench.workload import LLAMA3_8B, model_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(BenchModelConf(source="llama3_8b_shape", dtype="bfloat16"), args.cache_dir)
    presets = write_presets(out, LLAMA3_8B["hidden_size"])
    rows: Dict[str, dict] = {}
    for name in names:
        rows.update(measure(name, model, presets, out, args))
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "command": "python -m steer.bench.serving " + " ".join(argv if argv is not None else sys.argv[1:]),
            **{k: getattr(args, k) for k in ("requests", "concurrency", "input_len", "output_len", "repeats")}}
    write_json(out / "bench-serve.json", {"meta": meta, "rows": rows})
    write_text(out / "bench-serve.md", markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
