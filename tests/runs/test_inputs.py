"""A job's inputs beside its config (steer/runs/inputs.py): what a resume re-reads to tell a finished job from a stale
one."""

import json
import os

import torch
from helpers import compose
from safetensors.torch import save_file

from steer.runs import inputs
from steer.runs.extract import Recipe
from steer.models.spec import spec as model_spec


TINY = {"kind": "tiny", "source": None, "revision": None}  # the tiny model's record: no files to read


def _vector(path, seed):
    save_file({"direction": torch.randn(64, generator=torch.Generator().manual_seed(seed))}, str(path))


def test_a_rewritten_or_missing_vector_file_is_named_and_an_untouched_one_is_not(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _vector(a, 0)
    _vector(b, 1)
    cfg = compose(f"edit.vector.path={a}", f"+extra_edits=[{{tap:{{layer:0}},edit:{{vector:{{path:'{b}'}}}}}}]")
    digests = inputs.vectors(cfg)
    assert list(digests) == [str(a), str(b)] and None not in digests.values()
    recorded = {"vectors": digests, "model": {"kind": "tiny", "source": None, "revision": None}}
    assert inputs.changes(recorded) is None
    _vector(b, 2)
    assert inputs.changes(recorded) == f"vector {b}"
    a.unlink()
    assert inputs.changes(recorded) == f"vector {a} (gone), vector {b}"


def test_an_edited_or_missing_data_file_or_datasets_directory_is_named(tmp_path):
    import datasets

    txt, pairs, saved = tmp_path / "prompts.txt", tmp_path / "pairs.jsonl", tmp_path / "saved"
    txt.write_text("one\ntwo\n")
    pairs.write_text('{"positive": "a", "negative": "b"}\n')
    datasets.Dataset.from_dict({"text": ["x", "y"]}).save_to_disk(str(saved))
    cfg = compose(f"prompts.steer_file={txt}", f"prompts.pairs_file={pairs}")
    assert inputs.data_paths(cfg)[:2] == [str(txt), str(pairs)]
    recorded = {"data": inputs.data([str(txt), str(pairs), str(saved), None]), "model": TINY}
    assert list(recorded["data"]) == [str(txt), str(pairs), str(saved)] and None not in recorded["data"].values()
    assert inputs.changes(recorded) is None
    txt.write_text("one\nthree\n")
    assert inputs.changes(recorded) == f"data file {txt}"
    datasets.Dataset.from_dict({"text": ["x", "z"]}).save_to_disk(str(saved))  # saved again over it
    pairs.unlink()
    assert inputs.changes(recorded) == f"data file {txt}, data file {pairs} (gone), data file {saved}"


def test_a_record_without_data_fingerprints_cannot_vouch_for_the_data_files_its_config_names(tmp_path):
    txt = tmp_path / "prompts.txt"
    txt.write_text("one\n")
    old = {"vectors": {}, "model": TINY}  # written before data files were fingerprinted
    named = inputs.data_paths(compose(f"prompts.steer_file={txt}"))
    assert inputs.changes(old, named) == f"data file {txt} (not fingerprinted)"
    assert inputs.changes(old, inputs.data_paths(compose())) is None  # the built-in prompts: nothing to vouch for
    assert inputs.changes({**old, "data": inputs.data(named)}, named) is None


def test_task_eval_fingerprints_its_ab_dataset_shipped_or_a_path(tmp_path):
    from steer.runs.data import dataset_path
    from steer.tasks import registry

    assert registry.data_paths(compose("task=eval"))[-1] == str(dataset_path("optimism"))
    assert inputs.data(registry.data_paths(compose("task=eval")))[str(dataset_path("optimism"))] is not None
    mine = tmp_path / "mine.json"
    assert registry.data_paths(compose("task=eval", f"eval.dataset={mine}"))[-1] == str(mine)
    assert registry.data_paths(compose()) == []  # the built-in prompts: no file


def test_the_default_direction_and_an_extraction_read_no_vector_file(tmp_path, cache_dir):
    from steer.tasks import registry

    assert inputs.vectors(compose()) == {}
    v = tmp_path / "v.safetensors"  # an extraction writes its vector: an edit's file, set or not, it does not read
    v.write_bytes(b"")
    assert registry.prepare(compose("task=extract", f"edit.vector.path={v}", f"cache_dir={cache_dir}"),
                            tmp_path).vectors == {}


def test_a_local_checkpoint_changed_in_place_is_named(tmp_path, tiny_spec, cache_dir):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_spec.source, ckpt)
    cfg = compose(f"model.source={ckpt}", f"cache_dir={cache_dir}")
    spec = model_spec(cfg.model, cfg.cache_dir)
    recorded = {"vectors": {}, "model": inputs.model(cfg, spec)}
    assert recorded["model"]["kind"] == "dir" and "config.json" in recorded["model"]["files"]
    assert inputs.changes(json.loads(json.dumps(recorded))) is None  # as read back from inputs.json
    weights = next(ckpt.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # retrained: same size, newer
    assert inputs.changes(recorded) == f"model {ckpt}"


def test_a_hub_model_is_named_once_its_revision_resolves_to_another_cached_snapshot(tmp_path, monkeypatch):
    from steer.runs.inputs import _model

    repo = tmp_path / "hub" / "models--org--name"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(json.dumps({"commit": commit}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    recorded = _model("hub", "org/name", None)
    assert recorded["snapshot"].endswith("a" * 40) and "config.json" in recorded["files"]
    assert inputs.changes({"model": recorded}) is None
    (repo / "refs" / "main").write_text("b" * 40)  # the hub's newer snapshot fetched into the cache
    assert inputs.changes({"model": recorded}) == "model org/name"


def test_a_job_dir_without_inputs_json_counts_as_changed(tmp_path):
    assert inputs.recorded_changes(tmp_path) == "no record of its inputs"
    inputs.write(tmp_path, {}, {"kind": "tiny", "source": None, "revision": None})
    assert inputs.recorded_changes(tmp_path) is None


def test_a_vector_file_is_read_once_while_it_stays_as_it_was(tmp_path):
    from steer.runs.inputs import _sha256_of, digest

    a = tmp_path / "a.safetensors"
    _vector(a, 0)
    first = digest(a)
    misses = _sha256_of.cache_info().misses
    assert [digest(a) for _ in range(100)] == [first] * 100 and _sha256_of.cache_info().misses == misses
    _vector(a, 1)  # rewritten: a new identity or time, read again
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert digest(a) != first and _sha256_of.cache_info().misses == misses + 1


def test_a_checkpoint_saved_in_place_while_its_job_runs_reads_as_changed(tmp_path, tiny_spec, cache_dir,
                                                                         monkeypatch):
    import io
    import shutil

    from rich.console import Console

    from steer.runs import run
    from steer.tasks import registry

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_spec.source, ckpt)
    cfg = compose(f"model.source={ckpt}", "model.name=mine", f"cache_dir={cache_dir}", "engine=hf",
                  "gen.max_new_tokens=2", "prompts.steer=['Hi there']", "progress=false")
    score = run._score

    def score_then_save(*args):  # the trainer saves a checkpoint into the directory while the job scores
        rows = score(*args)
        weights = next(ckpt.glob("*.safetensors"))
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return rows

    monkeypatch.setattr(run, "_score", score_then_save)
    (tmp_path / "job").mkdir()
    registry.main(cfg, tmp_path / "job", Console(file=io.StringIO()))
    assert inputs.recorded_changes(tmp_path / "job") == f"model {ckpt}"


def test_a_hub_models_record_holds_the_files_its_engine_fetched(tmp_path, monkeypatch, tiny_spec):
    from contextlib import contextmanager

    from steer.runs import job as job_mod
    from steer.runs.job import Job

    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")  # what validation's config read left there
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    @contextmanager
    def fetching_engine(*args):  # the engine's start downloads the weights into the snapshot
        (snapshot / "model.safetensors").write_bytes(b"weights")
        yield object()

    monkeypatch.setattr(job_mod.engines, "make", fetching_engine)
    cfg = compose("model.source=org/name", "model.name=org/name", "engine=hf")
    job = Job(cfg, tiny_spec, tmp_path, "hf", Recipe.from_conf(cfg.extract, cfg.prompts.chat))
    with job_mod.engine_for([job]) as engine:
        files = job_mod.model_files(job, engine)
    assert set(files["files"]) == {"config.json", "model.safetensors"}
    assert inputs.changes({"vectors": {}, "model": files}) is None  # a resume finds it as it was
