"""A mixed batch of steered requests on the fake graph (fake.py), shared by the tests of the ways a tap's
program can run: its edits, the steps it serves, and the engine they run on."""

import nnsight
import torch

from fake import H, Graphed
from interleaver import EditBank, RequestEdits, Span, TapProgram, VLLMInterleaver
from interleaver.bank import layout
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, Tokens


def edits_and_inputs():
    """Five requests' edits (every kind, an unsteered one, a two-edit one) and inputs of 5, 3 and 2 rows."""
    g = torch.Generator().manual_seed(0)
    v, d = torch.randn(1, H, generator=g), torch.randn(1, H, generator=g)
    edits = [[compile_edit(EditKind.add, 2.0, v)], [compile_edit(EditKind.ablate, 1.0, d)],
             [compile_edit(EditKind.clamp, 1.0, d, lo=-0.1, hi=0.1)], None,
             [compile_edit(EditKind.add, 3.0, v, tokens=Tokens.generated), compile_edit(EditKind.set, 1.0, d)]]
    return edits, [torch.randn(n, H, generator=g) for n in (5, 3, 2)]


def steps(reqs, x5, x3, x2):
    """Decode rows, a prefill chunk beside a decode row, and a step nobody steers."""
    return [([Span(i, 1, 6, 3, r) for i, r in enumerate(reqs)], x5),
            ([Span(0, 2, 0, 4, reqs[4]), Span(2, 1, 9, 3, reqs[0])], x3),
            ([Span(0, 1, 7, 3, None), Span(1, 1, 7, 3, None)], x2)]


def engine(taps, edits, tap_of=lambda e: 0):
    """The fake graph (not yet recorded) with every tap's program; request i's edits at `taps[tap_of(edits[i])]`."""
    il = VLLMInterleaver(taps=taps)
    module = Graphed(il)
    nnsight.NNsight(module, interleaver=il)
    bank = EditBank()
    reqs = [RequestEdits(bank.register(taps[tap_of(e)], e)) if e else None for e in edits]
    il.step.order = layout(bank.stages)
    columns = {int(s): c for c, s in enumerate(il.step.order)}
    il.programs = {t: TapProgram(t, bank.at(t), residual=False, columns=columns) for t in taps}
    return module, il, bank, reqs


def run(module, il, bank, steps):
    """Each step's output, the step's rows set before it and cleared after, as the worker does."""
    outs = []
    for spans, x in steps:
        il.step.set(spans, x.shape[0], len(bank.stages), "cpu")
        outs.append(module(x).clone())
        il.step.clear()
    return outs
