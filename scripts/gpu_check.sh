#!/usr/bin/env bash
# The GPU checks of issue 5 in one run: the `cuda` tests and both benchmarks on CudaDevice.
#
# Made for the `device` tool's H200 machine (PyTorch, attrs, click, hypothesis, pytest are in
# its image; `returns` is not, so it travels as a wheel). Here, once, in the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl returns==0.30.0
#
# then run `bash scripts/gpu_check.sh` there with carry [".whl"] and timeout_s 540.
# Logs and results land in $OUT (or ./gpu_out when OUT is unset).
set -uo pipefail
out="${OUT:-gpu_out}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
status=0
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" \
    | tee "$out/env.txt" || exit 1
timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="" tests 2>&1 | tee "$out/cuda_tests.log" || status=1
timeout 120 python3 benchmarks/bench_overhead.py --device cuda --quick 2>&1 | tee "$out/overhead.txt" || status=1
timeout 150 python3 benchmarks/bench_overlap.py --device cuda --quick --only mixed_matmul --only mixed_wait \
    2>&1 | tee "$out/overlap.txt" || status=1
exit $status
