"""Each way a server takes async pushes applies exactly the gradients it received, no more, no fewer, none
twice: the message path (exchange/serving.py over MPI), a worker's mailbox (another launch's worker on rank
0's host: exchange/mailbox.py) and rank 0's remote workers under --ps-transport shm (modes/shm_remote.py).

Each worker pushes a gradient whose every entry is its rank x 2^-10 (no model, no data), and the learning
rate is 2^-4, so each applied push moves every parameter by exactly rank x 2^-14 in float32. The server's
counts of applied pushes per worker (the summary's worker_steps) then say where the parameters must end, to
within the roundings of the subtractions (far under one push of the smallest size).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from conftest import MPI_TIMEOUT_S, child_env, launcher

from mpitrain.exchange.protocol import HEADER_BYTES

SCRIPT = """
import os
import sys
import time
import numpy as np
import mpitrain
from mpitrain.modes import gradients

out, seen = sys.argv[1], []

def compute(self, params, grad, step=0):
    if not seen:  # the first gradient is computed on the job's start parameters
        np.save(f"{out}/start-{mpitrain.rank()}.npy", np.asarray(params, np.float32))
    seen.append(1)
    if len(seen) == 3:  # this worker's first push is applied (its third gradient waits for that reply, overlap or
        # not): so is the other's before either goes on, or a fast path alone spends the whole budget first
        # (the store's worker did all 600 before a loaded machine ran the remote one once, [600, 0])
        open(f"{out}/applied-{mpitrain.rank()}", "w").close()
        other = f"{out}/applied-{3 - mpitrain.rank()}"
        for _ in range(60000):
            if os.path.exists(other):
                break
            time.sleep(0.001)
    grad[:] = mpitrain.rank() * 2.0 ** -10
    self.batches.taken += 1
    return 0.5

gradients.GradientSource.compute = compute
r = mpitrain.train(model="softmax", steps=600, lr=2.0 ** -4, optimizer="sgd", staleness_lr=0, lr_decay=1.0, progress=False,
                   summary_json=f"{out}/s.json", ps_transport=sys.argv[2])
if mpitrain.rank() == 0:
    np.save(f"{out}/end.npy", np.asarray(r.params, np.float32))
"""

UNIT = 2.0 ** -14  # one push of rank 1's, times the learning rate


@pytest.mark.parametrize("path", ["messages", "mailbox", "shm-remote"])
def test_a_server_applies_exactly_the_pushes_it_received(tmp_path, path):
    script = tmp_path / "pushes.py"
    script.write_text(SCRIPT)
    env = child_env()
    transport = "mpi"
    if path == "mailbox":
        env["MPITRAIN_INJECT_STRANGER"] = "2"  # rank 2 counts as another launch's: a mailbox to rank 0
    if path == "shm-remote":
        env["MPITRAIN_INJECT_OFFHOST"] = "2"  # rank 1 applies in the store, rank 2's pushes come as messages
        transport = "shm"
    import subprocess

    proc = subprocess.run([*launcher(), "-np", "3", sys.executable, str(script), str(tmp_path), transport],
                          capture_output=True, text=True, env=env, timeout=MPI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    applied = s["worker_steps"]  # rank 0's count of each worker's pushes applied
    assert sum(applied) == s["global_step"] == 600 and min(applied) > 0, applied
    start, end = np.load(tmp_path / "start-2.npy"), np.load(tmp_path / "end.npy")
    moved = sum(count * (w + 1) for w, count in enumerate(applied)) * UNIT
    assert np.abs(start - end - moved).max() < UNIT / 4, (applied, float(np.abs(start - end - moved).max()))
    message = HEADER_BYTES + 4 * (64 * 10 + 10)  # header + softmax 64-10 (digits), the bytes of one push
    through_mpi = s["ps_shards"][0]["bytes_in"]  # what rank 0 took from MPI (a mailbox's pushes are not)
    expected = {"messages": sum(applied), "mailbox": applied[0], "shm-remote": applied[1]}[path] * message
    assert expected <= through_mpi <= expected + 2 * message, (through_mpi / message, applied)  # + the last pushes
