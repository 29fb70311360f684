#!/usr/bin/env bash
# Ensure Debian packages are present. Arguments are CHECK=PACKAGE pairs, where
# CHECK is a command that succeeds when the package is already usable.
# As root, missing packages are installed with apt-get; otherwise they are named.
set -euo pipefail
missing=()
for pair in "$@"; do
  check=${pair%%=*}
  pkg=${pair#*=}
  if ! bash -c "$check" >/dev/null 2>&1; then
    missing+=("$pkg")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing system packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "missing system packages: ${missing[*]}" >&2
  echo "install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
