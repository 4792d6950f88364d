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
for key in ("steered", "baseline"):
    same = [a[key] == b[key] for a, b in zip(r["vllm"], r["hf"])]
    print(f"{key} text identical vllm vs hf: {sum(same)}/{len(same)}")
for e in ("vllm", "hf"):
    print(e, json.load(open(f"{out}/metrics-{e}.json")))
PY
# A single vLLM job against a 16-job packed sweep of the same model (wall time, engine start included).
t0=$(date +%s.%N)
python -m steer engine=vllm model=tiny progress=false hydra.run.dir=$runs/single > "$OUT/single.log" 2>&1; echo "single rc=$?"
t1=$(date +%s.%N)
python -m steer -m engine=vllm model=tiny 'edit.scale=range(0,16)' progress=false hydra.sweep.dir=$runs/sweep16 \
  > "$OUT/sweep16.log" 2>&1; echo "sweep16 rc=$?"
t2=$(date +%s.%N)
python -c "a=$t1-$t0; b=$t2-$t1; print(f'single job {a:.1f}s, 16-job packed sweep {b:.1f}s, ratio {b/a:.2f}')" | tee "$OUT/sweep-timing.txt"
ls $runs/sweep16 | tr '\n' ' '; echo
# The device tool brings back at most 8 files: pack the report into one when asked.
if [ -n "${PACK_REPORT:-}" ]; then
  (cd "$OUT" && tar czf ../gpu-report.tgz . && rm -rf ./* && mv ../gpu-report.tgz .)
fi
