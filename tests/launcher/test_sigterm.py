"""SIGTERM on a sweep (a job scheduler's stop, `kill`) does what Ctrl-C does: the jobs that finished are kept, their
summary is written, the last line says so, and the sweep exits 130; no process of it is left behind."""

import os
import signal
import time

import pytest

from helpers import TWO_PROMPTS, cli_env, held_cli, started, summary_rows, sweep_jobs
from hydra_plugins.steer_launcher.packed import complete


@pytest.mark.parametrize("launcher, said", [
    # packs of 2: a stop between packs keeps the packs done
    (["hydra.launcher.pack_size=2"], "interrupted: {done} of 8 jobs finished; summary written to {summary}"),
    (["hydra/launcher=basic"], "interrupted: {done} job{s} finished; summary written to {summary}"),
], ids=["packed", "basic"])
def test_sigterm_stops_a_sweep_as_ctrl_c_does(launcher, said, tmp_path, cache_dir, tiny_spec):
    sweep = tmp_path / "sweep"
    args = ["-m", "edit.scale=0,2,4,8", "tap.layer=1,2", "engine=hf", "gen.max_new_tokens=4", TWO_PROMPTS,
            *launcher,
            f"hydra.sweep.dir={sweep}", "progress=false"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        with started(held_cli(1, args), cwd=tmp_path, env=cli_env(cache_dir),
                     stdout=out, stderr=err) as proc:
            deadline = time.time() + 400
            while time.time() < deadline and not any(complete(j) for j in sweep_jobs(sweep)) and proc.poll() is None:
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler or `kill -- -PGID` sends it
            rc = proc.wait(timeout=300)
            deadline = time.time() + 30
            while time.time() < deadline:  # the group empties once its last process has ended
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("a process of the sweep outlived it")
    stderr = (tmp_path / "err").read_text()
    finished = [j.name for j in sweep_jobs(sweep) if complete(j)]
    assert 1 <= len(finished) < 8, "the sweep should have been stopped part way"
    assert rc == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr
    assert stderr.splitlines()[-1] == said.format(done=len(finished), s="" if len(finished) == 1 else "s",
                                                 summary=sweep / "summary.csv"), stderr[-2000:]
    rows = summary_rows(sweep)
    assert [r["job"] for r in rows if r["status"] == "ok"] == finished
