#!/usr/bin/env bash
# Install Debian's Chromium and its driver for the browser tests, if they are missing.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
echo "installing chromium and chromium-driver"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
