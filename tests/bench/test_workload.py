"""The bench's config and workload, on CPU: what every configuration runs, and bad config caught early."""

import json

import pytest
import torch

from bench_common import bench_conf
from steer.bench import schema, workload
from steer.errors import ConfigError
from steer.schema import EditKind


def test_committed_bench_config_composes_and_checks():
    cfg = bench_conf()
    assert isinstance(cfg, schema.BenchConf)
    workload.check(cfg)
    assert cfg.run == ["tiny", "llama3_8b"] and cfg.batches == [[64, 128], [256, 256]]
    assert {t.scenario for t in cfg.targets if t.of == "c"} == {"add", "ablate_all", "k64"}
    assert {t.scenario for t in cfg.targets if t.of == "f"} == set(cfg.scenarios)


@pytest.mark.parametrize("override,field", [("run=[nope]", "run[0]"), ("configs=[a,x]", "configs[1]"),
                                            ("scenarios=[add,k0]", "scenarios[1]"), ("batches=[[64]]", "batches[0]"),
                                            ("models.tiny.source=/no/such/dir", "models.tiny.source"),
                                            ("capture_sizes=[1,64]", "capture_sizes"),
                                            ("repeats=0", "repeats"), ("max_repeats=2", "max_repeats"),
                                            ("min_timed_s=-1", "min_timed_s"), ("max_timed_s=0", "max_timed_s"),
                                            ("models.tiny.engines_at_once=0", "models.tiny.engines_at_once"),
                                            ("kv_cache_tokens=1000", "kv_cache_tokens"),
                                            ('lanes=[{gpus:"0",runs:["*/[abc]"]},{gpus:"1",runs:["*/d"]}]', "lanes"),
                                            ('lanes=[{gpus:"x",runs:["*"]}]', "lanes[0].gpus"),
                                            ('lanes=[{gpus:"0",runs:["*/a"]},{gpus:"1,0",runs:["*"]}]',
                                             "lanes[1].gpus"),
                                            ('lanes=[{gpus:"0",runs:["*/a"]},{runs:["*"]}]', "lanes"),
                                            ("lanes=[]", "lanes"), ("trace_tokens=0", "trace_tokens"),
                                            ("trace_timeout_s=0", "trace_timeout_s")])
def test_bad_bench_config_names_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        workload.check(bench_conf(override))
    assert e.value.field == field


def test_an_engine_goes_to_the_first_lane_that_names_it():
    cfg = bench_conf('lanes=[{gpus:"0",runs:["*/[abcf]"]},{gpus:"1",runs:["*"]}]')
    workload.check(cfg)
    assert [workload.lane(cfg, "llama3_8b", c) for c in "abcfde"] == [0, 0, 0, 0, 1, 1]


def test_skip_patterns_match_cells():
    cfg = bench_conf("skip=[llama3_8b/e/*,*/d/k64/256x256]")
    assert workload.skipped(cfg, "llama3_8b", "e", "add", (64, 128)) == "llama3_8b/e/*"
    assert workload.skipped(cfg, "tiny", "d", "k64", (256, 256)) == "*/d/k64/256x256"
    assert workload.skipped(cfg, "tiny", "d", "k64", (64, 128)) is None


def test_scenarios_give_every_request_its_edit():
    add = workload.scenario("add", 16, 4, 10, 0)
    assert add.layers == [2] and len(add.edits) == 10 and all(e is add.edits[0] for e in add.edits)
    abl = workload.scenario("ablate_all", 16, 4, 3, 0)
    assert abl.layers == [0, 1, 2, 3] and abl.edits[0].kind == EditKind.ablate
    k8 = workload.scenario("k8", 16, 4, 20, 0)
    distinct = {id(e) for e in k8.edits}
    assert len(distinct) == 8 and k8.edits[8] is k8.edits[0]
    assert [e.kind for e in k8.edits[:5]] == [EditKind.add, EditKind.ablate, EditKind.clamp, EditKind.set,
                                              EditKind.scale]
    assert not torch.equal(k8.edits[0].basis, k8.edits[5].basis)  # same kind, its own vector
    assert workload.scenario("k8", 16, 4, 20, 0).edits[3].basis.equal(k8.edits[3].basis)  # deterministic


def test_prompts_are_the_same_for_everyone():
    p = workload.prompts(4, 7, 0)
    assert p == workload.prompts(4, 7, 0) and len(p) == 4 and all(len(x) == 7 and min(x) >= 2 for x in p)


def test_llama3_8b_shape_is_written_once_with_the_tiny_tokenizer(cache_dir, bench_model):
    from pathlib import Path

    cfg = bench_conf(cache_dir=cache_dir)
    m = cfg.models["llama3_8b"]
    where = workload.model_dir(m, cache_dir)
    config = json.loads((where / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (4096, 32, 8)
    assert (where / "tokenizer.json").read_text() == (Path(bench_model) / "tokenizer.json").read_text()
    assert not list(where.glob("*.safetensors"))
    spec = workload.spec(m, "llama3_8b", where)
    assert spec.layers == 32 and spec.hidden == 4096 and spec.layer_path(16) == "model.layers.16"
    assert workload.model_dir(m, cache_dir) == where
