#!/usr/bin/env bash
# The GPU checks in one run (under ten minutes): the `cuda` tests, the CUDA start-up self-check,
# the overlapped loop of every reference backend and step shape under every policy against a
# serial run on the GPU, `readfence verify` with poison, both benchmarks, and the demo on CUDA.
# With two GPUs or more, the tensor-parallel demo and verify on NCCL (each rank's all-reduces
# captured in its CUDA graph); with one, the `cuda` tests still capture a rank's all-reduce over
# a one-rank NCCL group. None of the tensor-parallel steps has run on a GPU yet.
# Every figure ends up in one file, $OUT/summary.txt.
#
# Run it on a machine with a CUDA GPU and a CUDA build of torch, from the repository root,
# after `pip install -e '.[test]'`: `bash scripts/gpu_check.sh`. On a machine without network
# access, put the wheels of missing dependencies in a `.whl/` folder at the root first; they
# are installed into /tmp/site before anything runs.
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
step() {  # step NAME SECONDS COMMAND...: run it, log it, note its status in the summary
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || status=1
    echo "== $name: exit $rc in $((SECONDS - t0)) s" >>"$out/summary.txt"
}
: >"$out/summary.txt"
cat "$out/env.txt" >>"$out/summary.txt"
step self_check 60 python3 -c "from readfence.graph.devices import _cuda; _cuda.self_check(); print('CUDA self-check passed')"
step cuda_tests 150 python3 -m pytest -q -m cuda -p no:cacheprovider -o addopts="" tests
step loop_check 120 python3 scripts/gpu_loop_check.py --device cuda --steps 20
rf=(python3 -c "from readfence.cli import main; main()")  # the package is on PYTHONPATH, not installed
step verify 60 "${rf[@]}" verify "hybrid_linear(trtllm_mha, linear)" --device cuda --steps 8
step overhead 90 python3 benchmarks/bench_overhead.py --device cuda --quick
step overlap 120 python3 benchmarks/bench_overlap.py --device cuda --quick --only mixed_matmul --only mixed_wait
step demo 60 "${rf[@]}" demo --device cuda --steps 50
names=(self_check cuda_tests loop_check verify overhead overlap demo)
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    step tp_demo 180 "${rf[@]}" demo --tp 2 --device cuda --steps 50
    step tp_verify 240 "${rf[@]}" verify paged --tp 2 --device cuda --steps 8
    names+=(tp_demo tp_verify)
else
    echo "== tp_demo, tp_verify: not run (they need 2 GPUs, one per rank; this machine has $gpus)" >>"$out/summary.txt"
fi
for name in "${names[@]}"; do
    { echo; echo "---- $name (last 40 lines)"; tail -n 40 "$out/$name.log"; } >>"$out/summary.txt"
done
cat "$out/summary.txt"
exit $status
