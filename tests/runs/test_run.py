"""`run.execute`: a pack of jobs gives each job exactly what it gives alone; and what a run refuses before any
engine starts (steer.tasks.registry.prepare)."""

from helpers import TWO_PROMPTS, compose
from steer.runs import run
from steer.tasks import registry

QUICK = [TWO_PROMPTS, "progress=false"]


def test_pack_with_different_generation_settings_equals_solo_runs(tmp_path, cache_dir, tiny_spec, console):
    cfgs = [compose("gen.max_new_tokens=3", "edit.scale=4", *QUICK),
            compose("gen.max_new_tokens=6", "edit.scale=4", *QUICK),  # same prompts and seeds, longer baseline
            compose("gen.max_new_tokens=6", "edit=ablate", "tap=layer2", *QUICK)]

    def job(cfg, name):
        (tmp_path / name).mkdir()
        return registry.prepare(cfg, tmp_path / name)

    packed = run.execute([job(c, f"pack{i}") for i, c in enumerate(cfgs)], console)
    for i, c in enumerate(cfgs):
        [solo] = run.execute([job(c, f"solo{i}")], console)
        results = [(tmp_path / f"{kind}{i}" / "results.jsonl").read_text() for kind in ("pack", "solo")]
        assert results[0] == results[1]
        assert {k: v for k, v in packed[i].items() if k != "tokens_per_s"} == \
            {k: v for k, v in solo.items() if k != "tokens_per_s"}


def test_engine_settings_are_checked_before_any_engine(cache_dir):
    import pytest

    from steer.errors import ConfigError

    for override, says in [("vllm.tensor_parallel_size=0", "must be at least 1"),
                           ("vllm.tensor_parallel_size=2", "needs engine=vllm"),
                           ("vllm.edits_in_graph=true", "for the bench and the API"),
                           ("vllm.compiled_edits=true", "for the bench and the API"),
                           ("vllm.tap_graphs=true", "needs engine=vllm"),
                           ("vllm.fold_norm=true", "for the bench and the API"),
                           ("vllm.kv_cache_memory_bytes=0", "positive number of bytes"),
                           ("vllm.gpu_memory_utilization=0", "must be a share in (0, 1]"),
                           ("vllm.max_model_len=0", "positive number of positions"),
                           ("device=banana", "expected cpu, cuda or cuda:N"),
                           ("device=cuda:x", "expected cpu, cuda or cuda:N"),
                           ("device=cuda:4096", "CUDA device(s)")]:
        with pytest.raises(ConfigError) as e:
            registry.prepare(compose(override, "engine=hf", f"cache_dir={cache_dir}"), cache_dir)
        assert e.value.field == override.split("=")[0] and says in str(e.value)


def test_a_run_into_a_directory_that_held_one_keeps_none_of_its_results(tmp_path, cache_dir, console):
    import pytest

    from steer.errors import ConfigError
    from steer.runs.rundir import STALE

    d = tmp_path / "run"
    d.mkdir()
    for name in STALE:
        (d / name).write_text("the last run's")
    with pytest.raises(ConfigError):  # fails validation: its error.txt must not stand beside the old metrics
        registry.main(compose("tap.layer=99", *QUICK), d, console)
    assert [name for name in STALE if (d / name).exists()] == []


def test_prompts_that_are_no_text_and_an_extract_out_that_is_a_directory_are_refused(tmp_path, cache_dir):
    import pytest

    from steer.errors import ConfigError

    for overrides, field in [(["prompts.negative=[b,{k:v}]"], "prompts.negative[1]"),
                             (["prompts.steer=[[a,b]]"], "prompts.steer[0]"),
                             (["task=extract", f"extract.out={tmp_path}"], "extract.out")]:
        with pytest.raises(ConfigError) as e:
            registry.prepare(compose(*QUICK, *overrides), tmp_path)
        assert e.value.field == field, (overrides, e.value)


def test_a_run_clears_the_last_runs_results_before_hydra_writes_its_config(tmp_path):
    from omegaconf import OmegaConf

    from steer.runs.rundir import STALE, RunDirLock

    d = tmp_path / "run"
    d.mkdir()
    for name in STALE:
        (d / name).write_text("the last run's")
    (d / "notes.txt").write_text("the user's")
    # The callback Hydra calls before it writes .hydra/: a run killed after it cannot leave them with a new config
    RunDirLock().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(d)}}}))
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_a_missing_vector_file_is_said_before_the_models_files_are_read(tmp_path, cache_dir, monkeypatch):
    import pytest

    from steer.errors import ConfigError

    def unread(*a, **kw):
        raise AssertionError("the model's files were read first")

    monkeypatch.setattr(registry, "model_spec", unread)
    for field in ("edit.vector", "extra_edits[0].edit.vector"):
        paths = {f: str(tmp_path / "other.safetensors") for f in ("edit.vector", "extra_edits[0].edit.vector")}
        paths[field] = str(tmp_path / "missing.safetensors")
        (tmp_path / "other.safetensors").write_bytes(b"")  # there: only the missing one is named
        with pytest.raises(ConfigError) as e:
            registry.prepare(compose(f"edit.vector.path={paths['edit.vector']}", "+experiment=joy_two_taps",
                                f"extra_edits.0.edit.vector.path={paths['extra_edits[0].edit.vector']}",
                                f"cache_dir={cache_dir}"), tmp_path / "out")
        assert e.value.field == f"{field}.path" and "missing.safetensors' does not exist" in str(e.value)


def test_a_continuation_longer_than_the_model_is_refused_before_any_weights(tmp_path, cache_dir, monkeypatch):
    import pytest

    from steer.runs import job
    from steer.errors import ConfigError

    monkeypatch.setattr(job, "engine_for", lambda jobs: pytest.fail("an engine was started"))
    for limit, overrides in [(2048, ["gen.max_new_tokens=2048"]),
                             (64, ["model=tiny", "gen.max_new_tokens=64", "model.tiny.max_positions=64"])]:
        with pytest.raises(ConfigError) as e:
            registry.prepare(compose(*QUICK, *overrides), tmp_path)
        assert e.value.field == "gen.max_new_tokens" and f"tiny has {limit} positions" in str(e.value)
    registry.prepare(compose("gen.max_new_tokens=2047", *QUICK), tmp_path)


def test_a_pack_leaves_no_log_file_open_and_a_later_line_still_lands(tmp_path, cache_dir, console):
    import os

    def open_logs():
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                out += [fd] if os.readlink(f"/proc/self/fd/{fd}").endswith("steer.log") else []
            except OSError:  # the descriptor listdir itself held
                pass
        return out

    jobs = [_job(compose("gen.max_new_tokens=2", *QUICK), tmp_path / str(i)) for i in range(3)]
    run.execute(jobs, console)
    assert open_logs() == []
    run.job_log(jobs[0]).info("a later line")
    run.close_log(jobs[0].out_dir)
    log = (tmp_path / "0" / "steer.log").read_text()
    assert "wrote results.jsonl" in log and log.endswith("a later line\n")


def _job(cfg, d):
    d.mkdir()
    return registry.prepare(cfg, d)


LONG = "the weather " * 1100  # about 2,200 tokens against the tiny model's 2,048 positions


def test_a_failing_job_does_not_lose_its_pack(tmp_path, cache_dir, console):
    good = compose("gen.max_new_tokens=3", *QUICK)
    bad = compose("gen.max_new_tokens=3", *QUICK)
    bad.prompts.steer = ["The weather today is", LONG]
    jobs = [_job(good, tmp_path / "0"), _job(bad, tmp_path / "1"), _job(good, tmp_path / "2")]
    outcomes = run.run_jobs(jobs, console)
    out = [o.result for o in outcomes]
    assert "error" not in out[0] and "error" not in out[2] and out[0]["prompts"] == 2
    assert outcomes[0].error is None and outcomes[2].error is None
    assert out[1] == {"error": str(outcomes[1].error)} and "prompts.steer[1]" in out[1]["error"]
    for d in ("0", "2"):
        assert (tmp_path / d / "metrics.json").exists() and not (tmp_path / d / "error.txt").exists()
    assert not (tmp_path / "1" / "metrics.json").exists() and not (tmp_path / "1" / "results.jsonl").exists()
    assert "prompts.steer[1]" in (tmp_path / "1" / "error.txt").read_text()
    assert "failed: prompts.steer[1]" in (tmp_path / "1" / "steer.log").read_text()


def test_a_prompt_longer_than_the_context_is_refused_before_generation(tmp_path, cache_dir, monkeypatch, console):
    import pytest

    from steer.errors import ConfigError

    cfg = compose("gen.max_new_tokens=3", *QUICK)
    cfg.prompts.steer = ["The weather today is", LONG]
    job = _job(cfg, tmp_path / "j")
    generated = []
    monkeypatch.setattr(run, "_generate", lambda engine, work, conts, console: generated.extend(work))
    with pytest.raises(ConfigError) as e:
        registry.main(cfg, job.out_dir, console)
    assert e.value.field == "prompts.steer[1]" and not generated
    n = int(str(e.value).split(" is ")[1].split(" tokens")[0])
    assert n > 2045 and f"needs {n + 3} positions, but tiny has 2048" in str(e.value)
    assert "prompts.truncate=true" in str(e.value)


def test_truncate_keeps_the_last_tokens_that_fit(tmp_path, cache_dir, console):
    cfg = compose("gen.max_new_tokens=3", "prompts.truncate=true", *QUICK)
    cfg.prompts.steer = [LONG + " and I felt"]
    [m] = run.execute([_job(cfg, tmp_path / "j")], console)
    assert m["prompts"] == 1
    assert "truncated to its last 2045" in console.file.getvalue()
    assert "truncated to its last 2045" in (tmp_path / "j" / "steer.log").read_text()


def test_a_sweep_over_layers_reads_its_pairs_once_and_each_baseline_once(tmp_path, cache_dir, tiny_spec, console,
                                                                         monkeypatch):
    """The pack's default directions come from one read of the pairs (every layer captured at once), each equal to
    its layer's extraction alone, and a baseline the jobs share is re-read once; each job's files equal its run
    alone."""
    import torch

    from steer.edits import vector
    from steer.runs import extract
    from steer.runs import job as job_mod

    # Pairs of this test's own: no other test has their directions in the shared cache
    pairs = ["prompts.positive=['A warm sunny morning','Laughing with old friends']",
             "prompts.negative=['A cold grey morning','Crying alone at night']"]
    reads, scored = [], []
    read_taps = extract.read_taps
    monkeypatch.setattr(extract, "read_taps", lambda eng, taps, *a, **k: reads.append(len(taps)) or
                        read_taps(eng, taps, *a, **k))

    def job(name, layer):
        (tmp_path / name).mkdir()
        return registry.prepare(compose(f"tap.layer={layer}", *pairs, *QUICK), tmp_path / name)

    layers = [1, 2, 3]
    pack = [job(f"pack{k}", k) for k in layers]
    with job_mod.engine_for(pack) as engine:
        real = engine.score_many
        monkeypatch.setattr(engine, "score_many", lambda rows: scored.append(list(rows)) or real(rows))
        run.execute(pack, console, engine=engine)
        assert reads == [3, 3]  # the positive and the negative set, each read once at the three layers
        baseline_rows = [r for rows in scored for r in rows if r[1] and r[2] is None and len(r[3]) == 3]
        assert len(baseline_rows) == 2  # the two prompts' baselines, re-read once with the three taps captured
        cfg = pack[0].cfg
        recipe = extract.Recipe.from_conf(cfg.extract, cfg.prompts.chat)
        for j in pack:
            [tap] = j.taps
            alone = extract.extract(engine, tap, list(cfg.prompts.positive), list(cfg.prompts.negative), recipe)
            cached = extract.cached_default(cfg.cache_dir, engine, tap, list(cfg.prompts.positive),
                                            list(cfg.prompts.negative), recipe)
            assert torch.equal(cached, vector.check(alone.direction, tiny_spec.hidden, "alone"))
    for k in layers:
        [solo] = run.execute([job(f"solo{k}", k)], console)
        assert "error" not in solo
        assert (tmp_path / f"pack{k}" / "results.jsonl").read_text() == \
            (tmp_path / f"solo{k}" / "results.jsonl").read_text()


def test_an_extract_out_the_kernel_refuses_is_said_before_any_engine(tmp_path, cache_dir, monkeypatch):
    """/proc takes no new directory, though os.access tells root it may: the run stops before an engine starts,
    naming extract.out, rather than after the whole extraction with a traceback."""
    import pytest

    from steer.errors import ConfigError
    from steer.runs import job

    monkeypatch.setattr(job, "engine_for", lambda jobs: pytest.fail("an engine started"))
    with pytest.raises(ConfigError) as e:
        registry.main(compose(*QUICK, "task=extract", "extract.out=/proc/nope/x.safetensors"), tmp_path, None)
    assert e.value.field == "extract.out" and "cannot be written" in str(e.value), e.value
    assert not list(tmp_path.glob("*.safetensors"))
