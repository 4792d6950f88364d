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
UNTRAINED = ["models.tiny.tiny.train_steps=0", "models.llama3_8b.tiny.train_steps=0"]
COMMAND = "python -m steer.bench"


def bench_conf(*overrides, cache_dir="/tmp/unused"):
    """conf/bench.yaml with `overrides`, its models untrained, as a BenchConf."""
    return OmegaConf.to_object(compose_conf("bench", [f"cache_dir={cache_dir}", *UNTRAINED, *overrides]))


def one_tap(cfg, config="c"):
    """The engine group of `config` on the tiny model with one tap (add, k1, k8, k64)."""
    return next(g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == config and len(g.layers) == 1)


def first_cell(cfg, where, out):
    """The records of one engine process, run in this process, that times only the first cell of `one_tap(cfg)`
    on the tiny model at `where`, into `out`."""
    group = one_tap(cfg)
    group.cells = group.cells[:1]
    runs.run_group(cfg, cfg.models["tiny"], where, group, str(out))
    return records(out)


def stand_in_runner():
    """A stand-in engine's runner, a new one each call (tracing gives a runner attributes of its own): a pass in
    which every request generates all its tokens, at once."""
    return lambda prompts, scen, tokens: len(prompts) * tokens


def records(out):
    """The records an engine process wrote to `out`."""
    return json.loads(Path(out).read_text())["records"]


def ended(killed=False, ready=True):
    """An engine process as the scheduler hands it to the book once it is gone: ended with code -9, `killed` by the
    scheduler (after it got `ready`, or while still starting)."""
    return SimpleNamespace(exitcode=-9, killed=killed, ready=lambda: ready)


def _stat(pid, command, ppid, cpu, utime, stime):
    # proc(5): pid (comm) state ppid ... utime(14) stime(15) ... processor(39)
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 23 + [str(cpu)] + ["0"] * 13
    return f"{pid} ({command}) " + " ".join(fields) + "\n"


def fake_proc(root, procs, threads=None):
    """A /proc under `root` holding `procs` ({pid: (command, parent pid, CPU, CPU ticks)}) and, where `threads`
    names them ({pid: [thread ids]}), their threads."""
    for pid, (command, ppid, cpu, ticks) in procs.items():
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "stat").write_text(_stat(pid, command, ppid, cpu, ticks, 0))
        for tid in (threads or {}).get(pid, ()):
            (root / str(pid) / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
    (root / "self").mkdir(exist_ok=True)  # not a process directory
    (root / "stat").write_text("cpu 1 2 3\n")
