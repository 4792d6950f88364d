"""Conditions decided on the device and edits placed by position, on the fake recording: replay (the program at an
eager break) and in-graph (captured, reading fixed buffers) against the outputs computed here by hand from the
semantics (interleaver/conditions.py, interleaver/select.py), over prefill chunks, decode steps and padding."""

import numpy as np
import pytest
import torch

from fake import H, PAD, Graphed
from interleaver import EditBank, RequestEdits, VLLMInterleaver
from interleaver.bank import BatchEdits, layout
from interleaver.conditions import Conditions
from interleaver.program import TapProgram
from interleaver.rows import StepRows
from interleaver.edit import Condition, Edit
from interleaver.kinds import EditKind
from interleaver.select import Positions
from interleaver.vllm_internals import tap_path

import nnsight

COND, EDIT = "model.layers.0.output", "model.layers.1.output"  # the stream after x2, then after x3 (then x5)
pytestmark = pytest.mark.usefixtures("fake_recording")


def build(in_graph: bool, stages, conditions):
    """The fake graph with programs at both taps; `stages`: [(location, Edit)] registered in order."""
    il = VLLMInterleaver(taps=[COND, EDIT])
    module = Graphed(il)
    nnsight.NNsight(module, interleaver=il)
    bank = EditBank()
    for c in conditions:
        bank.condition(c)
    entries = [bank.register(loc, [e])[0] for loc, e in stages]
    il.step.order = layout(bank.stages)
    columns = {int(s): c for c, s in enumerate(il.step.order)}
    cond = Conditions(bank.conditions, slots=4, max_rows=PAD, device="cpu") if conditions else None
    il.step.conditions = cond
    il.programs = {t: TapProgram(t, bank.at(t), residual=False, columns=columns, conditions=cond) for t in (COND, EDIT)}
    if in_graph:
        il.in_graph = True
        il.step.use_static(PAD, len(bank.stages), "cpu")
    module.record()
    return module, il, bank, entries, cond


def run_steps(module, il, bank, cond, reqs, steps):
    """`reqs`: request id -> (RequestEdits or None, prompt length); `steps`: [[(id, rows, computed)], ...] and
    their inputs. Each step's output."""
    outs = []
    for sched, x in steps:
        ids = [r for r, _, _ in sched]
        batch = BatchEdits([reqs[r][0] for r in ids], np.array([reqs[r][1] for r in ids]), len(bank.stages),
                           il.step.order)
        if cond is not None:
            batch.slots = cond.slots_for(ids, batch.edits)
        counts = np.array([n for _, n, _ in sched])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        il.step.set_rows(starts, counts, np.array([c for _, _, c in sched]), batch, int(counts.sum()), "cpu")
        outs.append(module(x).clone())
        il.step.clear()
    return outs


def test_a_condition_gates_its_edit_per_request_from_the_last_prompt_chunk_on_in_both_forms():
    g = torch.Generator().manual_seed(1)
    c = torch.tensor([1.0, 0.0, 0.0, 0.0])  # cosine against the first axis: the sign of the prompt's mean there
    v = torch.randn(H, generator=g)
    cond = Condition(tap_path(COND), c, reduce="mean", score="cosine", compare="above", threshold=0.0)
    gated = Edit(EditKind.add, v[None], strength=1.0, when=cond)
    plain = Edit(EditKind.add, v[None], strength=1.0)

    def prompt(sign, n):
        x = torch.randn(n, H, generator=g)
        x[:, 0] = sign * (x[:, 0].abs() + 0.5)
        return x

    a, b, d = prompt(+1, 3), prompt(-1, 2), torch.randn(2, H, generator=g)  # a meets, b does not; d unconditioned
    a[0, 0] = -2.0  # a's first chunk alone scores below: the mean over both chunks decides
    gen = torch.randn(3, H, generator=g)
    # step 1: a's first chunk (positions 0-1) and b's whole prompt; step 2: a's last chunk, b's first generated
    # row, d's prompt; step 3: every request's next generated row
    steps = [([("a", 2, 0), ("b", 2, 0)], torch.cat([a[:2], b])),
             ([("a", 1, 2), ("b", 1, 2), ("d", 2, 0)], torch.cat([a[2:], gen[:1], d])),
             ([("a", 1, 3), ("b", 1, 3), ("d", 1, 2)], gen)]

    assert bool(a.mean(0)[0] > 0) and bool(b.mean(0)[0] < 0) and bool(a[:2].mean(0)[0] < 0)
    # By hand: the stream is x*2 at the condition, x*6 at the edit plus the add where it is on, then x*5. Step 1:
    # a's first chunk is undecided, b decides "no" on its last row (at the condition's tap, before the edit's);
    # step 2: a decides "yes" on its last prompt row, b's generated row holds "no", d's add is not gated.
    on = [[0, 0, 0, 0], [1, 0, 1, 1], [1, 0, 1]]
    want = [(x * 6 + torch.tensor(o, dtype=torch.float32)[:, None] * v) * 5 for (_, x), o in zip(steps, on)]

    outs = {}
    for in_graph in (False, True):
        module, il, bank, entries, conds = build(in_graph, [(EDIT, gated), (EDIT, plain)], [cond])
        reqs = {"a": (RequestEdits([entries[0]], decide=True), 3), "b": (RequestEdits([entries[0]], decide=True), 2),
                "d": (RequestEdits([entries[1]]), 2)}
        outs[in_graph] = run_steps(module, il, bank, conds, reqs, steps)
        if in_graph:
            assert module.static_out[3:].eq(1000 * 30).all()  # padding rows: no edit, no decision reached them
        got = {r: (float(conds.scores[0, s]), float(conds.flags[s, 0])) for r, s in conds._slot.items()}
        assert got["a"][1] == 1.0 and got["b"][1] == 0.0
        torch.testing.assert_close(torch.tensor(got["a"][0]), torch.nn.functional.cosine_similarity(
            a.mul(2).mean(0), c, dim=0))
    for mode in (False, True):
        for o, w in zip(outs[mode], want):
            torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5)


def test_reduce_last_and_cast_decide_from_the_prompts_last_row():
    g = torch.Generator().manual_seed(2)
    c = torch.randn(H, generator=g)
    x = torch.randn(3, H, generator=g)
    cast = lambda h: float(torch.nn.functional.cosine_similarity(  # noqa: E731
        h, torch.tanh((h @ c) * c / (c @ c)), dim=0, eps=1e-30))
    threshold = cast(x[2] * 2) - 1e-4  # just met by the last row; the mean scores otherwise
    assert cast(x.mul(2).mean(0)) < threshold
    for reduce, want in (("last", 1.0), ("mean", 0.0)):
        cond = Condition(tap_path(COND), c, reduce=reduce, score="cast", compare="above", threshold=threshold)
        module, il, bank, entries, conds = build(True, [(EDIT, Edit(EditKind.add, c[None], when=cond))], [cond])
        run_steps(module, il, bank, conds, {"r": (RequestEdits([entries[0]], decide=True), 3)}, [([("r", 3, 0)], x)])
        assert float(conds.flags[conds._slot["r"], 0]) == want


def test_a_slot_taken_again_starts_from_nothing():
    c = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cond = Condition(tap_path(COND), c, reduce="mean", score="cosine", compare="above", threshold=0.0)
    module, il, bank, entries, conds = build(False, [(EDIT, Edit(EditKind.add, c[None], when=cond))], [cond])
    yes, no = torch.ones(2, H), -torch.ones(2, H)
    reqs = {"a": (RequestEdits([entries[0]], decide=True), 2), "b": (RequestEdits([entries[0]], decide=True), 2)}
    run_steps(module, il, bank, conds, reqs, [([("a", 2, 0)], yes)])
    slot = conds._slot["a"]
    conds.release(["a"])
    run_steps(module, il, bank, conds, reqs, [([("b", 1, 0)], no[:1])])  # b's first chunk, in a's old slot
    assert conds._slot["b"] == slot and float(conds.flags[slot, 0]) == 0.0
    assert torch.equal(conds.acc[0][slot], no[0] * 2)  # a's sum is gone


def test_a_graph_replayed_after_a_deciding_step_sums_and_decides_nothing():
    """A warm-up or dummy batch replays a captured graph outside any step, its decide kernels included: with the
    step over, every row points at the scratch slot, so the decision and the sums stand."""
    c = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cond = Condition(tap_path(COND), c, reduce="mean", score="cast", compare="above", threshold=0.25)
    module, il, bank, entries, conds = build(True, [(EDIT, Edit(EditKind.add, c[None], when=cond))], [cond])
    reqs = {"a": (RequestEdits([entries[0]], decide=True), 2)}
    run_steps(module, il, bank, conds, reqs, [([("a", 2, 0)], torch.ones(2, H))])
    slot = conds._slot["a"]
    held = slice(0, conds.scratch)  # the slots requests hold (the scratch slot's contents are never read)
    state = (conds.acc[0][held].clone(), conds.flags[held].clone(), conds.scores[:, held].clone())
    assert float(state[1][slot, 0]) == 1.0
    il.programs[COND].in_graph(-torch.ones(PAD, H), il.step.static)  # what the replayed graph runs at the tap
    assert torch.equal(conds.acc[0][held], state[0]) and torch.equal(conds.flags[held], state[1])
    assert torch.equal(conds.scores[:, held], state[2])


def test_position_entries_weigh_exactly_the_rows_they_select_in_a_mixed_batch():
    v = torch.ones(1, H)
    where = {"last2": ("last_prompt", 2, 0), "first1": ("first_generated", 1, 0), "win": ("window", 1, 3)}
    bank = EditBank()
    entries = {k: bank.register(EDIT, [Edit(EditKind.add, v, strength=2.0, positions=Positions.of(w))])[0]
               for k, w in where.items()}
    plain = bank.register(EDIT, [Edit(EditKind.add, v, strength=1.0)])[0]
    reqs = [RequestEdits([entries["last2"]]), RequestEdits([entries["first1"], plain]), RequestEdits([entries["win"]]),
            None]
    plen = np.array([4, 2, 3, 2])
    rows = StepRows()
    rows.order = layout(bank.stages)
    batch = BatchEdits(reqs, plen, len(bank.stages), rows.order)
    # a prefill chunk of request 0 (positions 1-3), request 1's first generated row, request 2's prompt and its
    # first generated row can't share a step: request 2 runs positions 0-2, request 3 two prompt rows
    rows.set_rows(np.array([0, 3, 4, 7]), np.array([3, 1, 3, 2]), np.array([1, 2, 0, 0]), batch, 9, "cpu")
    assert len(bank.stages) == 1  # positions are a request's rows, not a stage: one column serves them all
    w = rows.weights.numpy()
    total = w.sum(1)
    assert total.tolist() == [0, 2, 2,  # positions 1..3 of a 4-token prompt: the last two
                              3,        # request 1's first generated row: 2 (first_generated) + 1 (plain)
                              0, 2, 2,  # window 1..3 over positions 0..2
                              0, 0]     # unsteered
    # a decode step: request 1's second generated row is past first_generated; the step is never "steady"
    batch2 = BatchEdits(reqs[1:2], plen[1:2], len(bank.stages), rows.order)
    rows.set_rows(np.array([0]), np.array([1]), np.array([3]), batch2, 1, "cpu")
    assert rows.weights.numpy().sum() == 1.0 and not rows.repeat(batch2, 1)


def test_the_worker_decides_per_request_and_frees_the_slot_and_its_own_conditions():
    """On the stand-in runner (the stream is x at both taps): a condition declared at start (a preset's) gates an
    add at the second tap; a request's own condition (steer_when) gates its own vector, and the worker takes it
    as a condition while the request runs and drops it once none uses it."""
    from interleaver.tap_worker import CONDITIONS_KEY, STAGES_KEY
    from interleaver.vllm_internals import tap_location
    from steer.serve.protocol import encode_vector
    from stand_in import step, tap_worker

    first, second = tap_location("layers.0"), tap_location("layers.1")
    axis = torch.tensor([1.0, 0.0, 0.0, 0.0])
    v = torch.tensor([0.0, 1.0, 2.0, 3.0])
    cond = Condition(tap_path(first), axis, "mean", "cosine", "above", 0.0)
    gated = Edit(EditKind.add, v[None], when=cond)
    w = tap_worker({STAGES_KEY: [(0, second, 0, gated.to_dict(0))], CONDITIONS_KEY: [cond.to_dict()]},
                   taps=(("layers.0", True), ("layers.1", True)))
    preset = {"steer": RequestEdits([(0, 1.0, "both")], decide=True).to_args()}
    yes, no = torch.ones(2, H), -torch.ones(2, H)
    runner = w.model_runner
    out = step(runner, [("a", 2, 0, 2, preset), ("b", 2, 0, 2, preset)], torch.cat([yes, no]))
    torch.testing.assert_close(out, torch.cat([yes + v, no]))  # decided at the first tap, edited at the second
    out = step(runner, [("a", 1, 2, 2, preset), ("b", 1, 2, 2, preset)], torch.cat([no[:1], yes[:1]]))
    torch.testing.assert_close(out, torch.cat([no[:1] + v, yes[:1]]))  # generated rows hold their decision
    own = {"steer": RequestEdits([], inline=[(second, 0, 2.0, "generated", encode_vector(v))], decide=True,
                                 inline_when=(first, encode_vector(-axis), "last", "cast", "above", 0.4)).to_args()}
    out = step(runner, [("c", 2, 0, 2, own)], no, finished=["a", "b"])
    assert len(w.steer_bank.conditions) == 2 and set(w.steer_conditions._slot) == {"c"}  # a and b freed theirs
    torch.testing.assert_close(out, no)  # generated rows only
    out = step(runner, [("c", 1, 2, 2, own)], no[:1])
    torch.testing.assert_close(out, no[:1] + 2.0 * v)  # cast of the last row along -axis: 0.5 > 0.4, met
    step(runner, [("d", 1, 0, 1, None)], no[:1], finished=["c"])
    assert len(w.steer_bank.conditions) == 1 and len(w.steer_conditions.list) == 1  # the request's own is gone


def test_a_scoring_pass_reads_its_continuation_under_the_decision_its_prompt_made():
    """A teacher-forced reading runs prompt and continuation as one prompt. Its prompt first runs alone and keeps
    its decision (`hold`); in the reading (`held`) the continuation's rows read that decision at every tap, the
    condition's own included, as generated rows do, while the prompt's rows decide again as any prompt does. The
    kept slot is freed when the reading ends."""
    from interleaver.tap_worker import CONDITIONS_KEY, STAGES_KEY
    from interleaver.vllm_internals import tap_location
    from stand_in import step, tap_worker

    first = tap_location("layers.0")
    axis, v = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 2.0, 3.0])
    cond = Condition(tap_path(first), axis, "mean", "cosine", "above", 0.0)
    gated = Edit(EditKind.add, v[None], when=cond)  # at the condition's own tap: after the decision's forward only
    w = tap_worker({STAGES_KEY: [(0, first, 0, gated.to_dict(0))], CONDITIONS_KEY: [cond.to_dict()]},
                   taps=(("layers.0", True), ("layers.1", True)))
    runner, conds = w.model_runner, w.steer_conditions

    def args(**kw):
        return {"steer": RequestEdits([(0, 1.0, "both")], decide=True, **kw).to_args()}

    yes, no = torch.ones(2, H), -torch.ones(2, H)
    cont = torch.full((1, H), 0.5)
    for prompt, met in ((yes, True), (no, False)):
        out = step(runner, [("p", 2, 0, 2, args(hold="k"))], prompt)
        torch.testing.assert_close(out, prompt)  # the prompt's rows pass the tap before the decision
        out = step(runner, [("r", 3, 0, 3, args(held="k", prompt_len=2))], torch.cat([prompt, cont]), finished=["p"])
        assert set(conds._kept) == {"k"} and set(conds._slot) == {"r"}
        torch.testing.assert_close(out, torch.cat([prompt, cont + v if met else cont]))
        step(runner, [("u", 1, 0, 1, None)], cont, finished=["r"])  # the reading ends: no slot held
        assert not conds._kept and not conds._slot and len(conds._free) == conds.scratch
    # without a kept decision the continuation's rows read their own, not yet made at this tap: unedited
    out = step(runner, [("r2", 3, 0, 3, args(held="gone", prompt_len=2))], torch.cat([yes, cont]))
    torch.testing.assert_close(out, torch.cat([yes, cont]))
    # a decision kept for a reading that never came is dropped by name (the engine does so after every round)
    step(runner, [("p2", 2, 0, 2, args(hold="k2"))], yes, finished=["r2"])
    step(runner, [("u2", 1, 0, 1, None)], cont, finished=["p2"])
    assert set(conds._kept) == {"k2"}
    w.steer_drop_held(["k2", "never"])
    assert not conds._kept and not conds._slot and len(conds._free) == conds.scratch


def test_a_request_run_again_from_its_start_keeps_a_decision_made_and_restarts_one_not_made():
    """vLLM recomputes a preempted request from its first token: one that decided keeps its decision (and decides
    nothing more, whatever its rows score now); one preempted mid-prompt sums its prompt anew."""
    c = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cond = Condition(tap_path(COND), c, reduce="mean", score="cosine", compare="above", threshold=0.0)
    module, il, bank, entries, conds = build(False, [(EDIT, Edit(EditKind.add, c[None], when=cond))], [cond])
    yes, no = torch.ones(3, H), -torch.ones(3, H)
    reqs = {"a": (RequestEdits([entries[0]], decide=True), 2), "b": (RequestEdits([entries[0]], decide=True), 3)}
    run_steps(module, il, bank, conds, reqs, [([("a", 2, 0), ("b", 2, 0)], torch.cat([yes[:2], yes[:2]]))])
    a, b = conds._slot["a"], conds._slot["b"]
    assert float(conds.flags[a, 0]) == 1.0 and a in conds._decided and b not in conds._decided
    # both run again from position 0 with rows that score the other way
    out = run_steps(module, il, bank, conds, reqs, [([("a", 3, 0), ("b", 3, 0)], torch.cat([no, no]))])[0]
    assert float(conds.flags[a, 0]) == 1.0  # a keeps its "yes": generated row 2 still steered
    torch.testing.assert_close(out[:3], (no * 6 + c) * 5)
    assert float(conds.flags[b, 0]) == 0.0  # b's sum started over: its three new rows alone decided "no"
    torch.testing.assert_close(conds.acc[0][b], no.mul(2).sum(0))
