"""The packed launcher on the HF engine (CPU): same results as the basic launcher from one engine, resume after a
kill."""

import json
import os
import signal
import subprocess
import time

import pytest

from helpers import TWO_PROMPTS, cli_env, held_cli, started, sweep_jobs as jobs, summary_rows

from hydra_plugins.steer_launcher.packed import complete

QUICK = ["gen.max_new_tokens=6", TWO_PROMPTS]
SWEEP = ["-m", "edit=add", "edit.scale=0,4", "tap.layer=1,2"]


def engine_taps(job):
    """The taps of the engine a job ran on, as its steer.log names them."""
    [line] = [x for x in (job / "steer.log").read_text().splitlines() if " - engine " in x]
    return line.split(", taps ")[1]


def test_packed_sweep_equals_unpacked_from_one_engine(cli, tmp_path, tiny_spec):
    for launcher in ("packed", "basic"):
        res = cli(SWEEP + QUICK + [f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path / launcher}"], tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    packed, basic = jobs(tmp_path / "packed"), jobs(tmp_path / "basic")
    # the packed launcher ran all 4 jobs on one engine tapping both layers; the basic one, each on its own engine
    assert {engine_taps(j) for j in packed} == {"['model.layers.1', 'model.layers.2']"}
    assert sorted(engine_taps(j) for j in basic) == ["['model.layers.1']"] * 2 + ["['model.layers.2']"] * 2
    assert len(packed) == len(basic) == 4
    for p, b in zip(packed, basic):
        assert sorted(os.listdir(p)) == sorted(os.listdir(b))
        assert (p / "results.jsonl").read_text() == (b / "results.jsonl").read_text()
        mp, mb = json.loads((p / "metrics.json").read_text()), json.loads((b / "metrics.json").read_text())
        mp.pop("tokens_per_s"), mb.pop("tokens_per_s")
        assert mp == mb
        assert (p / ".hydra" / "overrides.yaml").read_text() == (b / ".hydra" / "overrides.yaml").read_text()


def test_extractions_in_a_sweep_run_in_its_engine_group(cli, tmp_path, tiny_spec):
    """task=extract jobs are validated first and run together on one engine, like steer jobs: each writes the
    default direction at its own tap, the same as a single extraction."""
    sweep, single = tmp_path / "sweep", tmp_path / "single"
    res = cli(["-m", "task=extract", "tap.layer=1,2", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {engine_taps(j) for j in jobs(sweep)} == {"['model.layers.1', 'model.layers.2']"}
    res = cli(["task=extract", "tap.layer=2", f"hydra.run.dir={single}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    import torch
    from safetensors.torch import load_file

    vecs = [load_file(str(d / "vector.safetensors"))["direction"] for d in (sweep / "1", single)]
    assert vecs[0].shape[-1] == tiny_spec.hidden and torch.equal(*vecs)
    assert [r["vector"] for r in summary_rows(sweep)] == [str(j / "vector.safetensors") for j in jobs(sweep)]

    # Resumed: done while the vector each wrote reads as written; one removed is extracted again.
    (sweep / "0" / "vector.safetensors").unlink()
    res = cli(["-m", "task=extract", "tap.layer=1,2", f"hydra.sweep.dir={sweep}"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert f"(inputs changed: vector {sweep / '0' / 'vector.safetensors'} (gone), rerunning)" in out
    assert out.count("(complete, skipped)") == 1 and (sweep / "0" / "vector.safetensors").is_file()


@pytest.mark.parametrize("how", [["hydra/launcher=packed"], ["hydra/launcher=packed", "hydra.sweeper.max_batch_size=1"],
                                 ["hydra/launcher=basic"], ["hydra/launcher=basic", "hydra.job.chdir=true"]],
                         ids=["packed", "packed-batches-of-one", "basic", "basic-chdir"])
def test_extractions_of_a_sweep_that_share_one_file_are_refused_before_the_engine(cli, tmp_path, how):
    sweep, shared = tmp_path / "sweep", tmp_path / "v.safetensors"
    checked_first = how == ["hydra/launcher=packed"]  # the whole sweep validated before any job runs
    res = cli(["-m", "task=extract", "tap.layer=1,2", f"extract.out={shared}", f"hydra.sweep.dir={sweep}"] + how,
              tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert f"error extract.out: job #0 of this sweep writes {shared} too, and each writes the whole file" in out
    assert "(each job's directory)" in out
    # #1 is refused before its engine starts; unless the sweep was checked first, #0 has run and holds the file.
    assert (sweep / "1" / "error.txt").read_text().startswith(f"extract.out: job #0 of this sweep writes {shared}")
    assert not (sweep / "1" / "metrics.json").exists()
    assert shared.exists() != checked_first
    # Run again into the same directory with a file each, #1 now writing the file #0 held: that hold is gone.
    other = tmp_path / "u.safetensors"
    res = cli(["-m", "task=extract", "tap.layer=1", f"extract.out={other},{shared}", f"hydra.sweep.dir={sweep}"]
              + how, tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert other.is_file() and shared.is_file()

    # A path that does not resolve is bad input like any other: named, before any engine starts.
    bad = str(tmp_path / "w${tap.layr}.safetensors")
    res = cli(["-m", "task=extract", f"extract.out={tmp_path / 'w.safetensors'},'{bad}'",
               f"hydra.sweep.dir={tmp_path / 'sweep2'}"] + how, tmp_path)
    assert res.returncode == 2 and (tmp_path / "w.safetensors").exists() != checked_first, res.stderr[-3000:]
    assert "error extract.out: Interpolation key 'tap.layr' not found" in res.stderr


def test_a_finished_extraction_skipped_on_resume_still_holds_its_file(cli, tmp_path):
    sweep, shared = tmp_path / "sweep", tmp_path / "v.safetensors"
    res = cli(["-m", "task=extract", "tap.layer=1", f"extract.out={shared}", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    written = shared.read_bytes()
    # The sweep extended: #0 is done and skipped, #1 would write #0's file over
    res = cli(["-m", "task=extract", "tap.layer=1,2", f"extract.out={shared}", f"hydra.sweep.dir={sweep}"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "(complete, skipped)" in out, out[-3000:]
    assert f"error extract.out: job #0 of this sweep writes {shared} too" in out
    assert shared.read_bytes() == written


def test_every_bad_job_of_a_sweep_is_named_before_any_engine_starts(cli, tmp_path, tiny_spec):
    import torch

    from steer.edits import vector

    good, nan, wide = (tmp_path / f"{n}.safetensors" for n in ("good", "nan", "wide"))
    vector.save(good, {"direction": torch.randn(tiny_spec.hidden)}, model="tiny", tap="layer1", method="m")
    vector.save(nan, {"direction": torch.full((tiny_spec.hidden,), float("nan"))}, model="tiny", tap="layer1",
                method="m")
    vector.save(wide, {"direction": torch.randn(tiny_spec.hidden + 1)}, model="tiny", tap="layer1", method="m")
    res = cli(["-m", f"edit.vector.path={good},{nan},{wide}", *QUICK, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
              tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "2 of 3 jobs have bad input (#1, #2;" in res.stderr
    assert "no engine started, none of the sweep's jobs ran" in res.stderr
    assert "nan" in res.stderr and f"shape [{tiny_spec.hidden + 1}]" in res.stderr  # each job's own error
    assert not (tmp_path / "sweep" / "0" / "metrics.json").exists()


def test_a_second_engine_group_runs_in_a_process_of_its_own(cli, tmp_path, tiny_spec):
    sweep = tmp_path / "sweep"  # vLLM settings tell the groups apart, which the HF engine then ignores: cheap
    res = cli(["-m", "vllm.max_model_len=null,512", *QUICK, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 jobs to run in 2 engine group(s)" in res.stdout + res.stderr
    pids = [int(line.split(" in pid ")[1].split(",")[0]) for j in jobs(sweep)
            for line in (j / "steer.log").read_text().splitlines() if " - engine " in line]
    assert all(complete(j) for j in jobs(sweep)) and len(set(pids)) == 2


def test_killed_sweep_resumes_only_missing_jobs(cli, tmp_path, cache_dir):
    sweep = tmp_path / "sweep"
    args = ["-m", "edit=add", "edit.scale=0,2,4,8", "tap.layer=1,2", *QUICK, "hydra.launcher.pack_size=1",
            f"hydra.sweep.dir={sweep}"]
    env = cli_env(cache_dir)
    # The fourth job waits for the kill (held_cli), so it lands part way on any machine
    with started(held_cli(3, [*args, "progress=false"]), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL) as proc:
        deadline = time.time() + 300
        while time.time() < deadline and sum(complete(j) for j in jobs(sweep)) < 3 and proc.poll() is None:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = {j.name: (j / "metrics.json").stat().st_mtime_ns for j in jobs(sweep) if complete(j)}
    assert 3 <= len(done) < 8, "the sweep should have been stopped part way"
    res = cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(complete(j) for j in jobs(sweep)) and len(jobs(sweep)) == 8
    for name, mtime in done.items():  # finished jobs were not run again
        assert (sweep / name / "metrics.json").stat().st_mtime_ns == mtime
    assert (res.stdout + res.stderr).count("(complete, skipped)") == len(done)
    assert f"{8 - len(done)} jobs to run" in res.stdout + res.stderr
    assert [r["job"] for r in summary_rows(sweep)] == [str(i) for i in range(8)]


def test_force_reruns_complete_jobs(cli, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "edit.scale=0,4", *QUICK, f"hydra.sweep.dir={sweep}"]
    assert cli(args, tmp_path).returncode == 0
    res = cli(args + ["hydra.launcher.force=true"], tmp_path)
    assert res.returncode == 0 and "2 jobs to run" in res.stdout + res.stderr


def test_half_written_job_is_not_complete(tmp_path):
    (tmp_path / "results.jsonl").write_text("{}\n")
    assert not complete(tmp_path)
    (tmp_path / "metrics.json").write_text("{}")
    assert complete(tmp_path)


def test_bad_job_fails_the_sweep_before_any_engine_starts(cli, tmp_path):
    res = cli(["-m", "tap.layer=1,9", *QUICK, f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path)
    assert res.returncode != 0 and "layer 9 is out of range" in res.stderr
    assert "Loading weights" not in res.stderr and not list(tmp_path.rglob("results.jsonl"))


def test_submitit_local_runs_each_job_in_its_own_process(cli, tmp_path):
    sweep = tmp_path / "sweep"
    res = cli(["-m", "hydra/launcher=local_procs", "edit.scale=0,4", *QUICK, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [complete(j) for j in jobs(sweep)] == [True, True]
    assert [r["job"] for r in summary_rows(sweep)] == ["0", "1"]
