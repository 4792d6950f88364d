"""The serving benchmark's CPU side: its presets, servers, repeated loads, medians and table, with the servers and
vLLM's load generator stood in for (what they measure needs the GPU: tests/gpu/run.sh serve)."""

import argparse
import json
import statistics
from contextlib import contextmanager

import pytest
from safetensors.torch import load_file

from steer.bench import serving
from steer.serve.schema import ServeOptions
from steer.serve import presets


def test_the_presets_are_valid_presets_of_unit_directions(tmp_path):
    pdir = serving.write_presets(tmp_path, 64)
    read = presets.read(ServeOptions(preset_dir=str(pdir), presets=list(serving.PRESETS)))
    assert sorted(read) == sorted(serving.PRESETS)
    cmd = serving.steer_cmd(tmp_path / "model", pdir, 8000, 0.5, "replay")
    assert f"serve.presets=[{','.join(serving.PRESETS)}]" in cmd  # its own presets only, not the built-in ones too
    assert [e.tap.layer for e in read["ablate_all"].edits] == list(range(serving.LAYERS))
    assert read["clamp16"].edits[0].edit.lo == -2.0
    for name, v in load_file(str(tmp_path / "vectors.safetensors")).items():
        assert v.shape == (64,) and abs(float(v.norm()) - 1) < 1e-6, name


def _args(**kw):
    return argparse.Namespace(**{
        "baselines": "stock,stock_v1", "modes": "replay,compiled", "repeats": 2, "requests": 8, "concurrency": 2,
        "input_len": 4, "output_len": 4, "gpu_memory_utilization": 0.5, **kw})


@pytest.mark.parametrize("over,match", [
    ({"baselines": "stock,vanilla"}, "--baselines: unknown server 'vanilla'"),
    ({"modes": "replay,eager"}, "--modes: unknown server 'eager'"),
    ({"modes": "replay,compiled,replay"}, "--modes: 'replay' named twice"),
    ({"baselines": "", "modes": ""}, "both empty"),
])
def test_bad_servers_are_refused_naming_the_flag(over, match):
    with pytest.raises(SystemExit, match=match):
        serving.servers(_args(**over))


def test_repeats_below_one_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        serving.main(["--out", str(tmp_path), "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err


@pytest.fixture
def fake_servers(monkeypatch):
    """Servers and loads stood in for: each load's result is a throughput and TTFT derived from its server, load and
    repeat, so medians and ratios can be computed independently; the calls are recorded."""
    calls = {"started": [], "loads": []}
    tput = {"stock": 1000.0, "stock_v1": 800.0, "replay": 900.0, "compiled": 950.0, "replay_when": 880.0}

    @contextmanager
    def running(cmd, port, log_path, env=None):
        calls["started"].append((log_path.stem.removeprefix("server-"), cmd, env))
        yield f"http://127.0.0.1:{port}"

    def load(url, tokenizer, cycle, out, args):
        name, load_name, rep = out.stem.rsplit("-", 2)
        calls["loads"].append((name, load_name, int(rep), cycle))
        base = tput[name] - (50 if load_name == "ablate_all" else 0)
        rep = int(rep)
        return {"completed": args.requests, "failed": int(name == "replay" and rep == 1),
                "output_throughput": base + 10 * rep ** 2, "median_ttft_ms": 100.0 + rep ** 3,
                "median_tpot_ms": 5.0 + rep ** 2 / 4, "duration": 1.0}

    monkeypatch.setattr(serving, "running", running)
    monkeypatch.setattr(serving, "load", load)
    return calls


def test_each_server_runs_its_loads_in_turn_repeats_times(tmp_path, fake_servers, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # exported in the shell: stock must still get vLLM's choice
    rows = {}
    for name in serving.servers(_args(repeats=3)):
        rows.update(serving.measure(name, tmp_path / "model", tmp_path / "presets", tmp_path, _args(repeats=3)))
    started = {name: (cmd, env) for name, cmd, env in fake_servers["started"]}
    assert list(started) == ["stock", "stock_v1", "replay", "compiled"]
    assert started["stock_v1"][1]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in started["stock"][1]  # vLLM's own choice of runner
    assert "vllm.compiled_edits=true" in started["compiled"][0] and started["replay"][1] is None
    assert "vllm.compiled_edits=false" in started["replay"][0]  # the server's own pick would be compiled
    # stock servers run the unsteered load only; steer's run every load; loads in turn within each repeat
    assert [(n, ld, r) for n, ld, r, _ in fake_servers["loads"] if n == "stock"] == [("stock", "unsteered", r)
                                                                                   for r in range(3)]
    assert [ld for n, ld, _, _ in fake_servers["loads"] if n == "replay"] == list(serving.LOADS) * 3
    assert [c for n, ld, _, c in fake_servers["loads"] if n == "replay" and ld == "mixed"][0] == \
        [None, "add8", "clamp16"]
    r = rows["replay/ablate_all"]
    assert r["output_throughput"] == statistics.median([850.0, 860.0, 890.0])
    assert r["throughput_range"] == [850.0, 890.0] and len(r["runs"]) == 3
    # TTFT 100, 101, 108 and TPOT 5, 5.25, 6 over the repeats: medians, not means; one failed run in replay's three
    assert r["median_ttft_ms"] == 101.0 and r["median_tpot_ms"] == 5.25 and r["failed"] == 1
    assert rows["compiled/ablate_all"]["failed"] == 0


def test_the_when_load_sends_its_own_vector_and_condition_to_the_server_that_takes_them(tmp_path, fake_servers):
    from steer.serve.protocol import InlinePolicy, parse_steer

    serving.write_presets(tmp_path, 64)
    own = json.loads((tmp_path / "when.json").read_text())
    args = parse_steer({"vllm_xargs": own}, [], 100.0, inline=InlinePolicy(64, serving.WHEN_LAYERS))
    assert len(args.inline) == 1 and args.inline[0].layer == 12 and args.when.layer == 8  # the server's own checks
    assert args.when.score == "cosine" and args.when.threshold == 0.0
    serving.measure("replay_when", tmp_path / "model", tmp_path / "presets", tmp_path, _args(repeats=1))
    serving.measure("compiled", tmp_path / "model", tmp_path / "presets", tmp_path, _args(repeats=1))
    (_, cmd, _), _ = fake_servers["started"]
    assert "serve.inline_layers=[8,12]" in cmd and "vllm.compiled_edits=false" in cmd
    loads = [(n, ld, c) for n, ld, _, c in fake_servers["loads"]]
    assert loads[:2] == [("replay_when", "unsteered", [None]), ("replay_when", "when", [None, "when"])]
    assert "when" not in {ld for n, ld, _ in loads if n == "compiled"}  # a compiled server takes no own vectors


def test_main_writes_the_table_against_both_stock_servers(tmp_path, fake_servers, monkeypatch):
    from steer.bench import workload

    monkeypatch.setattr(workload, "model_dir", lambda m, cache: tmp_path / "model")
    monkeypatch.setattr(serving, "require_gpu", lambda: None)
    serving.main(["--out", str(tmp_path / "out"), "--repeats", "1"])
    got = json.loads((tmp_path / "out" / "bench-serve.json").read_text())
    assert got["meta"]["repeats"] == 1 and set(got["rows"]) == {
        "stock/unsteered", "stock_v1/unsteered", *(f"{m}/{ld}" for m in ("replay", "compiled") for ld in serving.LOADS)}
    table = (tmp_path / "out" / "bench-serve.md").read_text()
    assert ("| server / load | output tok/s | range | x stock | x stock_v1 | TTFT p50 ms | x stock | x stock_v1 |"
            in table)
    # compiled/mixed: 950 tok/s against stock's 1000 and stock_v1's 800
    assert "| compiled/mixed | 950 | 950-950 | 0.950 | 1.188 | 100.0 | 1.00 | 1.00 | 5.00 | 0 |" in table
    assert all(line.count("|") == table.splitlines()[4].count("|") for line in table.splitlines()[4:] if line)


def test_the_table_leaves_out_a_baseline_not_run():
    rows = {"stock/unsteered": serving.row([{"output_throughput": 10.0, "median_ttft_ms": 2.0, "median_tpot_ms": 1.0,
                                             "failed": 0}]),
            "replay/mixed": serving.row([{"output_throughput": 9.0, "median_ttft_ms": 3.0, "median_tpot_ms": 1.0,
                                          "failed": 1}])}
    meta = {"date": "d", "machine": "m", "command": "c", "requests": 1, "concurrency": 1, "input_len": 1,
            "output_len": 1, "repeats": 1}
    table = serving.markdown(rows, meta)
    assert "stock_v1" not in table and "| replay/mixed | 9 | 9-9 | 0.900 | 3.0 | 1.50 | 1.00 | 1 |" in table


def test_without_cuda_it_stops_before_any_server(tmp_path, monkeypatch, fake_servers):
    monkeypatch.setattr(serving.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA"):
        serving.main(["--out", str(tmp_path)])
    assert fake_servers["started"] == []
