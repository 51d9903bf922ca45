"""mpitrain on one GPU: samples/s beside PyTorch on the same GPU, and the share of a step spent
staging through the host.

    python benchmarks/gpu.py --json gpu.json          # on a GPU machine (~4 min); prints the tables too
    python benchmarks/gpu.py --report gpu.json        # the markdown (benchmarks/GPU.md) from a saved run

Two models: the MNIST MLP 784-100-10 at batch 100 (tiny for a GPU: kernel launches and the
per-step host round trip dominate) and a GPU-sized MLP 784-4096-4096-10 at batch 4096. Rows: one
process, async and sync np=3 (two workers sharing the one GPU), PyTorch on the same GPU with the
same model, batch and SGD. The staging rows time, in one process, the gradient's copy to the
pinned host buffer and the parameters' copy back (what one async step moves), against the
gradient computation itself, each synchronised.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import add_saved_run_flags, machine, measured_or_saved, median_row, run_mpitrain, run_torch  # noqa: E402

FED = "one GPU worker fed, mlp 784-4096-4096-10, batch 4096"
CONFIGS = {  # name -> (hidden, batch, global steps, synthetic samples)
    "mlp 784-100-10, batch 100": ("100", 100, 3000, 12000),
    "mlp 784-4096-4096-10, batch 4096": ("4096,4096", 4096, 300, 60000),
    FED: ("4096,4096", 4096, 120, 60000),
}
ONE, ASYNC, SYNC, TORCH = "one process", "async np=3 (2 workers, one GPU)", "sync np=3 (2 workers, one GPU)", \
    "PyTorch, same GPU, 1 process"


def same_run(hidden: str, batch: int, steps: int, samples: int) -> tuple[list[str], tuple[str, ...]]:
    """mpitrain's flags on the GPU, and torch_ddp.py's for the same model, batch and data."""
    return (["--device", "gpu", "--dataset", "synthetic", "--synthetic-samples", str(samples), "--model", "mlp",
             "--hidden", hidden, "--batch-size", str(batch), "--steps", str(steps)],
            ("--device", "cuda", "--hidden", hidden, "--batch-size", str(batch), "--samples", str(samples)))


def rows_for(name: str, hidden: str, batch: int, steps: int, samples: int) -> list[tuple[str, callable]]:
    base, torch_args = same_run(hidden, batch, steps, samples)
    if name == FED:
        return fed_rows(base) + [(TORCH, lambda: run_torch(1, "mlp", steps, torch_args))]
    return [
        (ONE, lambda: run_mpitrain(0, base)),
        (ASYNC, lambda: run_mpitrain(3, base)),
        (SYNC, lambda: run_mpitrain(3, [*base, "--mode", "sync"])),
        ("async np=3 --compress bf16", lambda: run_mpitrain(3, [*base, "--compress", "bf16"])),
        (TORCH, lambda: run_torch(1, "mlp", steps, torch_args)),
    ]


def slim(summary: dict) -> dict:
    """What the tables read from a run's summary (the raw figures kept in the JSON)."""
    keep = ("samples_per_second", "global_step", "bytes_per_sample", "ps_busy_fraction", "time_breakdown",
            "train_seconds")
    out = {k: summary.get(k) for k in keep}
    out["server_busy"] = [sh.get("busy_fraction") for sh in summary.get("ps_shards") or []]
    return out


def fed_rows(base: list[str]) -> list[tuple[str, callable]]:
    """One GPU worker, and what feeds it (issues 52 and 83, item 2): a CPU server, the server on the GPU,
    16-bit exchanges, local steps on either server, the shared-memory store. (`--num-ps` 2/4/8 were measured on
    2026-11-27: 0.24-0.32x, flat from 4 servers; GPU.md.)"""
    rows = [(ONE, lambda: run_mpitrain(0, base))]
    for label, flags in (("async np=2, 1 CPU server", []),
                         ("async np=2 --ps-device gpu", ["--ps-device", "gpu"]),
                         ("async np=2 --compress bf16", ["--compress", "bf16"]),
                         ("async np=2 --ps-device gpu --compress bf16", ["--ps-device", "gpu", "--compress", "bf16"]),
                         ("async np=2 --local-steps 32", ["--local-steps", "32"]),
                         ("async np=2 --ps-device gpu --local-steps 32", ["--ps-device", "gpu", "--local-steps", "32"]),
                         ("async np=2 --ps-device gpu --local-steps 32 --compress bf16",
                          ["--ps-device", "gpu", "--local-steps", "32", "--compress", "bf16"]),
                         ("async np=2 --ps-transport shm", ["--ps-transport", "shm"])):
        rows.append((label, lambda flags=flags: run_mpitrain(2, [*base, *flags])))
    return rows


def staging(hidden: str, batch: int, reps: int = 200) -> dict:
    """Milliseconds per step: gradient computation, and the host round trip of one async step
    (gradient down to pinned memory, parameters up), for float32 and bf16 on the wire."""
    import cupy
    import numpy as np

    from support import MLP, WIRE_DTYPES, make_backend, make_synthetic

    be = make_backend("gpu", 0)
    sizes = (784, *map(int, hidden.split(",")), 10)
    model = MLP(sizes, 0.0, cupy)
    ds = make_synthetic(batch * 2, 784, 10, 0)
    x, y = cupy.asarray(ds.x_train[:batch]), cupy.asarray(ds.y_train[:batch])
    params = cupy.asarray(model.init_params(0))
    grad = cupy.zeros_like(params)

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        cupy.cuda.Device().synchronize()
        return 1e3 * (time.perf_counter() - t0) / reps

    out = {"params": model.n_params, "compute_ms": timed(lambda: model.loss_and_grad(params, x, y, grad))}
    for compress in ("none", "bf16"):
        wire = np.dtype(WIRE_DTYPES[compress])
        host = be.host_alloc(model.n_params * wire.itemsize).view(wire)

        def round_trip():
            be.download(grad, host)
            be.upload(params, host)

        out[f"stage_ms_{compress}"] = timed(round_trip)
    return out


def measure(reps: int, save=lambda res: None, only: str = "") -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": name, "nvidia_smi": smi,
              "machine": machine().replace("; no GPU on this machine", ""), "cupy": cupy.__version__,
              "reps": reps, "configs": {}}
    for cname, (hidden, batch, steps, samples) in CONFIGS.items():
        if only not in cname:
            continue
        rows = rows_for(cname, hidden, batch, steps, samples)
        raw: dict[str, list] = {name: [] for name, _ in rows}
        for rep in range(reps):
            for rname, fn in rows:
                print(f"[{cname} rep {rep + 1}/{reps}] {rname}", file=sys.stderr, flush=True)
                try:
                    raw[rname].append(fn())
                except Exception as exc:  # one failed row must not cost the others
                    print(f"  failed: {exc}", file=sys.stderr, flush=True)
        result["configs"][cname] = {"steps": steps, "reps": reps, "batch": batch,
                                    "rows": {k: median_row(v) for k, v in raw.items()},
                                    "raw": {k: [slim(r) for r in v if r] for k, v in raw.items()},
                                    "staging": None if cname == FED else staging(hidden, batch)}
        save(result)  # a run cut short still leaves the finished configurations
    return result


def report(res: dict) -> str:
    lines = ["# mpitrain on a GPU", "",
             f"- date: {res['date']}", f"- GPU: {res['gpu']} (`nvidia-smi`: {res['nvidia_smi']})",
             f"- host: {res['machine']}, CuPy {res['cupy']}",
             "- command: `python benchmarks/gpu.py --json gpu.json`, tables by `--report`",
             "- each row: median of the interleaved repetitions given with each table; synthetic MNIST-shaped "
             "data; SGD; np=3 puts both workers on the one GPU", ""]
    for cname, c in res["configs"].items():
        if cname == FED:
            lines += fed_report(cname, c)
            continue
        rows = c["rows"]
        torch = (rows.get(TORCH) or {}).get("rate")
        lines += [f"## {cname}, {c['steps']} global steps, median of {c.get('reps', res['reps'])} run(s)", "",
                  "| run | samples/s (median) | min-max | per worker | per worker vs PyTorch 1 GPU |",
                  "|---|---|---|---|---|"]
        for rname, r in rows.items():
            if r is None:
                lines.append(f"| {rname} | failed or skipped | | | |")
                continue
            workers = 2 if "np=3" in rname else 1
            per = r["rate"] / workers
            vs = f"{per / torch:.2f}x" if torch else "n/a"
            lines.append(f"| {rname} | {r['rate']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} | {per:,.0f} | {vs} |")
        s = c["staging"]
        lines += ["", f"Staging through the host ({s['params']:,} parameters, one process, synchronised):", "",
                  "| | ms per step | share of a step |", "|---|---|---|",
                  f"| gradient computation | {s['compute_ms']:.3f} | |"]
        for compress in ("none", "bf16"):
            st = s[f"stage_ms_{compress}"]
            label = "float32" if compress == "none" else compress
            lines.append(f"| gradient down + parameters up, {label} on the wire | {st:.3f} "
                         f"| {100 * st / (st + s['compute_ms']):.0f}% |")
        lines.append("")
    return "\n".join(lines)


def fed_report(cname: str, c: dict) -> list[str]:
    """The fed-worker table: each configuration against one process, with what it moves and how
    busy its servers were."""
    one = (c["rows"].get(ONE) or {}).get("rate")
    lines = [f"## {cname}, {c['steps']} global steps, median of {c['reps']} run(s)", "",
             "| run | samples/s | vs one process | MB through MPI per step (worker) | servers busy | "
             "worker computing |", "|---|---|---|---|---|---|"]
    for rname, r in c["rows"].items():
        if r is None:
            lines.append(f"| {rname} | failed or skipped | | | | |")
            continue
        raw = (c.get("raw") or {}).get(rname) or [{}]
        mid = sorted(raw, key=lambda x: x.get("samples_per_second") or 0)[len(raw) // 2]
        bps = mid.get("bytes_per_sample")
        mb = f"{bps * c['batch'] / 1e6:.1f}" if bps else "-"
        busy = ", ".join(f"{b:.0%}" for b in mid.get("server_busy") or [] if b is not None) or "-"
        tb = mid.get("time_breakdown") or []
        comp = f"{tb[0]['compute']:.0%}" if tb and tb[0] else "-"  # fractions of the worker's wall time
        vs = f"{r['rate'] / one:.2f}x" if one else "n/a"
        lines.append(f"| {rname} | {r['rate']:,.0f} | {vs} | {mb} | {busy} | {comp} |")
    return lines + [""]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", default="", help="measure only the configurations whose name contains this")
    add_saved_run_flags(p, "benchmarks/GPU.md")
    args = p.parse_args()
    res = measured_or_saved(args, lambda save: measure(args.reps, save, args.only))
    text = report(res)
    if args.out:
        record(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
