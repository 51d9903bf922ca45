"""Your own model through the Python API: softmax regression trained on a label-smoothed
cross-entropy (Szegedy et al. 2016), written against the array module `xp` so that the same class
runs on NumPy and, on a GPU worker, CuPy.

    python examples/custom_model.py                      # one process
    mpirun -np 3 python examples/custom_model.py sync    # 1 parameter server + 2 workers, sync
    mpirun -np 3 python examples/custom_model.py async

A model is any object with model.Model's members (see its docstring): ONE flat float32 parameter
vector, the loss and its gradient written into a buffer of the same layout, evaluation, a `spec`
that checkpoints store, and `with_backend(xp)`. Everything else (transport, optimizers, --quorum,
checkpoints, signals) is mpitrain's.
"""

import sys

import numpy as np

import mpitrain


class SmoothedLogistic:
    def __init__(self, n_features: int, n_classes: int, smoothing: float = 0.1, xp=np):
        self.sizes = (n_features, n_classes)
        self.smoothing, self.xp = smoothing, xp
        self.n_params = n_features * n_classes + n_classes
        self.spec = {"kind": "smoothed-logistic", "sizes": [n_features, n_classes], "smoothing": smoothing}
        self.description = f"smoothed-logistic {n_features}-{n_classes} ({self.n_params:,} params)"

    def with_backend(self, xp):
        return self if xp is self.xp else SmoothedLogistic(*self.sizes, self.smoothing, xp)

    def _views(self, flat):
        """(W, b) as views into one flat vector: parameters or gradient alike."""
        d, c = self.sizes
        return flat[: d * c].reshape(d, c), flat[d * c:]

    def init_params(self, seed: int) -> np.ndarray:
        return np.zeros(self.n_params, np.float32)

    def _log_probs(self, params, x):
        w, b = self._views(params)
        z = x @ w + b
        z = z - z.max(axis=1, keepdims=True)
        return z - self.xp.log(self.xp.exp(z).sum(axis=1, keepdims=True))

    def _targets(self, y):
        xp, c = self.xp, self.sizes[1]
        t = xp.full((len(y), c), self.smoothing / c, xp.float32)
        t[xp.arange(len(y)), y] += 1 - self.smoothing
        return t

    def loss_and_grad(self, params, x, y, grad) -> float:
        logp, t = self._log_probs(params, x), self._targets(y)
        dz = (self.xp.exp(logp) - t) / len(y)  # d loss / d logits
        gw, gb = self._views(grad)
        gw[...] = x.T @ dz
        gb[...] = dz.sum(axis=0)
        return float(-(t * logp).sum() / len(y))

    def evaluate(self, params, x, y, chunk: int = 4096):
        logp = self._log_probs(params, x)
        pred = logp.argmax(axis=1)
        loss = float(-(self._targets(y) * logp).sum() / len(y))
        acc = float((pred == y).mean())
        return loss, acc, np.asarray(pred.get() if hasattr(pred, "get") else pred)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "async"
    digits = mpitrain.dataset("digits")
    model = SmoothedLogistic(digits.x_train.shape[1], digits.n_classes)
    result = mpitrain.train(model=model, mode=mode, epochs=30, progress=False)
    if mpitrain.rank() == 0:
        print(f"custom model, {result['mode']}: test accuracy {result['test_accuracy']:.4f}; "
              f"predicted {result.predict(digits.x_test[:8]).tolist()}, true {digits.y_test[:8].tolist()}")
