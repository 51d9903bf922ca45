#!/usr/bin/env bash
# The exact recipe used on the lent GPU machine (no network there): a venv over the image's
# CuPy/PyTorch, the wheels this project needs carried in .whl/ (mpich, mpi4py, tfds, ...), then
#   bash benchmarks/device_run.sh env|gpu-tests|gpu-bench|scaling|suite  OUTDIR
# Each step writes its log (and JSON) to OUTDIR. Fill .whl/ here first with `pip download`
# (see benchmarks/README.md, "GPU and 16 cores").
set -uo pipefail
step=$1
out=${2:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
V=/tmp/v/bin/python
if [ ! -x $V ]; then
    # the image's PyTorch/CuPy live in their own venv: ours sees them through a .pth file
    base=/opt/torch/.venv/bin/python3; [ -x $base ] || base=python3
    python3 -m venv /tmp/v
    $base -c "import site; print(site.getsitepackages()[0])" > /tmp/v/lib/python3.12/site-packages/image.pth
    /tmp/v/bin/pip install -q --no-index --no-deps .whl/*.whl 2>&1 | grep -v WARNING
    /tmp/v/bin/pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
fi
case $step in
env)
    { nvidia-smi; nproc; python3 -c "import os; print('cpu_count', os.cpu_count(), 'affinity', len(os.sched_getaffinity(0)))"; grep -c ^processor /proc/cpuinfo; free -g; python3 -V; which mpirun mpiexec;
      python3 -c "import mpi4py; from mpi4py import MPI; print('image mpi4py', mpi4py.__version__, MPI.Get_library_version()[:120])";
      $V -c "import mpi4py, cupy, numpy, torch; from mpi4py import MPI; print('venv mpi4py', mpi4py.__version__, MPI.Get_library_version()[:60]); print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), cupy.cuda.runtime.runtimeGetVersion(), 'numpy', numpy.__version__, 'torch', torch.__version__)";
      $V -c "from mpitrain.backend import mpi_cuda_support; print('MPIX_Query_cuda_support:', mpi_cuda_support())";
    } > "$out/env.log" 2>&1
    cat "$out/env.log" ;;
gpu-tests)
    timeout ${T:-240} $V -m pytest -m gpu -v -p no:cacheprovider tests/ 2>&1 | tee "$out/gpu-tests.log" | tail -40 ;;
gpu-bench)
    timeout ${T:-300} $V benchmarks/gpu.py --reps "${REPS:-3}" ${ARGS:-} --json "$out/gpu.json" 2>&1 | tee "$out/gpu-bench.log" | tail -60 ;;
scaling)
    timeout ${T:-560} $V benchmarks/scaling.py --reps "${REPS:-1}" ${ARGS:-} --json "$out/scaling.json" 2>&1 | tee "$out/scaling.log" | tail -40 ;;
suite)
    timeout ${T:-400} $V -m pytest -q -p no:cacheprovider -n "${JOBS:-6}" tests/ 2>&1 | tee "$out/suite.log" | tail -40 ;;
esac
