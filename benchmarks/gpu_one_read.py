"""`python -m mpitrain` with the GPU step's host reads chosen: `one` as shipped (a large model reads its loss and
finite check in one copy, modes/gradients.py), `two` with that turned off (the loss, then the squared norm).

    for r in 1 2 3; do for v in one two; do
      python benchmarks/gpu_one_read.py $v --device gpu --dataset synthetic --synthetic-samples 60000 --model mlp \
        --hidden 4096,4096 --batch-size 4096 --steps 600 --no-progress --summary-json s-$v-$r.json
    done; done

benchmarks/GPU.md, section 1, has what it measured on an H200 (2026-12-04), interleaved as above.
"""

import runpy
import sys

if sys.argv[1] not in ("one", "two"):
    sys.exit("usage: gpu_one_read.py one|two MPITRAIN_FLAGS...")
if sys.argv[1] == "two":
    from support import gradients  # beside this script

    shipped = gradients.GradientSource.__init__

    def two_reads(self, *args, **kwargs):
        shipped(self, *args, **kwargs)
        self.one_read = False

    gradients.GradientSource.__init__ = two_reads
sys.argv = ["mpitrain", *sys.argv[2:]]
runpy.run_module("mpitrain", run_name="__main__")
