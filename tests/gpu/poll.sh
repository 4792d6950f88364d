#!/usr/bin/env bash
# For the device tool: hold the call (and so the machine) for SECS seconds while a background run writes its reports
# under SRC, copying them to $OUT every 15 s. The tool brings back at most 8 files, so everything goes into one
# report.tgz (the profiler's raw traces left out), beside run.log and bench.md as they are for a quick look.
#   bash tests/gpu/poll.sh [SRC=/tmp/R] [SECS=570]
src=${1:-/tmp/R}; secs=${2:-570}; end=$((SECONDS + secs))
while [ $SECONDS -lt $end ]; do
  sleep 15
  cp "$src/run.log" "$src/bench/bench.md" "$OUT/" 2>/dev/null
  tar czf "$OUT/partial.tgz" -C "$src" --exclude=./bench/traces . 2>/dev/null && mv "$OUT/partial.tgz" "$OUT/report.tgz"
  # A run that has ended (or died at its start) leaves nothing to wait for: hand the report back now
  pgrep -f "tests/gpu/run.sh" > /dev/null || { echo "run.sh is not running"; break; }
done
grep -E "^\[bench\]" "$src/bench.log" 2>/dev/null | grep -v "host profile" | tail -40
tail -5 "$src/run.log"
