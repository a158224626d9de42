#!/usr/bin/env bash
# System packages some tests need (headless Chromium for the HTML diff report). Best effort:
# a test that needs a missing one is skipped with the reason.
set -u
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "install_test_deps: could not install chromium; HTML render tests will be skipped" >&2
  fi
fi
exit 0
