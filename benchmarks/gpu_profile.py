"""Where one process's GPU step goes, beside PyTorch's (issue 52, item 1): the step with and
without its host round trips, the GEMMs one by one, the kernels per step, and the Python time.

    python benchmarks/gpu_profile.py --json profile.json        # on a GPU machine (~1 min)

Step variants, each in this process on the same data, model sizes, batch and SGD (timed between
two device synchronisations, after a warm-up):
- "mpitrain's step": what a one-process run computes per step: the minibatch gather, the model's
  loss_and_grad (one host read: the loss), the finite check (a second: the gradient's squared
  norm), the SGD update;
- "one host read": the loss and the squared norm read together;
- "no host read": nothing read back, as PyTorch's loop in benchmarks/torch_ddp.py;
- PyTorch's step, as torch_ddp.py's, with and without `loss.item()`.
Then each GEMM of the big model (forward, weight gradient, input gradient) on CuPy and on PyTorch,
the CUDA kernels launched by one step of each (CUPTI through torch.profiler sees CuPy's too), and
the top of cProfile for a real one-process run (`python -m mpitrain`, batch 100).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {"100": (100, 500), "4096,4096": (4096, 30)}  # hidden -> (batch, timed steps per block)
LR = 0.1


def cupy_steps(hidden: str, batch: int):
    """name -> a function doing one step, for each variant; and a synchronize."""
    import cupy

    from support import MLP, PlainOps, make_synthetic

    sizes = (784, *map(int, hidden.split(",")), 10)
    model = MLP(sizes, 0.0, cupy)
    plain = MLP(sizes, 0.0, cupy)
    plain.ops = PlainOps(cupy)  # the element-wise steps as array expressions, as before FusedOps
    ds = make_synthetic(max(12000, 4 * batch), 784, 10, 0)
    x_all, y_all = cupy.asarray(ds.x_train), cupy.asarray(ds.y_train)
    params = cupy.asarray(model.init_params(0))
    grad = cupy.zeros_like(params)
    n = x_all.shape[0]
    both = cupy.empty(2, cupy.float32)

    def batch_xy():
        idx = cupy.random.randint(0, n, batch)
        return x_all[idx], y_all[idx]

    def as_is():
        x, y = batch_xy()
        loss = model.loss_and_grad(params, x, y, grad)
        finite = float(cupy.dot(grad, grad))
        params[...] -= LR * grad  # optim._sgd's update
        return loss, finite

    def one_read():
        x, y = batch_xy()
        both[0] = model.log_likelihood_and_grad(params, x, y, grad)
        both[1] = cupy.dot(grad, grad)
        params[...] -= LR * grad
        return cupy.asnumpy(both)

    def no_read():
        x, y = batch_xy()
        model.log_likelihood_and_grad(params, x, y, grad)
        params[...] -= LR * grad

    def plain_ops():
        x, y = batch_xy()
        loss = plain.loss_and_grad(params, x, y, grad)
        finite = float(cupy.dot(grad, grad))
        params[...] -= LR * grad
        return loss, finite

    # A CUDA graph of the no-read step (issue 83, item 1: is launching kernels what batch 100 pays?). The
    # batch's rows come from an index buffer refilled before each replay (one copy); the graph is captured
    # after three eager steps, so that every temporary it allocates is already in CuPy's pool (no cudaMalloc
    # while capturing). A measurement only: the replayed temporaries' addresses are the pool's, safe here
    # because nothing else allocates between replays.
    picks = cupy.random.randint(0, n, (64, batch))
    idx = cupy.empty(batch, picks.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    state = {"graph": None, "i": 0}

    def body():
        model.log_likelihood_and_grad(params, x_all[idx], y_all[idx], grad)
        params[...] -= LR * grad

    def graphed():
        with stream:
            idx[...] = picks[state["i"] % 64]
            state["i"] += 1
            if state["graph"] is None:
                for _ in range(3):
                    body()
                stream.synchronize()
                stream.begin_capture()
                body()
                state["graph"] = stream.end_capture()
            state["graph"].launch(stream)

    return {"mpitrain's step (2 host reads)": as_is, "the same, unfused element-wise ops": plain_ops,
            "one host read": one_read, "no host read": no_read, "no host read, one CUDA graph": graphed}, \
        cupy.cuda.Device().synchronize


def torch_steps(hidden: str, batch: int):
    import torch

    from support import make_synthetic

    sizes = [784, *map(int, hidden.split(",")), 10]
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    ds = make_synthetic(max(12000, 4 * batch), 784, 10, 0)
    x_all, y_all = torch.from_numpy(ds.x_train).to(dev), torch.from_numpy(ds.y_train).to(dev)
    n = x_all.shape[0]

    def step(read: bool):
        idx = torch.randint(0, n, (batch,), device=dev)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x_all[idx]), y_all[idx])
        loss.backward()
        opt.step()
        return loss.item() if read else None

    return {"PyTorch (no host read)": lambda: step(False), "PyTorch with loss.item()": lambda: step(True)}, \
        torch.cuda.synchronize


def timed(fn, sync, steps: int) -> float:
    """Milliseconds per step, median of 3 timed blocks after a warm-up."""
    for _ in range(20):
        fn()
    sync()
    blocks = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        blocks.append(1e3 * (time.perf_counter() - t0) / steps)
    return sorted(blocks)[1]


def kernels_per_step(fn, sync) -> tuple[int | None, list]:
    """CUDA kernels one step launches (any library's: CUPTI sees the device), and the costliest
    kinds: [(name, microseconds per step)]; None where torch.profiler is missing."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None, []
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        sync()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    per: dict[str, float] = {}
    for e in kernels:
        us = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0) or 0.0
        per[e.name[:70]] = per.get(e.name[:70], 0.0) + us / 10
    top = sorted(per.items(), key=lambda kv: kv[1], reverse=True)[:10]
    launched = [e for e in kernels if "Memcpy" not in e.name and "Memset" not in e.name]
    return round(len(launched) / 10), top


def gemms(batch: int = 4096, hidden: str = "4096,4096", reps: int = 20) -> list[dict]:
    """Each GEMM of one MLP step, CuPy (as model.py calls it) against torch.mm, ms each."""
    import cupy
    import torch

    sizes = [784, *map(int, hidden.split(",")), 10]
    rows = []
    ev = cupy.cuda.Event

    def cupy_ms(fn):
        for _ in range(3):
            fn()
        t0, t1 = ev(), ev()
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        t1.synchronize()
        return cupy.cuda.get_elapsed_time(t0, t1) / reps

    def torch_ms(fn):
        for _ in range(3):
            fn()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            fn()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) / reps

    for a, b in zip(sizes[:-1], sizes[1:]):
        x, w, d = (cupy.random.random_sample(s, dtype=cupy.float32) for s in ((batch, a), (a, b), (batch, b)))
        z, gw = cupy.empty((batch, b), cupy.float32), cupy.empty((a, b), cupy.float32)
        tx, tw, td = (torch.as_tensor(v, device="cuda") for v in (x, w, d))
        flops = 2 * batch * a * b
        for name, cfn, tfn in (
            ("forward x @ W", lambda: cupy.matmul(x, w, out=z), lambda: tx @ tw),
            ("weight grad x.T @ d", lambda: cupy.matmul(x.T, d, out=gw), lambda: tx.T @ td),
            ("input grad d @ W.T", lambda: cupy.matmul(d, w.T), lambda: td @ tw.T),
        ):
            c, t = cupy_ms(cfn), torch_ms(tfn)
            rows.append({"layer": f"{a}->{b}", "gemm": name, "cupy_ms": c, "torch_ms": t,
                         "cupy_tflops": flops / c / 1e9, "torch_tflops": flops / t / 1e9})
    return rows


def python_profile(steps: int = 2000) -> list[dict]:
    """The top of cProfile (own time) for a real one-process run at batch 100 on the GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "prof")
        cmd = [sys.executable, "-m", "cProfile", "-o", out, "-m", "mpitrain", "--no-progress", "--device", "gpu",
               "--dataset", "synthetic", "--steps", str(steps)]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT, timeout=300)
        st = pstats.Stats(out)
        rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
        return [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls": v[1], "own_s": v[2], "cum_s": v[3]}
                for k, v in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    args = p.parse_args()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": {}}

    def save():
        Path(args.json).write_text(json.dumps(res, indent=1))

    for hidden, (batch, steps) in CONFIGS.items():
        rows = {}
        for maker in (cupy_steps, torch_steps):
            try:
                fns, sync = maker(hidden, batch)
            except Exception as exc:  # noqa: BLE001 -- one missing library must not cost the rest
                rows[maker.__name__] = {"error": str(exc)[-300:]}
                continue
            for name, fn in fns.items():
                try:
                    ms = timed(fn, sync, steps)
                except Exception as exc:  # noqa: BLE001 -- one variant that cannot run must not cost the rest
                    rows[name] = {"error": str(exc)[-300:]}
                    print(f"{name}: failed: {exc}", flush=True)
                    continue
                count, top = kernels_per_step(fn, sync)
                rows[name] = {"ms_per_step": ms, "samples_per_s": batch / ms * 1e3, "kernels_per_step": count,
                              "top_kernels_us": top}
                print(f"mlp 784-{hidden.replace(',', '-')}-10 batch {batch}: {name}: {ms:.3f} ms/step, "
                      f"{count} kernels", flush=True)
                if batch > 1000:
                    for kname, us in top[:8]:
                        print(f"      {us:9.1f} us  {kname}", flush=True)
        res["steps"][f"784-{hidden.replace(',', '-')}-10, batch {batch}"] = rows
        save()
    res["gemms"] = gemms()
    for r in res["gemms"]:
        print(f"{r['layer']:>10} {r['gemm']:<22} cupy {r['cupy_ms']:.3f} ms ({r['cupy_tflops']:.1f} TFLOP/s)  "
              f"torch {r['torch_ms']:.3f} ms ({r['torch_tflops']:.1f})", flush=True)
    save()
    res["python_profile"] = python_profile()
    for r in res["python_profile"][:15]:
        print(f"{r['own_s']:8.3f} s own {r['cum_s']:8.3f} s cum {r['calls']:>8} calls  {r['function']}", flush=True)
    save()
    res["real_runs"] = real_runs()
    save()
    return 0


def real_runs() -> dict:
    """`python -m mpitrain` (one process) against torch_ddp.py on the same GPU, model, batch and
    steps: samples/s as each reports it (mpitrain's clock starts before the data reaches the GPU;
    PyTorch's after 20 warm-up steps), at a short and a longer run to show the one-off costs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import same_run
    from run import run_mpitrain, run_torch

    out = {}
    for hidden, batch, steps in (("100", 100, 3000), ("4096,4096", 4096, 120), ("4096,4096", 4096, 600)):
        base, torch_args = same_run(hidden, batch, steps, 12000 if batch == 100 else 60000)
        key = f"784-{hidden.replace(',', '-')}-10, batch {batch}, {steps} steps"
        mine = run_mpitrain(0, base)["samples_per_second"]
        torch = run_torch(1, "mlp", steps, torch_args)
        out[key] = {"mpitrain": mine, "pytorch": torch and torch["samples_per_second"]}
        print(f"real run {key}: mpitrain {mine:,.0f} samples/s, PyTorch {out[key]['pytorch'] or 0:,.0f}", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
