"""edit.scale_by: the vector `add` adds at scale 1, computed directly from the file's tensor and metadata."""

import pytest
import torch

from helpers import compose
from steer.edits import vector
from steer.edits.plan import build
from steer.errors import ConfigError

HIDDEN = 256


@pytest.fixture(scope="module")
def shape(cache_dir):
    """The tiny model's spec, read from its recipe (building a plan needs no weights)."""
    from steer.config.schema import ModelConf
    from steer.models.spec import spec

    return spec(ModelConf(name="tiny"), str(cache_dir))


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(HIDDEN, generator=g) * 3
    one = vector.save(tmp_path / "one.safetensors", {"direction": v}, model="tiny", tap="layer1", method="diffmean",
                      extra={"diag.resid_norm": "12.5"})
    many = vector.save(tmp_path / "many.safetensors", {"direction.1": v, "direction.2": 2 * v}, model="tiny",
                       tap="layer1,layer2", method="diffmean",
                       extra={"layers": "1,2", "diag.1.resid_norm": "12.5", "diag.2.resid_norm": "20"})
    return v, one, many


def added(cfg, spec):
    plan = build(cfg, spec)
    tap, edit = plan.primary
    return edit.delta(torch.zeros(1, HIDDEN))[0]


@pytest.mark.parametrize("scale_by,factor", [("vector", None), ("unit", 1.0), ("resid", 12.5)])
def test_scale_by_sets_what_scale_multiplies(shape, files, scale_by, factor):
    v, one, _ = files
    cfg = compose(f"edit.vector.path={one}", "edit.scale=0.5", f"edit.scale_by={scale_by}")
    want = 0.5 * v if factor is None else 0.5 * factor * v / v.norm()
    torch.testing.assert_close(added(cfg, shape), want)


def test_resid_reads_the_layer_of_a_multi_layer_file(shape, files):
    v, _, many = files
    cfg = compose("tap=layer2", f"edit.vector.path={many}", "edit.vector.key=direction.2", "edit.scale_by=resid",
                  "edit.scale=1")
    torch.testing.assert_close(added(cfg, shape), 20.0 * v / v.norm())
    cfg = compose("tap=layer1", f"edit.vector.path={many}", "edit.vector.key=direction.2", "edit.scale_by=resid")
    with pytest.raises(ConfigError, match="recorded the residual norm at layer2, and the edit runs at layer1"):
        build(cfg, shape)


def test_resid_at_another_tap_than_extracted_is_refused(shape, files):
    _, one, _ = files
    cfg = compose("tap=layer2", f"edit.vector.path={one}", "edit.scale_by=resid")
    with pytest.raises(ConfigError) as e:
        build(cfg, shape)
    assert e.value.field == "edit.scale_by"
