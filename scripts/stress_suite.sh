#!/usr/bin/env sh
# The test suite under a competing CPU load: a test that passes only on a quiet machine fails
# here. Runs pytest RUNS times in a row (default 3) while LOAD busy processes (default 2, one per
# core of a 2-core machine) compete for the CPU, prints each run's outcome and time, and exits
# non-zero if any run failed. Each run's output is kept in $LOGS/run-N.log.
#
#   scripts/stress_suite.sh                                   # the main suite, 3 times
#   RUNS=10 scripts/stress_suite.sh tests/runtime/test_interrupt.py   # one file, 10 times
#
# Arguments are pytest's (default: the main suite, in TEST_WORKERS processes); make stress runs
# it after installing what the tests need. Ctrl-C or SIGTERM stops the run and the load.
set -u
cd "$(dirname "$0")/.."

RUNS=${RUNS:-3}
LOAD=${LOAD:-2}
TEST_WORKERS=${TEST_WORKERS:-2}
PY=${PY:-.venv/bin/python}
LOGS=${LOGS:-runs/stress}
[ $# -gt 0 ] || set -- tests

mkdir -p "$LOGS"
busy=""
suite=""
stop() {
    # shellcheck disable=SC2086  # the pids are words
    kill $busy $suite 2>/dev/null
}
trap stop EXIT
trap 'stop; exit 129' HUP
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
for _ in $(seq "$LOAD"); do
    python3 -c 'while True: pass' &
    busy="$busy $!"
done
echo "stress: pytest $*, $RUNS run(s) beside $LOAD busy process(es); logs in $LOGS/"

failed=0
for i in $(seq "$RUNS"); do
    start=$(date +%s)
    # in the background, so a signal to this script is handled at once
    env -u PYTHONDONTWRITEBYTECODE "$PY" -m pytest -q -p no:cacheprovider --dist worksteal -n "$TEST_WORKERS" \
        "$@" >"$LOGS/run-$i.log" 2>&1 &
    suite=$!
    wait "$suite"
    rc=$?
    suite=""
    echo "run $i/$RUNS: exit $rc in $(($(date +%s) - start)) s: $(tail -n 1 "$LOGS/run-$i.log")"
    if [ "$rc" -ne 0 ]; then
        failed=$((failed + 1))
        grep -E "^(FAILED|ERROR) " "$LOGS/run-$i.log" | sed 's/^/    /'
    fi
done
echo "stress: $((RUNS - failed)) of $RUNS run(s) green"
[ "$failed" -eq 0 ]
