"""`run.execute`: a pack of jobs gives each job exactly what it gives alone."""

import io

from rich.console import Console

from helpers import compose
from steer import run

QUICK = ["prompts.steer=['The weather today is','My friend looked at me and said']", "progress=false"]


def test_pack_with_different_generation_settings_equals_solo_runs(tmp_path, cache_dir, tiny_spec):
    cfgs = [compose("gen.max_new_tokens=3", "edit.scale=4", *QUICK),
            compose("gen.max_new_tokens=6", "edit.scale=4", *QUICK),  # same prompts and seeds, longer baseline
            compose("gen.max_new_tokens=6", "edit=ablate", "tap=layer2", *QUICK)]
    console = Console(file=io.StringIO())

    def job(cfg, name):
        (tmp_path / name).mkdir()
        return run.Job(cfg, run.prepare(cfg), tmp_path / name)

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
                           ("vllm.tap_graphs=true", "needs engine=vllm"),
                           ("vllm.kv_cache_memory_bytes=0", "positive number of bytes")]:
        with pytest.raises(ConfigError) as e:
            run.prepare(compose(override, "engine=hf", f"cache_dir={cache_dir}"))
        assert e.value.field == override.split("=")[0] and says in str(e.value)
