"""Sweep two learning rates with the Python API, in one process or under mpirun:

    python examples/sweep_lr.py                 # each run trains locally
    mpirun -np 3 python examples/sweep_lr.py    # each run: 1 parameter server + 2 workers

Every rank makes the same calls; rank 0 gets each run's summary, the workers their own reports.
"""

import mpitrain

results = {}
for lr in (0.02, 0.2):
    try:
        summary = mpitrain.train(model="mlp", dataset="digits", epochs=30, lr=lr, progress=False)
    except mpitrain.Diverged as e:  # a learning rate too large for the model: record it, go on
        summary = e.summary
    if mpitrain.rank() == 0:
        results[lr] = summary["test_accuracy"]

if mpitrain.rank() == 0:
    for lr, accuracy in results.items():
        print(f"sweep: lr {lr:g} -> test accuracy {accuracy:.4f}")
    best = max(results, key=results.get)
    print(f"sweep: best lr {best:g}")
