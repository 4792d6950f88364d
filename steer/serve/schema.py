"""The server's typed config (conf/serve.yaml; a preset's, conf/preset/*.yaml, is steer.config.schema.PresetConf):
Hydra and OmegaConf merge the YAML onto these dataclasses, so an unknown key or a wrong type fails before anything
loads."""

from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from steer.config.schema import (Choice, EngineName, ExtractConf, HfConf, ModelConf, PresetConf,  # noqa: F401
                                 PromptsConf, VllmConf)


class LogLevel(Choice):
    """uvicorn's and vLLM's --uvicorn-log-level."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    # Presets to load, by file name in the preset directories; null: every preset there.
    presets: Optional[List[str]] = None
    # A directory of presets served beside the built-in ones (conf/preset/); a name both define is an error.
    preset_dir: Optional[str] = None
    # The model name clients pass (and /v1/models lists); null: model.name.
    model_name: Optional[str] = None
    # The largest |steer_scale| (and |steer_strength|) a request may ask for (a huge one only overflows the
    # activations).
    max_steer_scale: float = 100.0
    # Decoder layers whose residual stream a request's own vector (steer_vector) may be added to. Each is a tap on
    # every request (engine=vllm in replay mode: a break in each step's graph), so none by default.
    inline_layers: List[int] = field(default_factory=list)
    # engine=hf: max_tokens when a chat request gives none (a completion's default is OpenAI's, 16).
    chat_max_tokens: int = 256
    log_level: LogLevel = LogLevel.info
    # Seconds an idle connection stays open. Longer than clients' own (httpx's, and with it the openai client's:
    # 5 s): at uvicorn's and vLLM's default of 5 both sides close together, and a client that reuses the
    # connection the server is closing gets "connection reset" (seen under 12 concurrent requests on 2 CPUs).
    keep_alive_s: int = 30
    # The playground page at / (a prompt, presets, a strength, a direction from a few lines; the unsteered and the
    # steered continuations streamed side by side) and its routes /v1/steer/info and /v1/steer/direction.
    playground: bool = True


@dataclass
class ServeConf:
    engine: EngineName = EngineName.auto  # vllm where CUDA and vLLM are available, else hf
    model: ModelConf = MISSING
    # The contrastive sets of presets whose vector path is null (the default direction, as in `python -m steer`).
    prompts: PromptsConf = MISSING
    # How those default directions are made (extract.* as in `python -m steer`, with prompts.chat).
    extract: ExtractConf = field(default_factory=ExtractConf)
    device: str = "cpu"  # engine=hf: where the model runs; engine=vllm: where default directions are extracted
    # vllm.compiled_edits null: engine=vllm compiles the presets' edits into vLLM's own torch.compile'd graphs, the
    # fastest mode (docs/benchmark.md, "Serving"), unless vllm.edits_in_graph, vllm.tap_graphs or
    # serve.inline_layers ask for another (requests' own vectors need replay mode); engine=hf has no graphs.
    vllm: VllmConf = field(default_factory=VllmConf)
    hf: HfConf = field(default_factory=HfConf)
    serve: ServeOptions = field(default_factory=ServeOptions)
    cache_dir: str = MISSING


def register() -> None:
    """Register the schema under the name conf/serve.yaml puts first in its defaults list."""
    ConfigStore.instance().store(name="serve_schema", node=ServeConf)
