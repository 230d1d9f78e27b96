#!/usr/bin/env bash
# Measure this machine's GPU for trainbook, once, and leave the numbers as data to commit.
#
# Runs `python -m trainbook gpumeasure` with the defaults for a one-GPU machine (GPU 0, the
# large size, a 420 s budget shared by all measurements: under 8 minutes in all), then stores
# `nvidia-smi -q` (or `rocm-smi --showallinfo` on ROCm) beside the JSON records, with serial
# numbers and UUIDs removed. Extra arguments go to gpumeasure and win over the defaults, e.g.
#   tools/gpu/measure.sh --budget-s 200        tools/gpu/measure.sh --size small --out /tmp/x
# Python: $PYTHON, else .venv/bin/python, else python3; the package is taken from code/ if it is
# not installed. See data/gpu/README.md for the layout and how to commit the result.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT/code${PYTHONPATH:+:$PYTHONPATH}"

rc=0
summary="$("$PYTHON" -m trainbook gpumeasure --device cuda --json "$@")" || rc=$?
if [ -z "$summary" ]; then  # bad input or no GPU: gpumeasure said why on stderr
  exit "$rc"
fi
out="$(printf '%s' "$summary" | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["out"])')"

redact() { sed -E 's/^([[:space:]]*(Serial Number|GPU UUID|UUID|Board Serial)[^:]*:).*/\1 (removed)/'; }
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -q 2>&1 | redact > "$out/nvidia-smi-q.txt" || true
elif command -v rocm-smi >/dev/null 2>&1; then
  rocm-smi --showallinfo 2>&1 | redact > "$out/rocm-smi.txt" || true
fi

printf '%s\n' "$summary"
cat >&2 <<MSG

gpumeasure wrote $out/ (exit status $rc; 1: a measurement failed, its record says why).
Check it, then commit it:
  git add $out && git commit -m "GPU truth: $(basename "$out")"
MSG
exit "$rc"
