#!/usr/bin/env bash
# The exact recipe used on the lent GPU machine (no network there): a venv over the image's
# CuPy/PyTorch, the wheels this project needs carried in .whl/ (mpich, mpi4py, tfds, ...), then
#   bash benchmarks/device_run.sh env|gpu-tests|gpu-bench|scaling|suite|issue52|issue83  OUTDIR
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
    # what the image lacks, from .whl/ (scikit-learn and SciPy only where the image has none)
    whl=$(ls .whl/*.whl | grep -v -E 'scikit_learn|scipy|joblib')
    $base -c "import sklearn" 2>/dev/null || whl="$whl $(ls .whl/*.whl | grep -E 'scikit_learn|scipy|joblib')"
    /tmp/v/bin/pip install -q --no-index --no-deps $whl 2>&1 | grep -v WARNING
    /tmp/v/bin/pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
    # an image whose setuptools predates SPDX licence strings (77) cannot build the editable install: the
    # source tree itself on the path then
    $V -c "import mpitrain" 2>/dev/null || pwd > /tmp/v/lib/python3.12/site-packages/mpitrain-src.pth
fi
case $step in
env)
    { nvidia-smi; nproc; python3 -c "import os; print('cpu_count', os.cpu_count(), 'affinity', len(os.sched_getaffinity(0)))"; grep -c ^processor /proc/cpuinfo; free -g; python3 -V; which mpirun mpiexec;
      python3 -c "import mpi4py; from mpi4py import MPI; print('image mpi4py', mpi4py.__version__, MPI.Get_library_version()[:120])";
      $V -c "import mpi4py, cupy, numpy, torch; from mpi4py import MPI; print('venv mpi4py', mpi4py.__version__, MPI.Get_library_version()[:60]); print('cupy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), cupy.cuda.runtime.runtimeGetVersion(), 'numpy', numpy.__version__, 'torch', torch.__version__)";
      $V -c "from mpitrain.launch.mpiimpl import mpi_cuda_support; print('MPIX_Query_cuda_support:', mpi_cuda_support())";
      python3 -c "import ctypes; from mpi4py import MPI; print('image MPI MPIX_Query_cuda_support:', ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support())";
      echo "nproc without OMP_NUM_THREADS: $(env -u OMP_NUM_THREADS nproc)"; lscpu | head -20;
    } > "$out/env.log" 2>&1
    cat "$out/env.log" ;;
gpu-tests)
    timeout ${T:-240} $V -m pytest -m gpu -v -p no:cacheprovider tests/ 2>&1 | tee "$out/gpu-tests.log" | tail -40 ;;
gpu-bench)
    timeout ${T:-300} $V benchmarks/gpu.py --reps "${REPS:-3}" ${ARGS:-} --json "$out/gpu.json" 2>&1 | tee "$out/gpu-bench.log" | tail -60 ;;
scaling)
    timeout ${T:-560} $V benchmarks/scaling.py --reps "${REPS:-1}" ${ARGS:-} --json "$out/scaling.json" 2>&1 | tee "$out/scaling.log" | tail -40 ;;
issue52)
    # Issue 52 in one call, most wanted first, each part under its own limit; every part leaves its log
    # (and JSON) in OUTDIR even when a later one is cut: what never ran on a GPU, the fed worker,
    # the step's profile, the 16-core CPU, several servers at 8 and 15 workers.
    bash "$0" env "$out"
    timeout 150 $V -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_gpu.py > "$out/gpu-tests.log" 2>&1
    tail -5 "$out/gpu-tests.log"
    timeout 170 $V benchmarks/gpu.py --reps 1 --only "fed" --json "$out/gpu-fed.json" > "$out/gpu-fed.log" 2>&1
    tail -16 "$out/gpu-fed.log"
    timeout 60 $V benchmarks/gpu_profile.py --json "$out/gpu-profile.json" > "$out/gpu-profile.log" 2>&1
    tail -30 "$out/gpu-profile.log"
    timeout 60 $V benchmarks/cpu_diag.py --json "$out/cpu-diag.json" > "$out/cpu-diag.log" 2>&1
    tail -12 "$out/cpu-diag.log"
    timeout 100 $V benchmarks/scaling.py --servers 8,15 --models mlp --json "$out/servers.json" > "$out/servers.log" 2>&1
    tail -6 "$out/servers.log" ;;
issue83)
    # Issue 83 in one call (~8 min), most wanted first, each part under its own limit so that a cut part
    # costs only itself: the GPU tests, one process against PyTorch (kernels, a CUDA graph), one GPU worker
    # fed (GPU server, bf16, local steps), then the 16 cores: server saturation and 8/15 NumPy workers.
    bash "$0" env "$out" > /dev/null
    head -3 "$out/env.log"
    timeout -k 5 100 $V -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 60 tests/test_gpu.py > "$out/gpu-tests.log" 2>&1
    tail -8 "$out/gpu-tests.log"
    timeout -k 5 110 $V benchmarks/gpu_profile.py --json "$out/gpu-profile.json" > "$out/gpu-profile.log" 2>&1
    grep -v "^ " "$out/gpu-profile.log" | tail -40
    timeout -k 5 125 $V benchmarks/gpu.py --reps 1 --only "fed" --json "$out/gpu-fed.json" > "$out/gpu-fed.log" 2>&1
    $V benchmarks/gpu.py --report "$out/gpu-fed.json" 2>&1 | tail -14
    timeout -k 5 50 $V benchmarks/server.py --workers 1,4,8,15 --sizes mlp --rounds 1 --steps 10000 > "$out/server.log" 2>&1
    tail -6 "$out/server.log"
    timeout -k 5 90 $V benchmarks/scaling.py --servers 8,15 --models mlp --json "$out/servers.json" > "$out/servers.log" 2>&1
    tail -6 "$out/servers.log" ;;
suite)
    timeout ${T:-400} $V -m pytest -q -p no:cacheprovider -n "${JOBS:-6}" tests/ 2>&1 | tee "$out/suite.log" | tail -40 ;;
esac
