"""The host micro-benchmark runs the tap worker's own code (interleaver's HostWorker) on a stand-in runner."""

import pytest

from steer.bench import host


@pytest.mark.parametrize("scen", ["add", "k8"])
def test_the_host_bench_times_the_join_step_the_workers_row_mapping_and_a_taps_program(scen):
    r = host.measure(8, scen, hidden=16, steps=3)
    assert (r["requests"], r["scenario"]) == (8, scen)
    assert r["join_us"] > 0 and r["fill_step_us"] > 0 and r["replay_us"] > 0 and r["churn_us"] > 0
    assert r["churn_ways"] == {"batch": 3}  # each serving step has a new request to look up


def test_a_serving_step_updates_the_rows_that_changed_and_keeps_the_rest(monkeypatch):
    from interleaver.bank import BatchEdits, RequestEdits

    whole, parsed = [], []
    init, parse = BatchEdits.__init__, RequestEdits.from_args.__func__
    monkeypatch.setattr(BatchEdits, "__init__", lambda self, *a: whole.append(1) or init(self, *a))
    monkeypatch.setattr(RequestEdits, "from_args", classmethod(lambda cls, d: parsed.append(d) or parse(cls, d)))
    host.measure(8, "k8", hidden=16, steps=5)
    assert len(whole) == 1  # the join step's; each of the 5 serving steps updated one row
    assert len(parsed) == len(set(parsed)) == 8  # k8: 8 requests, 8 vectors, each string parsed once


def test_the_host_bench_times_each_case_with_its_caches_hot_and_cold(capsys):
    """Cold: other memory read before each step, as an engine's step runs the taps' code once among much else."""
    r = host.measure(8, "add", hidden=16, steps=3, cold_mb=1)
    assert r["cold_mb"] == 1 and r["fill_step_us"] > 0 and r["replay_us"] > 0
    host.main(["--requests", "4", "--scenarios", "add", "--cold-mb", "1"])
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["4", "add", "hot"], ["4", "add", "cold"]]
    assert all(len(row.split()) == 7 for row in rows)  # with the serving step's column


def test_cold_caches_read_a_sane_amount_of_other_memory(tmp_path):
    with pytest.raises(ValueError, match="cold_mb: -1 MB"):
        host.measure(8, "add", hidden=16, steps=1, cold_mb=-1)
    with pytest.raises(SystemExit):
        host.main(["--cold-mb", "-1"])
    size = tmp_path / "size"
    size.write_text("1536K\n")
    assert host._llc_mb(str(size)) == 2  # rounded up
    size.write_text("300M\n")
    assert host._llc_mb(str(size)) == 300
    assert host._llc_mb(str(tmp_path / "none")) == 0  # the default then reads 64 MB
