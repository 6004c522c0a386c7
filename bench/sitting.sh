#!/usr/bin/env bash
# The README's speed rows in one sitting, on a quiet machine (bench/sitting.py says what
# it runs): bench/sitting.sh LLAMA_CPP_BIN_DIR [--rounds N] [--dry-run]
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 LLAMA_CPP_BIN_DIR [--rounds N] [--dry-run]" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$1"; shift
cd "$root"
uptime
exec "${PYTHON:-$root/.venv/bin/python}" -m bench.sitting --llama-cpp "$dir" "$@"
