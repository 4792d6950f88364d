"""The tap worker's bookkeeping on CPU, against a stand-in for vLLM's runner: taps installed at load, each
step's rows mapped from the runner's own buffers (query_start_loc, num_computed_tokens, extra_args)."""

import numpy as np
import pytest
import torch

from interleaver.bank import EditBank, RequestEdits, encode_vector
from interleaver.vllm_internals import tap_location
from stand_in import H, step, tap_worker
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, Tokens


def _serving(worker, *edits):
    """A request's edits for each of `edits` at the tap after layer 0, the worker serving their stages."""
    bank = EditBank()
    out = [RequestEdits(bank.register(tap_location("layers.0"), [e])) for e in edits]
    worker.steer_set_stages(bank.stage_list())
    return out


def test_steps_map_rows_to_requests_and_clear_after(worker):
    v = torch.randn(1, H)
    bank = EditBank()
    loc = tap_location("layers.0")
    add = bank.register(loc, [compile_edit(EditKind.add, 2.0, v, tokens=Tokens.generated)])
    abl = bank.register(loc, [compile_edit(EditKind.ablate, 1.0, v)])
    assert worker.steer_set_stages(bank.stage_list()) == 2
    x = torch.randn(6, H)
    # a: 3 prompt rows; b: one decode row; c: unsteered; d: a generated row
    out = step(worker.model_runner, [
        ("a", 3, 0, 5, {"steer": RequestEdits(add).to_args()}),
        ("b", 1, 9, 4, {"steer": RequestEdits(add).to_args()}),
        ("c", 1, 2, 1, None),
        ("d", 1, 3, 4, {"steer": RequestEdits(abl).to_args()}),
    ], x)
    expected = x.clone()
    expected[3] += 2.0 * v[0]  # only b's row is a generated token; a's rows are all prompt
    d = v[0] / v[0].norm()
    expected[5] -= (x[5] @ d) * d
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[4], x[4]) and torch.equal(out[:3], x[:3])
    assert worker.steer_il.step.num_tokens is None  # cleared: a warm-up run after this edits nothing


def test_capture_only_request_keeps_its_rows(worker):
    x = torch.randn(3, H)
    step(worker.model_runner, [("s", 3, 0, 3, {"steer": RequestEdits(capture=[tap_location("layers.0")],
                                                                      key="k1").to_args()})], x)
    kept = worker.steer_take_kept()
    torch.testing.assert_close(torch.tensor(kept[tap_location("layers.0")]["k1"][0]), x)
    assert worker.steer_take_kept() == {}


def test_edit_at_a_location_that_is_no_tap_is_refused(worker):
    bank = EditBank()
    bank.register(tap_location("layers.1"), [compile_edit(EditKind.add, 1.0, torch.ones(1, H))])
    with pytest.raises(ValueError, match="not a tap of this engine"):
        worker.steer_set_stages(bank.stage_list())


def test_tap_naming_no_module_fails_at_load():
    with pytest.raises(ValueError, match="'layers.7' names no module"):
        tap_worker(taps=[("layers.7", True)])


def test_folding_into_norms_is_refused_without_edits_in_the_graph():
    from interleaver.tap_worker import FOLD_KEY

    with pytest.raises(ValueError, match=f"{FOLD_KEY}: only an in-graph engine"):
        tap_worker({FOLD_KEY: True})


def test_two_ranks_given_the_same_stages_and_step_edit_alike():
    """Tensor parallelism, simulated: each rank's worker gets the same stage list (collective_rpc) and the same
    scheduled batch, holds the whole residual stream, and so must make the same edit and keep the same rows."""
    ranks = [tap_worker() for _ in range(2)]
    v, d = torch.randn(1, H), torch.randn(1, H)
    bank = EditBank()
    loc = tap_location("layers.0")
    add = RequestEdits(bank.register(loc, [compile_edit(EditKind.add, 2.0, v)]), capture=[loc], key="k")
    abl = RequestEdits(bank.register(loc, [compile_edit(EditKind.ablate, 1.0, d)]))
    stages = bank.stage_list()
    x = torch.randn(4, H)
    outs, kept = [], []
    for w in ranks:
        w.steer_set_stages(stages)
        outs.append(step(w.model_runner, [("a", 2, 0, 2, {"steer": add.to_args()}), ("b", 1, 5, 3, None),
                                          ("c", 1, 4, 3, {"steer": abl.to_args()})], x))
        kept.append(w.steer_take_kept())
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], x)
    assert kept[0] == kept[1] and len(kept[0][loc]["k"]) == 1


def test_a_batch_kept_across_steps_follows_positions_and_membership(worker):
    """The worker looks a batch's edits up once and reuses them while the same requests are scheduled: rows
    still move from prompt to generated, and a request that joins is served from its first step."""
    v = torch.randn(1, H)
    [gen] = _serving(worker, compile_edit(EditKind.add, 1.0, v, tokens=Tokens.generated))
    x = torch.randn(2, H)
    a = ("a", 1, 3, 4, {"steer": gen.to_args()})
    out = step(worker.model_runner, [a, ("b", 1, 0, 1, None)], x)  # a's position 3 < 4: still its prompt
    torch.testing.assert_close(out, x)
    out = step(worker.model_runner, [("a", 1, 4, 4, None), ("b", 1, 1, 1, None)], x)  # same batch, next step
    torch.testing.assert_close(out[0], x[0] + v[0])
    assert torch.equal(out[1], x[1])
    out = step(worker.model_runner, [("c", 1, 5, 2, {"steer": gen.to_args()}), ("a", 1, 5, 4, None)], x)
    torch.testing.assert_close(out, x + v[0])  # c joined (and took a's slot): both rows are generated tokens


def test_steady_decode_steps_reuse_the_device_weights(worker, monkeypatch):
    """Once every row of a batch is a generated token, a decode step's weights are the last step's: the same
    device tensor serves, computed once, until a row is a prompt token again or the batch changes."""
    import interleaver.rows

    computed = []
    weights = interleaver.rows._weights
    monkeypatch.setattr(interleaver.rows, "_weights", lambda *a: computed.append(a) or weights(*a))
    v = torch.randn(1, H)
    bank = EditBank()
    both = RequestEdits(bank.register(tap_location("layers.0"), [compile_edit(EditKind.add, 1.0, v)]))
    gen = RequestEdits(bank.register(tap_location("layers.0"), [compile_edit(EditKind.add, 2.0, v,
                                                                              tokens=Tokens.generated)]))
    worker.steer_set_stages(bank.stage_list())
    rows = worker.steer_il.step
    rows.use_static(8, len(bank.stages), "cpu")  # as graphed programs read them
    seen = []
    fill = worker._steer_fill_step
    worker._steer_fill_step = lambda so: (fill(so), seen.append(rows.weights))
    x = torch.randn(2, H)
    a, b = {"steer": both.to_args()}, {"steer": gen.to_args()}
    for pos in (5, 6, 7):
        out = step(worker.model_runner, [("a", 1, pos, 4, a), ("b", 1, pos, 4, b)], x)
        torch.testing.assert_close(out, x + torch.stack([v[0], 2 * v[0]]))
    assert seen[1] is seen[0] and seen[2] is seen[0] and len(computed) == 1
    assert torch.equal(rows.static[:2], seen[0]) and not rows.static[2:].any()
    out = step(worker.model_runner, [("a", 1, 8, 4, a), ("c", 1, 2, 4, b)], x)  # c is still in its prompt
    torch.testing.assert_close(out[0], x[0] + v[0])
    assert torch.equal(out[1], x[1]) and seen[3] is not seen[0]


def test_a_request_that_keeps_its_rows_keeps_each_steady_steps_own(worker):
    """A steady step repeats the last one's weights, but a request capturing a tap keeps each step's row at that
    step's position, so its steps are set from their rows."""
    v = torch.randn(1, H)
    bank = EditBank()
    loc = tap_location("layers.0")
    add = RequestEdits(bank.register(loc, [compile_edit(EditKind.add, 1.0, v)]), capture=[loc], key="k")
    worker.steer_set_stages(bank.stage_list())
    for pos in (5, 6, 7):
        x = torch.randn(1, H)
        out = step(worker.model_runner, [("a", 1, pos, 4, {"steer": add.to_args()})], x)
        torch.testing.assert_close(out, x + v[0])
        [kept] = worker.steer_take_kept()[loc]["k"]  # this step's row, as the edit left it
        torch.testing.assert_close(torch.tensor(kept), out)


def test_an_id_resubmitted_into_its_freed_slot_is_looked_up_again(worker):
    """vLLM may reuse a finished or aborted request's id for a new request in the same slot: the batch's ids are
    the same, its edits are not."""
    v = torch.randn(1, H)
    bank = EditBank()
    add = RequestEdits(bank.register(tap_location("layers.0"), [compile_edit(EditKind.add, 1.0, v)]))
    worker.steer_set_stages(bank.stage_list())
    x = torch.randn(1, H)
    torch.testing.assert_close(step(worker.model_runner, [("a", 1, 5, 4, {"steer": add.to_args()})], x), x + v[0])
    out = step(worker.model_runner, [("a", 1, 6, 4, None)], x, finished={"a"})  # a new "a", unsteered
    assert torch.equal(out, x)


@pytest.mark.parametrize("gather_from", [0, None])
def test_requests_joining_and_leaving_keep_each_rows_own_edit(worker, monkeypatch, gather_from):
    """Under serving load requests join and leave at most steps, and vLLM moves the last ones into the gaps. The
    worker builds its batch whole only where more than a quarter of the rows are new, and otherwise updates those
    rows alone; either way each row gets what its own request asks, checked against a direct sum of its entries
    over 80 steps of random joins (prompts in chunks), finishes and moves. Prompt rows' weights are expanded on
    the host, or on the device from each request's two rows (`gather_from` 0: every step with prompt rows)."""
    from interleaver.bank import BatchEdits
    from interleaver.rows import StepRows

    if gather_from is not None:
        monkeypatch.setattr(StepRows, "_GATHER_FROM", gather_from)

    whole = []  # the batches built whole, and those updated
    init = BatchEdits.__init__
    monkeypatch.setattr(BatchEdits, "__init__", lambda self, *a: whole.append(1) or init(self, *a))
    updated, replaced = [], BatchEdits.replaced
    monkeypatch.setattr(BatchEdits, "replaced", lambda self, *a: updated.append(1) or replaced(self, *a))
    gathered, gather = [], StepRows._gather
    monkeypatch.setattr(StepRows, "_gather", lambda self, *a: gathered.append(1) or gather(self, *a))
    rng = np.random.default_rng(7)
    vs, loc = torch.randn(4, H), tap_location("layers.0")
    bank = EditBank()
    # Vector 2 sits second in the tap's edit list but is registered first, so the weight columns are not in id
    # order. Kinds of request: unsteered; steered on all, generated or prompt rows; one whose prompt ends early (a
    # scoring pass fed its continuation as prompt); two that keep the tap's rows; one that brings its own vector
    # (vector 3: a stage of its own while such a request is in flight, which moves the weight columns).
    first = bank.register(loc, [compile_edit(EditKind.add, 1.0, vs[2:3])], start=1)
    keeps = {"capture": [loc], "key": "kept"}
    specs = [((), None, {}), (((0, 1.0, Tokens.both),), None, {}), (((1, 2.0, Tokens.generated),), None, {}),
             (((0, -0.5, Tokens.prompt), (2, 1.0, Tokens.both)), None, {}), (((1, 1.0, Tokens.generated),), 1, {}),
             ((), None, keeps), (((0, 1.0, Tokens.both),), None, keeps), (((3, 0.5, Tokens.both),), None, None)]
    own = 7

    def entries(k, s, rows):
        e = compile_edit(EditKind.add, s, vs[k : k + 1], tokens=rows)
        return [(first[0][0], s, rows.value)] if k == 2 else bank.register(loc, [e])

    args = [None] + [{"steer": RequestEdits([e for k, s, rows in spec for e in entries(k, s, rows)], prompt_len=ends,
                                            **more).to_args()} for spec, ends, more in specs[1:own]]
    args.append({"steer": RequestEdits(inline=[(loc, 0, 0.5, "both", encode_vector(vs[3].numpy()))]).to_args()})
    worker.steer_set_stages(bank.stage_list())
    runner = worker.model_runner
    runner.query_start_loc.np = np.zeros(65, dtype=np.int32)
    runner.input_batch.num_computed_tokens_cpu = np.zeros(64, dtype=np.int64)
    live, slots, last, born, expected_whole = {}, [], [], 0, 0  # live: rid -> [spec, prompt length, computed]
    holding = 0  # requests in flight with their own vector: its stage exists while there is one
    for _ in range(80):
        done = [r for r in slots if live[r][2] >= live[r][1] and rng.random() < 0.15]
        slots = [r if r not in done else None for r in slots]
        for _ in range(rng.integers(0, 3)):
            born += 1
            rid = f"r{born}"
            live[rid] = [int(rng.integers(0, len(specs))), int(rng.integers(2, 7)), 0]
            if None in slots:  # a new request takes the first gap
                slots[slots.index(None)] = rid
            else:
                slots.append(rid)
        while None in slots:  # vLLM's condense: the last request into the first gap
            tail = slots.pop()
            if tail is not None:
                slots[slots.index(None)] = tail
        if len(slots) > 1 and rng.random() < 0.1:
            i, j = rng.choice(len(slots), 2, replace=False)
            slots[i], slots[j] = slots[j], slots[i]
        mine = sum(live[r][0] == own for r in done)
        moved = 0 < holding == mine  # the last request with its own vector left: its stage goes
        holding -= mine
        if not slots:
            continue
        reqs, want, kept_rows = [], [], []
        for rid in slots:
            spec, plen, done_ = live[rid]
            ends = specs[spec][1] or plen
            n = int(rng.integers(1, plen - done_ + 1)) if done_ < plen else 1  # a prompt in chunks, then one a step
            reqs.append((rid, n, done_, plen, args[spec]))
            if specs[spec][2] == keeps:
                kept_rows.extend(range(len(want), len(want) + n))
            for pos in range(done_, done_ + n):
                want.append(sum((s * vs[k] for k, s, rows in specs[spec][0] if rows == Tokens.both
                                 or (rows == Tokens.prompt) == (pos < ends)), torch.zeros(H)))
        joining = sum(live[r][0] == own and live[r][2] == 0 for r in slots)
        moved |= holding == 0 < joining  # the first request with its own vector: a stage for it
        holding += joining
        m = min(len(slots), len(last))
        fresh = sum(a != b or b in done for a, b in zip(slots[:m], last[:m])) + len(slots) - m
        if slots != last or done:
            expected_whole += not last or 4 * fresh > len(slots) or moved
        x = torch.randn(len(want), H)
        out = step(runner, reqs, x, finished=done)
        torch.testing.assert_close(out, x + torch.stack(want))
        # no request steers: no weights to build, updated or not
        assert (worker.steer_batch.dense is None) == (not any(specs[live[r][0]][0] for r in slots))
        kept = worker.steer_take_kept().get(loc, {}).get("kept", [])
        torch.testing.assert_close(torch.tensor([r for block in kept for r in block]).reshape(-1, H),
                                   out[kept_rows])  # the tap's rows as edited, in batch order
        for rid, n, *_ in reqs:
            live[rid][2] += n
        last = list(slots)
    assert (gather_from == 0) == bool(gathered)
    assert len(whole) == expected_whole and 10 < expected_whole < 40 and len(updated) > 20


def test_a_batch_whose_last_steered_request_left_builds_no_weights(worker):
    """The one steered request of five leaves and an unsteered one takes its row: the batch, updated rather than
    built whole, has no weights left to build or ship, as a batch of unsteered requests built whole has none."""
    [add] = _serving(worker, compile_edit(EditKind.add, 1.0, torch.randn(1, H)))
    others = [(f"u{i}", 1, 5, 4, None) for i in range(4)]
    step(worker.model_runner, [("s", 1, 5, 4, {"steer": add.to_args()})] + others, torch.randn(5, H))
    assert worker.steer_batch.dense is not None
    batch = worker.steer_batch
    x = torch.randn(5, H)
    assert torch.equal(step(worker.model_runner, [("t", 1, 0, 1, None)] + others, x, finished=["s"]), x)
    assert worker.steer_batch is not batch and worker.steer_batch.dense is None


def test_a_streaming_request_updated_under_its_id_is_looked_up_again(worker):
    """A streaming request comes back among vLLM's new requests under the same id, in the same row, with
    new sampling params and a prompt that now holds its earlier output: its new edits and prompt length serve."""
    v = torch.randn(1, H)
    [gen] = _serving(worker, compile_edit(EditKind.add, 1.0, v, tokens=Tokens.generated))
    x = torch.randn(2, H)
    b = ("b", 1, 6, 4, None)
    torch.testing.assert_close(step(worker.model_runner, [("s", 1, 5, 4, {"steer": gen.to_args()}), b], x)[0],
                               x[0] + v[0])
    out = step(worker.model_runner, [("s", 1, 6, 8, {"steer": gen.to_args()}), b], x, new=["s"])
    assert torch.equal(out, x)  # position 6 is in its new prompt of 8: no generated row yet
    out = step(worker.model_runner, [("s", 1, 8, 8, None), b], x)
    torch.testing.assert_close(out[0], x[0] + v[0])


def test_an_in_graph_worker_serves_only_its_declared_stages():
    from interleaver.tap_worker import IN_GRAPH_KEY

    bank = EditBank()
    loc = tap_location("layers.0")
    v = torch.randn(1, H)
    add = RequestEdits(bank.register(loc, [compile_edit(EditKind.add, 2.0, v)]))
    declared = bank.stage_list()
    w = tap_worker({IN_GRAPH_KEY: declared})
    assert w.steer_il.in_graph and tuple(w.steer_il.step.static.shape) == (8, 1)
    x = torch.randn(3, H)
    out = step(w.model_runner, [("a", 2, 0, 2, {"steer": add.to_args()}), ("b", 1, 4, 2, None)], x)
    torch.testing.assert_close(out[:2], x[:2] + 2.0 * v[0])  # an eager step: the in-graph program on real rows
    assert torch.equal(out[2], x[2])
    bank.register(loc, [compile_edit(EditKind.ablate, 1.0, v)])
    with pytest.raises(ValueError, match="cannot serve others"):
        w.steer_set_stages(bank.stage_list())



def test_a_profiled_worker_times_each_way_it_fills_a_step_and_each_steps_first_break(monkeypatch):
    """STEER_PROFILE=1: `fill_step` is timed as a whole and by the way it went (a request joined, rows read anew,
    the last step's weights again), and a step's first eager break apart from the rest, each with its calls'
    histogram (interleaver.clock)."""
    monkeypatch.setenv("STEER_PROFILE", "1")
    w = tap_worker()
    bank, loc = EditBank(), tap_location("layers.0")
    add = RequestEdits(bank.register(loc, [compile_edit(EditKind.add, 1.0, torch.randn(1, H))]))
    w.steer_set_stages(bank.stage_list())
    il = w.steer_il

    class TwoBreaks(torch.nn.Module):  # a replayed graph's step: two eager breaks at the tap
        def forward(self, x):
            for _ in range(2):
                il._timed_replay(loc, (x * 0.5, x * 0.5))
            return x

    w.model_runner.model = TwoBreaks()
    for pos, rows in ((0, 3), (3, 1), (4, 1), (5, 1)):  # a's prompt, its first generated token, then steady steps
        step(w.model_runner, [("a", rows, pos, 3, {"steer": add.to_args()})], torch.randn(rows, H))
    il._timed_replay(loc, (torch.zeros(1, H), torch.zeros(1, H)))  # a dummy run's break, after the steps: no first
    prof = w.steer_profile()
    timed = {k: v for k, v in prof.items() if not k.startswith("edits_")}  # the programs' forms: counts alone
    assert {k: v["calls"] for k, v in timed.items()} == {"fill_step": 4, "fill_step:batch": 1, "fill_step:rows": 1,
                                                         "fill_step:steady": 2, "replay": 9, "replay:first": 4,
                                                         "replay:rest": 5}
    assert all(sum(v["hist"].values()) == v["calls"] for v in timed.values())
