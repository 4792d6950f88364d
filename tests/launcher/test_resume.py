"""The packed launcher's resume, failed jobs and Ctrl-C, on the HF engine (CPU)."""

import json
import os
import signal
import time
from pathlib import Path

from helpers import (TWO_PROMPTS, cli_env, compose_conf, held_cli, on_tiny, started, summary_rows as summary,
                     sweep_jobs as jobs)

from hydra_plugins.steer_launcher import packed
from steer.runs import inputs
from steer.runs.report import build
from hydra_plugins.steer_launcher.packed import complete

QUICK = ["engine=hf", "gen.max_new_tokens=4", TWO_PROMPTS]


def _cfg(*overrides):
    return compose_conf("config", on_tiny(overrides))


def test_config_changes_names_what_differs_and_ignores_progress(tmp_path):
    from omegaconf import OmegaConf

    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(_cfg("tap.layer=1", "edit.scale=4"), tmp_path / ".hydra" / "config.yaml")
    assert packed.config_changes(tmp_path, _cfg("tap.layer=1", "edit.scale=4")) is None
    assert packed.config_changes(tmp_path, _cfg("tap.layer=1", "edit.scale=4", "progress=false")) is None
    assert packed.config_changes(tmp_path, _cfg("tap.layer=2", "edit.scale=4")) == "tap.layer 1 -> 2"
    changed = packed.config_changes(tmp_path, _cfg("tap.layer=2", "edit.scale=0"))
    assert changed == "tap.layer 1 -> 2, edit.scale 4.0 -> 0.0"
    assert packed.config_changes(tmp_path, _cfg("+experiment=joy_two_taps", "tap.layer=1", "edit.scale=4")).startswith(
        "extra_edits [] -> ")
    OmegaConf.save(_cfg("+experiment=joy_two_taps"), tmp_path / ".hydra" / "config.yaml")
    changed = packed.config_changes(tmp_path, _cfg("+experiment=joy_two_taps", "extra_edits.0.edit.scale=3"))
    assert changed.startswith("extra_edits.0.edit.scale ") and changed.endswith(" -> 3.0")  # as an override names it
    assert packed.config_changes(tmp_path / "nope", _cfg()) == "no saved config"


def test_a_jobs_settings_are_as_it_resolves_them(tmp_path, tiny_spec):
    """"auto" extraction settings read pairs that are not A/B items as mean over all: a job saved with those
    values has the settings of one that says auto, and one of A/B items has others. A prompts file's content is
    part of them."""
    ab = tmp_path / "ab.json"
    ab.write_text(json.dumps([{"question": "Good?\n (A) Yes\n (B) No", "answer_matching_behavior": "(A)",
                               "answer_not_matching_behavior": "(B)"}] * 2))
    plain = tmp_path / "pairs.jsonl"
    plain.write_text('{"positive": "glad", "negative": "sad"}\n')
    for pairs, same in ((plain, True), (ab, False)):
        old = _cfg(f"prompts.pairs_file={pairs}", "extract.position=mean", "extract.span=all")  # the old defaults
        assert (packed.settings_of(old) == packed.settings_of(_cfg(f"prompts.pairs_file={pairs}"))) == same
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The weather today is\n")
    before = packed.settings_of(_cfg(f"prompts.steer_file={prompts}"))
    assert packed.settings_of(_cfg(f"prompts.steer_file={prompts}")) == before
    prompts.write_text("The music in the hall was\n")
    assert before is not None and packed.settings_of(_cfg(f"prompts.steer_file={prompts}")) != before


def test_resume_says_what_it_finds_in_a_job_dir(tmp_path, tiny_spec):
    from omegaconf import OmegaConf

    cfg = _cfg("tap.layer=1")
    assert packed.resume_note(tmp_path / "new", cfg) == ""  # a first run says nothing
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    assert packed.resume_note(tmp_path, cfg) == " (unfinished before, rerunning)"  # set up, stopped before metrics
    (tmp_path / "error.txt").write_text("boom")
    assert packed.resume_note(tmp_path, cfg) == " (failed before, rerunning)"
    (tmp_path / "metrics.json").write_text("{}")
    # complete, the same config, but no record of what it read (written before inputs.json was): run again
    assert packed.resume_note(tmp_path, cfg) == " (inputs changed: no record of its inputs, rerunning)"
    inputs.write(tmp_path, {}, {"kind": "tiny", "source": None, "revision": None})
    assert packed.resume_note(tmp_path, cfg) == " (no record of its settings, rerunning)"  # recorded before they were
    inputs.write(tmp_path, {}, {"kind": "tiny", "source": None, "revision": None}, {}, packed.settings_of(cfg))
    assert packed.resume_note(tmp_path, cfg) is None  # complete, the same settings and inputs: skipped
    assert packed.resume_note(tmp_path, _cfg("tap.layer=2")) == " (config changed: tap.layer 1 -> 2, rerunning)"
    assert packed.resume_note(tmp_path, cfg, force=True) == ""
    for damaged in ('{"kl_mean": 0.2', "[1, 2]", ""):  # cut short by hand or by the disk: rerun, not a traceback
        (tmp_path / "metrics.json").write_text(damaged)
        assert packed.resume_note(tmp_path, cfg) == " (its metrics.json is damaged, rerunning)"
        (tmp_path / "sweep" / "0").mkdir(parents=True, exist_ok=True)
        (tmp_path / "sweep" / "0" / "metrics.json").write_text(damaged)
        assert [r["status"] for r in build(tmp_path / "sweep")["rows"]] == ["failed"]  # the report says so

def test_resume_reruns_jobs_whose_config_changed(cli, tmp_path, tiny_spec):
    sweep = tmp_path / "sweep"
    args = ["-m", "edit.scale=0,4", *QUICK, f"hydra.sweep.dir={sweep}"]
    assert cli(args + ["tap.layer=1"], tmp_path).returncode == 0
    res = cli(args + ["tap.layer=2"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(complete, skipped)" not in out and "2 jobs to run" in out
    assert out.count("(config changed: tap.layer 1 -> 2, rerunning)") == 2
    rows = summary(sweep)
    assert [r["tap.layer"] for r in rows] == ["2", "2"]
    for r, j in zip(rows, jobs(sweep)):  # the summary is the jobs' results, made with the config they hold
        assert "layer: 2" in (j / ".hydra" / "config.yaml").read_text()
        assert float(r["kl_mean"]) == json.loads((j / "metrics.json").read_text())["kl_mean"]
    res = cli(args + ["tap.layer=2"], tmp_path)  # the same sweep again: nothing to do
    assert res.returncode == 0 and (res.stdout + res.stderr).count("(complete, skipped)") == 2


def test_a_value_added_to_a_sweep_runs_that_job_alone(cli, tmp_path, tiny_spec):
    """Resume goes by settings, not job numbers: `edit.scale=2,4` then `2,3,4` runs scale 3 alone; scale 4's job,
    number 1 before and 2 now, is moved to its new directory with its results."""
    sweep = tmp_path / "sweep"
    args = [*QUICK, "tap.layer=1", f"hydra.sweep.dir={sweep}"]
    assert cli(["-m", "edit.scale=2,4", *args], tmp_path).returncode == 0
    four = json.loads((sweep / "1" / "metrics.json").read_text())
    res = cli(["-m", "edit.scale=2,3,4", *args], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "1 jobs to run" in out and out.count("(complete, skipped)") == 2
    assert json.loads((sweep / "2" / "metrics.json").read_text()) == four
    assert [r["edit.scale"] for r in summary(sweep)] == ["2", "3", "4"]
    assert "scale: 3.0" in (sweep / "1" / ".hydra" / "config.yaml").read_text()
    assert "scale: 4.0" in (sweep / "2" / ".hydra" / "config.yaml").read_text()


def test_resume_reruns_jobs_whose_vector_file_was_rewritten(cli, tmp_path, tiny_spec):
    import torch
    from safetensors.torch import save_file

    sweep, vec = tmp_path / "sweep", tmp_path / "v.safetensors"
    save_file({"direction": torch.ones(tiny_spec.hidden)}, str(vec))
    args = ["-m", "edit.scale=1,2", *QUICK, f"edit.vector.path={vec}", f"hydra.sweep.dir={sweep}"]
    assert cli(args, tmp_path).returncode == 0
    before = [json.loads((j / "metrics.json").read_text()) for j in jobs(sweep)]
    save_file({"direction": -50 * torch.ones(tiny_spec.hidden)}, str(vec))  # the same path, another vector
    res = cli(args, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "(complete, skipped)" not in out and out.count(f"(inputs changed: vector {vec}, rerunning)") == 2
    after = [json.loads((j / "metrics.json").read_text()) for j in jobs(sweep)]
    assert all(a["proj_steered"] != b["proj_steered"] for a, b in zip(after, before))
    res = cli(args, tmp_path)  # and nothing changed since: both done
    assert res.returncode == 0 and (res.stdout + res.stderr).count("(complete, skipped)") == 2


def _prompts_file_sweep(cli, tmp_path, text):
    """A two-job sweep on the HF engine reading its prompts from a file holding `text`, run once: (sweep dir,
    prompts file, the command's arguments)."""
    sweep, prompts = tmp_path / "sweep", tmp_path / "prompts.txt"
    prompts.write_text(text)
    args = ["-m", "edit.scale=1,2", "engine=hf", "gen.max_new_tokens=4", f"prompts.steer_file={prompts}",
            f"hydra.sweep.dir={sweep}"]
    assert cli(args, tmp_path).returncode == 0
    return sweep, prompts, args


def _resumed(cli, tmp_path, args, rerun: str) -> None:
    """Resumed: every job reruns saying `rerun`; resumed again: every job is done."""
    res = cli(args, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "(complete, skipped)" not in out and out.count(rerun) == 2
    res = cli(args, tmp_path)
    assert res.returncode == 0 and (res.stdout + res.stderr).count("(complete, skipped)") == 2


def test_resume_reruns_jobs_whose_prompts_file_was_edited(cli, tmp_path):
    sweep, prompts, args = _prompts_file_sweep(cli, tmp_path, "The weather today is\nMy favourite food is\n")
    prompts.write_text("The weather today is\nThe music in the hall was\n")  # the same path, one prompt changed
    _resumed(cli, tmp_path, args, f"(inputs changed: data file {prompts}, rerunning)")
    for j in jobs(sweep):  # the results are the edited file's prompts
        rows = [json.loads(line) for line in (j / "results.jsonl").read_text().splitlines()]
        assert [r["prompt"] for r in rows] == ["The weather today is", "The music in the hall was"]


def test_resume_reruns_jobs_whose_record_predates_data_fingerprints(cli, tmp_path):
    sweep, prompts, args = _prompts_file_sweep(cli, tmp_path, "The weather today is\n")
    for j in jobs(sweep):  # as a job recorded its inputs before data files were fingerprinted
        record = json.loads((j / "inputs.json").read_text())
        assert record.pop("data") == {str(prompts): inputs.digest(prompts)}
        (j / "inputs.json").write_text(json.dumps(record))
    _resumed(cli, tmp_path, args, f"(inputs changed: data file {prompts} (not fingerprinted), rerunning)")


def _stand_in_jobs(tmp_path, n):
    from types import SimpleNamespace

    from steer.config.schema import Task

    js = [SimpleNamespace(cfg=SimpleNamespace(progress=False, task=Task.steer), out_dir=tmp_path / str(i))
          for i in range(n)]
    for j in js:
        j.out_dir.mkdir()
    return js


def test_run_group_fails_a_pack_that_raises_and_runs_the_next(tmp_path, monkeypatch):
    from contextlib import nullcontext

    from steer.runs import job
    from steer.runs import run

    js = _stand_in_jobs(tmp_path, 4)
    engine = object()

    def run_jobs(pack, console, on_done=None, summary=None, engine=None, say=None):
        assert engine is held  # every pack runs on the group's one engine
        if js[0] in pack:
            raise RuntimeError("the engine failed mid-pack")
        return [run.Outcome({"kl_mean": 1.0}) for _ in pack]

    held = engine
    monkeypatch.setattr(job, "engine_for", lambda jobs: nullcontext(engine))
    monkeypatch.setattr(run, "run_jobs", run_jobs)
    out = packed.run_group(js, 2)
    assert out == [{"error": "RuntimeError: the engine failed mid-pack"}] * 2 + [{"kl_mean": 1.0}] * 2
    assert "RuntimeError: the engine failed mid-pack" in (js[0].out_dir / "error.txt").read_text()
    assert not (js[2].out_dir / "error.txt").exists()


def test_run_group_fails_every_job_when_its_engine_does_not_start(tmp_path, monkeypatch):
    from steer.runs import job

    js = _stand_in_jobs(tmp_path, 3)

    def engine_for(jobs):
        raise RuntimeError("engine did not start")

    monkeypatch.setattr(job, "engine_for", engine_for)
    assert packed.run_group(js, 2) == [{"error": "RuntimeError: engine did not start"}] * 3
    assert all((j.out_dir / "error.txt").is_file() for j in js)


def test_a_group_whose_process_dies_fails_its_jobs_and_the_sweep_goes_on(tmp_path):
    import threading

    from helpers import DiesWhenRun

    js = [DiesWhenRun(tmp_path / str(i)) for i in range(2)]
    for j in js:
        j.out_dir.mkdir()
    out = []
    t = threading.Thread(target=lambda: out.append(packed._in_own_process(js, 2)), daemon=True)
    t.start()
    t.join(120)
    assert out, "the launcher still waits for a group whose process was killed"
    assert [m["error"] for m in out[0]] == ["RuntimeError: the process running this engine group ended (exit code "
                                            "-9) before it reported its jobs"] * 2
    assert all("exit code -9" in (j.out_dir / "error.txt").read_text() for j in js)


def test_a_group_whose_process_dies_leaving_a_child_is_ended_whole(tmp_path):
    import time

    from helpers import DiesLeavingAChild

    job = DiesLeavingAChild(tmp_path)
    t0 = time.monotonic()
    out = packed._in_own_process([job], 1)
    assert time.monotonic() - t0 < 60, "the launcher waited for the child that holds the group's pipe"
    assert "before it reported its jobs" in out[0]["error"]
    pid = int((tmp_path / "child.pid").read_text())
    status, deadline = Path(f"/proc/{pid}/status"), time.monotonic() + 10  # SIGKILL is sent, not yet taken
    while time.monotonic() < deadline and status.exists() and "zombie" not in status.read_text():
        time.sleep(0.1)
    assert not status.exists() or "zombie" in status.read_text(), "the group's engine core outlived it"


def test_a_group_whose_jobs_cannot_reach_its_process_fails_them(tmp_path):
    class Unpicklable:  # a test's own class: a spawned process cannot import it
        out_dir = tmp_path

    out = packed._in_own_process([Unpicklable()], 1)
    assert out[0]["error"].startswith(("AttributeError", "PicklingError"))
    assert "pickle" in (tmp_path / "error.txt").read_text()


def test_a_group_whose_process_raises_fails_its_jobs_with_the_error(tmp_path):
    from helpers import RaisesWhenRun

    js = [RaisesWhenRun(tmp_path / str(i)) for i in range(2)]
    for j in js:
        j.out_dir.mkdir()
    out = packed._in_own_process(js, 2)
    assert [m["error"].splitlines()[0] for m in out] == [
        "RuntimeError: the process running this engine group raised ValueError: no config here"] * 2
    assert all("Traceback" in (j.out_dir / "error.txt").read_text() for j in js)


def test_a_validated_job_crosses_into_a_spawned_process(tmp_path, cache_dir, tiny_spec):
    import pickle

    from helpers import compose
    from steer.tasks.registry import prepare

    job = prepare(compose("tap.path=model.layers.1.mlp"), tmp_path)
    assert job.spec.outputs and pickle.loads(pickle.dumps(job)).spec.outputs == job.spec.outputs


def test_failed_job_keeps_its_pack_fails_the_sweep_and_reruns_on_resume(cli, tmp_path, tiny_spec):
    sweep = tmp_path / "sweep"
    (sweep / "1" / "results.jsonl").mkdir(parents=True)  # job 1 cannot write its results: it fails after generating
    args = ["-m", "edit.scale=0,2,4,8", *QUICK, f"hydra.sweep.dir={sweep}"]
    res = cli(args, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert [complete(j) for j in jobs(sweep)] == [True, False, True, True]  # the rest of its pack finished
    assert (sweep / "1" / "error.txt").is_file()
    assert out.count("#1 : edit.scale=2") == 2 and "#1 : edit.scale=2 engine=hf" in out  # set up; failed: once
    assert len([line for line in out.splitlines() if "(failed: IsADirectoryError" in line]) == 1
    assert "1 of 4 jobs failed" in res.stderr and "Traceback" not in res.stderr
    rows = summary(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "ok"), ("1", "failed"), ("2", "ok"), ("3", "ok")]
    assert rows[1]["error"].startswith("IsADirectoryError") and rows[1]["kl_mean"] == ""

    (sweep / "1" / "results.jsonl").rmdir()
    res = cli(args, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert out.count("(complete, skipped)") == 3 and out.count("(failed before, rerunning)") == 1
    assert all(complete(j) for j in jobs(sweep)) and not (sweep / "1" / "error.txt").exists()
    assert [r["status"] for r in summary(sweep)] == ["ok"] * 4


def test_ctrl_c_keeps_finished_jobs_writes_their_summary_and_exits_130(tmp_path, cache_dir, tiny_spec):
    sweep = tmp_path / "sweep"
    # Packs of 2: a pack of one job prints its run's tables, as a single run does.
    args = ["-m", "edit.scale=0,2,4,8", "tap.layer=1,2", *QUICK, "hydra.launcher.pack_size=2",
            f"hydra.sweep.dir={sweep}", "progress=false"]
    env = cli_env(cache_dir)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        # Ctrl-C reaches the whole foreground process group; SIGINT must not be inherited as ignored.
        # The second pack waits for the stop (held_cli), so the stop lands part way on any machine
        with started(held_cli(1, args), cwd=tmp_path, env=env, stdout=out, stderr=err,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
            deadline = time.time() + 300
            while time.time() < deadline and not any(complete(j) for j in jobs(sweep)) and proc.poll() is None:
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=300)
    stderr = (tmp_path / "err").read_text()
    finished = [j.name for j in jobs(sweep) if complete(j)]
    assert 1 <= len(finished) < 8, "the sweep should have been stopped part way"
    assert rc == 130, stderr[-3000:]
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 5, stderr
    assert stderr.splitlines()[-1] == (f"interrupted: {len(finished)} of 8 jobs finished; "
                                       f"summary written to {sweep / 'summary.csv'}")
    assert [r["job"] for r in summary(sweep)] == finished and all(r["status"] == "ok" for r in summary(sweep))
    assert not list(sweep.rglob(".*.json*"))  # no temporary file left behind
