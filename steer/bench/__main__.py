"""`python -m steer.bench`: every configuration, scenario, model and batch of conf/bench.yaml in one run.

    python -m steer.bench                                   # the full run (a GPU machine with vLLM)
    python -m steer.bench run=[tiny] batches=[[64,128]]     # a smaller one
    python -m steer.bench 'skip=[llama3_8b/e/*]'            # leave cells out (reported as not run)

Each engine configuration runs in a process of its own; the report (bench.md, bench.csv, bench.png) lands in the
run directory and is rewritten after every engine, so a run cut short keeps what it measured.
"""

import multiprocessing
import sys
from datetime import datetime, timezone
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from steer.bench import schema
from steer.errors import ConfigError

schema.register()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="bench")
def app(cfg: DictConfig) -> None:
    console = Console(stderr=True, soft_wrap=True)
    conf = OmegaConf.to_object(cfg)
    command = " ".join(["python -m steer.bench", *HydraConfig.get().overrides.task])
    try:
        run(conf, Path(HydraConfig.get().runtime.output_dir), console, command)
    except ConfigError as e:
        console.print(f"[bold red]error[/] {escape(str(e))}", highlight=False)
        sys.exit(2)


def run(conf: schema.BenchConf, out_dir: Path, console: Console, command: str) -> None:
    import json

    from steer.bench import report, workload
    from steer.bench.runs import plan_groups, run_group
    from steer.engine.vllm import available
    from steer.results import write_jsonl

    workload.check(conf)
    if not available():
        raise ConfigError("engine", "steer.bench runs vLLM: it needs CUDA and vLLM (pip install -e '.[vllm]')")
    records, machine = [], {}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    ctx = multiprocessing.get_context("spawn")
    for name in conf.run:
        m = conf.models[name]
        where = workload.model_dir(m, conf.cache_dir)
        layers = workload.spec(m, name, where).layers
        for group in plan_groups(conf, name, layers):
            todo = []
            for cell in group.cells:
                pattern = workload.skipped(conf, name, group.config, cell["scenario"],
                                           (cell["requests"], cell["tokens"]))
                if pattern:
                    records.append({**cell, "model": name, "config": group.config, "status": "skipped",
                                    "detail": f"skip pattern {pattern!r}"})
                else:
                    todo.append(cell)
            if not todo:
                continue
            group.cells = todo
            out = out_dir / f".{name}-{group.config}-{len(group.layers)}taps.json"
            console.print(f"[bold]{name}[/] config {group.config} ({schema.CONFIGS[group.config]}), "
                          f"taps at {len(group.layers)} layer(s), {len(todo)} cell(s)")
            p = ctx.Process(target=run_group, args=(conf, m, str(where), group, str(out)))
            p.start()
            p.join(conf.timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
            got = json.loads(out.read_text()) if out.exists() else None
            if got is None:
                why = f"engine process ended with code {p.exitcode} and no records"
                got = {"records": [{**c, "status": "error", "detail": why} for c in todo], "machine": {}}
            out.unlink(missing_ok=True)
            machine = got["machine"] or machine
            records += [{**r, "model": name, "config": group.config} for r in got["records"]]
            write_jsonl(out_dir / "records.jsonl", records)
            _report(records, conf, machine, when, command, out_dir)
    md = _report(records, conf, machine, when, command, out_dir)
    console.print(md, highlight=False, markup=False)
    console.print(f"report in {out_dir}")


def _report(records, conf, machine, when, command, out_dir) -> str:
    from steer.bench import report

    rows = report.cells(records, conf)
    goals = report.targets(rows, conf)
    md = report.markdown(rows, goals, conf, machine, when, command)
    report.write(out_dir, rows, goals, md, conf)
    return md


if __name__ == "__main__":
    app()
