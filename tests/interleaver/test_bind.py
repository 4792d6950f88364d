"""A tap's fused launch bound to its tensors (triton_internals.bind, kernels.Fused) and run at a replayed break
over the step's rows (TapProgram.at_break, VLLMInterleaver._break), on CPU: Triton's launcher, JIT and kernel stand
in (fake_triton.py), and a bound launch must edit exactly what the unbound one would."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mixed
from fake import PAD
from fake_triton import direction_table, in_torch
from interleaver import kernels, nnsight_internals, triton_internals
from interleaver.bank import EditBank
from interleaver.interleaver import VLLMInterleaver
from interleaver.program import TapProgram
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind
from test_program import TAP


class _Compiled:
    """A compiled kernel as `bind` reads it: its launcher (recording each call), function and metadata."""

    function, packed_metadata = 77, (4, 1, 0)

    def __init__(self, scratch=0):
        self.launches = []
        self.run = SimpleNamespace(launch=lambda *a: self.launches.append(a), global_scratch_size=scratch,
                                   profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=True)


def _runtime(monkeypatch):
    """Triton's knobs (no launch hooks) and driver (stream of device d: 1000 + d) as `bind` reads them."""
    knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]),
                                                    launch_exit_hook=SimpleNamespace(calls=[])))
    streams = []
    driver = SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda d: streams.append(d) or 1000 + d))
    monkeypatch.setattr(triton_internals, "_runtime", lambda: (knobs, driver))
    return knobs, streams


def test_a_bound_launch_calls_tritons_c_launcher_as_a_launch_of_the_compiled_kernel_would(monkeypatch):
    knobs, streams = _runtime(monkeypatch)
    compiled, t = _Compiled(), torch.zeros(8)
    go = triton_internals.bind(compiled, 3, (t, t[2:], 7, 16, True, 256))
    assert go(5) is True and streams == [3]
    # Triton 3.6's format "iiiKKppOOOOOO": grid, stream, function, cooperative, pdl, both scratch buffers (none),
    # the packed metadata, launch metadata and both hooks (none); then the kernel's arguments, tensors as addresses
    assert compiled.launches == [(5, 1, 1, 1003, 77, False, True, None, None, (4, 1, 0), None, None, None,
                                  t.data_ptr(), t.data_ptr() + 8, 7, 16, True, 256)]
    knobs.runtime.launch_exit_hook.calls.append(print)  # a profiler's hook, installed after the binding
    assert go(5) is False and len(compiled.launches) == 1  # declined: the unbound launch calls the hooks
    for other in (_Compiled(scratch=64), SimpleNamespace(run=compiled.run, function=None, packed_metadata=()),
                  object()):  # scratch memory per launch, a handle that is no address, no launcher at all
        assert triton_internals.bind(other, 0, ()) is None
    monkeypatch.setattr(triton_internals, "_runtime", lambda: None)  # no Triton
    assert triton_internals.bind(compiled, 0, ()) is None


def test_a_launch_on_the_same_tensors_reuses_its_binding_over_any_leading_rows(fake_triton):
    fake, table = fake_triton(), direction_table()
    g = torch.Generator().manual_seed(1)
    h, r, w = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.rand(8, 2, generator=g)
    table(h.clone(), r, w)  # through the JIT, compiling
    for rows in (8, 5, 1):  # a graph's tap value: the same memory every step, its first `rows` real
        want = h.clone()
        in_torch(table, want, r, w, rows)
        assert table(h, r, w, rows=rows) is True
        assert torch.equal(h, want)
    assert len(fake.binds) == 1 and fake.bound_rows == [8, 5, 1]
    table(h, r, w[:4].clone(), rows=4)  # the step's weights elsewhere: bound anew
    table(h[:6], r[:6], w, rows=6)  # views at the same addresses: the same binding
    assert len(fake.binds) == 2 and fake.bound_rows == [8, 5, 1, 4, 6]
    assert fake.devices == [None, None]  # each bound on its tensors' own device (a CPU tensor's has no index)
    assert table(h, r, w, rows=0) is False and table(h[:2], r[:2], w, rows=3) is False  # no rows, or too many
    assert fake.bound_rows == [8, 5, 1, 4, 6]


def test_a_break_finds_its_launch_by_its_tensors_identity_and_nothing_else(fake_triton, monkeypatch):
    """A replayed graph hands a break the same tensor objects every step: the second break on them launches without
    reading their attributes, and a step with new weights reads only the weights'. Eager views, a tensor now at a
    dead one's id, rows the tensors do not hold, an unbound form and a profiler's hooks go the address way."""
    fake, table = fake_triton(), direction_table()
    looked, weighed = [], []
    monkeypatch.setattr(kernels, "_addresses", lambda *a, f=kernels._addresses: looked.append(1) or f(*a))
    monkeypatch.setattr(kernels, "_weights_key", lambda w, f=kernels._weights_key: weighed.append(1) or f(w))
    g = torch.Generator().manual_seed(6)
    h, r, w = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.rand(8, 2, generator=g)
    want = h.clone()
    for rows in (8, 8, 3):
        in_torch(table, want, r, w, rows)
        assert table(h, r, w, rows=rows) is True
    # the JIT's launch and the binding looked the tensors up; the third break knew them
    assert torch.equal(h, want) and fake.bound_rows == [8, 3] and len(looked) == 2
    w2 = w.clone()  # the next step's weights, elsewhere: looked up whole once, then known
    table(h, r, w2, rows=8)
    table(h, r, w2, rows=8)
    assert len(looked) == 3 and len(fake.binds) == 2
    weighed.clear()
    table(h, r, w, rows=8)  # weights where a step's were bound before: only their own part of the key read
    assert len(looked) == 3 and len(weighed) == 1 and fake.bound_rows == [8, 3, 8, 8, 8]
    bound = len(fake.bound_rows)
    assert table(h, r, w[:4], rows=6) is False  # weights at a known address with fewer rows than the step's
    assert table(h, r, w, rows=9) is False and len(looked) == 5  # more rows than they hold: the address way
    assert len(fake.bound_rows) == bound
    table(h[:8], r, w)  # an eager call (no rows) on the step's trimmed views: never remembered by identity
    table(h[:8], r, w)
    assert len(looked) == 7 and list(table._seen) == [(id(h), id(r))]
    for i in (0, 1):  # a new hidden or residual at a dead one's id: its weak reference tells them apart
        known = [h, r]
        known[i] = known[i].clone()
        table._seen[tuple(map(id, known))] = table._seen.pop((id(h), id(r)))
        before = len(looked)
        table(*known, w, rows=8)
        assert len(looked) == before + 1
        table._seen.pop(tuple(map(id, known)))
        table(h, r, w, rows=8)  # known again
    n, bound = len(fake.direct_args), len(fake.bound_rows)
    table.bound = False  # the kernel bench's unbound forms: never served by a binding
    table(h, r, w, rows=8)
    table.bound, fake.hooked = True, True  # a profiler's launch hooks: the known launch declines
    table(h, r, w, rows=8)
    assert len(fake.direct_args) == n + 2 and len(fake.bound_rows) == bound
    monkeypatch.setattr(kernels, "_SEEN_MAX", 2)
    fake.hooked, values = False, [(torch.randn(8, 16, generator=g), r) for _ in range(3)]  # three graph sizes'
    table._seen.clear()
    for x, res in values:
        table(x, res, w, rows=8)
    assert list(table._seen) == [(id(values[2][0]), id(r))]  # a full table of known breaks starts again


def test_a_break_known_by_identity_launches_no_more_rows_than_its_weights_hold(fake_triton):
    fake, table = fake_triton(), direction_table()
    g = torch.Generator().manual_seed(7)
    h, r, w = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.rand(4, 2, generator=g)
    for _ in range(3):  # through the JIT, bound, then known by identity
        assert table(h, r, w, rows=4) is True
    assert fake.bound_rows == [4, 4] and len(table._seen) == 1
    assert table(h, r, w, rows=6) is False and fake.bound_rows == [4, 4]  # hidden holds 8 rows, the weights 4


@pytest.mark.usefixtures("fake_recording")
def test_a_recorded_break_reads_its_tensors_attributes_on_its_first_replay_only(fake_triton, monkeypatch):
    """Through the whole chain (recorded break, _break, at_break, Fused): a graph's break closure hands the same
    objects every replay, which is what the identity lookup stands on."""
    fake_triton()
    monkeypatch.setattr(kernels, "available", lambda device: True)
    looked = []
    monkeypatch.setattr(kernels, "_addresses", lambda *a, f=kernels._addresses: looked.append(1) or f(*a))
    edits, inputs = mixed.edits_and_inputs()
    edits[4] = edits[4][:1]
    module, il, bank, reqs = mixed.engine(["model.layers.0.output"], edits)
    module.record()
    spans, x = mixed.steps(reqs, *inputs)[0]
    il.step.set(spans, x.shape[0], len(bank.stages), "cpu")
    il.step.weights = il.step.weights.contiguous()  # as _upload leaves it on a GPU (on CPU, numpy's column order)
    looked.clear()  # (the engine's start compiled and bound the kernel on tensors of its own)
    outs = [module(x).clone() for _ in range(3)]  # replays of one step: the first binds, the others know it
    assert len(looked) == 1 and len(il.programs["model.layers.0.output"]._fused._seen) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    il.step.clear()
    assert not torch.equal(module(x), outs[0])  # the breaks did edit


def test_unbound_or_unbindable_direct_launches_go_through_the_compiled_kernel(fake_triton, monkeypatch):
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(4, 16, generator=g), torch.rand(4, 2, generator=g)
    for bindable, bound in ((False, True), (True, False)):
        fake, table = fake_triton(bindable=bindable), direction_table()
        table.bound = bound
        want = h.clone()
        in_torch(table, want, None, w)
        in_torch(table, want, None, w)
        x = h.clone()
        table(x, None, w)
        table(x, None, w)
        assert torch.equal(x, want) and len(fake.jit_args) == 1 and len(fake.direct_args) == 1
        assert fake.bound_rows == [] and table._bound == {}
    monkeypatch.setattr(kernels, "_BOUND_MAX", 2)
    fake, table = fake_triton(), direction_table()
    for _ in range(4):
        table(torch.randn(4, 16), None, w)
    assert len(fake.binds) == 3 and len(table._bound) == 1  # a full table of bindings starts again



@pytest.mark.usefixtures("fake_recording")
def test_a_replayed_break_launches_the_fused_kernel_once_over_the_real_rows(monkeypatch):
    rows = []
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(kernels.Fused, "warm", lambda self: None)
    monkeypatch.setattr(kernels.Fused, "__call__",
                        lambda self, h, r, w, n=None: rows.append(n if n is None else (n, h.shape[0]))
                        or in_torch(self, h, r, w, n))
    edits, inputs = mixed.edits_and_inputs()
    edits[4] = edits[4][:1]  # one edit a request: a table of one index, which the fused kernel takes
    outs = {}
    for fused in (True, False):
        module, il, bank, reqs = mixed.engine(["model.layers.0.output"], edits)
        assert il.programs["model.layers.0.output"].fused
        if not fused:
            il.programs["model.layers.0.output"]._fused = None
        module.record()
        outs[fused] = mixed.run(module, il, bank, mixed.steps(reqs, *inputs))
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # one launch over the real rows of the graph's 8 at each steered step, decode (5) and prefill (3, some stages
    # unused); nobody steered: no launch
    assert rows == [(5, PAD), (3, PAD)]


def test_a_break_launches_where_a_row_asks_for_a_stage_of_its_tap_and_leaves_the_rest_to_the_host(fused):
    bank = EditBank()
    bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))])  # column 0
    bank.register("elsewhere", [compile_edit(EditKind.add, 1.0, torch.randn(1, 16))])  # column 1
    program, live = TapProgram(TAP, bank.at(TAP), False), torch.randn(4, 16)
    step = SimpleNamespace(capturing={}, used=None, all_used=False, weights=torch.ones(3, 2))
    assert program.at_break(live, 3, step) and fused == []  # nobody steered this step: nothing to launch
    other = SimpleNamespace(**{**vars(step), "used": np.array([False, True])})
    assert program.at_break(live, 3, other) and fused == []  # only another tap's stage is asked for
    mine = SimpleNamespace(**{**vars(step), "used": np.array([True, False])})
    assert program.at_break(live, 3, mine) and fused == [1] and program.ran["fused"] == 1
    every = SimpleNamespace(**{**vars(step), "used": np.array([True, True]), "all_used": True,
                               "capturing": {"elsewhere": [object()]}})
    assert program.at_break(live, 3, every) and fused == [1, 1]
    keeps = SimpleNamespace(**{**vars(every), "capturing": {TAP: [object()]}})  # a request keeps this tap's value
    assert not program.at_break(live, 3, keeps) and fused == [1, 1]
    program._fused = None
    assert not program.at_break(live, 3, every)


def test_a_break_serving_a_trace_takes_the_general_path(monkeypatch):
    il, calls = VLLMInterleaver(taps=[TAP]), []
    il.programs[TAP] = SimpleNamespace(at_break=lambda *a: calls.append("at_break") or True)
    monkeypatch.setattr(VLLMInterleaver, "replay", lambda self, location, live: calls.append("replay"))
    il.step.num_tokens = 2
    for serving in (True, False):
        monkeypatch.setattr(nnsight_internals, "serving", lambda il, serving=serving: serving)
        il._break(TAP, torch.zeros(4, 16))
    assert calls == ["replay", "at_break"]  # a trace parked at the tap sees the value: the general path serves it


def test_a_form_says_how_the_kernel_launches_inside_it_and_no_longer(fused):
    bank = EditBank()
    bank.register(TAP, [compile_edit(EditKind.ablate, 1.0, torch.randn(1, 16))])
    program = TapProgram(TAP, bank.at(TAP), False)
    table = program._fused
    for form, launch in (("fused", (True, True)), ("direct", (True, False)), ("jit", (False, False))):
        with program.form(form):
            assert program._fused is table and (table.direct, table.bound) == launch
    with program.form("torch"):
        assert program._fused is None
    assert program._fused is table and (table.direct, table.bound) == (True, True)


def test_while_launch_hooks_are_installed_a_bound_table_launches_unbound(fake_triton):
    fake, table = fake_triton(), direction_table()
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(4, 16, generator=g), torch.rand(4, 2, generator=g)
    want = h.clone()
    for _ in range(3):
        in_torch(table, want, None, w)
    table(h, None, w)  # through the JIT
    table(h, None, w)  # bound
    fake.hooked = True
    table(h, None, w)  # the compiled kernel's own launch, which calls the hooks; not bound again
    assert torch.equal(h, want) and len(fake.binds) == 1 and fake.bound_rows == [4] and len(fake.direct_args) == 1


def test_a_binding_serves_only_tensors_laid_out_as_the_ones_it_was_bound_to(fake_triton):
    fake, table = fake_triton(), direction_table()
    g = torch.Generator().manual_seed(4)
    base, w = torch.randn(8 * 32, generator=g), torch.rand(8, 2, generator=g)
    h = base[: 8 * 16].view(8, 16)
    # At h's address: another row stride, another dtype, h as its own residual (the bound launch without one
    # passes h there too): each must edit as its own launch would, never through h's binding
    for x, r in ((h, None), (base.as_strided((8, 16), (32, 1)), None),
                 (base.view(torch.bfloat16)[: 8 * 16].view(8, 16), None), (h, h)):
        # Values exact in bfloat16 (the low halves 0), so that the bfloat16 view holds no NaN
        base.copy_(torch.randn(8 * 32, generator=g).to(torch.bfloat16).float())
        for _ in range(2):  # through the JIT or bound, then bound
            want = x.clone()
            in_torch(table, want, None if r is None else r.clone(), w)
            table(x, r, w)
            torch.testing.assert_close(x, want, atol=0, rtol=0)
    assert len(fake.binds) == 4
    r = torch.randn(8, 16, generator=g)
    table(h, r, w)
    table(h, r, w)
    n = len(fake.bound_rows)
    # Fewer rows of weights or residual than asked for, at the bound addresses: no launch
    assert table(h, r, w[:4], rows=6) is False and table(h[:6], r[:4], w, rows=6) is False
    assert len(fake.bound_rows) == n
