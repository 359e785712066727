#!/usr/bin/env bash
# Everything the project measures on a GPU, in one run, written under one folder:
#
#   tools/gpu_check.sh OUT [--data CMUDICT_FILE] [--budget SECONDS] [--steps N]
#
#   OUT/env.txt          nvidia-smi, versions
#   OUT/measure.json     tools/gpu_measure.py: copy bandwidth, masked softmax bandwidth,
#                        flash_varlen against SDPA + mask, additive against the textbook,
#                        a profile of one call (OUT/measure.log: its progress)
#   OUT/tests.log        the CUDA tests (tests/kernels/test_cuda_*.py, test_varlen.py), not
#                        skipped
#   OUT/g2p/, g2p.log    the G2P headline recipe for --steps optimizer steps on the GPU
#   OUT/bench-ROW.json   attnscore bench --device cuda --json, one file per row, rows in
#                        order until --budget seconds (default 420) have passed; all of them
#                        in OUT/bench.json (attnscore bench --from-json OUT/bench.json)
#
# Nothing is installed from a registry: the GPU machines of this project reach none, so the
# package runs from src/ (PYTHONPATH) with the machine's own torch and triton; a missing
# Python package can be given as wheels in WHEELS (a folder), installed with --no-index.
# Each step has its own time limit and the run goes on past a failing step; the step
# times and exit codes close env.txt. On a machine without a GPU the script stops after
# env.txt (exit 2); `TRITON_INTERPRET=1 tools/gpu_check.sh OUT --dry-run` runs every step
# on the CPU at toy sizes, to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: tools/gpu_check.sh OUT [--data FILE] [--budget S] [--steps N] [--dry-run]}"
shift
data="" budget=420 steps=300 dry=0
while [ $# -gt 0 ]; do
    case "$1" in
    --data) data="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out" || exit 2
py="${PYTHON:-python3}"
if [ -n "${WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/gpu-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# attnscore-g2p from its src/ too: not installed, so `attnscore g2p` (an entry point) is not
# found; the G2P step runs `python -m attnscore_g2p` instead
export PYTHONPATH="$PWD/src:$PWD/attnscore-g2p/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
start=$SECONDS
log() { echo "$*" | tee -a "$out/env.txt"; }
run_step() { # run_step NAME LIMIT_S COMMAND...: time-limited, logged, never fatal
    local name="$1" limit="$2" t0=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit} s)" >&2
    timeout --signal=INT --kill-after=15 "$limit" "$@"
    rc=$?
    log "step $name: $((SECONDS - t0)) s, exit $rc"
}

{
    date -u
    nvidia-smi 2>&1 | head -20
    "$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    "$py" -c "import triton; print('triton', triton.__version__)" 2>&1
    nproc
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
if [ "$dry" -eq 0 ] && ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    log "gpu_check: no CUDA GPU here"
    exit 2
fi

if [ "$dry" -eq 1 ]; then
    run_step varlen-cpu 300 "$py" -m pytest -q -p no:cacheprovider -o addopts= tests/kernels/test_varlen.py
    run_step measure-help 60 "$py" tools/gpu_measure.py --help
    run_step bench-args 60 "$py" -m attnscore bench --device cpu --quick --cases dot --min-time 0.01 \
        --json "$out/bench-dot.json" --overwrite --quiet
else
    run_step measure 280 "$py" tools/gpu_measure.py --out "$out/measure.json" >"$out/measure.log" 2>&1
    run_step tests 90 "$py" -m pytest -q -p no:cacheprovider -o addopts= --timeout 60 \
        tests/kernels/test_varlen.py tests/kernels/test_cuda_paths.py tests/kernels/test_cuda_backend.py \
        >"$out/tests.log" 2>&1
    tail -5 "$out/tests.log"
    g2p=(--steps "$steps" --precision bfloat16 --hidden 512 --dropout 0.0 --eval-every 0
        --ckpt-every 0 --no-progress --device cuda --seed 0 --out "$out/g2p")
    if [ -n "$data" ]; then g2p+=(--data "$data"); fi
    run_step g2p 60 "$py" -m attnscore_g2p train "${g2p[@]}" >"$out/g2p.log" 2>&1
    tail -3 "$out/g2p.log"
    for row in dot heads multihead general cosine masked_softmax additive "dot (issue)" \
        "heads (issue)" "masked_softmax (issue)" "dot (mid)" "decoder_step"; do
        left=$((budget - (SECONDS - start)))
        if [ "$left" -lt 20 ]; then
            log "bench: no time left for $row"
            continue
        fi
        file="$out/bench-${row// /_}.json"
        file="${file//[()]/}"
        run_step "bench $row" "$left" "$py" -m attnscore bench --device cuda --min-time 0.1 \
            --cases "$row" --json "$file" --quiet
    done
fi
if [ "$dry" -eq 0 ] && ls "$out"/bench-*.json >/dev/null 2>&1; then # one file for --from-json
    "$py" tools/gpu_measure.py --merge-bench "$out/bench.json" "$out"/bench-*.json
fi
log "gpu_check: $((SECONDS - start)) s"
