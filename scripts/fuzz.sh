#!/usr/bin/env bash
# Runs every libFuzzer harness built in BUILD_DIR (fuzz_<reader>, from `make fuzz`) for SECONDS
# each, seeded from tests/fuzz/corpus/<reader>/ and tests/fuzz/regress/<reader>/ (read only:
# new inputs go to BUILD_DIR/fuzz-work/<reader>/, kept between local runs). A crash, leak,
# sanitizer report, input slower than 10 s or RSS over 2 GB fails the run; the input is in
# BUILD_DIR/fuzz-artifacts/<reader>/. Commit it under tests/fuzz/regress/<reader>/ so the replay
# tests keep it.
#
#     scripts/fuzz.sh BUILD_DIR SECONDS [READER...]     (default: every harness built)
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR SECONDS [READER...]" >&2; exit 2; }
build=$1 seconds=$2
shift 2
readers=("$@")
if [ ${#readers[@]} -eq 0 ]; then
  for src in tests/fuzz/fuzz_*.c; do
    r=$(basename "$src" .c)
    readers+=("${r#fuzz_}")
  done
fi

failed=()
for r in "${readers[@]}"; do
  bin=$build/fuzz_$r
  [ -x "$bin" ] || { echo "fuzz: $bin not built" >&2; failed+=("$r (not built)"); continue; }
  work=$build/fuzz-work/$r art=$build/fuzz-artifacts/$r
  mkdir -p "$work" "$art" "tests/fuzz/regress/$r"
  opts=(-max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=65536
        -artifact_prefix="$art/" -print_final_stats=1)
  [ -f "tests/fuzz/$r.dict" ] && opts+=(-dict="tests/fuzz/$r.dict")
  echo "== fuzz_$r: ${seconds}s"
  # the output of the whole run goes to a log; its tail and every report are shown
  log=$build/fuzz-$r.log
  OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$bin" "${opts[@]}" "$work" "tests/fuzz/corpus/$r" "tests/fuzz/regress/$r" >"$log" 2>&1
  rc=$?
  grep -E '^(#[0-9]+ +(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" | tail -4
  if [ $rc -ne 0 ]; then
    echo "fuzz_$r FAILED (exit $rc); the report (full log: $log):"
    awk '/==[0-9]+==ERROR|runtime error|ALARM|deadly signal|out-of-memory/ {p = 1} p && n++ < 12' "$log"
    grep -m1 'Test unit written' "$log"
    failed+=("$r")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: failed: ${failed[*]}"
  exit 1
fi
echo "fuzz: ${#readers[@]} harnesses ran ${seconds}s each without a finding"
