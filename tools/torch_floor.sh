#!/usr/bin/env bash
# Test trainbook against an older torch: a fresh venv with torch==VERSION and the pinned
# requirements (torch's own pins win where they clash, e.g. sympy), then the whole suite except
# the notebooks. Writes data/torch-floor/torch-VERSION.json: command, date, versions, counts and
# the failing tests. tests/test_torch_floor.py checks that code/pyproject.toml's floor has a
# passing record. Needs the network (PyPI: a CUDA build of torch, about 5 GB in the venv) and
# about 10 minutes on 2 cores; not run by CI.
#
#   bash tools/torch_floor.sh 2.12.0
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: tools/torch_floor.sh TORCH_VERSION (e.g. 2.12.0)}
venv=${FLOOR_VENV:-/tmp/trainbook-floor-$version}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version"
  grep -vE '^(torch|sympy)==' requirements.txt > "$venv/requirements-floor.txt"
  echo "torch==$version" > "$venv/constraints-floor.txt"
  "$venv/bin/pip" install -q -r "$venv/requirements-floor.txt" -c "$venv/constraints-floor.txt"
fi
"$venv/bin/pip" install -q -e ./code --no-deps
report=$(mktemp)
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider --ignore=tests/test_notebooks.py \
    --ignore=tests/test_torch_floor.py -rfE > "$report" 2>&1
set -e
"$venv/bin/python" - "$report" "$version" <<'PY'
import datetime, json, platform, re, subprocess, sys
import torch
report, version = open(sys.argv[1]).read(), sys.argv[2]
summary = report.strip().splitlines()[-1]
count = lambda word: int(m.group(1)) if (m := re.search(rf"(\d+) {word}", summary)) else 0
failing = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", report, re.M)))
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = bool(subprocess.run(["git", "status", "--porcelain", "code", "tests"],
                            capture_output=True, text=True).stdout.strip())
out = {"kind": "torch-floor", "torch": torch.__version__, "requested": version,
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "command": f"bash tools/torch_floor.sh {version}", "commit": commit,
       "uncommitted_changes": dirty,
       "python": platform.python_version(), "machine": platform.machine(),
       "passed": count("passed"), "failed": count("failed"), "errors": count("error"),
       "failing": failing, "summary": summary}
path = f"data/torch-floor/torch-{torch.__version__.split('+')[0]}.json"
open(path, "w").write(json.dumps(out, indent=2) + "\n")
print(f"{path}: {summary}")
PY
