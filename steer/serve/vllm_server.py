"""engine=vllm: vLLM's own OpenAI-compatible server (vllm.entrypoints.openai.api_server.run_server, as `vllm serve`
runs it with one API server process), in this process, with steer's tap worker and every preset registered.

The one module of steer.serve that imports vLLM (its entrypoints; the worker's internals stay in
interleaver/vllm_internals.py). The engine is started as steer.engine.vllm.VLLMEngine starts one (breakable CUDA
graphs, or vLLM's own compiled graphs with compiled edits, the server's default; the tap worker, prefix caching off,
the V1 runner), and every preset's edits go to the workers as plain data
inside additional_config, before vLLM records its graphs: the stage list under STAGES_KEY (replay at the taps'
breaks) or IN_GRAPH_KEY (`vllm.edits_in_graph=true`: captured into the graphs; with `vllm.compiled_edits=true`
also COMPILED_KEY, and vLLM's own torch.compile and CUDA graphs instead of breakable ones). No RPC carries code or
tensors, so VLLM_ALLOW_INSECURE_SERIALIZATION stays off. vLLM's `--middleware` installs
steer.serve.middleware.SteerMiddleware, which turns each request's vllm_xargs (steer, steer_scale) into the worker's
entries before vLLM parses the body.
"""

import json
import os
from pathlib import Path
from typing import Dict, List

from steer.errors import ConfigError
from steer.models.spec import ModelSpec
from steer.serve import presets as presets_mod
from steer.serve.middleware import TABLE_ENV
from steer.serve.presets import Preset
from steer.serve.schema import ServeConf
from steer.serve.stages import StageTable
from steer.edits.tap import Tap

KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # vLLM's api_server reads its idle-connection timeout from it at start


def engine_config(conf: ServeConf, table: StageTable) -> dict:
    """The additional_config of the tap worker: the presets' taps and their stages, as plain data."""
    from interleaver.tap_worker import (COMPILED_KEY, COMPILED_VERSION, CONDITIONS_KEY, FOLD_KEY, IN_GRAPH_KEY,
                                        STAGES_KEY, TAP_GRAPHS_KEY, TAPS_KEY)

    extra = {TAPS_KEY: table.tap_list(), CONDITIONS_KEY: table.bank.condition_list()}
    if conf.vllm.in_graph_field():
        if not table.bank.stages:
            raise ConfigError(f"vllm.{conf.vllm.in_graph_field()}", "no preset has an edit to capture into the graphs")
        extra[IN_GRAPH_KEY] = table.bank.stage_list()
        if conf.vllm.compiled_edits:
            extra[COMPILED_KEY] = COMPILED_VERSION
        if conf.vllm.fold_norm:  # prepare() refused it with compiled edits
            extra[FOLD_KEY] = True
    else:
        extra[STAGES_KEY] = table.bank.stage_list()
        if conf.vllm.tap_graphs:
            extra[TAP_GRAPHS_KEY] = True
    return extra


def argv(conf: ServeConf, spec: ModelSpec, model_name: str) -> List[str]:
    """`vllm serve` flags for this server (the settings that have no flag here are set on the parsed args)."""
    from interleaver.tap_worker import worker_cls
    from steer.engine.vllm import compilation_config

    v, s = conf.vllm, conf.serve
    out = ["--model", spec.source, "--served-model-name", model_name, "--dtype", str(spec.dtype).replace("torch.", ""),
           "--gpu-memory-utilization", str(v.gpu_memory_utilization), "--max-num-seqs", str(v.max_num_seqs),
           "--load-format", v.load_format, "--worker-cls", worker_cls(), "--tensor-parallel-size",
           str(v.tensor_parallel_size), "--seed", "0", "--host", s.host, "--port", str(s.port),
           "--middleware", "steer.serve.middleware.SteerMiddleware",
           # vLLM's sampling defaults, not the checkpoint's generation_config: both engines answer a request alike.
           "--generation-config", "vllm", "--uvicorn-log-level", s.log_level]
    compilation = compilation_config(v)
    if compilation:
        out += ["--compilation-config", json.dumps(compilation)]
    return out


def playground_section(conf: ServeConf, spec: ModelSpec, model_name: str, out_dir: Path) -> dict:
    """What the middleware serves the playground from: the page's facts, and the server's config (written beside the
    table) to read directions on the HF engine with."""
    from omegaconf import OmegaConf

    from steer.serve import playground

    conf_path = Path(out_dir) / "serve_conf.yaml"
    conf_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(conf)))
    return playground.section(conf, spec, model_name, str(conf_path))


def serve(conf: ServeConf, spec: ModelSpec, compiled: Dict[str, Preset], inline_taps: Dict[int, Tap], out_dir: Path,
          model_name: str) -> None:
    stages = StageTable(compiled, inline_taps)
    extra = engine_config(conf, stages)
    path = Path(out_dir) / "steer_presets.json"
    translator = stages.translator(presets_mod.listing(compiled), conf.serve.max_steer_scale, spec.hidden)
    translator.table["playground"] = playground_section(conf, spec, model_name, out_dir)
    translator.dump(str(path))
    os.environ[TABLE_ENV] = str(path)
    os.environ[KEEP_ALIVE_ENV] = str(conf.serve.keep_alive_s)
    from steer.engine.vllm import set_environment

    set_environment(conf.vllm, rpc_tensors=False)  # as VLLMEngine, but every message to the workers is plain data

    from transformers import AutoTokenizer

    from steer.serve.protocol import plain_chat_template

    tokenizer = AutoTokenizer.from_pretrained(spec.source, revision=spec.revision)
    # The read-only request path (vLLM's api_server) and its arguments, as `vllm serve` builds them.
    from vllm.entrypoints.openai.api_server import run_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog="python -m steer.serve engine=vllm")).parse_args(
        argv(conf, spec, model_name))
    v = conf.vllm
    args.revision = spec.revision
    args.enable_prefix_caching = False  # a prefix cached without an edit must not serve a steered request
    args.enforce_eager = v.enforce_eager
    args.kv_cache_memory_bytes = v.kv_cache_memory_bytes
    args.max_model_len = v.max_model_len
    args.additional_config = extra
    if not getattr(tokenizer, "chat_template", None):
        args.chat_template = plain_chat_template(tokenizer)  # the HF engine's: a chat request is fed alike
    validate_parsed_serve_args(args)
    args.api_server_count = None  # one API server: this process (vllm serve's single-server path)
    try:
        from uvloop import run  # what vllm serve runs it with
    except ImportError:
        from asyncio import run
    run(run_server(args))
