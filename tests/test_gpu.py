"""The CuPy path on a real GPU. Every test here is marked `gpu` and skipped unless CuPy sees a
CUDA device, so CI (no GPU) skips them; on a GPU machine `pytest -m gpu` runs just these.

What they pin down: the GPU computes the same gradient as NumPy; the pinned staging buffers and
the separate copy stream are really what carries the data; both modes learn digits on the GPU;
sync replicas stay bitwise identical there; --cuda-aware is refused, in one line, by an MPI that
says it cannot read GPU memory, and works where one says it can.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import train
from test_cli import per_rank_exit_codes

from mpitrain.core.backend import _import_cupy, make_backend
from mpitrain.core.codec import WIRE_DTYPES, decode, encode
from mpitrain.core.model import MLP
from mpitrain.launch.mpiimpl import mpi_cuda_support

cupy, N_GPUS = _import_cupy()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS == 0, reason="needs CuPy and a CUDA device")]

CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked host memory known to CUDA


def digits_batch(n: int = 256, seed: int = 0):
    from mpitrain.core.data import make_synthetic

    ds = make_synthetic(2 * n, 64, 10, seed)
    return ds.x_train[:n], ds.y_train[:n]


@pytest.mark.parametrize("sizes", [(64, 10), (64, 100, 10), (64, 32, 16, 10)])
@pytest.mark.parametrize("l2", [0.0, 1e-3])
def test_gradient_matches_numpy_on_the_same_parameters(sizes, l2):
    x, y = digits_batch()
    cpu, gpu = MLP(sizes, l2, np), MLP(sizes, l2, cupy)
    params = cpu.init_params(seed=3)
    params += np.random.default_rng(1).normal(0, 0.05, params.size).astype(np.float32)  # softmax starts at 0
    g_cpu = np.zeros_like(params)
    g_gpu = cupy.zeros(params.size, cupy.float32)
    loss_cpu = cpu.loss_and_grad(params, x, y, g_cpu)
    loss_gpu = gpu.loss_and_grad(cupy.asarray(params), cupy.asarray(x), cupy.asarray(y), g_gpu)
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-5)
    np.testing.assert_allclose(g_gpu.get(), g_cpu, rtol=1e-4, atol=1e-6)
    _, acc_cpu, pred_cpu = cpu.evaluate(params, x, y)
    _, acc_gpu, pred_gpu = gpu.evaluate(cupy.asarray(params), cupy.asarray(x), cupy.asarray(y))
    assert acc_gpu == acc_cpu and np.array_equal(pred_gpu, pred_cpu)


@pytest.mark.parametrize("name", ["int8", "int4", "top 2% in int8"])
def test_a_compressed_part_on_the_gpu_decodes_as_numpy_decodes_it(name):
    """core/compress.py on CuPy (GatherReducer and a GPU worker's pushes compress on the device): the same
    entries kept, each within its block's bound, and a part made on the GPU read back on the host alike."""
    from mpitrain.core.compress import QUANTIZERS, TopK

    s = TopK(0.02, QUANTIZERS["int8"]) if name.startswith("top") else QUANTIZERS[name]
    src = (np.random.default_rng(0).standard_normal(100_003) * 3).astype(np.float32)
    host, dev = np.zeros(s.wire_bytes(src.size), np.uint8), cupy.zeros(s.wire_bytes(src.size), cupy.uint8)
    s.encode(np, src, host)
    s.encode(cupy, cupy.asarray(src), dev)
    back_cpu, back_gpu = np.empty(src.size, np.float32), cupy.empty(src.size, cupy.float32)
    s.decode(np, host, back_cpu)
    s.decode(cupy, dev, back_gpu)
    from_gpu_on_host = np.empty(src.size, np.float32)
    s.decode(np, dev.get(), from_gpu_on_host)
    np.testing.assert_array_equal(from_gpu_on_host, back_gpu.get())
    step = np.abs(src).max() / getattr(s, "inner", s).levels  # a division rounded apart may move one value one step
    np.testing.assert_allclose(back_gpu.get(), back_cpu, rtol=0, atol=step * 1.001)
    if name.startswith("top"):  # the same entries picked: the indices in front are the same bytes
        k = s.k(src.size)
        assert np.array_equal(dev[: 4 * k].get(), host[: 4 * k])


@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_wire_codec_on_the_gpu_is_bitwise_the_numpy_one(compress):
    wire = np.dtype(WIRE_DTYPES[compress])
    src = np.random.default_rng(0).normal(0, 3, 100_000).astype(np.float32)
    src[:4] = [0.0, -0.0, 1e-30, 65504.0]
    host, dev = np.empty(src.size, wire), cupy.empty(src.size, wire)
    encode(np, src, host)
    encode(cupy, cupy.asarray(src), dev)
    assert np.array_equal(dev.get().view(np.uint16), host.view(np.uint16))
    back_host, back_dev = np.empty_like(src), cupy.empty(src.size, cupy.float32)
    decode(np, host, back_host)
    decode(cupy, dev, back_dev)
    assert np.array_equal(back_dev.get(), back_host)


def is_pinned(a: np.ndarray) -> bool:
    attrs = cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    return attrs.type == CUDA_MEMORY_TYPE_HOST


def copy_stream_ms(be, work) -> float:
    """Milliseconds of GPU time that `work` put on the backend's copy stream, measured by events
    recorded on that stream around it (nothing else runs there)."""
    cupy.cuda.Device().synchronize()
    t0, t1 = cupy.cuda.Event(), cupy.cuda.Event()
    t0.record(be.copy_stream)
    work()
    t1.record(be.copy_stream)
    t1.synchronize()
    return cupy.cuda.get_elapsed_time(t0, t1)


@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_staging_goes_through_pinned_memory_on_the_copy_stream(compress):
    be = make_backend("gpu", 0)
    wire = np.dtype(WIRE_DTYPES[compress])
    n = 32 * 2**20  # 128 MiB of float32: the copy takes milliseconds, not microseconds
    host = be.host_alloc(n * wire.itemsize).view(wire)
    assert is_pinned(host), "message buffers must be page-locked, or copies are neither async nor DMA"
    assert not is_pinned(np.empty(16, np.uint8))  # the check itself can tell the difference
    dev = be.mirror(host)
    assert isinstance(dev, cupy.ndarray) and dev.dtype == np.float32
    values = cupy.arange(n, dtype=cupy.float32) % 1000 - 500
    dev[...] = values
    # the copy must land on the copy stream: a download of 64-128 MiB takes over 1 ms there
    assert copy_stream_ms(be, lambda: be.download(dev, host)) > 1.0
    expect = np.arange(n, dtype=np.float32) % 1000 - 500  # bf16 keeps 8 bits of it
    back = np.empty(n, np.float32)
    decode(np, host, back)
    np.testing.assert_allclose(back, expect, rtol=2 ** -8)
    dev[...] = 0
    assert copy_stream_ms(be, lambda: be.upload(dev, host)) > 1.0
    np.testing.assert_array_equal(dev.get(), back)


def test_download_waits_for_the_compute_that_wrote_the_buffer():
    """The copy stream is non-blocking: without the event, a download could copy a gradient that a
    still-running kernel has not finished writing."""
    be = make_backend("gpu", 0)
    n = 4096
    host = be.host_alloc(n * n * 4).view(np.float32)
    a = cupy.full((n, n), 1.0, cupy.float32)
    for trial in range(3):
        dev = cupy.zeros(n * n, cupy.float32)
        for _ in range(20):  # tens of ms of work queued on the compute stream, the host not waiting
            cupy.matmul(a, a, out=dev.reshape(n, n))
        dev += trial
        be.download(dev, host)  # no synchronize between: ordering is the backend's job
        assert host[0] == n + trial and host[-1] == n + trial


def test_async_np3_learns_digits_on_the_gpu(tmp_path):
    s = train(3, tmp_path, "--device", "gpu")
    assert "GPU 0" in s["_stdout"].splitlines()[1]  # rank 1's line names the GPU it computes on
    assert s["test_accuracy"] >= 0.93
    assert all(a >= 0.90 for a in s["worker_test_accuracy"])
    assert s["global_step"] == sum(s["worker_steps"])


@pytest.mark.parametrize("flags", [
    ("--ps-transport", "shm"),
    ("--local-steps", "4"),
    ("--delay-compensation",),
    ("--ps-device", "gpu", "--local-steps", "4", "--compress", "bf16"),
    ("--mode", "sync", "--local-steps", "4"),
], ids=["shm-store", "local-steps", "delay-compensation", "gpu-server-local-steps-bf16", "sync-local-steps"])
def test_the_later_paths_learn_digits_on_gpu_workers(tmp_path, flags):
    """What came after the last GPU run (issue 83): the shared-memory store (the worker stages to the host
    and applies there), local steps (the outer delta on the device), delay compensation, and their mixes."""
    s = train(3, tmp_path, "--device", "gpu", *flags)
    assert "GPU 0" in s["_stdout"].splitlines()[1]
    assert s["test_accuracy"] >= 0.88


def test_sync_np3_learns_digits_on_the_gpu_and_replicas_stay_identical(tmp_path):
    s = train(3, tmp_path, "--device", "gpu", "--mode", "sync")
    assert s["test_accuracy"] >= 0.90
    assert len(set(s["worker_param_digests"])) == 1 and s["worker_param_digests"][0] == s["param_digest"]


@pytest.mark.parametrize("mode,compress", [("sync", "bf16"), ("async", "bf16"), ("async", "fp16")])
def test_compressed_wire_on_the_gpu(tmp_path, mode, compress):
    s = train(3, tmp_path, "--device", "gpu", "--mode", mode, "--compress", compress)
    assert s["test_accuracy"] >= 0.90


def test_sync_np4_replicas_identical_on_the_gpu(tmp_path):
    s = train(4, tmp_path, "--device", "gpu", "--mode", "sync", "--steps", "100", "--optimizer", "adam", "--lr", "0.01")
    assert len(s["worker_param_digests"]) == 3
    assert set(s["worker_param_digests"]) == {s["param_digest"]}


@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_quorum_on_the_gpu_keeps_replicas_identical(tmp_path, compress):
    """--quorum stages its pushes and updates through pinned memory: the chief's own gradient
    (its thread) and the pushed ones add up on the device, and every replica applies the same."""
    s = train(4, tmp_path, "--device", "gpu", "--mode", "sync", "--quorum", "2", "--compress", compress,
              "--straggler", "3:0.003", "--steps", "150")
    assert sum(s["worker_steps"]) == 2 * s["global_step"]
    assert set(s["worker_param_digests"]) == {s["param_digest"]}
    assert s["test_accuracy"] >= 0.85


def test_gpu_and_cpu_sync_runs_agree(tmp_path):
    """The same sync run on NumPy and on CuPy: float32 sums in another order, so not bitwise, but
    the same model to within a point of accuracy."""
    args = ("--mode", "sync", "--steps", "150", "--hidden", "64")
    cpu = train(3, tmp_path, "--device", "cpu", *args)
    gpu = train(3, tmp_path, "--device", "gpu", *args)
    assert abs(cpu["test_accuracy"] - gpu["test_accuracy"]) <= 0.01
    assert gpu["final_loss"] == pytest.approx(cpu["final_loss"], rel=0.05)


def test_cuda_aware_follows_what_the_mpi_library_says(tmp_path):
    if mpi_cuda_support() is False:
        proc, codes, _ = per_rank_exit_codes(["--device", "gpu", "--cuda-aware", "--steps", "20"])
        assert codes == {0: 2, 1: 2, 2: 2}, proc.stdout + proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "cannot read GPU memory" in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
    else:
        for mode in ("async", "sync"):
            s = train(3, tmp_path, "--device", "gpu", "--cuda-aware", "--mode", mode)
            assert "CUDA-aware MPI" in s["_stdout"] and s["test_accuracy"] >= 0.90


@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_a_gpu_parameter_server_trains_as_a_cpu_one_and_evaluates_on_its_gpu(tmp_path, compress):
    """--ps-device gpu: rank 0 keeps the parameters, the optimizer's state and the EMA on its GPU,
    decodes pushes there and evaluates there (chief.record_eval on rank 0's CuPy backend). One
    worker and --no-overlap make the run deterministic up to float32 rounding (CuPy's kernels
    contract multiply-adds), so it must end where the same run with a NumPy server ends."""
    args = ("--no-overlap", "--steps", "300", "--optimizer", "adam", "--lr", "0.01", "--ema-decay", "0.9",
            "--eval-every", "100", "--compress", compress)
    cpu = train(2, tmp_path, "--device", "gpu", *args)
    gpu = train(2, tmp_path, "--device", "gpu", "--ps-device", "gpu", *args)
    assert "GPU 0" in gpu["_stdout"].splitlines()[0] and "GPU 0" not in cpu["_stdout"].splitlines()[0]
    assert [e["global_step"] for e in gpu["eval_history"]] == [e["global_step"] for e in cpu["eval_history"]] == [100, 200, 300]
    assert all("ema_test_accuracy" in e for e in gpu["eval_history"])
    assert gpu["test_accuracy"] >= 0.90 and abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.01
    assert gpu["final_loss"] == pytest.approx(cpu["final_loss"], rel=0.05, abs=0.01)  # ~0.02 at the end


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_users_model_trains_on_cupy_workers(mode):
    """examples/custom_model.py's model, written against `xp`, through the API on GPU workers (and,
    in async, a GPU server): its with_backend(cupy) copy is what computes."""
    from test_seams import run_python

    extra = ', ps_device="gpu"' if mode == "async" else ""
    code = f"""
import sys
sys.path.insert(0, "examples")
import mpitrain
from custom_model import SmoothedLogistic
r = mpitrain.train(model=SmoothedLogistic(64, 10), mode={mode!r}, device="gpu", epochs=30, progress=False{extra})
if mpitrain.rank() == 0:
    print("ACC", r["test_accuracy"])
"""
    proc = run_python(code, np_=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    placement = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    assert sum("GPU 0" in ln for ln in placement) == (3 if mode == "async" else 2), proc.stdout
    assert float(proc.stdout.split("ACC ")[1].split()[0]) > 0.9, proc.stdout
