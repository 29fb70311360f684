#!/usr/bin/env bash
# Compile protos/ into the package. With --check, compile into a scratch
# directory and fail if the committed stubs differ (CI runs this).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PATH="$(dirname "$PY"):$PATH"
out=.
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mapfile -t files < <(find protos -name '*.proto' | sort)
"$PY" -m grpc_tools.protoc -Iprotos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  --mypy_grpc_out="$out" "${files[@]}"
# The .proto files ship in the wheel beside their stubs, at their import paths, so
# teams that call the admin API from another language compile the same contract.
for f in "${files[@]}"; do
  rel=${f#protos/}
  mkdir -p "$out/$(dirname "$rel")"
  cp "$f" "$out/$rel"
done
if [ "${1:-}" = "--check" ]; then
  status=0
  while IFS= read -r f; do
    rel=${f#"$out"/}
    if ! cmp -s "$f" "$rel"; then
      echo "stale generated stub: $rel (run 'make protos')" >&2
      status=1
    fi
  done < <(find "$out" -type f \( -name '*_pb2*.py' -o -name '*_pb2*.pyi' -o -name '*.proto' \))
  exit $status
fi
