#!/usr/bin/env bash
# The whole suite, as `make test` runs it (CI too): two pytest processes side by side.
#
#   tests/suite.sh PYTHON [pytest args...]
#
# tests/test_deployments.py brings up a stack of its own (a Ray head, a `prefect server`, a process
# worker, deployments: no session fixture but the tiny policy) and spends much of its ~450 s waiting on
# those processes, so it runs in a second pytest process beside the rest of the suite; on 2 cores a
# quarter of the CPU stood idle with the two in one process. Its output follows the main run's, and the
# exit status is the main run's or, if that passed, the other's. With pytest args (one module, -k, ...)
# everything runs in one process, as before.
set -uo pipefail
py=$1; shift
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  exec "$py" -m pytest -q --durations=60 tests "$@"
fi
beside=tests/test_deployments.py
log=$(mktemp -t reflow-beside-XXXXXX.log)
"$py" -m pytest -q --durations=10 "$beside" > "$log" 2>&1 &
pid=$!
"$py" -m pytest -q --durations=60 tests --ignore="$beside"
main=$?
wait "$pid"
other=$?
echo "---------------------------------------- $beside (ran beside the rest; exit $other)"
cat "$log"
rm -f "$log"
[ "$main" -ne 0 ] && exit "$main"
exit "$other"
