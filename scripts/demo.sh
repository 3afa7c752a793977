#!/usr/bin/env bash
# `make demo`: the pipeline end to end on a small embedded default. Stages are added as they land;
# this script says plainly which ones it ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
echo "== demo: effective configuration (config.py) =="
$PY config.py
echo
echo "demo ran: config.py only (the data pipeline and training stages are not built yet)."
