"""task=select on SmolLM2 (CPU), the cases a steering researcher met: a prompt that collapses into a loop at most
settings, a grid of negative scales, and layers whose own directions read on different rulers. One Lab (one engine)
runs them all; each grid is what the case names. The probe's readings are checked against the engine read directly.
Run with `-s` to see each case's tables."""

import json

import pytest

import steer
from steer.edits import vector
from steer.runs import metrics
from steer.tasks.select import read_rows

# One worker runs the three cases, on one Lab, and early in the run (--dist loadgroup): the longest tests there are
pytestmark = pytest.mark.xdist_group("smollm2_select")

JOY = ["The weather today is", "When I opened the letter, I felt", "My friend looked at me and said",
       "The old house at the end of the street", "After the long journey we finally", "The music in the hall was"]
BATTERY = "My phone battery died again."
# (b) and (c) read each pair's gain on the probe, which 12 tokens show as the default 24 do; (a)'s loops need the 24
SHORT = ["gen.max_new_tokens=12"]


@pytest.fixture(scope="module")
def lab(smollm2_spec):
    with steer.Lab(model="smollm2", overrides=["engine=hf", "progress=false"], quiet=True) as lab:
        yield lab


def cells(sel):
    return {(c["layer"], c["scale"]): c for c in sel.cells}


def show(title, sel):
    best = sel.best and (sel.best["layer"], sel.best["scale"])
    print(f"\n== {title}: probe {sel.summary['probe']['layer']} (AUC by layer "
          f"{sel.summary['probe']['heldout_auc_by_layer']}); best {best}")
    for c in sel.cells:
        print(f"  layer {c['layer']:>2} scale {c['scale']:>5g}: gain {c['gain']!s:.6} (own layer "
              f"{c['gain_layer']!s:.6}) ppl x{c['ppl_ratio']!s:.5} kept {c['ok']}; {c['why'] or ''}")
        for d in c["damaged"]:
            print(f"      {d['half']:>6} prompt {d['index'] + 1} {d['prompt']!r}: {'; '.join(d['damage'])}")


def test_a_prompt_that_loops_rejects_its_pairs_and_the_chosen_one_loops_on_none(lab):
    sel = lab.select(layers=[9, 12, 15], scales=[0.15, 0.3, 0.6], prompts=JOY + [BATTERY],
                     overrides=["edit.scale_by=resid"])
    show("(a)", sel)
    choose = set(sel.summary["split"]["choose"])
    # the battery prompt collapses into a loop at most settings, and each such pair names it
    battery = [c for c in sel.cells if any(d["looping"] and d["prompt"] == BATTERY for d in c["damaged"])]
    assert len(battery) >= 4, [c["dir"] for c in battery]
    for c in sel.cells:  # a pair with a looping prompt among those it is chosen on is rejected, saying so
        if any(d["looping"] and d["index"] in choose for d in c["damaged"]):
            assert not c["ok"] and "loop" in c["why"], c
    if sel.best is not None:  # the chosen pair loops on no prompt, on either half
        assert not [d for d in sel.best["damaged"] if d["looping"]], sel.best["damaged"]
    else:
        assert all(c["why"] for c in sel.cells)
    md = (sel.dir / "selection.md").read_text()
    assert f"| 7: {BATTERY} |" in md  # the damaged prompts' table names it
    for c in sel.cells:  # the run's own counts, per pair, agree with its rows' flags
        rows = read_rows(sel.dir / c["dir"])
        m = json.loads((sel.dir / c["dir"] / "metrics.json").read_text())
        assert m["prompts_looping"] == sum(r["looping"] for r in rows)


def test_a_grid_of_negative_scales_chooses_a_pair_that_moves_toward_the_negative_set(lab):
    # the default grid's layers of best held-out AUC (3 and 6 read lower): the probe, so each pair's gain, is the full
    # grid's
    sel = lab.select(layers=[9, 12, 15], scales=[-4, -2], overrides=SHORT)
    show("(b)", sel)
    best = sel.best
    assert best is not None and best["scale"] < 0 and best["pole"] == "negative"
    assert best["choose"]["probe_steered"] < best["choose"]["probe_baseline"]  # toward gloom, on the probe's ruler
    assert best["gain"] == pytest.approx(best["choose"]["probe_baseline"] - best["choose"]["probe_steered"])


def test_layers_3_and_12_are_ranked_by_one_probe_read_as_the_engine_reads_it(lab, smollm2_spec, smollm2_engine):
    sel = lab.select(layers=[3, 12], overrides=SHORT)
    show("(c)", sel)
    probe = sel.summary["probe"]
    assert probe["layer"] == 12 and probe["heldout_auc_by_layer"]["12"] > probe["heldout_auc_by_layer"]["3"]
    kept = [c for c in sel.cells if c["ok"] and c["gain"] > 0]
    assert sel.best == max(kept, key=lambda c: c["gain"])
    # a pair's probe reading is the unsteered model's tap values at the probe's layer on its steered text,
    # projected on the probe's direction: read here with an engine other than the Lab's
    d = vector.load(probe["file"], "direction", smollm2_spec.hidden)[0]
    engine = smollm2_engine
    path = smollm2_spec.layer_path(12)
    for c in (cells(sel)[(3, 2.0)], sel.best):
        r = read_rows(sel.dir / c["dir"])[0]
        _, captured = engine.score(r["prompt_ids"], r["steered_ids"], None, (path,))
        want = metrics.concept(captured[path][len(r["prompt_ids"]):], d)
        assert r["probe_steered"] == pytest.approx(want, rel=1e-3, abs=1e-3), c["dir"]
