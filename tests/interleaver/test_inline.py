"""Requests' own vectors in the tap worker (`InlineStages`, steer serve's steer_vector): a vector becomes a stage
when a request first brings it, is shared by every request bringing the same one, and its id is reused once the
last of them has finished, while the ids of requests in flight stay put. On the stand-in runner, on CPU."""

import torch

from interleaver.bank import EditBank, InlineStages, RequestEdits
from interleaver.vllm_internals import tap_location
from stand_in import H, step
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind
from steer.serve.protocol import encode_vector

LOC = tap_location("layers.0")


def _own(v, strength, index=0, entries=()):
    return {"steer": RequestEdits(list(entries), inline=[(LOC, index, strength, "both", encode_vector(v))]).to_args()}


def test_a_requests_own_vector_is_added_to_its_rows_only(worker):
    v, u, x = torch.randn(H), torch.randn(H), torch.randn(4, H)
    out = step(worker.model_runner, [("a", 2, 0, 2, _own(v, 3.0)), ("b", 1, 5, 2, None), ("c", 1, 0, 1, _own(u, -1.0))],
               x)
    expected = x.clone()
    expected[:2] += 3.0 * v
    expected[3] -= u
    torch.testing.assert_close(out, expected)
    assert [s.location for s in worker.steer_bank.stages] == [LOC, LOC]


def test_one_vector_is_one_stage_and_a_freed_id_is_reused(worker):
    v, w, z, x = torch.randn(H), torch.randn(H), torch.randn(H), torch.randn(2, H)
    runner, stages = worker.model_runner, worker.steer_bank.stages
    step(runner, [("a", 1, 0, 1, _own(v, 1.0)), ("b", 1, 0, 1, _own(v, 2.0))], x)
    assert len(stages) == 1  # the same vector at the same place: one stage, two strengths
    step(runner, [("b", 1, 1, 1, _own(v, 2.0)), ("c", 1, 0, 1, _own(w, 1.0))], x, finished=["a"])
    assert len(stages) == 2  # b still uses v's stage: c's vector gets a new one
    out = step(runner, [("c", 1, 1, 1, _own(w, 1.0)), ("d", 1, 0, 1, _own(z, 1.0))], x, finished=["b"])
    assert len(stages) == 2 and torch.equal(stages[0].edit.basis[0], z)  # d took v's freed id
    torch.testing.assert_close(out, x + torch.stack([w, z]))  # and c, in flight, kept its own
    step(runner, [("c", 1, 2, 1, _own(w, 1.0)), ("e", 1, 0, 1, _own(z, 1.0))], x, finished=["d"])
    assert len(stages) == 2 and worker.steer_inline._refs == {0: 1, 1: 1}  # z again, before its id went: kept


def test_own_vector_runs_after_the_presets_edits_at_its_tap(worker):
    """A request's preset ablates a direction at the tap (position 0); its own vector is added after (position
    1), so the vector's part along the direction stays."""
    d, v, x = torch.randn(1, H), torch.randn(H), torch.randn(1, H)
    bank = EditBank()
    ablate = bank.register(LOC, [compile_edit(EditKind.ablate, 1.0, d)])
    worker.steer_set_stages(bank.stage_list())
    out = step(worker.model_runner, [("a", 1, 0, 1, _own(v, 2.0, index=1, entries=ablate))], x)
    u = d[0] / d[0].norm()
    torch.testing.assert_close(out[0], x[0] - (x[0] @ u) * u + 2.0 * v)


def test_a_request_read_again_gets_its_stages_once():
    """vLLM may drop a preempted request from the worker's cache and schedule it again: its stages are taken once
    and released once, and its edits read again carry them."""
    inline = InlineStages(EditBank())
    args = RequestEdits(inline=[(LOC, 0, 1.0, "both", encode_vector(torch.ones(H)))]).to_args()
    first, again = RequestEdits.from_args(args), RequestEdits.from_args(args)
    assert inline.take("a", first, "cpu") == {LOC} and inline.take("a", again, "cpu") == set()
    assert inline._refs == {0: 1} and first.entries == again.entries == [(0, 1.0, "both")]
    assert inline.release(["a", "a", "never-seen"]) == {LOC}  # none in use: the bank forgets them
    assert inline.bank.stages == [] and inline.held() == []


def test_an_id_vllm_reuses_gets_the_new_requests_vector(worker):
    """A request resubmitted under the id of one that just finished (vLLM does so after an abort) is read anew."""
    v, w, z, x = torch.randn(H), torch.randn(H), torch.randn(H), torch.randn(2, H)
    step(worker.model_runner, [("a", 1, 0, 1, _own(v, 1.0))], x)
    out = step(worker.model_runner, [("a", 1, 0, 1, _own(w, 1.0)), ("b", 1, 0, 1, _own(z, 1.0))], x, finished=["a"])
    torch.testing.assert_close(out, x + torch.stack([w, z]))


def test_the_bank_forgets_inline_stages_when_none_is_in_use(worker):
    """Preset stages stay; once no request uses a vector of its own, the inline stages go and the tap's program
    has only the presets' again (its fused kernel, where it had one)."""
    d, v, x = torch.randn(1, H), torch.randn(H), torch.randn(1, H)
    bank = EditBank()
    bank.register(LOC, [compile_edit(EditKind.ablate, 1.0, d)])
    worker.steer_set_stages(bank.stage_list())
    step(worker.model_runner, [("a", 1, 0, 1, _own(v, 1.0, index=1))], x)
    assert len(worker.steer_il.programs[LOC].stages) == 2
    out = step(worker.model_runner, [("b", 1, 0, 1, None)], x, finished=["a"])
    assert [s.edit.kind.value for s in worker.steer_il.programs[LOC].stages] == ["ablate"]
    assert len(worker.steer_bank.stages) == 1 and torch.equal(out, x)
