#!/usr/bin/env bash
# A fake GPU discovery script for Spark workers: each worker that runs it gets its own GPU
# address ("0", then "1", ...), claimed atomically with mkdir in $SPARKHVD_FAKE_GPU_DIR.
set -euo pipefail
i=0
until mkdir "$SPARKHVD_FAKE_GPU_DIR/gpu-$i" 2>/dev/null; do i=$((i + 1)); done
echo "{\"name\": \"gpu\", \"addresses\": [\"$i\"]}"
