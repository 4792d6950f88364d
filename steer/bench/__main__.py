"""`python -m steer.bench`: every configuration, scenario, model and batch of conf/bench.yaml in one run.

    python -m steer.bench                                   # the full run (a GPU machine with vLLM)
    python -m steer.bench run=[tiny] batches=[[64,128]]     # a smaller one
    python -m steer.bench 'skip=[llama3_8b/e/*]'            # leave cells out (reported as not run)

Each engine configuration runs in a process of its own; up to a model's `engines_at_once` start side by side and
are then timed in rounds, one engine at a time (steer/bench/waves.py). With several `lanes`, each lane does that on
GPUs of its own, side by side with the others. The report (bench.md, bench.csv, bench.png) lands in the run
directory and is rewritten after every engine, so a run cut short keeps what it measured.
"""

import multiprocessing
import os
import sys
import threading
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import List

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from steer.bench import hostspeed, nvml, schema, waves
from steer.errors import ConfigError
from steer.config.schema import to_object

schema.register()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="bench")
def app(cfg: DictConfig) -> None:
    console = Console(stderr=True, soft_wrap=True)
    command = " ".join(["python -m steer.bench", *effective(HydraConfig.get().overrides.task)])
    try:
        conf = to_object(cfg)
        run(conf, Path(HydraConfig.get().runtime.output_dir), console, command)
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
    read, why = nvml.reader() if conf.gpu_sample_s > 0 else (None, "gpu_sample_s=0")
    if read is None:  # said once here; the engine processes then read nothing and say nothing
        console.print(f"[bench] warning: no GPU clock or power readings ({why}); the report's sm_mhz and power_w "
                      "stay empty", highlight=False, markup=False)
    book = _Book(conf, out_dir, console, command)
    lanes = [[] for _ in conf.lanes]  # per lane: (model, its groups) in run order
    for name in conf.run:
        m = conf.models[name]
        where = workload.model_dir(m, conf.cache_dir)
        mine = [[] for _ in conf.lanes]
        for group in plan_groups(conf, name, workload.spec(m, name, where).layers):
            todo = []
            for cell in group.cells:
                pattern = workload.skipped(conf, name, group.config, cell["scenario"],
                                           (cell["requests"], cell["tokens"]))
                if pattern:
                    book.records.append({**cell, "model": name, "config": group.config, "status": "skipped",
                                         "detail": f"skip pattern {pattern!r}"})
                else:
                    todo.append(cell)
            if todo:
                group.cells = todo
                mine[workload.lane(conf, name, group.config)].append(group)
        for i, groups in enumerate(mine):
            if groups:
                lanes[i].append((m, where, groups))
    threads = [threading.Thread(target=_lane, args=(conf, i, work, book), name=f"lane{i}", daemon=True)
               for i, work in enumerate(lanes) if work]
    probe = nullcontext() if conf.probe_cpu is None else hostspeed.Probe(conf.probe_cpu, book.probe_file)
    try:
        with probe:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        waves.kill_all()
    if conf.probe_cpu is not None and not hostspeed.readings(book.probe_file):
        console.print(f"[bench] warning: the host-speed probe on CPU {conf.probe_cpu} wrote nothing to "
                      f"{book.probe_file}; the cells' host_us stay empty", highlight=False, markup=False)
    if book.failed:
        raise book.failed[0]
    md = book.report()
    console.print(md, highlight=False, markup=False)
    console.print(f"report in {out_dir}")


def _lane(conf: schema.BenchConf, i: int, work, book: "_Book") -> None:
    """One lane: each model's engines in waves on the lane's GPUs, one model after another."""
    lane = conf.lanes[i]
    try:
        for m, where, groups in work:
            # Engines starting together (in every lane) share the cores their compilers get.
            env = {"TORCHINDUCTOR_COMPILE_THREADS":
                   str(max(1, (os.cpu_count() or 1) // (m.engines_at_once * len(conf.lanes))))}
            if lane.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = lane.gpus
            waves.run(groups, m.engines_at_once, lambda g, m=m, w=where, env=env: book.start(g, m, w, env),
                      book.finish, conf.timeout_s, reference=(lambda g, m=m: g.config == m.paired) if m.paired else
                      None, cells=lambda g: [(c["scenario"], (c["requests"], c["tokens"])) for c in g.cells])
        book.console.print(f"[bench] lane {i} done", highlight=False, markup=False)
    except BaseException as e:  # handed to the main thread, which raises it once every lane has stopped
        book.failed.append(e)


class _Book:
    """The run's records: each engine process's handed back as it ends, and the report rewritten then."""

    def __init__(self, conf: schema.BenchConf, out_dir: Path, console: Console, command: str):
        self.conf, self.out_dir, self.console, self.command = conf, out_dir, console, command
        self.records, self.machine, self.failed = [], {}, []
        self.lock = threading.Lock()  # lanes finish engines from threads of their own
        self.when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.ctx = multiprocessing.get_context("spawn")
        self.probe_file = out_dir / "hostspeed.txt"  # the host-speed probe's readings (probe_cpu)

    def _out(self, group) -> Path:
        return self.out_dir / f".{group.model}-{group.config}-{len(group.layers)}taps.json"

    def start(self, group, m, where, env):
        from steer.bench.runs import run_group

        self._out(group).unlink(missing_ok=True)
        gpus = f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else ""
        self.console.print(f"[bold]{group.model}[/] config {group.config} ({schema.CONFIGS[group.config]}), "
                           f"taps at {len(group.layers)} layer(s), {len(group.cells)} cell(s): starting{gpus}")
        return waves.Process(self.ctx, run_group, (self.conf, m, str(where), group, str(self._out(group)), env))

    def finish(self, group, engine) -> None:
        import json

        from steer.results import write_jsonl

        out = self._out(group)
        got = json.loads(out.read_text()) if out.exists() else {"records": [], "machine": {}}
        if getattr(engine, "killed", False):
            when = "when its lane moved on" if engine.ready() else "when its start timed out"
            self.console.print(f"[bench] {group.model} {group.config}: engine process still running {when}; killed "
                               "with its process group", highlight=False, markup=False)
        # Cells the process never finished (it died, or was stopped, before they had their passes) say so.
        have = {(r["scenario"], r["requests"], r["tokens"]) for r in got["records"]}
        why = f"engine process ended with code {engine.exitcode} before this cell had its passes"
        got["records"] += [{**c, "status": "error", "detail": why} for c in group.cells
                           if (c["scenario"], c["requests"], c["tokens"]) not in have]
        out.unlink(missing_ok=True)
        hostspeed.annotate(got["records"], hostspeed.readings(self.probe_file))
        with self.lock:
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
