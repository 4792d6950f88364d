#!/usr/bin/env bash
# For the device tool: start `tests/gpu/run.sh STAGES` in the background, from a copy of this tree outside it (the
# next call lays the working tree anew and replaces carried paths), reports under /tmp/R and its log in
# /tmp/R/run.log; the call then holds the machine with `bash tests/gpu/poll.sh /tmp/R SECS`. The environment passes
# through (TESTS_K, BENCH_ARGS, ...); vLLM comes from the bundle in /tmp/site.
#   TESTS_K=engine_core_in_this_process bash tests/gpu/detach.sh table tests && bash tests/gpu/poll.sh /tmp/R 250
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf /tmp/repo && mkdir -p /tmp/repo /tmp/R
tar --exclude=./.gpu --exclude=./.git -cf - . | tar -xf - -C /tmp/repo  # the bundle's parts stay behind
cd /tmp/repo
export PYTHONPATH=/tmp/site:/tmp/repo VLLM_USE_FLASHINFER_SAMPLER=0 OUT=/tmp/R
setsid nohup bash tests/gpu/run.sh "$@" > /tmp/R/run.log 2>&1 < /dev/null &
echo "run.sh $* started in /tmp/repo (pid $!); reports under /tmp/R"
