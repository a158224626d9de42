#!/usr/bin/env bash
# Developer entry point. Idempotent set-up of .venv, then one job:
#   tools/dev.sh demo   build MiniLM ONNX from the bundled package, run `graphopt optimize`, print the report
#   tools/dev.sh test   run the test suite
#   tools/dev.sh setup  only set up .venv
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-test}"; shift || true
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.graphopt-setup
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up .venv (log: .venv/setup.log)…" >&2
  {
    .venv/bin/python -m pip install -q --upgrade pip &&
    # constraints.txt pins torch to the CPU wheel on this machine's disk (not a hard pin for users)
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[export,dev]'
  } > .venv/setup.log 2>&1 || { cat .venv/setup.log >&2; echo "set-up failed" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
case "$job" in
  setup) ;;
  demo)
    out="${GRAPHOPT_DEMO_DIR:-build/demo}"
    mkdir -p "$out"
    .venv/bin/python models/minilm.py -o "$out/minilm.onnx"
    .venv/bin/graphopt optimize "$out/minilm.onnx" -o "$out/minilm.opt.onnx" --report "$out/report.json" "$@"
    ;;
  test)
    [ -z "${CI:-}" ] || bash tools/install_test_deps.sh
    # both cores: pytest-xdist, one test file per worker at a time (module fixtures are built once), the
    # slowest files first (tests/file_order.py, in place of xdist's order by number of tests);
    # the 25 slowest tests are listed at the end, to keep the suite within its time
    .venv/bin/python -m pytest -n "${GRAPHOPT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
      --durations=25 "$@"
    ;;
  *) echo "usage: tools/dev.sh demo|test|setup" >&2; exit 2 ;;
esac
