#!/usr/bin/env bash
# The whole GPU check, for a GPU machine with vLLM (see CONTRIBUTING.md). Stages, in the order given (default: tests
# cli sweep bench):
#   tests  the GPU tests (pytest -m gpu -n 0 tests; TESTS_K=expr runs those pytest -k selects)
#   cli    the acceptance CLI run on the vLLM and HF engines, steered tokens compared
#   sweep  a single vLLM job against a 16-job packed sweep (wall time, engine start included)
#   bench  python -m steer.bench with BENCH_ARGS (its report lands in $OUT/bench)
#   table  docs/benchmark.md's table: the bench on the 8B shape, then SmolLM2, a b b2 c f h
#   easysteer  steer beside EasySteer on EasySteer's own workload (the Qwen2 1.5B shape, 256 x 128, add at one layer
#          and at all, k1-k256 distinct vectors, each at full strength and at epsilon); needs EASYSTEER_PYTHONPATH,
#          EasySteer's vLLM and package (docs/benchmark.md); EASYSTEER_MODELS=qwen2_1p5b,llama3_8b adds the 8B shape,
#          EASYSTEER_SCENARIOS (comma-separated) and EASYSTEER_CONFIGS narrow it
#   conditional  the conditional-steering and position-selector scenarios on the 8B shape (cast: half the requests
#          meet a condition at layer 8, an add at layer 12; last_prompt, first_generated, window), a f h, 64 x 128, 9 rounds (a pass is about a second: the rounds narrow the spread)
#   tp     two GPUs: the tensor-parallel tests and the bench's one-tap add at TP=2, 8B shape
#   serve  python -m steer.bench.serving: steer's vLLM server against a stock vllm serve under vLLM's serving benchmark
#          (8B shape; SERVE_ARGS, e.g. --modes replay,in_graph; its report lands in $OUT/bench-serve)
# Reports land under ${OUT:-gpu-report}; PACK_REPORT=1 tars them into one file.
set -uo pipefail
OUT=${OUT:-gpu-report}; mkdir -p "$OUT"
export STEER_CACHE=${STEER_CACHE:-/tmp/steer-cache} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
# NVLink multicast stays off (a program using it can take a shared host's GPUs down); vLLM's symmetric-memory
# all-reduce is the part of it that would reach for multicast, so TP runs use NCCL's and vLLM's own all-reduce.
export VLLM_ALLREDUCE_USE_SYMM_MEM=0
runs=/tmp/steer-runs; rm -rf "$runs"; mkdir -p "$runs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"

tests() {  # [report name]
  local name=${1:-gpu-tests}
  STEER_TEST_FAILURES="$OUT/$name-failures.txt" python -m pytest -m gpu -n 0 -v -rA tests ${TESTS_K:+-k "$TESTS_K"} \
    --junitxml="$OUT/$name.xml" 2>&1 \
    | tee "$OUT/$name.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error"
}

cli() {
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
}

sweep() {
  t0=$(date +%s.%N)
  python -m steer engine=vllm model=tiny tap=layer1 progress=false hydra.run.dir=$runs/single > "$OUT/single.log" 2>&1
  echo "single rc=$?"
  t1=$(date +%s.%N)
  python -m steer -m engine=vllm model=tiny tap=layer1 'edit.scale=range(0,16)' progress=false hydra.sweep.dir=$runs/sweep16 \
    > "$OUT/sweep16.log" 2>&1; echo "sweep16 rc=$?"
  t2=$(date +%s.%N)
  python -c "a=$t1-$t0; b=$t2-$t1; print(f'single job {a:.1f}s, 16-job packed sweep {b:.1f}s, ratio {b/a:.2f}')" \
    | tee "$OUT/sweep-timing.txt"
  ls $runs/sweep16 | tr '\n' ' '; echo
}

bench() {  # [report name]
  local name=${1:-bench}
  # shellcheck disable=SC2086
  set -f  # BENCH_ARGS holds skip patterns: no globbing
  STEER_PROFILE=1 python -m steer.bench ${BENCH_ARGS:-} hydra.run.dir="$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; set +f
  grep -E "^\[bench\]" "$OUT/$name.log"
}

tp() {
  python -m pytest -m gpu -n 0 -v -rA tests/gpu/test_tensor_parallel.py --junitxml="$OUT/tp-junit.xml" 2>&1 \
    | tee "$OUT/tp-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|error"
  python -m steer.bench 'run=[llama3_8b]' 'configs=[b,c]' 'scenarios=[add]' tensor_parallel_size=2 \
    hydra.run.dir="$OUT/bench-tp2" > "$OUT/bench-tp2.log" 2>&1; echo "bench tp2 rc=$?"
  grep -E "^\[bench\]" "$OUT/bench-tp2.log"
}

serve() {
  # shellcheck disable=SC2086
  python -m steer.bench.serving --out "$OUT/bench-serve" ${SERVE_ARGS:-} > "$OUT/bench-serve.log" 2>&1
  echo "serve bench rc=$?"; grep -E "^\[serve-bench\]|^\|" "$OUT/bench-serve.log"
}

table() {
  # The 8B shape first, whose steered engines take three waves beside a and b, then SmolLM2, all in one wave; no
  # faint twin but the 8B shape's ablate_all@eps, b2 (the A/A control) on SmolLM2 only, h on the 8B shape only
  BENCH_ARGS="run=[llama3_8b,smollm2] configs=[a,b,b2,c,f,h] \
skip=['llama3_8b/*/add@eps/*','llama3_8b/b2/*','smollm2/h/*','smollm2/*/*@eps/*'] ${BENCH_ARGS:-}" bench
}

conditional() {
  BENCH_ARGS="run=[llama3_8b] batches=[[64,128]] configs=[a,f,h] repeats=9 \
scenarios=[add,cast,last_prompt,first_generated,window,cast@eps] ${COND_ARGS:-}" bench bench-conditional
}

easysteer() {
  local s=${EASYSTEER_SCENARIOS:-add,add_all,k1,k8,k32,k64,k128,k256}
  BENCH_ARGS="run=[${EASYSTEER_MODELS:-qwen2_1p5b}] batches=[[256,128]] configs=[${EASYSTEER_CONFIGS:-a,f,h,easysteer}] \
k_kinds=[add] scenarios=[$s,${s//,/@eps,}@eps] peers.easysteer.pythonpath=${EASYSTEER_PYTHONPATH:-} ${BENCH_ARGS:-}" \
    bench bench-easysteer
}

for stage in "${@:-tests cli sweep bench}"; do
  for s in $stage; do echo "== $s $(date +%T)"; $s; done
done
if [ -n "${PACK_REPORT:-}" ]; then
  (cd "$OUT" && tar czf ../gpu-report.tgz . && rm -rf ./* && mv ../gpu-report.tgz .)
fi
