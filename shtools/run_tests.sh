#!/usr/bin/env bash
# Install what is missing, then run the whole test suite on CPU (gloo).
#   bash shtools/run_tests.sh            # everything
#   bash shtools/run_tests.sh -k column  # extra arguments go to pytest
#   bash shtools/run_tests.sh --quick    # the quick tier (a few minutes) while working
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
bash shtools/install_deps.sh dev
if [ "${1:-}" = "--quick" ]; then
    shift  # the quick tier: unit tests and one whole run per parallel dimension
    exec "$PYTHON" -m pytest -q -m quick "$@"
fi
exec "$PYTHON" -m pytest -q "$@"
