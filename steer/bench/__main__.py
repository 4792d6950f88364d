"""`python -m steer.bench`: every configuration, scenario, model and batch of conf/bench.yaml in one run.

    python -m steer.bench run=[tiny] batches=[[64,128]] 'skip=[tiny/e/*]'   # a smaller run (GPU, vLLM)

Each engine runs in a process of its own, timed in rounds (steer/bench/waves.py). The report (bench.md, bench.csv,
bench.png) lands in the run directory and is rewritten after every engine, so a run cut short keeps what it timed.
"""

import json
import multiprocessing
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import List

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from steer.bench import schema, waves
from steer.errors import ConfigError
from steer.config.schema import to_object

schema.register()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="bench")
def app(cfg: DictConfig) -> None:
    console = Console(stderr=True, soft_wrap=True)
    command = " ".join(["python -m steer.bench", *effective(HydraConfig.get().overrides.task)])
    try:
        run(to_object(cfg), Path(HydraConfig.get().runtime.output_dir), console, command)
    except ConfigError as e:
        console.print(f"[bold red]error[/] {escape(str(e))}", highlight=False)
        sys.exit(2)


def effective(overrides: List[str]) -> List[str]:
    """The overrides as they took effect, for the report's command: an override that a later one of the same key
    (and package) replaces is left out (tests/gpu/run.sh's table stage appends BENCH_ARGS to its own). Hydra applies
    them in order and merges a dict into a dict, so one whose value is a dict stays."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    last = {(o.key_or_group, o.package): i for i, o in enumerate(parsed)}
    return [o.input_line for i, o in enumerate(parsed)
            if last[(o.key_or_group, o.package)] == i or isinstance(o.value(), dict)]


def run(conf: schema.BenchConf, out_dir: Path, console: Console, command: str) -> None:
    from steer.bench import workload
    from steer.bench.runs import plan_groups
    from steer.engine.vllm import available

    workload.check(conf)
    if not available():
        raise ConfigError("engine", "steer.bench runs vLLM: it needs CUDA and vLLM (pip install -e '.[vllm]')")
    book = Book(conf, out_dir, console, command)
    try:
        for name in conf.run:
            m = conf.models[name]
            where = workload.model_dir(m, conf.cache_dir)
            groups = []
            for group in plan_groups(conf, name, workload.spec(m, name, where).layers):
                for cell in list(group.cells):
                    pattern = workload.skipped(conf, name, group.config, cell["scenario"],
                                               (cell["requests"], cell["tokens"]))
                    if pattern:
                        group.cells.remove(cell)
                        book.records.append({**cell, "model": name, "config": group.config, "status": "skipped",
                                             "detail": f"skip pattern {pattern!r}"})
                if group.cells:
                    groups.append(group)
            # Engines starting together share the cores their compilers get.
            env = {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // m.engines_at_once))}
            waves.run(groups, m.engines_at_once, lambda g, m=m, w=where, env=env: book.start(g, m, w, env), book.finish,
                      conf.timeout_s, reference=lambda g: g.config in schema.REFERENCES)
    finally:
        waves.kill_all()
    console.print(book.report(), highlight=False, markup=False)
    console.print(f"report in {out_dir}")


class Book:
    """The run's records: each engine process's handed back as it ends, and the report rewritten then."""

    def __init__(self, conf: schema.BenchConf, out_dir: Path, console: Console, command: str):
        self.conf, self.out_dir, self.console, self.command = conf, out_dir, console, command
        self.records, self.machine = [], {}
        self.when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.ctx = multiprocessing.get_context("spawn")

    def out(self, group) -> Path:
        return self.out_dir / f".{group.model}-{group.config}-{len(group.layers)}taps.json"

    def start(self, group, m, where, env):
        from steer.bench.runs import run_group

        self.out(group).unlink(missing_ok=True)
        self.console.print(f"[bold]{group.model}[/] config {group.config} ({schema.CONFIGS[group.config]}), "
                           f"taps at {len(group.layers)} layer(s), {len(group.cells)} cell(s): starting")
        return waves.Process(self.ctx, run_group, (self.conf, m, str(where), group, str(self.out(group)), env))

    def finish(self, group, engine) -> None:
        from steer.results import write_jsonl

        out = self.out(group)
        got = json.loads(out.read_text()) if out.exists() else {"records": [], "machine": {}}
        if getattr(engine, "killed", False):
            self.console.print(f"[bench] {group.model} {group.config}: engine process still running when the "
                               "bench was done with it; killed with its process group", highlight=False, markup=False)
        # Cells the process never timed (it died, or was stopped, before their first pass) say so.
        have = {(r["scenario"], r["requests"], r["tokens"]) for r in got["records"]}
        why = f"engine process ended with code {engine.exitcode} before this cell had a pass"
        got["records"] += [{**c, "status": "error", "detail": why} for c in group.cells
                           if (c["scenario"], c["requests"], c["tokens"]) not in have]
        out.unlink(missing_ok=True)
        self.machine = got["machine"] or self.machine
        self.records += [{**r, "model": group.model, "config": group.config} for r in got["records"]]
        write_jsonl(self.out_dir / "records.jsonl", self.records)
        self.report()

    def report(self) -> str:
        from steer.bench import report

        return report.publish(self.out_dir, self.records, self.conf, self.machine, self.when, self.command)


if __name__ == "__main__":  # a config Hydra or OmegaConf rejects: one line, exit 2, as `python -m steer`
    from steer.errors import run_app

    run_app(app)
