"""A run's directory (steer/runs/rundir.py): what a single run refused for bad input removes, and what it keeps."""

from omegaconf import OmegaConf

from steer.runs import rundir


def _started(run_dir):
    """The run-dir callback's start of a single run into `run_dir`, as Hydra calls it."""
    rundir.RunDirLock().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}}))


def test_a_refused_run_removes_its_directory_and_the_parents_it_made_only_where_empty(tmp_path):
    run = tmp_path / "outputs" / "day" / "run"
    _started(run)
    other = tmp_path / "outputs" / "day" / "other"  # a run that started beside it meanwhile
    other.mkdir()
    (other / "metrics.json").write_text("{}")
    assert rundir.discard_made(run)
    assert not run.exists() and (other / "metrics.json").read_text() == "{}"
    alone = tmp_path / "outputs2" / "day" / "run"
    _started(alone)
    assert rundir.discard_made(alone) and not (tmp_path / "outputs2").exists()


def test_a_directory_that_was_there_before_stays(tmp_path):
    run = tmp_path / "mine"
    run.mkdir()
    _started(run)
    assert not rundir.discard_made(run) and run.is_dir()
