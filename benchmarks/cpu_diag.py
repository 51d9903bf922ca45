"""Why one NumPy process is slower on one machine than on another (issue 52, item 4): the BLAS
NumPy calls and the kernel it picked for this CPU, the CPU's clock and SMT, the step's GEMMs under
each OpenBLAS core type, pinning, and how a process slows when 15 others run beside it.

    python benchmarks/cpu_diag.py --json cpu.json      # ~1 min; run it on both machines

Each timing is a child process (OpenBLAS reads OPENBLAS_CORETYPE when it loads), one BLAS thread,
median of 5 blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import run  # noqa: E402  (benchmarks/run.py: the environment and command every benchmark uses)

# The GEMMs of one MLP 784-100-10 step at batch 100 (forward and both gradients), and softmax's.
GEMM_CODE = """
import json, time, numpy as np
rng = np.random.default_rng(0)
shapes = {"mlp fwd 100x784 @ 784x100": ((100, 784), (784, 100)), "mlp wgrad 784x100 @ 100x100": ((784, 100), (100, 100)),
          "softmax fwd 100x784 @ 784x10": ((100, 784), (784, 10)), "softmax wgrad 784x100 @ 100x10": ((784, 100), (100, 10))}
out = {}
for name, (sa, sb) in shapes.items():
    a, b = rng.random(sa, dtype=np.float32), rng.random(sb, dtype=np.float32)
    c = np.empty((sa[0], sb[1]), np.float32)
    for _ in range(200): np.matmul(a, b, out=c)
    blocks = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(500): np.matmul(a, b, out=c)
        blocks.append((time.perf_counter() - t0) / 500 * 1e6)
    out[name] = sorted(blocks)[2]
print(json.dumps(out))
"""
CORETYPES = ("", "Haswell", "SkylakeX", "Zen")


def env(coretype: str = "") -> dict:
    """The benchmarks' environment (one BLAS thread), with OpenBLAS's core type forced or not."""
    e = run.env()
    e.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        e["OPENBLAS_CORETYPE"] = coretype
    return e


def gemm_us(coretype: str = "", pin: str | None = None) -> dict:
    cmd = [sys.executable, "-c", GEMM_CODE]
    if pin is not None:
        cmd = ["taskset", "-c", pin, *cmd]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, env=env(coretype), check=True,
                                     timeout=120).stdout)


def machine() -> dict:
    import numpy as np

    info: dict = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "numpy": np.__version__}
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [{k: p.get(k) for k in ("internal_api", "version", "architecture", "num_threads", "filepath")}
                        for p in threadpool_info()]
    except ImportError:
        info["blas"] = "threadpoolctl missing"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU max MHz", "Hypervisor vendor",
            "L2 cache", "L3 cache", "NUMA node(s)")
    info["lscpu"] = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lscpu.splitlines())
                     if k.strip() in keep}
    flags = next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines() if ln.startswith("Flags")), [])
    info["simd"] = [f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    mhz = [float(ln.split(":")[1]) for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("cpu MHz")]
    info["mhz"] = {"min": min(mhz), "median": statistics.median(mhz), "max": max(mhz)} if mhz else None
    gov = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    info["governor"] = gov.read_text().strip() if gov.exists() else None
    return info


def mpitrain_rate(model: str, steps: int, coretype: str = "", pin: str | None = None) -> float:
    summary = f"/tmp/cpu-diag-{os.getpid()}.json"
    cmd = run.mpitrain_cmd(0, ["--device", "cpu", "--dataset", "synthetic", "--model", model, "--steps", str(steps)],
                           summary)
    if pin is not None:
        cmd = ["taskset", "-c", pin, *cmd]
    subprocess.run(cmd, capture_output=True, env=env(coretype), check=True, timeout=300, cwd=ROOT)
    return json.loads(Path(summary).read_text())["samples_per_second"]


def beside(n: int) -> dict:
    """The GEMM timings of one process while n-1 copies run at once (median over the n)."""
    procs = [subprocess.Popen([sys.executable, "-c", GEMM_CODE], stdout=subprocess.PIPE, text=True, env=env())
             for _ in range(n)]
    outs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    return {k: statistics.median(o[k] for o in outs) for k in outs[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--beside", type=int, default=0, help="also run N copies at once (default: cores - 1)")
    args = p.parse_args()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine()}
    print(json.dumps(res["machine"], indent=1), flush=True)

    def save():
        Path(args.json).write_text(json.dumps(res, indent=1))

    res["gemm_us"] = {}
    for ct in CORETYPES:
        try:
            res["gemm_us"][ct or "default"] = gemm_us(ct)
        except subprocess.CalledProcessError as exc:  # e.g. SkylakeX's AVX-512 on a CPU without it: SIGILL
            res["gemm_us"][ct or "default"] = {"error": f"exit {exc.returncode} {exc.stderr[-300:]}"}
        print("GEMM us,", ct or "default", res["gemm_us"][ct or "default"], flush=True)
    res["gemm_us"]["default, pinned to cpu 1"] = gemm_us("", "1")
    save()
    n = args.beside or max(1, (os.cpu_count() or 2) - 1)
    res["gemm_us"][f"default, {n} at once"] = beside(n)
    print(f"GEMM us, {n} at once", res["gemm_us"][f"default, {n} at once"], flush=True)
    save()
    res["mpitrain_samples_per_s"] = {}
    for model, steps in (("mlp", 1500), ("softmax", 4000)):
        for label, kw in (("default", {}), ("pinned to cpu 1", {"pin": "1"}), ("OPENBLAS_CORETYPE=Haswell",
                                                                               {"coretype": "Haswell"})):
            rate = mpitrain_rate(model, steps, **kw)
            res["mpitrain_samples_per_s"][f"{model}, {label}"] = rate
            print(f"one process {model}, {label}: {rate:,.0f} samples/s", flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
