import torch

from steer import vector
from steer.extract import cached_default, diff_of_means, extract_to
from steer.schema import TapConf
from steer.tap import resolve

POS = ["I am happy and glad", "What a lovely bright day"]
NEG = ["I am sad and tired", "What a grim dark day"]


def direct_mean(engine, prompts, layer, last):
    rows = []
    for p in prompts:
        with torch.no_grad():
            hs = engine.model(torch.tensor([engine.encode(p)]), output_hidden_states=True).hidden_states[layer + 1][0]
        rows.append(hs[-1] if last else hs.mean(0))
    return torch.stack(rows).mean(0)


def test_diff_of_means_matches_direct_computation(hf_engine, tiny_spec):
    tap = resolve(TapConf(layer=1), tiny_spec)
    for position in ("mean", "last"):
        d = diff_of_means(hf_engine, tap, POS, NEG, position)
        last = position == "last"
        expected = direct_mean(hf_engine, POS, 1, last) - direct_mean(hf_engine, NEG, 1, last)
        torch.testing.assert_close(d, expected, atol=1e-4, rtol=1e-4)
    assert abs(float(diff_of_means(hf_engine, tap, POS, NEG, normalize=True).norm()) - 1) < 1e-5


def test_extract_writes_metadata_and_caches(hf_engine, tiny_spec, tmp_path):
    tap = resolve(TapConf(layer=2), tiny_spec)
    p = extract_to(tmp_path / "v.safetensors", "joy", hf_engine, tap, POS, NEG)
    meta = vector.metadata(p)
    assert meta["tap"] == "layer2" and meta["method"] == "diff-of-means/mean" and meta["positive"] == "2"
    first = cached_default(str(tmp_path), hf_engine, tap, POS, NEG)
    cached = list((tmp_path / "vectors").glob("*.safetensors"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    assert torch.equal(cached_default(str(tmp_path), hf_engine, tap, POS, NEG), first)
    assert cached[0].stat().st_mtime_ns == mtime
    torch.testing.assert_close(first[0], vector.load(p, "joy", tiny_spec.hidden)[0])
