"""The serving benchmark: `python -m steer.serve engine=vllm` against a stock `vllm serve` with the same settings,
under vLLM's own serving benchmark (vllm.benchmarks.serve, what `vllm bench serve` runs), on Llama-3-8B's shape with
dummy weights. GPU only.

    python -m steer.bench.serving --out bench-serve [--modes replay,in_graph,compiled]

Loads (each: 256 random prompts of 256 tokens, 128 new tokens, EOS ignored, greedy, 16 requests in flight):
  unsteered    no request names a preset
  mixed        a third unsteered, a third on preset `add8` (add at layer 8), a third on `clamp16` (clamp at layer 16)
  ablate_all   every request on preset `ablate_all` (ablate at all 32 layers)
The stock server runs `unsteered`; each steer server (replay at the breaks, the edits captured into breakable graphs,
or compiled into vLLM's own torch.compile'd graphs: vllm.compiled_edits) runs all three. The report (bench-serve.md,
bench-serve.json) gives output throughput and TTFT p50 of each, and their ratios to the stock server's unsteered
load measured in the same run.
"""

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors.torch import save_file

from steer.serve.process import free_port, running

SERVED = "llama3_8b_shape"
LAYERS = 32
PRESETS = {  # name -> (kind, layers, scale, extra edit fields)
    "add8": ("add", [8], 4.0, {}),
    "clamp16": ("clamp", [16], 1.0, {"lo": -2.0, "hi": 2.0}),
    "ablate_all": ("ablate", list(range(LAYERS)), 1.0, {}),
}
LOADS = {"unsteered": [None], "mixed": [None, "add8", "clamp16"], "ablate_all": ["ablate_all"]}


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
    return pdir


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
           "serve.log_level=warning", f"hydra.run.dir={presets.parent / ('serve-' + mode)}"]
    return out + {"in_graph": ["vllm.edits_in_graph=true"], "compiled": ["vllm.compiled_edits=true"]}.get(mode, [])


def load(url: str, tokenizer: Path, cycle: List[Optional[str]], out: Path, args) -> dict:
    """vLLM's serving benchmark against `url`, request i carrying preset cycle[i % len(cycle)] (None: no steer
    field); its result dict (throughputs, TTFT/TPOT/ITL percentiles)."""
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

    def with_presets(a, tok):  # the one seam: each request's preset rides its own extra body (vllm_xargs)
        reqs = samples(a, tok)
        for i, r in enumerate(reqs):
            name = cycle[i % len(cycle)]
            if name is not None:
                r.request_overrides = {**(r.request_overrides or {}), "vllm_xargs": {"steer": name}}
        return reqs

    bench.get_samples = with_presets
    try:
        return bench.main(ns)
    finally:
        bench.get_samples = samples


def summary(result: dict) -> dict:
    keep = ("completed", "failed", "duration", "output_throughput", "request_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms")
    return {k: result.get(k) for k in keep}


def markdown(rows: Dict[str, dict], meta: dict) -> str:
    base = rows["stock/unsteered"]
    lines = [f"Serving benchmark, {meta['date']}, {meta['machine']}: `{meta['command']}`", "",
             f"Llama-3-8B shape (dummy weights, bf16), {meta['requests']} requests, {meta['concurrency']} in flight, "
             f"{meta['input_len']} prompt tokens, {meta['output_len']} new tokens, greedy, EOS ignored.", "",
             "| server / load | output tok/s | x stock | TTFT p50 ms | x stock | TPOT p50 ms | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['output_throughput']:,.0f} | "
                     f"{r['output_throughput'] / base['output_throughput']:.3f} | {r['median_ttft_ms']:.1f} | "
                     f"{r['median_ttft_ms'] / base['median_ttft_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
                     f"{r['failed']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m steer.bench.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-serve")
    p.add_argument("--modes", default="replay,compiled",
                   help="steer servers to run: replay, in_graph, compiled (comma-separated)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--cache-dir", default=os.environ.get("STEER_CACHE", str(Path.home() / ".cache" / "steer")))
    args = p.parse_args(argv)
    from steer.bench.schema import BenchModelConf
    from steer.bench.workload import LLAMA3_8B, model_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(BenchModelConf(source="llama3_8b_shape", dtype="bfloat16"), args.cache_dir)
    presets = write_presets(out, LLAMA3_8B["hidden_size"])
    rows: Dict[str, dict] = {}
    servers = [("stock", stock_cmd)] + [(m, None) for m in args.modes.split(",") if m]
    for name, make in servers:
        port = free_port()
        cmd = make(model, port, args.gpu_memory_utilization) if make else \
            steer_cmd(model, presets, port, args.gpu_memory_utilization, name)
        with running(cmd, port, out / f"server-{name}.log") as url:
            for load_name, cycle in LOADS.items():
                if name == "stock" and load_name != "unsteered":
                    continue
                r = load(url, model, cycle, out / f"{name}-{load_name}.json", args)
                rows[f"{name}/{load_name}"] = summary(r)
                print(f"[serve-bench] {name}/{load_name}: {json.dumps(rows[f'{name}/{load_name}'])}", flush=True)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "command": "python -m steer.bench.serving " + " ".join(argv if argv is not None else sys.argv[1:]),
            **{k: getattr(args, k) for k in ("requests", "concurrency", "input_len", "output_len")}}
    (out / "bench-serve.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "bench-serve.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
