"""The Python API against the command line under mpirun: the same job, alternated.

    python benchmarks/api_speed.py [--rounds 5] [--epochs 30] [--out benchmarks/API_SPEED.md]

Each round runs `mpirun -np 3 python -m mpitrain --epochs E` and a script that imports NumPy first
and then calls `mpitrain.train(epochs=E)` under `mpirun -np 3` (the case of issue 77, where the API
ran 6-14x slower: 3 ranks, each with a BLAS thread per core, on 2 cores). The BLAS variables are
left unset, as a user's shell leaves them: each door pins them itself (core/blas.py). Reported: the
summary's training seconds, medians over the rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import machine, mpirun  # noqa: E402  (same folder)

from support import local_flags, of_mpirun  # noqa: E402  (same folder: mpitrain's insides, the fault hooks)

SCRIPT = """
import sys
import numpy  # loaded before mpitrain is called, as a user's script does
import mpitrain
mpitrain.train(epochs={epochs}, progress=False, summary_json=sys.argv[1])
"""


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env.pop("SLURM_NTASKS", None)
    return env


def seconds(cmd: list[str], summary: Path, threads: str | None = None) -> float:
    env = clean_env() if threads is None else {**clean_env(), "OPENBLAS_NUM_THREADS": threads}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=600)
    return float(json.loads(summary.read_text())["wall_seconds"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    launch = [mpirun(), *local_flags(of_mpirun(mpirun())), "-np", "3", sys.executable]
    cli, api, before = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        script, summary = Path(tmp) / "api.py", Path(tmp) / "s.json"
        script.write_text(SCRIPT.format(epochs=a.epochs))
        for _ in range(a.rounds):
            cli.append(seconds([*launch, "-m", "mpitrain", "--epochs", str(a.epochs), "--no-progress",
                                "--summary-json", str(summary)], summary))
            api.append(seconds([*launch, str(script), str(summary)], summary))
            # what the API did before: a BLAS thread per core on every rank (a setting of the user's wins)
            before.append(seconds([*launch, str(script), str(summary)], summary, threads=str(os.cpu_count())))
    c, s, b = statistics.median(cli), statistics.median(api), statistics.median(before)
    lines = [f"# The Python API against the command line ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"`python benchmarks/api_speed.py --rounds {a.rounds} --epochs {a.epochs}`; {machine()}.", "",
             "MLP on digits, `mpirun -np 3` (1 server + 2 workers on 2 cores), the BLAS thread variables unset; "
             "training seconds from the summary, the two alternated each round.", "",
             "| door | median s | rounds |", "|---|---|---|",
             f"| command line | {c:.3f} | {', '.join(f'{x:.2f}' for x in cli)} |",
             f"| `mpitrain.train()`, NumPy imported first | {s:.3f} | {', '.join(f'{x:.2f}' for x in api)} |",
             f"| the same as before core/blas.py (a BLAS thread per core: `OPENBLAS_NUM_THREADS={os.cpu_count()}`) | "
             f"{b:.3f} | {', '.join(f'{x:.2f}' for x in before)} |", "",
             f"API / CLI: **{s / c:.2f}x**; the API as it was / CLI: {b / c:.2f}x (issue 77 measured 6-14x).", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        record(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
