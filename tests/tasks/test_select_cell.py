"""task=select's choice from its cells' rows, with no model: the grid's steer runs are replaced by rows given here
(tests/select_fake.py), and the gain, the cap's verdict and the chosen pair are checked against docs/sweeps.md's
rule computed directly (gain = probe_steered - probe_baseline toward the scale's pole; kept where every prompt's
ppl_steered <= max_ppl_ratio x its ppl_baseline; best: the kept pair of largest gain)."""

import json

import pytest

from helpers import compose
from select_fake import row, run_grid
from steer.tasks import select

CAP = 2.0
# (layer, scale) -> the metrics its steer run wrote for each of its prompts: gain 2 at ppl x1.25; gain 5 at x2
# exactly (values exactly representable, so the ratio is exactly the cap); gain -1.5 (steered away: a flipped sign
# would make it the best); gain 9 a hair past the cap.
METRICS = {
    (1, 2.0): {"probe_baseline": 1.0, "probe_steered": 3.0, "ppl_baseline": 2.0, "ppl_steered": 2.5},
    (1, 4.0): {"probe_baseline": 1.0, "probe_steered": 6.0, "ppl_baseline": 1.25, "ppl_steered": 2.5},
    (2, 2.0): {"probe_baseline": 2.0, "probe_steered": 0.5, "ppl_baseline": 1.0, "ppl_steered": 1.0},
    (2, 4.0): {"probe_baseline": 0.0, "probe_steered": 9.0, "ppl_baseline": 1.0, "ppl_steered": 2.0000001},
}


def direct(m):
    gain = m["probe_steered"] - m["probe_baseline"]
    return gain, m["ppl_steered"] / m["ppl_baseline"] <= CAP


@pytest.fixture
def selected(tmp_path, console):
    """select.run over a 2 x 2 grid whose cells 'ran' into METRICS (two prompts each); its summary."""
    return run_grid(tmp_path, console, {k: [row(**m), row(**m)] for k, m in METRICS.items()},
                    f"select.max_ppl_ratio={CAP}")


def test_each_cell_has_its_gain_and_the_caps_verdict(selected):
    got = {(c["layer"], c["scale"]): c for c in selected["cells"]}
    assert set(got) == set(METRICS)
    for key, m in METRICS.items():
        gain, ok = direct(m)
        assert got[key]["gain"] == pytest.approx(gain), f"cell {key}: gain {got[key]['gain']}, expected {gain}"
        assert got[key]["ok"] is ok, f"cell {key}: ppl x{got[key]['ppl_ratio']!r} against cap {CAP}: ok should be {ok}"
    # The rule's edges, said outright: a pair exactly at the cap is kept, one a hair past it is not.
    assert got[(1, 4.0)]["ppl_ratio"] == CAP and got[(1, 4.0)]["ok"], got[(1, 4.0)]
    over = got[(2, 4.0)]
    assert not over["ok"] and "2 of 2 prompts damaged (2 ppl over; max 0)" in over["why"], over
    assert over["why"].endswith("ppl x2.0000001 > 2") and over["damaged"][0]["damage"] == ["ppl x2.0000001 > 2"]


def test_the_best_pair_is_the_kept_one_of_largest_gain(selected, tmp_path):
    kept = {k: direct(m)[0] for k, m in METRICS.items() if direct(m)[1]}
    want = max(kept, key=kept.get)
    assert want == (1, 4.0)  # the cell at the cap, ahead of a larger gain past it and of gains in the wrong sense
    best = selected["best"]
    assert (best["layer"], best["scale"]) == want, f"picked layer {best['layer']} scale {best['scale']} (gain " \
                                                  f"{best['gain']}); expected {want}, gain {kept[want]}"
    assert best["gain"] == pytest.approx(5.0)
    assert selected["command"].endswith("tap.layer=1 edit.scale=4")
    assert json.loads((tmp_path / "selection.json").read_text())["best"] == best
    assert "**Best: layer 1, scale 4** (toward the positive set)" in (tmp_path / "selection.md").read_text()


def _contrast(a, b):
    """WCAG 2 contrast ratio of two RGB colours (components in 0..1)."""
    def lum(rgb):
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_the_heat_map_draws_rejected_pairs_apart_from_the_colour_map(selected):
    import matplotlib
    import numpy as np

    cfg = compose("task=select", "select.layers=[1,2]", "select.scales=[2,4]", f"select.max_ppl_ratio={CAP}",
                  "progress=false")
    fig = select.figure(cfg, selected["cells"], selected["best"])
    fig.canvas.draw()
    px = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(float) / 255
    ax = fig.axes[0]

    def patch(j, i, dx=0.3, dy=0.3, r=4):
        """The pixels of a small square inside cell (row i, column j), away from its label and its frame."""
        x, y = ax.transData.transform((j + dx, i + dy))
        row, col = int(round(px.shape[0] - y)), int(round(x))
        return px[row - r: row + r + 1, col - r: col + r + 1].reshape(-1, 3)

    kept = {k: direct(m)[0] for k, m in METRICS.items() if direct(m)[1]}
    lo, hi = min(kept.values()), max(kept.values())  # the colour map spans the kept pairs' gains alone
    layers, scales = [1, 2], [2.0, 4.0]
    for layer, scale in METRICS:
        i, j = layers.index(layer), scales.index(scale)
        got = patch(j, i)
        if (layer, scale) in kept:
            want = np.array(matplotlib.colormaps["viridis"]((kept[(layer, scale)] - lo) / (hi - lo))[:3])
            assert np.abs(got - want).max() < 0.02, f"cell {(layer, scale)}: {got[0]} is not viridis' {want}"
        else:  # grey and white only: no colour of the map
            assert np.abs(got - got.mean(axis=1, keepdims=True)).max() < 0.02, f"cell {(layer, scale)} is coloured"
            assert got.max() > 0.95 and got.min() < 0.85, f"cell {(layer, scale)}: no white hatching on grey"
    # every label stands out from the cell behind it (WCAG's 4.5:1 for small text), read off the drawn pixels
    for t in ax.texts:
        x, y = t.get_position()
        j, i = int(round(x)), int(round(y))
        back = np.median(patch(j, i, dx=0.0, dy=-0.3), axis=0) if (layers[i], scales[j]) in kept else \
            np.array(matplotlib.colors.to_rgb(select.REJECTED_FACE))
        assert _contrast(matplotlib.colors.to_rgb(t.get_color()), back) >= 4.5, (t.get_text(), t.get_color(), back)
    texts = {t.get_text() for t in ax.texts}
    assert "9\n2 of 2 damaged; ppl x2.0000001 > 2" in texts, texts  # a rejected pair says why
    import matplotlib.pyplot as plt

    plt.close(fig)
