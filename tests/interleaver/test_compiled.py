"""A compiled engine's taps (interleaver/compiled.py) on CPU: the stand-in runner's model, its hooks installed by the
tap worker as vLLM loads it, then compiled by torch.compile with fullgraph (as vLLM compiles a model: a graph
break is an error). Each step must equal the breakable in-graph worker's eager form of the same edits."""

import pytest
import torch

from interleaver.bank import EditBank, RequestEdits
from interleaver.vllm_internals import tap_location
from interleaver.tap_worker import COMPILED_KEY, COMPILED_VERSION, IN_GRAPH_KEY
from stand_in import H, step, tap_worker
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, Tokens

TAPS = (("layers.0", True), ("layers.1", True))


def _declared():
    bank = EditBank()
    v = torch.randn(1, H, generator=torch.Generator().manual_seed(0))
    add = RequestEdits(bank.register(tap_location("layers.0"),
        [compile_edit(EditKind.add, 2.0, v, tokens=Tokens.generated)]))
    abl = RequestEdits(bank.register(tap_location("layers.1"), [compile_edit(EditKind.ablate, 1.0, v)]))
    return bank.stage_list(), add, abl, v


def _compiled(declared, graphs):
    def backend(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)  # functionalized, as inductor sees it

    w = tap_worker({IN_GRAPH_KEY: declared, COMPILED_KEY: COMPILED_VERSION}, taps=TAPS)
    w.model_runner.model = torch.compile(w.model_runner.model, fullgraph=True, dynamic=True, backend=backend)
    return w


def test_compiled_taps_equal_the_in_graph_eager_form():
    torch._dynamo.reset()
    declared, add, abl, v = _declared()
    graphs = []
    w = _compiled(declared, graphs)
    ref = tap_worker({IN_GRAPH_KEY: declared}, taps=TAPS)
    steps = [
        [("a", 3, 0, 5, {"steer": add.to_args()}), ("b", 1, 9, 4, {"steer": add.to_args()}), ("c", 1, 2, 1, None)],
        [("b", 1, 10, 4, {"steer": add.to_args()}), ("d", 2, 4, 4, {"steer": abl.to_args()}),
         ("e", 1, 7, 3, {"steer": abl.to_args()})],
        [("c", 1, 3, 1, None), ("f", 1, 5, 2, None)],
    ]
    for reqs in steps:
        x = torch.randn(sum(r[1] for r in reqs), H)
        got, want = step(w.model_runner, reqs, x.clone()), step(ref.model_runner, reqs, x.clone())
        torch.testing.assert_close(got, want)
    # the edits landed (b's generated row moved) and the unsteered step is the model's own output
    x0, x2 = torch.randn(5, H), torch.randn(2, H)
    assert not torch.allclose(step(w.model_runner, steps[0], x0.clone()), x0)
    assert torch.equal(step(w.model_runner, steps[2], x2.clone()), x2)
    # one traced graph for every step (weights are data read at run time, nothing baked), the op once per tap
    assert len(graphs) == 1
    assert str(graphs[0].graph).count("steer.tap_edit") == len(TAPS)


def test_a_compiled_engine_needs_its_edits_declared():
    with pytest.raises(ValueError, match="runs only edits declared at start"):
        tap_worker({COMPILED_KEY: COMPILED_VERSION}, taps=TAPS)


def test_a_module_tap_edits_its_outputs_first_tensor():
    # A tap that is not a layer's residual stream reads its module's first output, as the breakable path does
    # (vLLM's linear layers hand on (output, bias); the stand-in's layer hands on a pair too).
    torch._dynamo.reset()
    bank = EditBank()
    v = torch.randn(1, H, generator=torch.Generator().manual_seed(1))
    add = RequestEdits(bank.register(tap_location("layers.0"), [compile_edit(EditKind.add, 3.0, v)]))
    declared = bank.stage_list()
    taps = (("layers.0", False),)
    w = tap_worker({IN_GRAPH_KEY: declared, COMPILED_KEY: COMPILED_VERSION}, taps=taps)
    w.model_runner.model = torch.compile(w.model_runner.model, fullgraph=True, backend="aot_eager")
    ref = tap_worker({IN_GRAPH_KEY: declared}, taps=taps)
    reqs = [("a", 2, 0, 2, {"steer": add.to_args()}), ("b", 1, 3, 1, None)]
    x = torch.randn(3, H)
    got = step(w.model_runner, reqs, x.clone())
    torch.testing.assert_close(got, step(ref.model_runner, reqs, x.clone()))
    torch.testing.assert_close(got[:2], x[:2] + 3.0 * v[0])  # the first tensor's delta reaches the stream
    assert torch.equal(got[2], x[2])
