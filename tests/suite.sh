#!/usr/bin/env bash
# The whole suite, as `make test` runs it (CI too): two pytest processes side by side.
#
#   tests/suite.sh PYTHON [pytest args...]
#
# Two modules run in a second pytest process beside the rest: tests/test_deployments.py (its own Ray head,
# `prefect server`, process worker and deployments, ~450 s, much of it waiting on those processes) and
# then tests/test_resume.py (`reflow train` subprocesses killed and resumed, each with a Ray cluster of its
# own; its session Prefect server is that process's own). On 2 cores a quarter of the CPU stood idle with
# everything in one process (/proc/stat over a whole run), and with the deployments alone beside the rest
# the idle share dropped to 3-14 % while they ran and went back to ~30 % after. Their output follows the
# main run's; the exit status is the main run's or, if that passed, the other's. With pytest args (one
# module, -k, ...) everything runs in one process, as before.
set -uo pipefail
py=$1; shift
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  exec "$py" -m pytest -q --durations=60 tests "$@"
fi
beside=(tests/test_deployments.py tests/test_resume.py)
log=$(mktemp -t reflow-beside-XXXXXX.log)
"$py" -m pytest -q --durations=15 "${beside[@]}" > "$log" 2>&1 &
pid=$!
"$py" -m pytest -q --durations=60 tests "${beside[@]/#/--ignore=}"
main=$?
wait "$pid"
other=$?
echo "---------------------------------------- ${beside[*]} (ran beside the rest; exit $other)"
cat "$log"
rm -f "$log"
[ "$main" -ne 0 ] && exit "$main"
exit "$other"
