from dataclasses import replace

import pytest
import torch

from steer.edits import vector
from steer.errors import ConfigError
from steer.runs.extract import Recipe, cached_default, direction, extract_to, prompt_rows
from steer.config.schema import ExtractConf, TapConf
from steer.edits.tap import resolve

POS = ["I am happy and glad", "What a lovely bright day"]
NEG = ["I am sad and tired", "What a grim dark day"]


def direct_mean(engine, prompts, layer, last, skip=0):
    rows = []
    for p in prompts:
        with torch.no_grad():
            hs = engine.model(torch.tensor([engine.encode(p)]), output_hidden_states=True).hidden_states[layer + 1][0]
        rows.append(hs[-1] if last else hs[skip:].mean(0))
    return torch.stack(rows).mean(0)


def test_the_difference_of_means_matches_direct_computation(hf_engine, tiny_spec):
    tap = resolve(TapConf(layer=1), tiny_spec)

    def difference(*sets, **recipe):
        return direction(hf_engine, tap, *sets, Recipe(**recipe))

    raw = dict(span="all", skip_first=False, skip_special=False, orthogonal_to_mean=False)  # every token fed
    for position in ("mean", "last"):
        d = difference(POS, NEG, position=position, **raw)
        last = position == "last"
        expected = direct_mean(hf_engine, POS, 1, last) - direct_mean(hf_engine, NEG, 1, last)
        torch.testing.assert_close(d, expected, atol=1e-4, rtol=1e-4)
    # The default leaves out the first token (the tiny model's is its BOS, a special token too).
    expected = direct_mean(hf_engine, POS, 1, False, skip=1) - direct_mean(hf_engine, NEG, 1, False, skip=1)
    plain = dict(orthogonal_to_mean=False)
    torch.testing.assert_close(difference(POS, NEG, **plain), expected, atol=1e-4, rtol=1e-4)
    assert hf_engine.encode(POS[0])[0] == hf_engine.tokenizer.bos_token_id
    torch.testing.assert_close(difference(POS, NEG, skip_first=False, **plain), expected,
                               atol=1e-4, rtol=1e-4)  # skip_special alone drops the BOS here
    assert abs(float(difference(POS, NEG, normalize=True).norm()) - 1) < 1e-5


@pytest.mark.parametrize("method", ["diffmean", "pca"])
def test_the_default_direction_has_no_part_along_the_rows_mean(hf_engine, tiny_spec, method):
    tap = resolve(TapConf(layer=1), tiny_spec)
    pos = POS + ["We laughed and smiled"]
    neg = NEG + ["We cried and sighed"]
    mean = (direct_mean(hf_engine, pos, 1, False, skip=1) + direct_mean(hf_engine, neg, 1, False, skip=1)) / 2
    plain = direction(hf_engine, tap, pos, neg, Recipe(method=method, orthogonal_to_mean=False))
    d = direction(hf_engine, tap, pos, neg, Recipe(method=method))  # orthogonal_to_mean is the default
    torch.testing.assert_close(d, plain - (plain @ mean) / (mean @ mean) * mean, atol=1e-4, rtol=1e-4)
    assert abs(float(d @ mean)) < 1e-5 * float(d.norm() * mean.norm())
    # There was a part to take out, ten times what the line above tolerates. (Its size is the trained tiny model's:
    # cos 1.8e-3 for pca under torch 2.13 on one CPU, 0.17-0.19 for the real model's diffmean.)
    assert abs(float(plain @ mean)) > 1e-4 * float(plain.norm() * mean.norm())


def test_extract_writes_metadata_and_caches(hf_engine, tiny_spec, tmp_path):
    tap = resolve(TapConf(layer=2), tiny_spec)
    p = extract_to(tmp_path / "v.safetensors", "joy", hf_engine, tap, POS, NEG)
    meta = vector.metadata(p)
    assert meta["tap"] == "layer2" and meta["positive"] == "2"
    assert {k: meta[k] for k in ("method", "position", "span", "chat", "skip_first", "skip_special", "normalize",
                                 "orthogonal_to_mean")} == {
        "method": "diffmean", "position": "mean", "span": "all", "chat": "false", "skip_first": "true",
        "skip_special": "true", "normalize": "false", "orthogonal_to_mean": "true"}
    first = cached_default(str(tmp_path), hf_engine, tap, POS, NEG)
    cached = list((tmp_path / "vectors").glob("*.safetensors"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    assert torch.equal(cached_default(str(tmp_path), hf_engine, tap, POS, NEG), first)
    assert cached[0].stat().st_mtime_ns == mtime
    torch.testing.assert_close(first[0], vector.load(p, "joy", tiny_spec.hidden)[0])
    for damage in (cached[0].read_bytes()[:40], b""):  # cut short, emptied: made again, not an error every run
        cached[0].write_bytes(damage)
        assert torch.equal(cached_default(str(tmp_path), hf_engine, tap, POS, NEG), first)


def test_cached_default_is_keyed_on_the_recipe(hf_engine, tiny_spec, tmp_path):
    tap = resolve(TapConf(layer=2), tiny_spec)
    base = cached_default(str(tmp_path), hf_engine, tap, POS, NEG)
    for n, recipe in enumerate([Recipe(span="all", skip_first=False, skip_special=False), Recipe(position="last"),
                                Recipe(method="pca"), Recipe(normalize=True), Recipe(orthogonal_to_mean=False)],
                               start=2):
        other = cached_default(str(tmp_path), hf_engine, tap, POS, NEG, recipe)
        assert not torch.allclose(other, base)
        assert len(list((tmp_path / "vectors").glob("*.safetensors"))) == n
    meta = [vector.metadata(p) for p in (tmp_path / "vectors").glob("*.safetensors")]
    assert sorted(m["method"] for m in meta) == ["diffmean"] * 5 + ["pca"]
    # chat "auto" on a tokenizer without a template resolves to raw prompts: the same vector, the same file.
    assert torch.equal(cached_default(str(tmp_path), hf_engine, tap, POS, NEG, Recipe(chat="auto")), base)
    assert len(list((tmp_path / "vectors").glob("*.safetensors"))) == 6


def test_pca_points_toward_the_positive_set(hf_engine, tiny_spec):
    tap = resolve(TapConf(layer=1), tiny_spec)
    pos = POS + ["We laughed and smiled", "She was delighted and warm"]
    neg = NEG + ["We cried and sighed", "She was miserable and cold"]
    recipe = Recipe(method="pca", orthogonal_to_mean=False)
    d = direction(hf_engine, tap, pos, neg, recipe)
    p, n = prompt_rows(hf_engine, tap, pos, recipe), prompt_rows(hf_engine, tap, neg, recipe)
    mean_diff = p.mean(0) - n.mean(0)
    assert float(d @ mean_diff) > 0
    assert float((p @ d).mean()) > float((n @ d).mean())
    # The first right singular vector of the paired differences, scaled by the mean difference along it.
    u = torch.linalg.svd(p - n, full_matrices=False).Vh[0]
    torch.testing.assert_close(d / d.norm(), u * torch.sign(u @ mean_diff), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(d.norm(), (mean_diff @ d / d.norm()).abs(), atol=1e-4, rtol=1e-4)
    # One pair: pca is that pair's difference, which is the difference of means.
    torch.testing.assert_close(direction(hf_engine, tap, pos[:1], neg[:1], recipe),
                               direction(hf_engine, tap, pos[:1], neg[:1], replace(recipe, method="diffmean")),
                               atol=1e-4, rtol=1e-4)


def test_bad_recipes_fail_before_the_engine_runs(hf_engine, tiny_spec):
    tap = resolve(TapConf(layer=1), tiny_spec)
    with pytest.raises(ConfigError) as e:
        Recipe.from_conf(ExtractConf(), "maybe")
    assert e.value.field == "prompts.chat"
    with pytest.raises(ConfigError, match="pca pairs") as e:
        Recipe(method="pca").check(POS, NEG[:1])
    assert e.value.field == "extract.method"
    with pytest.raises(ConfigError) as e:  # the tiny model's tokenizer has no chat template
        direction(hf_engine, tap, POS, NEG, Recipe(chat="true"))
    assert e.value.field == "prompts.chat"
    assert Recipe.from_conf(ExtractConf(), True).chat == "true"  # Hydra hands a YAML boolean over as a bool


@pytest.mark.parametrize("recipe", [Recipe(), Recipe(normalize=True), Recipe(method="pca")])
def test_sets_that_hold_no_direction_are_refused(hf_engine, tiny_spec, recipe):
    tap = resolve(TapConf(layer=2), tiny_spec)
    # the same set twice: a zero vector, NaN normalised, and for pca an arbitrary unit vector, each written as fine
    with pytest.raises(ConfigError, match="no direction between them") as e:
        direction(hf_engine, tap, POS, list(POS), recipe)
    assert e.value.field == "prompts.positive"


def test_cached_default_is_keyed_on_the_models_files_and_dtype(hf_engine, tiny_spec, tmp_path):
    import dataclasses
    import os
    import shutil

    class As:  # the same engine, described as another model
        def __init__(self, spec):
            self.spec = spec

        def __getattr__(self, name):
            return getattr(hf_engine, name)

    tap = resolve(TapConf(layer=2), tiny_spec)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_spec.source, ckpt)

    def cached():
        return len(list((tmp_path / "cache" / "vectors").glob("*.safetensors")))

    for n, spec in enumerate([tiny_spec, dataclasses.replace(tiny_spec, dtype=torch.bfloat16),
                              dataclasses.replace(tiny_spec, source=str(ckpt))], start=1):
        cached_default(str(tmp_path / "cache"), As(spec), tap, POS, NEG)
        assert cached() == n
    weights = next(ckpt.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # retrained in place
    cached_default(str(tmp_path / "cache"), As(dataclasses.replace(tiny_spec, source=str(ckpt))), tap, POS, NEG)
    assert cached() == 4


def test_auto_reads_ab_pairs_at_the_answers_last_token_and_other_pairs_as_a_mean_of_every_token():
    assert (Recipe.from_conf(ExtractConf()).position, Recipe.from_conf(ExtractConf()).span) == ("mean", "all")
    ab = Recipe.from_conf(ExtractConf(), ab=True, templated=True)  # in a chat rendering: the answer's last token
    assert (ab.position, ab.span) == ("last", "user")
    raw = Recipe.from_conf(ExtractConf(), ab=True)  # raw, the last token fed is the answer's already
    assert (raw.position, raw.span) == ("last", "all")
    assert Recipe(position="auto", span="auto").check() == Recipe(position="mean", span="all").check()
    mine = Recipe.from_conf(ExtractConf(position="mean", span="all"), ab=True)  # what the config says stands
    assert (mine.position, mine.span) == ("mean", "all")
