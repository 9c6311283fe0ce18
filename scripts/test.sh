#!/usr/bin/env bash
# The full test suite: set-up (first run only), ruff, then pytest. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "[test] ruff check" >&2
ruff check .
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of this script's purpose.
if [ "$rc" -eq 5 ]; then echo "[test] no tests were collected" >&2; exit 1; fi
exit "$rc"
