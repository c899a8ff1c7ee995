#!/usr/bin/env bash
# Install Debian's Chromium for the browser tests (Playwright drives it), if it is missing.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
echo "installing chromium"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
