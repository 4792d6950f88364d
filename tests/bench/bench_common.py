"""What the bench tests share: the bench config as `python -m steer.bench` composes it, and the pieces of a bench
run that stand in for engines."""

import json
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from helpers import compose_conf
from steer.bench import runs

# The bench's models untrained: the tiny recipe's shape and tokenizer with random weights. The tests read shapes
# and time stand-in engines, so none needs trained weights, and training the tiny model takes a minute or more on
# a CPU.
UNTRAINED = ["models.tiny.tiny.train_steps=0", "models.llama3_8b.tiny.train_steps=0",
             "models.qwen2_1p5b.tiny.train_steps=0"]
COMMAND = "python -m steer.bench"


def bench_conf(*overrides, cache_dir="/tmp/unused"):
    """conf/bench.yaml with `overrides`, its models untrained, as a BenchConf."""
    return OmegaConf.to_object(compose_conf("bench", [f"cache_dir={cache_dir}", *UNTRAINED, *overrides]))


def one_tap(cfg, config="c"):
    """The engine group of `config` on the tiny model with one tap (add, k1, k8, k64)."""
    return next(g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == config and len(g.layers) == 1)


def stand_in_runner():
    """A stand-in engine's runner: a pass in which every request generates all its tokens, at once."""
    return lambda prompts, scen, tokens: len(prompts) * tokens


def records(out):
    """The records an engine process wrote to `out`."""
    return json.loads(Path(out).read_text())["records"]


def ended(killed=False):
    """An engine process as the scheduler hands it to the book once it is gone: ended with code -9, `killed` by the
    scheduler or not."""
    return SimpleNamespace(exitcode=-9, killed=killed)
