"""EasySteer as a configuration of the bench, on CPU: its path refused before any engine starts, the bench's edits as
its steering, and its engine process importing the fork's vLLM ahead of steer's (a stand-in fork)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_common import bench_conf
from steer.bench import peers, workload
from steer.config.schema import EditKind, Tokens
from steer.edits.edit import compile_edit
from steer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def fork(tmp_path) -> Path:
    """A directory holding a stand-in for EasySteer's vLLM: its marker file, and a recording `LLM`."""
    site = tmp_path / "site-es"
    sv = site / "vllm" / "steer_vectors"
    sv.mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(
        "import json, os\n"
        "class SamplingParams:\n"
        "    def __init__(self, **kw): self.kw = kw\n"
        "class _Out:\n"
        "    def __init__(self, n): self.outputs = [type('C', (), {'token_ids': [0] * n})()]\n"
        "ENGINES = []\n"
        "class LLM:\n"
        "    def __init__(self, model, **kw):\n"
        "        ENGINES.append(self)\n"
        "        self.log = {'kwargs': {k: v for k, v in kw.items() if k != 'compilation_config'},\n"
        "                    'pythonpath': os.environ['PYTHONPATH'], 'passes': [],\n"
        "                    'start': os.environ.get('VLLM_WORKER_MULTIPROC_METHOD')}\n"
        "    def generate(self, prompts, params, steering=None, use_tqdm=True):\n"
        "        self.log['passes'].append({'prompts': prompts, 'params': params.kw, 'steering': steering})\n"
        "        return [_Out(params.kw['max_tokens']) for _ in prompts]\n")
    (site / "vllm" / "config.py").write_text("def CompilationConfig(**kw):\n    return kw\n")
    (sv / "__init__.py").write_text(
        "def _rec(name):\n"
        "    return lambda **kw: {name: kw}\n"
        "ApplySpec, VectorSpec, SteeringSpec = _rec('apply'), _rec('vector'), _rec('spec')\n")
    (sv / "api.py").write_text("")
    (sv / "payloads.py").write_text(
        "class DirectionVector:\n"
        "    def __init__(self, layers): self.layers = layers\n"
        "    def to_wire(self): return {str(i): [round(float(x), 6) for x in v] for i, v in self.layers.items()}\n")
    return site


def test_a_run_naming_easysteer_without_its_path_is_refused_in_one_line(tmp_path):
    from helpers import cli_env

    res = subprocess.run([sys.executable, "-m", "steer.bench", "run=[tiny]", "configs=[a,easysteer]"], cwd=tmp_path,
                         env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("error peers.easysteer.pythonpath: is not set"), res.stderr


def test_the_path_must_hold_easysteer_s_vllm_and_kn_edits_it_can_run(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory") as e:
        workload.check(bench_conf("configs=[a,easysteer]", f"peers.easysteer.pythonpath={tmp_path}/nowhere"))
    assert e.value.field == "peers.easysteer.pythonpath"
    with pytest.raises(ConfigError, match="holds no EasySteer vLLM") as e:
        workload.check(bench_conf("configs=[a,easysteer]", f"peers.easysteer.pythonpath={tmp_path}"))
    assert e.value.field == "peers.easysteer.pythonpath"
    path = f"peers.easysteer.pythonpath={fork(tmp_path)}:{tmp_path}"
    # kN's default kinds include clamp, set and scale, which EasySteer has no algorithm for
    with pytest.raises(ConfigError, match=r"\['clamp', 'set', 'rescale'\] have no EasySteer algorithm") as e:
        workload.check(bench_conf("configs=[a,easysteer]", path))
    assert e.value.field == "k_kinds"
    workload.check(bench_conf("configs=[a,easysteer]", path, "k_kinds=[add,ablate]"))
    workload.check(bench_conf("configs=[a,easysteer]", path, "scenarios=[add,ablate_all,add_all@eps]"))
    workload.check(bench_conf("configs=[a,b,c]"))  # without the peer, no path is asked for


def test_the_easysteer_stage_of_the_gpu_check_passes_the_checks(tmp_path):
    # tests/gpu/run.sh's `easysteer` stage is docs/benchmark.md's EasySteer table: its arguments compose and check
    text = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    body = text[text.index("\neasysteer() {"):]
    scen = body[body.index("local s=${EASYSTEER_SCENARIOS:-") + len("local s=${EASYSTEER_SCENARIOS:-"):].split("}")[0]
    scen = scen.split(",")
    args = body[body.index('BENCH_ARGS="') + len('BENCH_ARGS="'):body.index('" \\\n    bench bench-easysteer')]
    args = args.replace("\\\n", "").replace("${BENCH_ARGS:-}", "").replace("${EASYSTEER_MODELS:-qwen2_1p5b}",
                                                                           "qwen2_1p5b")
    args = args.replace("${EASYSTEER_CONFIGS:-a,f,h,easysteer}", "a,f,h,easysteer")
    args = args.replace("$s,${s//,/@eps,}@eps", ",".join(scen + [f"{s}@eps" for s in scen]))
    args = args.replace("${EASYSTEER_PYTHONPATH:-}", str(fork(tmp_path)))
    cfg = bench_conf(*args.split())
    workload.check(cfg)
    assert cfg.run == ["qwen2_1p5b"] and cfg.batches == [[256, 128]] and "easysteer" in cfg.configs
    assert {"add", "add_all", "k64", "k256", "k256@eps"} <= set(cfg.scenarios) and cfg.k_kinds == [EditKind.add]
    assert {t.scenario for t in cfg.targets if t.over == "easysteer"} <= set(cfg.scenarios)


def test_the_bench_s_edits_are_easysteer_s_algorithms_on_the_same_rows():
    assert peers.algorithm(compile_edit(EditKind.add, 4.0, torch.ones(1, 8))) == "direct"
    assert peers.algorithm(compile_edit(EditKind.ablate, 1.0, torch.eye(8)[:1])) == "erase"
    with pytest.raises(ValueError, match="no algorithm for a clamp edit"):
        peers.algorithm(compile_edit(EditKind.clamp, 1.0, torch.eye(8)[:1], lo=-1.0, hi=1.0))
    with pytest.raises(ValueError, match="of 2 direction"):
        peers.algorithm(compile_edit(EditKind.ablate, 1.0, torch.eye(8)[:2]))
    assert peers.apply(Tokens.both) == {"prompt": "all", "generation": "all"}
    assert peers.apply(Tokens.prompt) == {"prompt": "all", "generation": None}
    assert peers.apply(Tokens.generated) == {"prompt": None, "generation": "all"}


def test_the_engine_process_imports_the_fork_and_sends_each_request_its_edit(tmp_path, cache_dir, bench_model):
    # In a fresh interpreter, as an engine process is: the stand-in fork on the peer's path must be the vLLM it
    # imports, every request must carry its own edit's spec (one spec an edit, shared by the requests sharing it)
    site = fork(tmp_path)
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / 'tests')!r}); sys.path.insert(0, {str(ROOT / 'tests' / 'bench')!r})
from bench_common import bench_conf
from steer.bench import engines, runs, workload
cfg = bench_conf("run=[tiny]", "configs=[a,easysteer]", "batches=[[16,4]]", "scenarios=[k8_all]", "k_kinds=[add]",
                 "peers.easysteer.pythonpath={site}", cache_dir={str(cache_dir)!r})
m = cfg.models["tiny"]
where = workload.model_dir(m, cfg.cache_dir)
group = next(g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "easysteer")
run = engines.RUNNERS["easysteer"](cfg, m, where, group)
scen = workload.scenario("k8_all", 64, 4, 16, cfg.seed, cfg.epsilon, cfg.k_kinds)
assert run(workload.prompts(16, 5, 0), scen, 4) == 16 * 4
assert run(workload.prompts(16, 5, 0), scen, 4) == 16 * 4
import vllm
print(json.dumps({{"file": vllm.__file__, "log": vllm.ENGINES[0].log, "scales": [e.strength for e in scen.edits]}}))
"""
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(site))  # the fork, not another vLLM
    log = got["log"]
    assert log["pythonpath"].split(":")[0] == str(site)  # vLLM's own subprocesses import the fork too
    assert log["start"] == "spawn"  # the fork's imports reach the CUDA driver: a forked engine core would fail
    kw = log["kwargs"]
    assert kw["enable_steer_vector"] and kw["steer_algorithms"] == ["direct"]  # what its cells use, no more
    assert kw["max_steer_vectors"] == kw["max_num_seqs"] == 16 and kw["enable_prefix_caching"] is False
    first, second = log["passes"]
    assert first["params"] == {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "detokenize": False}
    assert first["prompts"] == [{"prompt_token_ids": p} for p in workload.prompts(16, 5, 0)]
    specs = first["steering"]
    assert len(specs) == 16 and second["steering"] == specs
    vectors = [s["spec"]["vectors"][0]["vector"] for s in specs]
    assert all(v["algorithm"] == "direct" and v["layers"] == [0, 1, 2, 3] for v in vectors)
    assert all(v["apply"] == {"apply": {"prompt": "all", "generation": "all"}} for v in vectors)
    assert [v["scale"] for v in vectors] == pytest.approx(got["scales"])
    # 8 distinct vectors over 16 requests, request i carrying edit i % 8, each at every layer of its spec
    payloads = [json.dumps(v["data"], sort_keys=True) for v in vectors]
    assert len(set(payloads)) == 8 and payloads[8:] == payloads[:8]
    assert all(sorted(v["data"]) == ["0", "1", "2", "3"] for v in vectors)


def test_easysteer_declares_the_algorithms_its_cells_use(cache_dir, bench_model):
    from steer.bench import engines, runs

    def algorithms(*overrides):
        cfg = bench_conf("run=[tiny]", "configs=[a,easysteer]", "batches=[[16,4]]", *overrides, cache_dir=cache_dir)
        m = cfg.models["tiny"]
        group = next(g for g in runs.plan_groups(cfg, "tiny", 4) if g.config == "easysteer")
        return engines.peer_algorithms(cfg, workload.spec(m, "tiny", workload.model_dir(m, cfg.cache_dir)), group)

    assert algorithms("scenarios=[add,k8_all]", "k_kinds=[add]") == ["direct"]
    assert algorithms("scenarios=[add,ablate_all@eps]") == ["direct", "erase"]
    assert algorithms("scenarios=[k8]", "k_kinds=[ablate]") == ["erase"]
