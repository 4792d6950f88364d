"""The CPU benchmark: steer's HF engine against plain transformers with a forward hook, and the CPU server's
throughput alone and under concurrent requests.

    python -m steer.bench.cpu [--rounds 3] [--tokens 24] [--requests 16] [--no-server]

Workload: the default main job (`python -m steer model=smollm2 engine=hf`): its 6 chat prompts, baseline and
steered (its edit: the joy direction added at layer 12, scale 4), greedy, `--tokens` new tokens each. steer runs the
12 requests through `generate_many`; the reference is what a researcher writes by hand: transformers' batched
`generate` on the same prompt ids, left-padded, once unsteered and once with a forward hook adding the same vector.
The two alternate for `--rounds` rounds and the best round of each counts (generated tokens per second, the stop
token not counted). A third entry runs the steered requests under a condition on the prompt (edit.when: the same
edit, applied where the prompt's mean at layer 5 scores above the prompts' median cosine with the edit's vector, so
half the prompts meet it), in the same rounds, against steer's unconditional batch. The server (`python -m
steer.serve engine=hf model=smollm2`, preset `joy`) is then sent `--requests` chat completions of the same prompts
with the official openai client, one at a time and then all at once, each answer checked against the same
request's answer sent alone.
"""

import argparse
import asyncio
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from steer.config.schema import GenConf


def main_job(tokens: int, out_dir: Path):
    """The default main job on SmolLM2 and the HF engine, its engine and its set-up work (plan, prompt ids)."""
    from hydra import compose, initialize_config_dir
    from rich.console import Console

    from steer.config.schema import register, to_object
    from steer.runs import run
    from steer.runs.job import engine_for
    from steer.tasks.registry import prepare

    register()
    conf_dir = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(version_base="1.3", config_dir=conf_dir):
        cfg = to_object(compose("config", overrides=["model=smollm2", "engine=hf", f"gen.max_new_tokens={tokens}",
                                                     "progress=false"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    job = prepare(cfg, out_dir)
    return job, engine_for([job]), run, Console(stderr=True)


def plain_generate(model, prompts: List[List[int]], tokens: int, pad: int, stop: List[int],
                   hook_layer=None, vector=None) -> List[List[int]]:
    """transformers' `generate` on the prompts as one left-padded batch, greedy; with a forward hook adding
    `vector` to `hook_layer`'s output where given. Each row's tokens before its first stop token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    handle = None
    if hook_layer is not None:
        def add(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            h += vector.to(h.dtype)
        handle = hook_layer.register_forward_hook(add)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=stop, temperature=None, top_p=None, top_k=None)
    finally:
        if handle is not None:
            handle.remove()
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), len(row))
        rows.append(row[:cut])
    return rows


def conditional(engine, work, layer: int = 5):
    """The steered plan with its edits under a condition half the prompts meet: the cosine of a prompt's mean at
    `layer` with the first edit's vector, above the middle of the prompts' scores. The plan, and which met it."""
    from dataclasses import replace

    from steer.edits.condition import Condition
    from steer.edits.plan import Plan

    tap, edit = work.plan.primary
    path = work.job.spec.layer_path(layer)
    probe = Condition(path, edit.basis[0], "mean", "cosine")
    read = engine.score_many([(ids, [], None, (path,)) for ids in work.encoded])
    scores = [float(probe.scores(r.captured[path][None], torch.ones(1, len(ids), dtype=torch.bool))[0])
              for ids, r in zip(work.encoded, read)]
    ranked = sorted(scores)
    middle = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2
    cond = replace(probe, threshold=middle)
    plan = Plan(taps=dict(work.steering.taps), primary=work.steering.primary)
    plan.edits = {p: [replace(e, when=cond) for e in es] for p, es in work.steering.edits.items()}
    return plan, [s > middle for s in scores]


def engines(rounds: int, tokens: int) -> Dict:
    """steer's HF engine and plain transformers + a hook on the main job, alternating; the best round of each."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        job, held, run, console = main_job(tokens, Path(tmp) / "run")
        with held as engine:
            work = run._setup(job, engine, console)
            tap, edit = work.plan.primary
            gen = GenConf(max_new_tokens=tokens)
            jobs = [(ids, None, seed) for ids, seed in zip(work.encoded, work.seeds)]
            jobs += [(ids, work.steering, seed) for ids, seed in zip(work.encoded, work.seeds)]
            plain = AutoModelForCausalLM.from_pretrained(job.spec.source, dtype=job.spec.dtype).eval()
            layer = dict(plain.named_modules())[tap.path]
            vector = edit.strength * edit.basis[0]
            stop = sorted(engine.stop_ids)
            pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else stop[0]
            cond_plan, met = conditional(engine, work)
            cond_jobs = jobs[: len(work.encoded)] + [(ids, cond_plan, seed) for ids, seed in
                                                      zip(work.encoded, work.seeds)]
            times: Dict[str, List[float]] = {"steer": [], "plain": [], "conditional": []}
            for i in range(rounds):
                console.print(f"round {i + 1} of {rounds}")
                t0 = time.perf_counter()
                ours = engine.generate_many(jobs, gen)
                times["steer"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                cond = engine.generate_many(cond_jobs, gen)
                times["conditional"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                theirs = plain_generate(plain, work.encoded, tokens, pad, stop)
                theirs += plain_generate(plain, work.encoded, tokens, pad, stop, layer, vector)
                times["plain"].append(time.perf_counter() - t0)
            one = engine.bound
            from steer.engine.hf_batch import Bound

            engine.bound = Bound(rows=1)
            t0 = time.perf_counter()
            alone = engine.generate_many(jobs, gen)
            t_alone = time.perf_counter() - t0
            engine.bound = one
    n_ours, n_theirs, n_alone, n_cond = (sum(len(r) for r in x) for x in (ours, theirs, alone, cond))
    same = sum(a == b for a, b in zip(ours, theirs))
    half = len(work.encoded)
    # a met row generates the steered text, an unmet one the baseline's
    cond_equal = sum(c == (s if m else b) for c, s, b, m in zip(cond[half:], ours[half:], ours[:half], met))
    return {"steer": n_ours / min(times["steer"]), "plain": n_theirs / min(times["plain"]),
            "steer_one_at_a_time": n_alone / t_alone, "tokens": n_ours, "plain_tokens": n_theirs,
            "rows_equal": same, "rows": len(jobs), "alone_equal": sum(a == b for a, b in zip(ours, alone)),
            "prompts": list(work.prompts), "conditional": n_cond / min(times["conditional"]), "met": sum(met),
            "conditional_equal": cond_equal}


async def _load(url: str, prompts: List[str], n: int, concurrency: int, tokens: int) -> Tuple[float, List[str]]:
    """`n` chat completions of the prompts in turn (every other one on preset joy), `concurrency` at a time: the
    generated tokens per second, and the answers."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="steer", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    made = 0

    async def one(i: int) -> str:
        nonlocal made
        async with gate:
            r = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                max_tokens=tokens, temperature=0, extra_body={"vllm_xargs": {"steer": "joy"}} if i % 2 else {})
            made += r.usage.completion_tokens
            return r.choices[0].message.content

    t0 = time.perf_counter()
    texts = await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    await client.close()
    return made / elapsed, list(texts)


def server(requests: int, tokens: int, prompts: List[str]) -> Dict:
    """The CPU server's throughput (generated tokens per second) at 1 and `requests` concurrent requests."""
    from steer.procgroup import free_port, running

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "steer.serve", "engine=hf", "model=smollm2", f"serve.port={port}",
               "serve.log_level=warning", "serve.presets=[joy]", f"hydra.run.dir={tmp}/serve"]
        with running(cmd, port, Path(tmp) / "server.log", timeout=1800) as url:
            asyncio.run(_load(url, prompts, 2, 1, 2))  # warm-up
            one, alone = asyncio.run(_load(url, prompts, requests, 1, tokens))
            many, together = asyncio.run(_load(url, prompts, requests, requests, tokens))
    return {"one": one, "many": many, "requests": requests, "equal": sum(a == b for a, b in zip(alone, together))}


def markdown(e: Dict, s: Dict, args) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"CPU benchmark, {now}, {torch.get_num_threads()} torch threads, `python -m steer.bench.cpu "
             f"--rounds {args.rounds} --tokens {args.tokens} --requests {args.requests}`", "",
             "| what | generated tok/s | x plain batched |", "| --- | ---: | ---: |",
             f"| steer HF engine, `generate_many` (12 rows, one batch) | {e['steer']:.1f} | "
             f"{e['steer'] / e['plain']:.2f} |",
             f"| steer HF engine, one request at a time (hf.batch_size=1) | {e['steer_one_at_a_time']:.1f} | "
             f"{e['steer_one_at_a_time'] / e['plain']:.2f} |",
             f"| steer HF engine, steered rows under edit.when ({e['met']} of {len(e['prompts'])} met; "
             f"x{e['conditional'] / e['steer']:.2f} of unconditional) | {e['conditional']:.1f} | "
             f"{e['conditional'] / e['plain']:.2f} |",
             f"| transformers `generate`, left-padded batch of 6, + forward hook | {e['plain']:.1f} | 1.00 |", "",
             f"{e['tokens']} tokens generated by steer, {e['plain_tokens']} by plain transformers; rows equal to "
             f"plain transformers': {e['rows_equal']} of {e['rows']}; batched rows equal to one at a time: "
             f"{e['alone_equal']} of {e['rows']}; conditional rows equal to the steered text where met and the "
             f"baseline where not: {e['conditional_equal']} of {len(e['prompts'])}."]
    if s:
        lines += ["", "| server (engine=hf, chat, half the requests on preset joy) | generated tok/s | x one |",
                  "| --- | ---: | ---: |",
                  f"| 1 request at a time ({s['requests']} requests) | {s['one']:.1f} | 1.00 |",
                  f"| {s['requests']} concurrent requests | {s['many']:.1f} | {s['many'] / s['one']:.2f} |", "",
                  f"answers equal to the same request's one at a time: {s['equal']} of {s['requests']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m steer.bench.cpu", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--no-server", action="store_true", help="measure the engines only")
    args = p.parse_args(argv)
    e = engines(args.rounds, args.tokens)
    print(f"steer {e['steer']:.1f} tok/s, plain batched generate + hook {e['plain']:.1f} tok/s: "
          f"x{e['steer'] / e['plain']:.2f}", flush=True)
    s = {}
    if not args.no_server:
        s = server(args.requests, args.tokens, e["prompts"])
        print(f"server {s['one']:.1f} tok/s at 1, {s['many']:.1f} at {s['requests']}: x{s['many'] / s['one']:.2f}",
              flush=True)
    print(markdown(e, s, args))


if __name__ == "__main__":
    main()
