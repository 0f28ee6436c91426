#!/usr/bin/env bash
# The GPU checks, run by hand on a machine with one CUDA device (a lent device machine has torch,
# NCCL and pytest, but neither pyspark nor Java nor TensorFlow): tests/collective/test_gpu.py, Horovod's own
# torch suite at np=1 in one process (when HVD_TESTS names a folder holding Horovod's test/ tree;
# never committed here), Spark's GPU discovery script, and bench/gpu.py. Each part's output goes to
# $OUT (default: a temporary folder) and the script goes on after a failure.
#
#   OUT=/tmp/gpu HVD_TESTS=.hvdtests bash bench/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The checkout is the package `sparkhvd` (pyproject maps the root to it): a link makes it importable.
ln -s "$PWD" "$work/sparkhvd"
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"

echo "== machine"
nvidia-smi -L
$PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version(), "devices", torch.cuda.device_count())'
for m in pyspark tensorflow; do $PY -c "import $m" 2>/dev/null && echo "$m: importable" || echo "$m: not installed"; done
command -v java >/dev/null && java -version 2>&1 | head -1 || echo "java: not installed"

echo "== Spark's GPU discovery script (examples/src/main/scripts/getGpusResources.sh)"
addrs=$(nvidia-smi --query-gpu=index --format=csv,noheader | sed -e ':a' -e 'N' -e '$!ba' -e 's/\n/","/g')
echo "{\"name\": \"gpu\", \"addresses\": [\"$addrs\"]}" | tee "$OUT/discovery.json"
$PY -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["name"] == "gpu" and d["addresses"], d; print("parses:", d)' \
    "$OUT/discovery.json"

echo "== tests/collective/test_gpu.py"
$PY -m pytest -p no:cacheprovider -q -rA tests/collective/test_gpu.py --junitxml="$OUT/test_gpu.xml" 2>&1 | tee "$OUT/test_gpu.log"

echo "== tests/data/test_data_torch.py -m gpu (make_torch_loader's device='cuda'; needs pyarrow)"
$PY -m pytest -p no:cacheprovider -q -rA -m gpu tests/data/test_data_torch.py 2>&1 | tee "$OUT/test_data_gpu.log"

if [ -n "${HVD_TESTS:-}" ] && [ -d "$HVD_TESTS/test/parallel" ]; then
    echo "== Horovod's test_torch.py and test_adasum_pytorch.py at np=1 on CUDA"
    $PY -c 'import sys; sys.path.insert(0, "bench"); import conformance; conformance.write_shims(sys.argv[1])' "$work"
    # Horovod runs its Adasum tests only where MPI is enabled (sparkhvd's needs none), and they call NumPy 1's
    # np.alltrue, gone in NumPy 2: a copy without that skip, with np.all
    sed -e 's/not hvd.mpi_enabled() or //' -e 's/if not hvd.mpi_enabled():/if False:/' -e 's/np\.alltrue/np.all/g' "$HVD_TESTS/test/parallel/test_adasum_pytorch.py" \
        > "$HVD_TESTS/test/parallel/test_adasum_pytorch_nompi.py"
    (cd "$HVD_TESTS/test/parallel" && PYTHONPATH="$work/shims:$PYTHONPATH" timeout "${HVD_TIMEOUT:-240}" \
        $PY -m pytest -p no:cacheprovider -q -rfE test_torch.py test_adasum_pytorch_nompi.py \
        --junitxml="$OUT/horovod_torch.xml") 2>&1 | tail -60 | tee "$OUT/horovod_torch.log"
    rm -f "$HVD_TESTS/test/parallel/test_adasum_pytorch_nompi.py"
fi

echo "== bench/gpu.py"
$PY bench/gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.log"
