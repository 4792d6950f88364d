#!/usr/bin/env bash
# The whole GPU check, for the GPU machine (see README): the GPU tests, then the acceptance CLI run on the vLLM
# and HF engines with their steered tokens compared. Reports land under ${OUT:-gpu-report}.
set -uo pipefail
OUT=${OUT:-gpu-report}; mkdir -p "$OUT"
export STEER_CACHE=${STEER_CACHE:-/tmp/steer-cache} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python -m pytest -m gpu -v -rA tests/gpu "$@" --junitxml="$OUT/gpu-junit.xml" 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error" 
runs=/tmp/steer-runs; rm -rf "$runs"
for e in vllm hf; do
  dev=$([ $e = hf ] && echo cpu || echo cuda)
  python -m steer engine=$e device=$dev model=tiny tap=layer3 edit=ablate progress=false hydra.run.dir=$runs/$e \
    > "$OUT/cli-$e.log" 2>&1; echo "engine=$e rc=$?"; ls -A $runs/$e
  cp $runs/$e/results.jsonl "$OUT/results-$e.jsonl" 2>/dev/null; cp $runs/$e/metrics.json "$OUT/metrics-$e.json" 2>/dev/null
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
r = {e: [json.loads(l) for l in open(f"{out}/results-{e}.jsonl")] for e in ("vllm", "hf")}
same = [a["steered"] == b["steered"] for a, b in zip(r["vllm"], r["hf"])]
print(f"steered text identical vllm vs hf: {sum(same)}/{len(same)}")
for e in ("vllm", "hf"):
    print(e, json.load(open(f"{out}/metrics-{e}.json")))
PY
