#!/bin/bash
# The GPU checks, in one go (not part of the test suite): bash tests/programs/gpu_check.sh OUTDIR [PART...]
# (PART: smoke, job, chaos, stop; default all four)
# Needs one CUDA GPU, torch with NCCL, etcd on PATH and elasticd's dependencies (and pytest) importable.
# 1. tests/programs/nccl_smoke.py: the NCCL build/abort/rebuild sequence on one GPU.
# 2. tests/programs/gpu_job.py: a NCCL job through a real agent with the model on the GPU, fp16 and
#    a GradScaler, an etcd SIGKILL + restart mid-run, then a resume from its durable checkpoint.
# 3. python -m elasticd.chaos --device cuda --fp16: several members sharing the GPU (gloo groups,
#    the model and optimizer state on the GPU) under a minute of seeded faults; every invariant.
# 4. tests/integration/test_stop_after_sum_gpu.py: a step whose sum a stopped member holds is committed
#    once with the model and its gradients on the GPU (skipped by the suite where there is no GPU).
# Each part is bounded by `timeout`; its work dir is packed into OUTDIR when it fails.
set -u
out=${1:?OUTDIR}
shift
parts=" ${*:-smoke job chaos stop} "
mkdir -p "$out"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
status=0
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
etcd --version | head -1
if [[ $parts == *" smoke "* ]]; then
echo "== 1. nccl_smoke"; timeout 120 python3 tests/programs/nccl_smoke.py || status=1
fi
if [[ $parts == *" job "* ]]; then
echo "== 2. gpu_job"; rm -rf /tmp/gpu-job
timeout 300 python3 tests/programs/gpu_job.py --workdir /tmp/gpu-job || { status=1; tar czf "$out/gpu_job.tgz" -C /tmp gpu-job; }
fi
if [[ $parts == *" chaos "* ]]; then
echo "== 3. chaos on the GPU"; rm -rf /tmp/gpu-chaos
timeout 200 python3 -m elasticd.chaos --minutes 1 --mean-interval-s 5 --warmup-s 5 --no-netns --device cuda --fp16 \
    --seed 1 --workdir /tmp/gpu-chaos --json > "$out/chaos.json" || { status=1; tar czf "$out/chaos.tgz" -C /tmp gpu-chaos; }
head -c 6000 "$out/chaos.json"; echo
fi
if [[ $parts == *" stop "* ]]; then
echo "== 4. a stop after the sum on the GPU"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/integration/test_stop_after_sum_gpu.py 2>&1 | tail -30 \
    | tee "$out/stop.txt"; grep -q " passed" "$out/stop.txt" && ! grep -q -E "failed|skipped" "$out/stop.txt" || status=1
fi
echo "== status $status"
exit $status
