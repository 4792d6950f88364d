"""Each edit's math against a direct computation (steer/edits/edit.py, docs/configs.md), and the exact no-ops."""

import re

import pytest
import torch

from steer.edits.edit import compile_edit, orthonormal
from steer.errors import ConfigError
from steer.config.schema import EditKind, Tokens

H = 16


@pytest.fixture
def h():
    return torch.randn(7, H, generator=torch.Generator().manual_seed(0)) * 3


@pytest.fixture
def v():
    return torch.randn(1, H, generator=torch.Generator().manual_seed(1))


def unit(v):
    return v[0] / v[0].norm()


def test_add(h, v):
    e = compile_edit(EditKind.add, 2.5, v)
    x = h.clone()
    e.apply_(x)
    torch.testing.assert_close(x, h + 2.5 * v[0])


def test_ablate_removes_direction(h, v):
    d = unit(v)
    x = h.clone()
    compile_edit(EditKind.ablate, 1.0, v).apply_(x)
    torch.testing.assert_close(x, h - (h @ d)[:, None] * d)
    assert (x @ d).abs().max() < 1e-5


def test_ablate_partial_scale(h, v):
    d = unit(v)
    x = h.clone()
    compile_edit(EditKind.ablate, 0.5, v).apply_(x)
    torch.testing.assert_close(x @ d, 0.5 * (h @ d), atol=1e-5, rtol=1e-5)


def test_ablate_subspace_orthonormalises(h):
    a = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    a[2] = a[0] + 0.5 * a[1] + 0.1 * torch.randn(H)  # far from orthogonal
    x = h.clone()
    compile_edit(EditKind.ablate, 1.0, a).apply_(x)
    q, _ = torch.linalg.qr(a.double().T)  # direct: project onto the orthogonal complement of span(a)
    expected = h.double() - h.double() @ q @ q.T
    torch.testing.assert_close(x.double(), expected, atol=1e-4, rtol=1e-4)
    assert (x @ a.T).abs().max() < 1e-4


def test_orthonormal_keeps_sense_and_drops_dependent_rows():
    a = torch.tensor([[2.0, 0, 0], [4.0, 0, 0], [1.0, 1.0, 0]])
    q = orthonormal(a)
    assert q.shape == (2, 3)
    torch.testing.assert_close(q @ q.T, torch.eye(2))
    assert q[0, 0] > 0


def test_clamp(h, v):
    d = unit(v)
    x = h.clone()
    compile_edit(EditKind.clamp, 1.0, v, lo=-0.5, hi=0.25).apply_(x)
    p = h @ d
    torch.testing.assert_close(x, h + (p.clamp(-0.5, 0.25) - p)[:, None] * d)
    assert float((x @ d).max()) <= 0.25 + 1e-5 and float((x @ d).min()) >= -0.5 - 1e-5


def test_clamp_one_sided(h, v):
    d = unit(v)
    x = h.clone()
    compile_edit(EditKind.clamp, 1.0, v, lo=None, hi=0.0).apply_(x)
    p = h @ d
    torch.testing.assert_close(x @ d, torch.minimum(p, torch.zeros_like(p)), atol=1e-5, rtol=1e-5)


def test_set(h, v):
    d = unit(v)
    x = h.clone()
    compile_edit(EditKind.set, 1.0, v, value=3.0).apply_(x)
    torch.testing.assert_close(x @ d, torch.full((7,), 3.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x - (x @ d)[:, None] * d, h - (h @ d)[:, None] * d, atol=1e-5, rtol=1e-5)


def test_rescale_and_mean_ablation(h, v):
    x = h.clone()
    compile_edit(EditKind.rescale, 0.5, None).apply_(x)
    torch.testing.assert_close(x, 0.5 * h)
    x = h.clone()
    compile_edit(EditKind.rescale, 0.0, v).apply_(x)  # mean ablation: every row becomes the centre
    torch.testing.assert_close(x, v[0].expand_as(h))


@pytest.mark.parametrize("kind", [EditKind.add, EditKind.ablate, EditKind.clamp, EditKind.set])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_zero_is_exact_noop(h, v, kind, dtype):
    e = compile_edit(kind, 0.0, v, lo=-0.1, hi=0.1, value=5.0)
    assert e.is_noop
    x = h.to(dtype)
    before = x.clone()
    e.apply_(x)  # the math itself is exact, not only skipped
    assert torch.equal(x, before)


def test_empty_clamp_and_unit_scale_are_noops(h, v):
    assert compile_edit(EditKind.clamp, 1.0, v).is_noop
    assert compile_edit(EditKind.rescale, 1.0, None).is_noop
    assert not compile_edit(EditKind.clamp, 1.0, v, hi=0.0).is_noop
    x = h.clone()
    compile_edit(EditKind.clamp, 1.0, v).apply_(x)
    assert torch.equal(x, h)


def test_bf16_computes_in_float32_and_casts_back(h, v):
    x = h.to(torch.bfloat16)
    compile_edit(EditKind.ablate, 1.0, v).apply_(x)
    assert x.dtype == torch.bfloat16
    expected = h.to(torch.bfloat16).float()
    d = unit(v)
    expected = (expected - (expected @ d)[:, None] * d).to(torch.bfloat16)
    assert torch.equal(x, expected)


def test_row_weights_select_prompt_or_generated_rows(h, v):
    is_prompt = torch.tensor([True] * 4 + [False] * 3)
    for tokens, rows in [(Tokens.prompt, slice(0, 4)), (Tokens.generated, slice(4, 7))]:
        e = compile_edit(EditKind.add, 1.0, v, tokens=tokens)
        x = h.clone()
        e.apply_(x, e.row_weight(is_prompt))
        expected = h.clone()
        expected[rows] += v[0]
        assert torch.equal(x, expected)
    assert compile_edit(EditKind.add, 1.0, v).row_weight(is_prompt) is None


def test_edit_lands_in_a_view(v):
    big = torch.zeros(2, 5, H)
    rows = big.view(-1, H)[:3]  # a trimmed view, as an engine hands it
    compile_edit(EditKind.add, 1.0, v).apply_(rows)
    assert torch.equal(big[0, :3], v[0].expand(3, H)) and big[0, 3:].abs().sum() == 0


@pytest.mark.parametrize("kind,vectors,field", [
    (EditKind.add, None, "edit.vector"),
    (EditKind.add, torch.ones(2, H), "edit.vector"),
    (EditKind.clamp, torch.ones(2, H), "edit.vector"),
    (EditKind.ablate, torch.zeros(1, H), "edit.vector"),
])
def test_bad_edits(kind, vectors, field):
    with pytest.raises(ConfigError) as e:
        compile_edit(kind, 1.0, vectors)
    assert e.value.field == field


@pytest.mark.parametrize("kind,vec,settings,field,says", [
    (EditKind.add, 1.0, {"scale": 1e39}, "edit.scale", "beyond float32's range"),
    (EditKind.clamp, 1.0, {"hi": -1e300}, "edit.hi", "beyond float32's range"),
    (EditKind.set, 1.0, {"value": 4e38}, "edit.value", "beyond float32's range"),
    (EditKind.add, 1e20, {"scale": 1e20}, "edit.scale", "largest entry is 1e+40"),
])
def test_edits_beyond_float32_are_refused(kind, vec, settings, field, says):
    settings = {"scale": 1.0, **settings}
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        compile_edit(kind, settings.pop("scale"), torch.full((1, H), vec), **settings)
    assert e.value.field == field


def test_an_edit_at_the_edge_of_float32_compiles():
    assert compile_edit(EditKind.add, 3e38, torch.ones(1, H)).strength == 3e38


def test_reversed_clamp_bounds(v):
    with pytest.raises(ConfigError, match="lo=1.0 > hi=0.0"):
        compile_edit(EditKind.clamp, 1.0, v, lo=1.0, hi=0.0)


@pytest.mark.parametrize("kind,scale", [(EditKind.add, 3.0), (EditKind.ablate, 0.5), (EditKind.clamp, 2.0),
                                        (EditKind.set, -1.0), (EditKind.rescale, 0.25)])
def test_delta_is_strength_times_unit_delta(h, v, kind, scale):
    e = compile_edit(kind, scale, v, lo=-0.2, hi=0.3, value=1.5)
    torch.testing.assert_close(e.delta(h), e.strength * e.unit().delta(h), atol=1e-5, rtol=1e-5)
