"""Same behaviour as another commit: sync digests, async accuracy, and an interleaved speed A/B.

    python benchmarks/ab.py REF [--reps 5] [--steps 3000] [--out benchmarks/AB.md]

REF (a commit, e.g. the one before a refactor) is checked out in a temporary git worktree; each
command runs once from that tree and once from this one (`python -m mpitrain` takes the package of
its working directory). Sync runs are deterministic: their `param_digest` must be equal. Async
runs are not (arrival order): their test accuracy is compared. Speed: samples/s of np=3 runs on
synthetic data, alternating A and B, medians and their ratio (this VM is noisy: read the ratio, not
the figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import record  # noqa: E402  (same folder)
from run import env as bench_env  # noqa: E402  (same folder)
from run import machine, mpirun  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# (label, ranks, flags): every sync configuration of the reshaping issue (#31); the learning rates
# are given, so a change of defaults does not read as a change of behaviour.
DIGESTS = [
    ("sync MLP sgd", 3, "--mode sync --lr 0.1 --steps 150"),
    ("sync softmax sgd", 3, "--mode sync --model softmax --lr 0.1 --steps 150"),
    ("sync momentum + EMA", 3, "--mode sync --optimizer momentum --lr 0.05 --ema-decay 0.9 --steps 150"),
    ("sync adam", 3, "--mode sync --optimizer adam --lr 0.01 --steps 150"),
    ("sync bf16", 3, "--mode sync --compress bf16 --lr 0.1 --steps 150"),
    ("sync fp16", 3, "--mode sync --compress fp16 --lr 0.1 --steps 150"),
    ("sync --num-ps 2", 5, "--mode sync --num-ps 2 --optimizer adam --lr 0.01 --ema-decay 0.9 --steps 150"),
    ("sync --local-steps 4", 3, "--mode sync --local-steps 4 --lr 0.1 --ema-decay 0.9 --steps 150"),
    ("sync --local-steps 8 --fragments 4 --outer-overlap 1 int8", 3,
     "--mode sync --local-steps 8 --fragments 4 --outer-overlap 1 --compress int8 --lr 0.1 --steps 160"),
    ("one process", 0, "--lr 0.1 --steps 150"),
    ("one process adam + EMA", 0, "--optimizer adam --lr 0.01 --ema-decay 0.9 --steps 150"),
    ("async, one worker, --no-overlap", 2, "--no-overlap --lr 0.1 --steps 150"),
]
ACCURACY = [
    ("async MLP", 3, "--lr 0.1 --epochs 30"),
    ("async --num-ps 2", 5, "--num-ps 2 --lr 0.1 --epochs 30"),
    ("sync --quorum 1", 4, "--mode sync --quorum 1 --lr 0.1 --epochs 30"),
]

SPEED = {"async": (3, "--mode async"), "async-softmax": (3, "--mode async --model softmax"),  # ranks, flags
         "sync": (3, "--mode sync"),  # (the speed A/B's modes)
         "quorum": (4, "--mode sync --quorum 2"), "shm": (3, "--mode async --ps-transport shm"),
         "shm-softmax": (3, "--mode async --ps-transport shm --model softmax")}


def run(tree: Path, ranks: int, flags: str, tmp: Path) -> dict:
    out = tmp / "summary.json"
    cmd = [sys.executable, "-m", "mpitrain", *flags.split(), "--no-progress", "--summary-json", str(out)]
    if ranks:
        cmd = [mpirun(), "-np", str(ranks), *cmd]
    env = {**bench_env(), "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "AB.md"))
    p.add_argument("--speed-only", action="store_true", help="only the speed A/B (a cost check with more --reps)")
    p.add_argument("--speed-modes", default="async,sync", help=f"of {', '.join(SPEED)}")
    args = p.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp, before = Path(tmpdir), Path(tmpdir) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.ref], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            ref = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip()
            lines += [f"# {'Speed' if args.speed_only else 'Same behaviour'}: {head} (B) against {ref} (A)", "",
                      f"`python benchmarks/ab.py {args.ref} --reps {args.reps} --steps {args.steps}"
                      f"{' --speed-only' if args.speed_only else ''} --speed-modes {args.speed_modes}`, "
                      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {machine()}.", ""]
            if not args.speed_only:
                lines += ["| deterministic run | A param_digest | B param_digest | equal |", "|---|---|---|---|"]
            for label, ranks, flags in [] if args.speed_only else DIGESTS:
                a, b = run(before, ranks, flags, tmp)["param_digest"], run(ROOT, ranks, flags, tmp)["param_digest"]
                lines.append(f"| {label} (`{flags}`) | {a} | {b} | {'yes' if a == b else '**no**'} |")
                print(lines[-1], flush=True)
            if not args.speed_only:
                lines += ["", "| run (not deterministic) | A test accuracy | B test accuracy |", "|---|---|---|"]
            for label, ranks, flags in [] if args.speed_only else ACCURACY:
                a, b = run(before, ranks, flags, tmp)["test_accuracy"], run(ROOT, ranks, flags, tmp)["test_accuracy"]
                lines.append(f"| {label} (`{flags}`) | {a:.4f} | {b:.4f} |")
                print(lines[-1], flush=True)
            lines += ["", f"Speed, synthetic, MLP, {args.steps} steps, A and B alternating, "
                          f"median of {args.reps} (samples/s), and each side's range:", "",
                      "| mode | A | B | B / A | A range | B range |",
                      "|---|---|---|---|---|---|"]
            for mode in args.speed_modes.split(","):
                ranks, mode_flags = SPEED[mode]
                flags = f"{mode_flags} --dataset synthetic --lr 0.1 --steps {args.steps}"
                rates = {"A": [], "B": []}
                for _ in range(args.reps):
                    rates["A"].append(run(before, ranks, flags, tmp)["samples_per_second"])
                    rates["B"].append(run(ROOT, ranks, flags, tmp)["samples_per_second"])
                a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
                spread = [f"{min(r):,.0f}-{max(r):,.0f}" for r in (rates["A"], rates["B"])]
                lines.append(f"| {mode} (np={ranks}) | {a:,.0f} | {b:,.0f} | {b / a:.3f}x | {spread[0]} | {spread[1]} |")
                print(lines[-1], flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
    record(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
