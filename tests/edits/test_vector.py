import os
import re
import stat

import pytest
import torch
from safetensors.torch import save_file

from steer.edits import vector
from steer.errors import ConfigError


def test_save_load_roundtrip_with_metadata(tmp_path):
    v = torch.randn(8)
    p = vector.save(tmp_path / "v.safetensors", {"direction": v}, model="tiny", tap="layer1", method="manual")
    meta = vector.metadata(p)
    assert meta["model"] == "tiny" and meta["tap"] == "layer1" and meta["method"] == "manual"
    assert meta["date"].startswith("20") and meta["hidden"] == "8"
    out = vector.load(p, "direction", 8)
    assert out.shape == (1, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out[0], v)
    assert not list(tmp_path.glob(".v.safetensors.*"))  # no temporary left behind


def test_subspace_and_half_precision(tmp_path):
    p = tmp_path / "s.safetensors"
    save_file({"basis": torch.randn(3, 8, dtype=torch.bfloat16)}, str(p))
    out = vector.load(p, "basis", 8)
    assert out.shape == (3, 8) and out.dtype == torch.float32


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        vector.load(tmp_path / "nope.safetensors", "direction", 8)
    assert e.value.field == "edit.vector.path"


def test_a_directory_is_not_a_vector_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; expected a .safetensors file") as e:
        vector.load(tmp_path, "direction", 8)
    assert e.value.field == "edit.vector.path"


def test_not_safetensors(tmp_path):
    p = tmp_path / "junk.safetensors"
    p.write_text("not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        vector.load(p, "direction", 8)


def test_missing_key_lists_keys(tmp_path):
    p = tmp_path / "v.safetensors"
    save_file({"a": torch.randn(8), "b": torch.randn(8)}, str(p))
    with pytest.raises(ConfigError, match=r"key 'c' is not in .*keys present: \['a', 'b'\]") as e:
        vector.load(p, "c", 8)
    assert e.value.field == "edit.vector.key"


@pytest.mark.parametrize("shape", [(7,), (2, 7)])
def test_wrong_shape_names_both_sizes(tmp_path, shape):
    p = tmp_path / "v.safetensors"
    save_file({"d": torch.randn(shape)}, str(p))
    with pytest.raises(ConfigError, match="the model's hidden size is 8, the vector's last dimension 7"):
        vector.load(p, "d", 8)


@pytest.mark.parametrize("shape,dims", [((2, 3, 8), 3), ((), 0)])
def test_wrong_number_of_dimensions_says_so(tmp_path, shape, dims):
    p = tmp_path / "v.safetensors"
    save_file({"d": torch.randn(shape)}, str(p))
    with pytest.raises(ConfigError, match=rf"has {dims} dimensions: expected \[8\] .* or \[k, 8\]") as e:
        vector.load(p, "d", 8)
    assert "hidden size" not in str(e.value)  # not the size message, whose sizes would agree


@pytest.mark.parametrize("v,says", [(torch.zeros(8), "the vector is all zeros"),
                                    (torch.cat([torch.randn(1, 8), torch.zeros(1, 8)]), "rows [1] are all zeros")])
def test_zero_vector_is_refused(tmp_path, v, says):
    p = tmp_path / "v.safetensors"
    save_file({"d": v}, str(p))
    with pytest.raises(ConfigError, match=re.escape(says)):
        vector.load(p, "d", 8)


def test_saved_files_honour_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        p = vector.save(tmp_path / "v.safetensors", {"d": torch.randn(8)}, model="m", tap="t", method="x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


@pytest.mark.parametrize("bad,dtype,word", [(float("nan"), torch.float32, "1 NaN"),
                                             (float("inf"), torch.float32, "1 infinite"),
                                             (1e39, torch.float64, "1 beyond float32's range"),
                                             (-1e300, torch.float64, "1 beyond float32's range"),
                                             (float("nan"), torch.float8_e5m2, "1 NaN")])
def test_non_finite(tmp_path, bad, dtype, word):
    v = torch.randn(8, dtype=torch.float64)
    v[2] = bad
    p = tmp_path / "v.safetensors"
    save_file({"d": v.to(dtype)}, str(p))
    with pytest.raises(ConfigError, match=f"entries are {word}"):
        vector.load(p, "d", 8)


def test_a_float64_vector_within_float32s_range_loads_as_float32(tmp_path):
    v = torch.randn(8, dtype=torch.float64) * 1e30
    p = tmp_path / "v.safetensors"
    save_file({"d": v}, str(p))
    got = vector.load(p, "d", 8)
    assert got.dtype == torch.float32 and torch.equal(got[0], v.float())


def test_an_empty_subspace_is_named_as_empty(tmp_path):
    p = tmp_path / "v.safetensors"
    save_file({"d": torch.zeros(0, 8)}, str(p))
    with pytest.raises(ConfigError, match=re.escape("shape [0, 8] holds no direction")):
        vector.load(p, "d", 8)


def test_integer_dtype(tmp_path):
    p = tmp_path / "v.safetensors"
    save_file({"d": torch.arange(8)}, str(p))
    with pytest.raises(ConfigError, match="not a floating-point type"):
        vector.load(p, "d", 8)


def test_the_same_vector_saved_again_leaves_the_file_as_it_was(tmp_path):
    import hashlib

    def sha(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    v = torch.randn(8)
    p = vector.save(tmp_path / "v.safetensors", {"direction": v}, model="m", tap="layer1", method="mean_diff")
    before = (sha(p), p.stat().st_mtime_ns)
    vector.save(p, {"direction": v.clone()}, model="m", tap="layer1", method="mean_diff")  # a later date
    assert (sha(p), p.stat().st_mtime_ns) == before
    vector.save(p, {"direction": v}, model="m", tap="layer2", method="mean_diff")  # made elsewhere
    assert sha(p) != before[0] and vector.metadata(p)["tap"] == "layer2"
    after = sha(p)
    vector.save(p, {"direction": v + 1}, model="m", tap="layer2", method="mean_diff")  # another direction
    assert sha(p) != after and torch.equal(vector.load(p, "direction", 8), (v + 1).unsqueeze(0))


def test_a_loaded_vector_is_not_changed_by_its_file_rewritten_in_place(tmp_path):
    p = tmp_path / "v.safetensors"
    save_file({"d": torch.ones(8)}, str(p))
    v = vector.load(p, "d", 8)
    save_file({"d": torch.full((8,), 7.0)}, str(tmp_path / "w.safetensors"))
    with open(p, "r+b") as f:  # as `cp w.safetensors v.safetensors` does, while a job runs with v
        f.write((tmp_path / "w.safetensors").read_bytes())
    assert torch.equal(v, torch.ones(1, 8))
