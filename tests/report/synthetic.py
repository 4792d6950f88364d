"""A synthetic sweep directory of many jobs (layer x scale), laid out as a real sweep's: each job's
.hydra/overrides.yaml, metrics.json and results.jsonl with the metrics a steer run writes. For the report's size
test and its opening benchmark (`python tests/report/open_bench.py`), where running a hundred real jobs would
measure the jobs, not the report."""

import json
import random
from pathlib import Path

import yaml

WORDS = ("the light was warm and the sky was bright with joy and wonder as we walked along the quiet river "
         "talking about the small things that made the day feel new again 😊").split()


def make(d: Path, layers: int = 10, scales: int = 10, prompts: int = 6, words: int = 40, seed: int = 0) -> Path:
    rng = random.Random(seed)
    d = Path(d)
    job = 0
    for layer in range(layers):
        for s in range(scales):
            scale = float(2 ** (s - 2))
            jd = d / str(job)
            (jd / ".hydra").mkdir(parents=True, exist_ok=True)
            overrides = [f"tap.layer={layer}", f"edit.scale={scale:g}"]
            (jd / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
            rows = []
            for i in range(prompts):
                base = " ".join(rng.choice(WORDS) for _ in range(words))
                steered = " ".join(rng.choice(WORDS) for _ in range(words))
                rows.append({"prompt": f"Prompt number {i} about <things> & more", "fed": f"Prompt number {i}",
                             "baseline": base, "steered": steered, "prompt_ids": list(range(8)),
                             "baseline_ids": list(range(words)), "steered_ids": list(range(words)),
                             "baseline_tokens": words, "steered_tokens": words, "tokens_changed": rng.randint(0, words),
                             "kl": rng.random(), "ppl_baseline": 2 + rng.random(), "ppl_steered": 2 + 4 * rng.random(),
                             "distinct2_baseline": rng.random(), "distinct2_steered": rng.random(),
                             "concept_baseline": rng.random(), "concept_steered": 10 * rng.random(),
                             "looping": rng.random() < 0.1})
            (jd / "results.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            keys = ("kl", "ppl_baseline", "ppl_steered", "distinct2_baseline", "distinct2_steered",
                    "concept_baseline", "concept_steered")
            metrics = {("kl_mean" if k == "kl" else k): sum(r[k] for r in rows) / len(rows) for k in keys}
            metrics["tokens_changed_frac"] = sum(r["tokens_changed"] for r in rows) / (words * prompts)
            metrics["prompts"] = prompts
            (jd / "metrics.json").write_text(json.dumps(metrics))
            job += 1
    return d
