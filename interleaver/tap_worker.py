"""The tap worker: vLLM's Worker with taps installed on the loaded model before vLLM records its graphs, and each
step's rows mapped to the requests that own them and the edits they carry (the per-step batching).

It reaches vLLM only through vllm_internals.py, and the engine that starts it only through the additional_config
keys below and the `steer_*` methods `collective_rpc` calls.
"""

import os
import time
from typing import Optional

import numpy as np

from interleaver.clock import Clock
from interleaver.vllm_internals import _worker_base, fold_norms, tap_location

TAPS_KEY = "steer_taps"  # additional_config key: [[module path, residual?], ...], fixed before graph capture
# additional_config key of an in-graph engine: its whole stage list (EditBank.stage_list), captured
IN_GRAPH_KEY = "steer_in_graph"
# additional_config key: true to replay each tap's program at its break as a CUDA graph of its own (tap_graphs.py)
TAP_GRAPHS_KEY = "steer_tap_graphs"
# additional_config key of a replay engine started with stages already registered (an OpenAI server's presets), the
# same list as IN_GRAPH_KEY's; more may still arrive through steer_set_stages
STAGES_KEY = "steer_stages"
# additional_config key of an in-graph engine under vLLM's own torch.compile and CUDA graphs (no breakable graphs):
# its taps call interleaver/compiled.py's op. The value versions the op: it is part of vLLM's compile cache key.
COMPILED_KEY = "steer_compiled"
# additional_config key of an in-graph engine on breakable graphs: true to run each residual tap's edits inside the
# next layer's residual add and RMSNorm (one launch for both) where that norm is vLLM's RMSNorm (fold_norms)
FOLD_KEY = "steer_fold_norm"
COMPILED_VERSION = 1
# additional_config key: the conditions the declared or preset stages name (EditBank.condition_list); a replay
# engine also takes more through steer_set_stages
CONDITIONS_KEY = "steer_conditions"



class _TapWorkerMixin:
    """Installs the interleaver's taps on the loaded model, before vLLM records its graphs, and fills the
    interleaver's step rows from the runner's own buffers after it prepares each step's inputs."""

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        from interleaver.bank import EditBank, InlineStages, ParsedArgs
        from interleaver.interleaver import VLLMInterleaver

        extra = self.vllm_config.additional_config or {}
        taps = [(p, bool(r)) for p, r in extra.get(TAPS_KEY, [])]
        runner = self.model_runner
        self.steer_il = VLLMInterleaver(taps=[tap_location(p) for p, _ in taps])
        declared = extra.get(IN_GRAPH_KEY)
        if extra.get(TAP_GRAPHS_KEY) and declared is None:
            from interleaver.tap_graphs import TapGraphs

            self.steer_il.tap_graphs = TapGraphs()
        self.steer_bank = EditBank()
        self.steer_inline = InlineStages(self.steer_bank)
        self.steer_residual = {tap_location(p): r for p, r in taps}
        self.steer_requests, self.steer_parse = {}, ParsedArgs()
        self.steer_batch_key, self.steer_batch = None, None
        compiled = bool(extra.get(COMPILED_KEY))
        if compiled and declared is None:
            raise ValueError(f"{COMPILED_KEY}: a compiled engine runs only edits declared at start ({IN_GRAPH_KEY})")
        modules = dict(runner.get_model().named_modules())
        for path, residual in taps:
            if path not in modules:
                raise ValueError(f"tap {path!r} names no module of the vLLM model; e.g. {sorted(modules)[:8]}")
            modules[path].register_forward_hook(_compiled_hook(self.steer_il, tap_location(path), residual)
                                                if compiled else _tap_hook(self.steer_il, tap_location(path)))
        self.steer_declared = None
        self.steer_conditions = None
        # every tap gets a program, so capture-only requests are served too
        self.steer_set_stages(declared if declared is not None else extra.get(STAGES_KEY) or [],
                              extra.get(CONDITIONS_KEY) or [])
        if declared is not None:
            # Captured edits read their weights from one buffer at a fixed address, filled every step.
            self.steer_il.in_graph = True
            self.steer_declared = len(declared)
            self.steer_il.step.use_static(runner.max_num_tokens, len(declared), runner.device)
        if extra.get(FOLD_KEY):
            if declared is None or compiled:
                raise ValueError(f"{FOLD_KEY}: only an in-graph engine on breakable graphs folds its edits")
            self.steer_il.folds = fold_norms(self.steer_il, modules, taps)
            self.steer_il.warm_folds()
        self._steer_wrap_runner()

    def _steer_wrap_runner(self) -> None:
        """Fill the step's rows once the runner has prepared its inputs, and clear them after it has run."""
        runner = self.model_runner
        prepare, execute = runner._prepare_inputs, runner.execute_model
        clock = self.steer_clock = Clock() if os.environ.get("STEER_PROFILE") == "1" else None

        def prepare_inputs(scheduler_output, *a, **k):
            out = prepare(scheduler_output, *a, **k)
            if clock is None:
                self._steer_fill_step(scheduler_output)
                return out
            t0 = time.perf_counter()
            path = self._steer_fill_step(scheduler_output)
            dt = time.perf_counter() - t0
            clock.add("fill_step", dt)
            clock.add(f"fill_step:{path}", dt)  # which of its paths, timed apart
            self.steer_il.fresh_step = True
            return out

        def execute_model(*a, **k):
            # Requests finished since the last step free their own vectors' stages (read here: a step that
            # schedules nothing may never prepare inputs). A streamed-input request comes back as new under
            # its id, with new sampling params and prompt (vLLM's _update_streaming_request): the one looked up ended.
            so = a[0] if a else k.get("scheduler_output")
            done = list(getattr(so, "finished_req_ids", None) or ())
            done += [r.req_id for r in getattr(so, "scheduled_new_reqs", None) or () if r.req_id in self.steer_requests]
            if done:
                self._steer_finished(done)
            try:
                return execute(*a, **k)
            finally:
                self.steer_il.step.clear()  # a later warm-up or dummy run must edit nothing
                self.steer_il.fresh_step = False  # ... nor count as a step's first break

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model
        self.steer_il.clock = clock

    def _steer_fill_step(self, scheduler_output) -> str:
        """Map the step's rows to their requests' edits; says which way: "steady" (the last step's weights again),
        "rows" (the rows read anew) or "batch" (a request joined or left: the batch's edits looked up first)."""
        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        il = self.steer_il
        ids = batch.req_ids  # vLLM's own list, kept in batch order and trimmed to the batch by condense()
        if len(ids) != n:
            ids = ids[:n]
        path = "rows"
        # Compared item by item with the last batch's copy, by identity where unchanged: no new tuple of the ids a
        # step (a steady step's host time is its caches' misses: one pointer array read, not n objects touched)
        key = self.steer_batch_key
        if ids != key:  # a request joined or left (or the stages changed): look the new ones' edits up once
            self._steer_rebatch(list(ids), key)  # a copy: vLLM changes its list in place
            path = "batch"
        num_tokens = int(scheduler_output.total_num_scheduled_tokens)
        if il.step.repeat(self.steer_batch, num_tokens):  # a steady decode step: most steps of a long generation
            return "steady"
        qsl = runner.query_start_loc.np[: n + 1].astype(np.int64)
        il.step.set_rows(qsl[:n], qsl[1:] - qsl[:n], batch.num_computed_tokens_cpu[:n].astype(np.int64),
                         self.steer_batch, num_tokens, runner.device)
        return path

    def _steer_rebatch(self, rids: list, key: Optional[list]) -> None:
        """The batch's edits for `rids`, from the last batch's (`key`: its ids) where only some rows changed:
        under serving load a request joins or leaves at most steps, and a batch of 256 looked up whole took
        180 us a step (the development machine, hot)."""
        from interleaver.bank import BatchEdits

        n, changed, last, fresh, looked = len(rids), set(), self.steer_batch, None, None
        if key is not None and last is not None:
            m = min(n, len(key))
            fresh = [i for i in range(m) if rids[i] != key[i]] + list(range(m, n))
            if 4 * len(fresh) > n:  # most rows are new: built whole, which is as cheap
                fresh = None
        if fresh is None:
            looked = [self._steer_request(rid, changed) for rid in rids]
        else:
            rows = {i: self._steer_request(rids[i], changed) for i in fresh}
        if changed:  # a request brought a vector of its own: its tap's program takes the new stage, and the weight
            self._steer_install(changed)  # columns moved, so the batch is built whole
            if looked is None:
                looked = [self._steer_request(rid, changed) for rid in rids]
            fresh = None
        if fresh is None:
            batch = BatchEdits([e for e, _ in looked], np.array([p for _, p in looked], dtype=np.int64),
                               len(self.steer_bank.stages), self.steer_il.step.order)
        else:
            batch = last.replaced(n, rows)
        if self.steer_conditions is not None:
            batch.slots = self.steer_conditions.slots_for(rids, batch.edits)
            batch.held = self.steer_conditions.held_for(rids, batch.edits)
        cache = self.steer_requests
        if len(cache) > 4 * max(n, 64):  # forget requests that have left the batch
            present = set(self.model_runner.requests)
            for rid in [r for r in cache if r not in present]:
                del cache[rid]
        self.steer_batch_key, self.steer_batch = rids, batch

    def _steer_request(self, rid, changed: set) -> tuple:
        """(edits, prompt length) of request `rid`, read from its sampling params the first time it is seen;
        `changed` gains the locations whose stages its own vectors changed."""
        got = self.steer_requests.get(rid)
        if got is None:
            state = self.model_runner.requests[rid]
            extra = getattr(state.sampling_params, "extra_args", None) or {}
            got = self.steer_requests[rid] = (self.steer_parse(extra.get("steer")), state.num_prompt_tokens)
            if got[0] is not None and got[0].inline and self.steer_declared is None:
                changed |= self.steer_inline.take(rid, got[0], self.model_runner.device)
        return got

    def _steer_finished(self, rids) -> None:
        """Forget finished requests (vLLM may reuse an id for a request resubmitted after an abort) and free their
        own vectors' stages."""
        for rid in rids:
            self.steer_requests.pop(rid, None)
        if self.steer_conditions is not None:
            self.steer_conditions.release(rids)
        key = self.steer_batch_key
        if key:  # an id resubmitted into its freed slot is another request: its row is looked up again
            gone = set(rids)
            for i, rid in enumerate(key):
                if rid in gone:
                    key[i] = None
        changed = self.steer_inline.release(rids)
        if changed:
            self._steer_install(changed)

    # collective_rpc entry points ----------------------------------------------------------------------

    def steer_set_stages(self, stages, conditions=()) -> int:
        """Install the client's stage list (EditBank.stage_list: [(id, location, index, Edit.to_dict(when))], ids in
        order) as the taps' programs, with the conditions their `when` indexes (EditBank.condition_list, the
        client's whole list so far)."""
        from interleaver.bank import InlineStages, Stage
        from interleaver.edit import Condition, Edit

        if getattr(self, "steer_declared", None) is not None:  # its graphs read these programs' tensors
            raise ValueError(f"this engine captured its {self.steer_declared} edit stage(s) into its graphs when it "
                             f"started and cannot serve others ({len(stages)} asked); declare every edit at start")
        device = self.model_runner.device
        conds = [Condition.from_dict(c) for c in conditions]
        edits = [Edit.from_dict(e, conds) for _, _, _, e in stages]
        self.steer_bank.stages = [Stage(i, loc, index, e.to(device), d["when"])
                                  for (i, loc, index, d), e in zip(stages, edits)]
        if len(conds) != len(self.steer_bank.conditions):  # the client's list only grows
            self._steer_conditions(conds)
        self.steer_inline = InlineStages(self.steer_bank)  # ids of requests' own vectors are the client's now
        self.steer_requests.clear()
        return self._steer_install()

    def _steer_conditions(self, conds: list) -> None:
        """Decide `conds` from now on: a new state for every slot (a replay engine takes new conditions between
        batches; requests in flight keep the decisions they made)."""
        from interleaver.conditions import Conditions

        stray = {c.location for c in conds} - self.steer_il.taps
        if stray:
            raise ValueError(f"condition at {sorted(stray)[0]!r}, which is not a tap of this engine: "
                             f"{sorted(self.steer_il.taps)}")
        runner, old = self.model_runner, self.steer_conditions
        # Twice the running requests: a preempted request keeps its slot (and decision) while others run, and a
        # scoring pass's kept decision waits for its reading (the vLLM engine reads max_num_seqs jobs at a time)
        slots = 2 * int(getattr(getattr(self.vllm_config, "scheduler_config", None), "max_num_seqs", 0) or 256)
        new = Conditions(conds, slots, runner.max_num_tokens, runner.device) if conds else None
        if old is not None and new is not None:  # the slots held and their decisions so far
            new.adopt(old)
        bank = self.steer_bank
        bank.drop_conditions(0)
        for c in conds:
            bank.condition(c)
        self.steer_conditions = self.steer_il.step.conditions = new
        self.steer_batch_key = None  # the batch's slots are looked up again

    def _steer_install(self, only: Optional[set] = None) -> int:
        """The bank's stages as the taps' programs; `only`: the locations whose stages changed, where the other
        taps' stages kept their columns (inline stages' columns follow every other stage's)."""
        from interleaver.bank import layout
        from interleaver.program import TapProgram

        device, bank, il = self.model_runner.device, self.steer_bank, self.steer_il
        held = self.steer_conditions.list if self.steer_conditions is not None else []
        if len(bank.conditions) != len(held):  # requests' own conditions came or went: every program reads them
            self._steer_conditions(list(bank.conditions))
            only = None
        stray = {s.location for s in bank.stages} - il.taps
        if stray:
            raise ValueError(f"edit at {sorted(stray)[0]!r}, which is not a tap of this engine: {sorted(il.taps)}")
        inline = self.steer_inline.held()
        held = set(inline)
        order = np.concatenate([layout([s for s in bank.stages if s.id not in held]), np.array(inline, dtype=np.int64)])
        il.step.order = order
        self.steer_batch_key = None  # column order changed: rebuild the batch's weights
        columns = {int(sid): col for col, sid in enumerate(order)}
        if il.tap_graphs is not None:  # the graphs read the old programs' tensors and the old weight buffer
            il.tap_graphs.clear()
            il.step.use_static(self.model_runner.max_num_tokens, len(bank.stages), device)
            only = None
        # Every tap gets a program, those with no edits too: they still serve capture-only requests.
        old = il.programs or {}
        conds = self.steer_conditions
        il.programs = {loc: old[loc] if only is not None and loc not in only and loc in old
                       else TapProgram(loc, bank.at(loc), self.steer_residual[loc], columns, device, conds)
                       for loc in il.taps}
        for loc, program in il.programs.items():
            if loc in old and program is not old[loc]:
                program.kept = old[loc].kept  # rows a scoring request kept, not yet taken
        return len(bank.stages)

    def steer_profile(self) -> dict:
        """Host seconds spent per section since the last call (STEER_PROFILE=1 in the engine's environment), and
        how many tap program calls took the fused kernel and the torch form (`edits_fused`, `edits_torch`)."""
        clock = getattr(self, "steer_clock", None)
        if not clock:
            return {}
        out = clock.take()
        for form in ("fused", "torch"):
            n = sum(p.ran[form] for p in self.steer_il.programs.values())
            if n:
                out[f"edits_{form}"] = {"seconds": 0.0, "calls": n}
        for p in self.steer_il.programs.values():
            p.ran = {"fused": 0, "torch": 0}
        return out

    def steer_drop_held(self, names) -> None:
        """Free the condition slots kept under `names` (RequestEdits.hold) whose readings have ended or never
        came (a failed scoring pass): a slot still held when its reading ends is freed then."""
        if self.steer_conditions is not None:
            for name in names:
                self.steer_conditions.drop_kept(name)

    def steer_take_kept(self):
        """Hand back (and forget) the tap rows kept for scoring requests: {location: {key: [rows, ...]}}, as
        nested lists (plain data crosses vLLM's RPC intact)."""
        out = {}
        for loc, program in self.steer_il.programs.items():
            if program.kept:
                out[loc] = {k: [b.tolist() for b in blocks] for k, blocks in program.kept.items()}
                program.kept = {}
        return out


def folds(worker) -> dict:
    """For `collective_rpc` on a tap worker: tap location -> the norm its edits are folded into (vllm.fold_norm)."""
    return dict(worker.steer_il.folds)


def _compiled_hook(il, location: str, residual: bool):
    """A tap of a compiled engine: Dynamo traces this hook into the model's graph, and the op it calls runs the
    tap's in-graph program (nnsight and the interleaver's `handle` stay out of the traced code)."""
    from interleaver import compiled

    compiled.serve(il, location)
    return compiled.hook(location, residual)


def _tap_hook(il, location: str):
    def hook(module, args, output):
        il.handle(location, output)
        return None  # edits land in place; the module's own output object flows on

    return hook


def worker_cls() -> str:
    """The dotted path vLLM imports the tap worker from (in every worker process)."""
    return "interleaver.tap_worker.TapWorker"


def __getattr__(name):
    # TapWorker subclasses vLLM's Worker, which cannot be imported without vLLM: build it on first use.
    if name == "TapWorker":
        cls = type("TapWorker", (_TapWorkerMixin, _worker_base()), {})
        globals()["TapWorker"] = cls
        return cls
    raise AttributeError(name)
