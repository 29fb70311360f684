#!/usr/bin/env bash
# buf breaking (FILE rules, protos/buf.yaml) of protos/ against the newest released API
# image in protos/releases/. The image is committed because CI clones may carry no tags.
# Each release adds its image: tools/buf/node_modules/.bin/buf build protos -o protos/releases/vX.Y.Z.binpb
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=${BUF:-tools/buf/node_modules/.bin/buf}
PROTOS=${PROTOS:-protos}
if [ ! -x "$BUF" ]; then
  echo "buf is not installed: npm ci --prefix tools/buf" >&2
  exit 2
fi
release=${RELEASE:-$(find protos/releases -name '*.binpb' | sort -V | tail -n 1)}
if [ -z "$release" ]; then
  echo "no released API image in protos/releases" >&2
  exit 2
fi
"$BUF" breaking "$PROTOS" --against "$release"
