"""The task registry (steer/tasks/registry.py): every task has one entry, from its own module, and a pack that mixes
tasks gives each job what it gives alone."""

from helpers import TWO_PROMPTS, compose
from steer.config.schema import Task
from steer.tasks import registry

QUICK = [TWO_PROMPTS, "progress=false", "gen.max_new_tokens=3"]


def test_every_task_has_one_entry_from_its_own_module():
    assert set(registry.TASKS) == set(Task)
    for name, task in registry.TASKS.items():
        assert task.name == name and registry.of(name.value) is task
        assert {f.__module__ for f in (task.check, task.prepare, task.run)} == {task.run.__module__}
        assert task.run.__module__.startswith("steer.tasks.")
    assert {t for t, task in registry.TASKS.items() if task.run_pack is not None} == {Task.steer, Task.extract}


def test_a_pack_of_extractions_and_steer_jobs_gives_each_what_it_gives_alone(tmp_path, cache_dir, console):
    import torch
    from safetensors import safe_open

    from steer.runs.job import engine_for

    cfgs = [compose("task=extract", "tap.layer=1", *QUICK), compose("edit.scale=4", *QUICK),
            compose("task=extract", "tap.layer=2", "extract.method=pca", *QUICK), compose("edit=ablate", *QUICK)]

    def jobs(kind):
        out = []
        for i, cfg in enumerate(cfgs):
            (tmp_path / f"{kind}{i}").mkdir()
            out.append(registry.prepare(cfg, tmp_path / f"{kind}{i}"))
        return out

    pack = jobs("pack")
    with engine_for(pack) as engine:
        done = []
        got = registry.execute_packs(pack, console, engine, pack_size=4, on_done=done.append)
    assert [j.out_dir.name for j in done] == ["pack0", "pack2", "pack1", "pack3"]  # a task's jobs run together
    alone = [registry.run(job, console) for job in jobs("solo")]
    for i, (a, b) in enumerate(zip(got, alone)):
        if cfgs[i].task == Task.extract:
            assert {k: v for k, v in a.items() if k != "vector"} == {k: v for k, v in b.items() if k != "vector"}
            files = [safe_open(str(tmp_path / f"{kind}{i}" / "vector.safetensors"), "pt") for kind in ("pack", "solo")]
            assert [{k: v for k, v in f.metadata().items() if k != "date"} for f in files] == \
                [{k: v for k, v in files[1].metadata().items() if k != "date"}] * 2
            assert torch.equal(files[0].get_tensor("direction"), files[1].get_tensor("direction"))
        else:
            assert {k: v for k, v in a.items() if k != "tokens_per_s"} == \
                {k: v for k, v in b.items() if k != "tokens_per_s"}
            assert (tmp_path / f"pack{i}" / "results.jsonl").read_text() == \
                (tmp_path / f"solo{i}" / "results.jsonl").read_text()
