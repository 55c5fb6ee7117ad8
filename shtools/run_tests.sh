#!/usr/bin/env bash
# Install what is missing, then run the whole test suite on CPU (gloo).
#   bash shtools/run_tests.sh            # everything
#   bash shtools/run_tests.sh -k column  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
bash shtools/install_deps.sh dev
exec "$PYTHON" -m pytest -q "$@"
