#!/usr/bin/env bash
# Install what is missing, then run the whole test suite on CPU (gloo).
#   bash shtools/run_tests.sh            # everything
#   bash shtools/run_tests.sh -k column  # extra arguments go to pytest
#   bash shtools/run_tests.sh --quick    # the quick tier (a few minutes) while working
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
bash shtools/install_deps.sh dev
TIER=()
if [ "${1:-}" = "--quick" ]; then
    shift  # the quick tier: unit tests and one whole run per parallel dimension
    TIER=(-m quick)
fi
# Two test processes (pytest-xdist) where it is installed: many tests wait on processes they
# start (torchrun, rank pools, scripts), and a second worker fills those waits (about 15% off
# the suite on 2 cores). PYTEST_WORKERS=1 runs them in one process; the GPU tier always does
# (its tests share the one GPU).
WORKERS=${PYTEST_WORKERS:-2}
case " $* " in *" tests/gpu"*|*" -n "*|*" -p no:xdist "*) WORKERS=1 ;; esac
PARALLEL=()
if [ "$WORKERS" -gt 1 ] && "$PYTHON" -c "import xdist" >/dev/null 2>&1; then
    PARALLEL=(-n "$WORKERS" --dist worksteal)
fi
exec "$PYTHON" -m pytest -q "${TIER[@]}" "${PARALLEL[@]}" "$@"
