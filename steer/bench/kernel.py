"""`python -m steer.bench.kernel`: one tap's edit on the GPU, in microseconds, beside the memory floor.

On the 8B shape, `ablate` at every layer costs about 29 us of GPU time a tap in f (edits captured in the graph,
no host work per tap), against the 2-4 us the fused kernel's memory traffic should take. This times one tap's
program alone, as f runs it (`TapProgram.in_graph`, the step's weights at a fixed address), `taps` times over in
one CUDA graph, as a decode step replays it:

- `fused`: the Triton kernel (interleaver/kernels.py), launched as a replayed step launches it (directly, its
  arguments bound once to its tensors' addresses);
- `direct`: the same launch resolving its arguments each time (Triton's `compiled[grid](...)`); its eager column
  against `fused`'s is what binding saves a tap on the host;
- `jit`: the same kernel, every launch through Triton's JIT (`kernel[grid](...)`); its eager column against
  `direct`'s is what the direct launch saves a tap on the host;
- `torch`: the same program on its torch form;
- `floor`: `hidden += residual` on the same rows, the least memory traffic an edit of the stream can have.

Each figure is microseconds a tap, the graph replayed `replays` times and timed with CUDA events; the eager
column is the same calls launched one by one (launch-bound). The ratio to the floor is what to read.

A second table measures a candidate for an edit that costs no launch of its own: vLLM's Llama-family layers hand
(hidden, residual) to the next layer's residual add and RMSNorm, which vLLM's compile pipeline generates with
torch.compile. Against that step alone (`norm`, compiled), it times the fused kernel followed by it
(`fused+norm`, what an engine with compiled edits runs today) and the edit's arithmetic written as torch ops
(kernels.folded) compiled together with it into one function (`folded`), and the Triton kernel that does the
edit, the add and the norm in one pass (`edit_norm`, what `vllm.fold_norm` runs), and gives each one's microseconds
over `norm`.
"""

import argparse
from contextlib import nullcontext
from typing import Callable, Dict, List

import torch

from interleaver.bank import EditBank, RequestEdits, layout
from interleaver.rows import Span, StepRows
from interleaver.program import TapProgram
from steer.bench.workload import scenario
from steer.engine.vllm import stage_edit

_TAP = "layers.0"


def _program(scen_name: str, rows: int, hidden: int, device) -> tuple:
    """A tap program for `rows` decode rows steered by `scen_name`, and the step's weights."""
    bank = EditBank()  # registers each distinct edit once, however many requests ask for it
    spans = [Span(i, 1, 40, 32, RequestEdits(bank.register(_TAP, [stage_edit(e)])))
             for i, e in enumerate(scenario(scen_name, hidden, 1, rows, 0).edits)]  # one generated row each: decode
    step = StepRows()
    step.order = layout(bank.stages)
    step.set(spans, rows, len(bank.stages), device)
    columns = {int(s): c for c, s in enumerate(step.order)}
    return TapProgram(_TAP, bank.at(_TAP), True, columns, device=device), step.weights


def _time(fn: Callable[[], None], taps: int, replays: int, graph: bool) -> float:
    """Microseconds a call of `fn`: `taps` calls in a CUDA graph replayed `replays` times, or launched eagerly."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile, allocate and settle before a capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run = lambda: [fn() for _ in range(taps)]  # noqa: E731
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        run()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * taps)


def measure(rows: int, hidden: int, scen_name: str, dtype=torch.bfloat16, taps: int = 32,
            replays: int = 50) -> List[Dict]:
    """Microseconds a tap for the fused kernel, the torch form and the floor, in a graph and eagerly."""
    device = "cuda"
    program, weights = _program(scen_name, rows, hidden, device)
    g = torch.Generator(device=device).manual_seed(0)
    h, r = (torch.randn(rows, hidden, generator=g, device=device).to(dtype) * 0.01 for _ in range(2))
    stream_add, edit = (lambda: h.add_(r)), (lambda: program.in_graph((h, r), weights))
    out = []
    for name in ("floor", *(("fused", "direct", "jit", "torch") if program.fused else ("torch",))):
        with nullcontext() if name == "floor" else program.form(name):  # the forms of this module's docstring
            fn = stream_add if name == "floor" else edit
            out.append({"rows": rows, "scenario": scen_name, "form": name,
                        "graph_us": _time(fn, taps, replays, graph=True),
                        "eager_us": _time(fn, taps, replays, graph=False)})
    floor = out[0]["graph_us"]
    for o in out:
        o["vs_floor"] = o["graph_us"] / floor
    return out


def next_norm(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> tuple:
    """The next layer's input step: the residual add and RMSNorm as vLLM's RMSNorm.forward_native computes them
    (float32 inside), returning the normed input and the new residual."""
    x = hidden.float() + residual.float()
    new_residual = x.to(hidden.dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(hidden.dtype) * weight, new_residual


def fold_forms(program: TapProgram, weights: torch.Tensor, h, r, norm_weight, compile_fn=torch.compile) -> Dict:
    """form -> a call of it on (h, r), for the second table: `norm` alone, the fused kernel (or torch form, off a
    GPU) then `norm`, the edit folded into `norm` as one compiled function, and (where the program runs fused)
    the one kernel of edit, add and norm."""
    from interleaver import kernels

    table = program.table()
    norm = compile_fn(next_norm)
    fold = compile_fn(lambda h, r, w, nw: next_norm(kernels.folded(table, h, r, w), r, nw))

    def edit_then_norm():
        program.in_graph((h, r), weights)
        return norm(h, r, norm_weight)

    def edit_norm():  # vllm.fold_norm's one launch, in place: h the normed sum, r the sum
        if not program.in_graph_norm((h, r), weights, norm_weight, 1e-5):
            raise RuntimeError("the fused edit + add + RMSNorm kernel did not run")

    forms = {"norm": lambda: norm(h, r, norm_weight), "fused+norm": edit_then_norm,
             "folded": lambda: fold(h, r, weights, norm_weight)}
    return {**forms, "edit_norm": edit_norm} if program.fused else forms


def measure_fold(rows: int, hidden: int, scen_name: str, dtype=torch.bfloat16, taps: int = 32,
                 replays: int = 50) -> List[Dict]:
    """Microseconds a tap of each of fold_forms, in a graph and eagerly, and over `norm` alone in a graph."""
    program, weights = _program(scen_name, rows, hidden, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    h, r = (torch.randn(rows, hidden, generator=g, device="cuda").to(dtype) * 0.01 for _ in range(2))
    nw = torch.ones(hidden, device="cuda", dtype=dtype)
    out = [{"rows": rows, "scenario": scen_name, "form": name, "graph_us": _time(fn, taps, replays, graph=True),
            "eager_us": _time(fn, taps, replays, graph=False)}
           for name, fn in fold_forms(program, weights, h, r, nw).items()]
    for o in out:
        o["over_norm_us"] = o["graph_us"] - out[0]["graph_us"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--hidden", type=int, default=4096)  # Llama-3-8B's
    p.add_argument("--scenarios", nargs="+", default=["ablate_all", "add", "k64"])
    p.add_argument("--taps", type=int, default=32)
    p.add_argument("--fold", action=argparse.BooleanOptionalAction, default=True,
                   help="the second table: the edit folded into the next layer's add and RMSNorm (torch.compile)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("steer.bench.kernel times GPU kernels: it needs CUDA")
    print(f"{torch.cuda.get_device_name(0)}, hidden {a.hidden}, bf16, {a.taps} taps a graph")
    print(f"{'rows':>5} {'scenario':>10} {'form':>6} {'graph us/tap':>13} {'eager us/tap':>13} {'x floor':>8}")
    for rows in a.rows:
        for s in a.scenarios:
            for o in measure(rows, a.hidden, s, taps=a.taps):
                print(f"{rows:>5} {s:>10} {o['form']:>6} {o['graph_us']:>13.2f} {o['eager_us']:>13.2f} "
                      f"{o['vs_floor']:>8.2f}")
    if a.fold:
        print(f"\n{'rows':>5} {'scenario':>10} {'form':>10} {'graph us/tap':>13} {'eager us/tap':>13} "
              f"{'us over norm':>13}")
        for rows in a.rows:
            for s in a.scenarios:
                for o in measure_fold(rows, a.hidden, s, taps=a.taps):
                    print(f"{rows:>5} {s:>10} {o['form']:>10} {o['graph_us']:>13.2f} {o['eager_us']:>13.2f} "
                          f"{o['over_norm_us']:>13.2f}")


if __name__ == "__main__":
    main()
