"""The embedded tiny model's build."""

from steer.models import tiny
from steer.config.schema import TinyConf


def test_building_the_tiny_model_prints_no_tokenizer_warning(tmp_path, capfd):
    conf = TinyConf(num_layers=1, hidden=64, heads=1, kv_heads=1, intermediate=64, train_steps=1)
    d = tiny.ensure_tiny(str(tmp_path), conf)
    out, err = capfd.readouterr()
    assert (d / "config.json").exists()
    assert "Token indices sequence length" not in out + err and "indexing errors" not in out + err
    assert "Writing model shards" not in out + err  # a quiet Lab, progress=false: the build says nothing


def test_the_cache_directory_honours_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        d = tiny.ensure_tiny(str(tmp_path), TinyConf(num_layers=1, hidden=64, heads=1, kv_heads=1, intermediate=64,
                                                     train_steps=1))
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert stat.S_IMODE((d / "config.json").stat().st_mode) == 0o644
