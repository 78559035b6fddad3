#!/usr/bin/env bash
# The GPU checks (docs/performance.md, "On a GPU"), in one run: CUDA tests, in-process training (streamed and resident), every
# other backbone and plug-in trained through the loop, the loop's one host wait per step against a wait after
# every forward and optimiser step, where the host still waits inside a step (by source line), profiles,
# evaluation (GMMFormer; MS-SL's indexed gallery), backbone steps and packing. Needs torch with CUDA,
# h5py, scipy, numpy, pyarrow, pandas, pyyaml, tqdm, pytest and pytest-xdist; neither Ray nor MLflow. Each stage's log goes to $OUT/<stage>.log.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_checklist.sh
#   QUICK=1 DEVICE=cpu OUT=/tmp/gpu bash benchmarks/gpu_checklist.sh   # rehearsal on a CPU, small sizes
#   STAGES="eval packing" OUT=/tmp/gpu bash benchmarks/gpu_checklist.sh # some stages only
#   STAGES=plugins PLUGIN_CONFIGS="mamfusion_tvr.yaml mamfusion_tvr.yaml+model.mamba_residual=zero_init" \
#       PLUGIN_EPOCHS=20 PLUGIN_LIMIT=400 OUT=/tmp/gpu bash benchmarks/gpu_checklist.sh   # chosen configs, longer
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/results/gpu_checklist}  # defaults inside the checkout (git-ignored), not a shared /tmp name
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd) || exit 1  # a relative OUT stays where it was given after the cd below
cd "$REPO"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DATA=${DATA:-$REPO/data/gpu_checklist}
if [ "${QUICK:-0}" = 1 ]; then
    SIZES=(--train-videos 128 --val-videos 32 --test-videos 48); EPOCHS=2; SYNC_EPOCHS=2
    AMP=none  # a CPU without bf16 units emulates it, tens of times slower
    STEPS=(--steps 1 --warmup 0 --videos 16 --queries 80 --amp none --encode-videos 32)
    GALLERY=(500); LOADERS=(1); PACK=(1 2); PACK_EPOCHS=1; TEST_T=900; XDIST=(); TESTS=(tests/test_device_under_test.py tests/evaluation)
else
    SIZES=(--train-videos 1280 --val-videos 500 --test-videos 2179); EPOCHS=12; SYNC_EPOCHS=6; AMP=bf16; STEPS=(--steps 2 --warmup 1)
    GALLERY=(500 1000 1500 2000 2500); LOADERS=(4 12); PACK=(1 2 4 8); PACK_EPOCHS=2; TEST_T=100; XDIST=(-n 6)
    TESTS=(tests/test_device_under_test.py tests/models tests/losses tests/evaluation tests/data tests/platform/train/test_pinning.py
           tests/platform/train/test_resident_train.py tests/platform/train/test_process_group.py
           tests/platform/train/test_step.py tests/platform/train/test_random_state.py tests/platform/train/test_eval_device.py)
fi

want() { [[ " ${STAGES:-tests profile train resident plugins syncs waits eval eval_mssl backbones packing} " == *" $1 "* ]]; }

stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log, print its tail
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -v -e 'video/s\]' -e '^\s*$' "$OUT/$name.log" | tail -n 40
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || FAILED="${FAILED:-}$name "
}

{
    nvidia-smi -L 2>/dev/null
    $PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0], 'gpus', torch.cuda.device_count())"
    nproc
} 2>&1 | tee "$OUT/info.log"

# The TVR-shaped collection (training, evaluation) is written in the background while the tests run.
$PY -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from _common import tvr_bench_collection
tvr_bench_collection(Path('$DATA/bench_tvr'), *[int(x) for x in '${SIZES[*]}'.split()[1::2]])
" >"$OUT/synth.log" 2>&1 &
SYNTH=$!

want tests && PRVRLAB_TEST_DEVICE=$DEVICE stage tests "$TEST_T" $PY -m pytest -q -p no:cacheprovider "${XDIST[@]}" -rfE "${TESTS[@]}"

PROFILE_CONFIGS=${PROFILE_CONFIGS:-gmmformer_tvr gmmformer_v2_tvr gmmformer_v2_ral_tvr mssl_tvr ice_base_tvr ice_base_ice_tvr arl_tvr mamfusion_tvr}
want profile && stage profile 100 $PY - "$DEVICE" "${GALLERY[*]}" $PROFILE_CONFIGS <<'PROFILE'
import sys
from prvrlab.platform.config import load_config
from prvrlab.evaluation.profile import profile_config
from prvrlab.reports.profile import profile_table
device, galleries = sys.argv[1], [int(g) for g in sys.argv[2].split()]
rows = []
for name in sys.argv[3:]:  # every backbone at TVR's dimensions, with and without plug-ins
    cfg = load_config(f"configs/{name}.yaml")
    rows.append(profile_config(cfg, galleries=galleries, queries=50, video_dim=3072, query_dim=768, device=device, name=name))
    print(profile_table(rows[-1:]), flush=True)  # each config as it is done: a stage cut short keeps them
print(profile_table(rows))
PROFILE

wait $SYNTH; echo "synthesis exit $?"
want train && stage train 140 $PY benchmarks/bench_inprocess.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --epochs "$EPOCHS" --amp "$AMP" --loader-workers 4 --threads 4
want resident && stage batches 90 $PY benchmarks/bench_batches.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --loader-workers "${LOADERS[@]}" --threads 4
want resident && stage resident 140 $PY benchmarks/bench_inprocess.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --epochs "$EPOCHS" --amp "$AMP" --loader-workers 4 --threads 4 --resident
PLUGIN_CONFIGS=${PLUGIN_CONFIGS:-gmmformer_v2_ral_tvr.yaml ice_base_ice_tvr.yaml arl_tvr.yaml mssl_tvr.yaml mamfusion_tvr.yaml mamfusion_tvr.yaml+model.mamba_init=mamba_ssm+model.mamba_residual=zero_init}
want plugins && stage plugins "${PLUGIN_LIMIT:-240}" $PY benchmarks/bench_inprocess.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --epochs "${PLUGIN_EPOCHS:-$SYNC_EPOCHS}" --amp "$AMP" --threads 4 --resident --configs $PLUGIN_CONFIGS
want syncs && stage syncs 200 $PY benchmarks/bench_inprocess.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --epochs "$SYNC_EPOCHS" --amp "$AMP" --threads 4 --resident --compare-syncs
WAIT_CONFIGS=${WAIT_CONFIGS:-gmmformer_tvr.yaml gmmformer_v2_tvr.yaml gmmformer_v2_ral_tvr.yaml ice_base_ice_tvr.yaml arl_tvr.yaml+plugins.arl.warmup_epochs=1 mssl_tvr.yaml mamfusion_tvr.yaml}
want waits && [ "$DEVICE" = cuda ] && stage waits 180 $PY benchmarks/bench_inprocess.py --root "$DATA/bench_tvr" "${SIZES[@]}" \
    --device cuda --epochs 2 --amp "$AMP" --threads 4 --resident --sync-sites --configs $WAIT_CONFIGS
want eval && stage eval 70 $PY benchmarks/bench_eval.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --splits val test --amp none bf16 --repeats 2 --no-memory --threads 4
want eval_mssl && stage eval_mssl 60 $PY benchmarks/bench_eval.py --root "$DATA/bench_tvr" "${SIZES[@]}" --device "$DEVICE" \
    --config mssl_tvr.yaml --splits val test --amp none bf16 --no-naive --no-memory --threads 4
want backbones && stage backbones 150 $PY benchmarks/bench_backbones.py --device "$DEVICE" "${STEPS[@]}" --threads 4 --galleries "${GALLERY[@]}"
want packing && stage packing 100 $PY benchmarks/bench_packing.py --root "$DATA/pack_small" --device "$DEVICE" --counts "${PACK[@]}" \
    --epochs "$PACK_EPOCHS" --amp "$AMP" --threads 2

[ -z "${FAILED:-}" ] || { echo "stages that failed or ran out of time: $FAILED"; exit 1; }
