"""Softmax regression and MLP over ONE flat float32 parameter vector.

Layer l has a weight matrix W_l (fan_in x fan_out) and a bias b_l; both are views into the flat
vector, in the order W_0, b_0, W_1, b_1, ... . Gradients use the same layout, so a gradient is
one contiguous buffer that can be sent as it is. Softmax regression is the MLP with no hidden
layer. All array work goes through `xp` (numpy or cupy), so one code path serves CPU and GPU.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np


class Model(Protocol):
    """What the trainer needs of a model, built-in or your own (`mpitrain.train(model=MyModel())`,
    examples/custom_model.py). Parameters are ONE flat float32 vector of `n_params` (every message,
    optimizer state and checkpoint is that vector); gradients have the same layout.

    - `sizes`: (input features, ..., classes); the first and last are checked against the data.
    - `spec`: a JSON-able dict naming the model and its shape, e.g. {"kind": "mlp", "sizes": [...]}:
      a checkpoint stores it, a resumed run and every rank must have the same.
    - `description`: one line for the start and summary lines.
    - `init_params(seed)`: the initial parameters, host float32 (NumPy), the same for a seed.
    - `loss_and_grad(params, x, y, grad)`: the mean loss of the batch (a float), its gradient
      written into `grad`; x is float32 rows (N, sizes[0]), y int64 labels, all of `xp`'s kind.
    - `evaluate(params, x, y)`: (mean loss, accuracy, predicted labels as a host int array).
    - `with_backend(xp)`: the same model computing with array module xp (numpy, or cupy on a GPU
      worker); it may return itself where xp is already its own.
    """

    sizes: tuple[int, ...]
    n_params: int
    description: str
    spec: dict

    def init_params(self, seed: int) -> np.ndarray: ...
    def loss_and_grad(self, params, x, y, grad) -> float: ...
    def evaluate(self, params, x, y, chunk: int = 4096) -> tuple[float, float, np.ndarray]: ...
    def with_backend(self, xp) -> "Model": ...


# What a model object must have (the API checks a user's model against it, naming what is missing).
MODEL_MEMBERS = ("sizes", "n_params", "description", "spec", "init_params", "loss_and_grad", "evaluate",
                 "with_backend")


class MLP:
    def __init__(self, sizes: tuple[int, ...], l2: float = 0.0, xp=np):
        if len(sizes) < 2:
            raise ValueError("need at least input and output sizes")
        self.sizes = tuple(int(s) for s in sizes)
        self.l2 = float(l2)
        self.xp = xp
        self.slices: list[tuple[slice, tuple[int, int], slice]] = []
        off = 0
        for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:]):
            w = slice(off, off + fan_in * fan_out)
            off = w.stop
            b = slice(off, off + fan_out)
            off = b.stop
            self.slices.append((w, (fan_in, fan_out), b))
        self.n_params = off
        self._scratch: dict[int, list] = {}
        self.ops = FusedOps(xp) if hasattr(xp, "ElementwiseKernel") else PlainOps(xp)  # CuPy, or NumPy's way

    @property
    def spec(self) -> dict:
        return builtin_spec(self.sizes)

    @property
    def description(self) -> str:
        return f"{self.spec['kind']} {'-'.join(map(str, self.sizes))} ({self.n_params:,} params)"

    def with_backend(self, xp) -> "MLP":
        return self if xp is self.xp else MLP(self.sizes, self.l2, xp)

    def layers(self, flat):
        """[(W, b), ...] as views into `flat` (parameters or gradients)."""
        return [(flat[w].reshape(shape), flat[b]) for w, shape, b in self.slices]

    def init_params(self, seed: int) -> np.ndarray:
        """Host float32 parameters. Softmax starts at zero (as the seeds did); an MLP uses
        He-uniform weights for ReLU layers and Glorot for the output layer, zero biases."""
        flat = np.zeros(self.n_params, np.float32)
        if len(self.sizes) == 2:
            return flat
        rng = np.random.default_rng([seed, 0x1A1])
        last = len(self.slices) - 1
        for i, (w, (fan_in, fan_out), _) in enumerate(self.slices):
            limit = np.sqrt(6.0 / fan_in) if i < last else np.sqrt(6.0 / (fan_in + fan_out))
            flat[w] = rng.uniform(-limit, limit, fan_in * fan_out).astype(np.float32)
        return flat

    def _buffers(self, batch: int):
        """Per-batch-size activation buffers, allocated once: the hot loop allocates little."""
        bufs = self._scratch.get(batch)
        if bufs is None:
            xp = self.xp
            bufs = [xp.empty((batch, s), xp.float32) for s in self.sizes[1:]]
            self._scratch[batch] = bufs
        return bufs

    def _forward(self, params, x):
        """Activations of every layer; the last holds logits. Uses shared scratch buffers."""
        xp = self.xp
        acts = self._buffers(x.shape[0])
        a = x
        layers = self.layers(params)
        for i, (W, b) in enumerate(layers):
            z = acts[i]
            xp.matmul(a, W, out=z)
            if i < len(layers) - 1:
                self.ops.bias_relu_(z, b)
            else:
                z += b
            a = z
        return acts

    def _log_softmax_(self, logits):
        """In place: logits -> log-probabilities."""
        xp = self.xp
        logits -= logits.max(axis=1, keepdims=True)
        logits -= xp.log(xp.exp(logits).sum(axis=1, keepdims=True))
        return logits

    def _l2_term(self, params) -> float:
        if not self.l2:
            return 0.0
        return 0.5 * self.l2 * sum(float((W * W).sum()) for W, _ in self.layers(params))

    def loss_and_grad(self, params, x, y, grad) -> float:
        """Mean softmax cross-entropy (+ L2 on weights) of the batch; writes d loss/d params into `grad`.
        Overflow yields inf/nan quietly: the caller checks the result (worker.Divergence)."""
        with np.errstate(over="ignore", invalid="ignore"):
            return self._loss_and_grad(params, x, y, grad)

    def _loss_and_grad(self, params, x, y, grad) -> float:
        return self.mean_loss(float(self.log_likelihood_and_grad(params, x, y, grad)), x.shape[0], params)

    def mean_loss(self, log_likelihood: float, n: int, params) -> float:
        """The loss loss_and_grad reports, from the batch's summed log-likelihood (read on the host) over n rows."""
        return -log_likelihood / n + self._l2_term(params)

    def log_likelihood_and_grad(self, params, x, y, grad):
        """The batch's summed log-likelihood, left where it was computed (a CuPy 0-d array on a GPU:
        reading it is a host round trip, which benchmarks/gpu_profile.py prices); the gradient of
        the mean loss into `grad`, as loss_and_grad."""
        xp = self.xp
        n = x.shape[0]
        acts = self._forward(params, x)
        logp = self._log_softmax_(acts[-1])
        rows = xp.arange(n)
        total = logp[rows, y].sum()
        # d loss / d logits = softmax - onehot, over n; computed in place of logp.
        d = logp
        xp.exp(d, out=d)
        d[rows, y] -= 1.0
        d *= 1.0 / n
        layers = self.layers(params)
        glayers = self.layers(grad)
        for i in range(len(layers) - 1, -1, -1):
            W, _ = layers[i]
            gW, gb = glayers[i]
            a_prev = acts[i - 1] if i > 0 else x
            xp.matmul(a_prev.T, d, out=gW)
            self.ops.column_sums(d, gb)
            if self.l2:
                gW += self.l2 * W
            if i > 0:
                d_prev = xp.matmul(d, W.T)
                self.ops.relu_grad_(d_prev, a_prev)
                d = d_prev
        return total

    def evaluate(self, params, x, y, chunk: int = 4096) -> tuple[float, float, np.ndarray]:
        """(mean loss, accuracy, predictions as host int array) over a whole set, in chunks."""
        with np.errstate(over="ignore", invalid="ignore"):  # a diverged model evaluates to nan/inf quietly
            return self._evaluate(params, x, y, chunk)

    def _evaluate(self, params, x, y, chunk: int) -> tuple[float, float, np.ndarray]:
        xp = self.xp
        total_loss = 0.0
        preds = []
        for start in range(0, x.shape[0], chunk):
            xb, yb = x[start : start + chunk], y[start : start + chunk]
            logits = self._forward_fresh(params, xb)
            logp = self._log_softmax_(logits)
            total_loss -= float(logp[xp.arange(xb.shape[0]), yb].sum())
            preds.append(logp.argmax(axis=1))
        pred = xp.concatenate(preds)
        acc = float((pred == y).mean())
        pred_host = pred.get() if hasattr(pred, "get") else pred
        return total_loss / x.shape[0] + self._l2_term(params), acc, np.asarray(pred_host)

    def _forward_fresh(self, params, x):
        """Forward pass with its own buffers (evaluation must not clobber training scratch)."""
        xp = self.xp
        a = x
        layers = self.layers(params)
        for i, (W, b) in enumerate(layers):
            a = a @ W + b
            if i < len(layers) - 1:
                a = xp.maximum(a, 0)
        return a


class PlainOps:
    """The MLP's element-wise steps as array expressions (NumPy: what the tests' digests were taken with)."""

    def __init__(self, xp):
        self.xp = xp

    def bias_relu_(self, z, b) -> None:
        z += b
        self.xp.maximum(z, 0, out=z)

    def column_sums(self, d, out) -> None:
        d.sum(axis=0, out=out)

    def relu_grad_(self, d, a) -> None:
        d *= a > 0


class FusedOps(PlainOps):
    """The same on CuPy in fewer passes over the activations: bias and ReLU in one kernel, ReLU's
    gradient without a boolean temporary, the bias gradient as a GEMV (cuBLAS) instead of a
    reduction down the columns. Why: the GPU step at batch 4096 spent ~1.5 ms a step outside its GEMMs,
    which alone take what PyTorch's take (benchmarks/GPU.md)."""

    def __init__(self, xp):
        super().__init__(xp)
        # NaN stays NaN, as with NumPy's maximum and `d *= a > 0` (the finite check must still see it)
        self._bias_relu = xp.ElementwiseKernel("T b", "T z", "T v = z + b; z = (v > (T)0 || v != v) ? v : (T)0",
                                               "mpitrain_bias_relu")
        self._relu_grad = xp.ElementwiseKernel("T a", "T d", "d = (a > (T)0) ? d : d * (T)0", "mpitrain_relu_grad")
        self._ones: dict[int, object] = {}

    def bias_relu_(self, z, b) -> None:
        self._bias_relu(b, z)

    def column_sums(self, d, out) -> None:
        rows = d.shape[0]
        ones = self._ones.get(rows)
        if ones is None:
            ones = self._ones[rows] = self.xp.ones(rows, d.dtype)
        self.xp.matmul(ones, d, out=out)

    def relu_grad_(self, d, a) -> None:
        self._relu_grad(a, d)


# --model NAME -> the hidden widths it uses, given --hidden. Both are this file's MLP (softmax
# regression is the MLP without hidden layers). Adding a model: a class with Model's methods and
# a line here, and `build`/`from_sizes` return it (docs/architecture.md).
HIDDEN: dict[str, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    "softmax": lambda hidden: (),
    "mlp": lambda hidden: tuple(hidden),
}


def build(name: str, n_features: int, hidden: tuple[int, ...], n_classes: int, l2: float = 0.0, xp=np) -> Model:
    """The model --model NAME --hidden ... describes, for data of this shape."""
    return MLP((n_features, *HIDDEN[name](hidden), n_classes), l2, xp)


def from_sizes(sizes, l2: float = 0.0, xp=np) -> Model:
    """The model a checkpoint's fingerprint (its `layer_sizes`) describes."""
    return MLP(tuple(sizes), l2, xp)


def builtin_spec(sizes) -> dict:
    """The spec of this file's MLP of these layer sizes (softmax regression: no hidden layer)."""
    return {"kind": "softmax" if len(sizes) == 2 else "mlp", "sizes": list(sizes)}


def is_builtin(spec: dict) -> bool:
    """Whether a checkpoint's model spec is one mpitrain builds itself (--model), or a user's."""
    return spec.get("kind") in HIDDEN


def model_name(model) -> str:
    """--model's value, or the kind a user's model object calls itself (summaries, logs)."""
    return model if isinstance(model, str) else str(model.spec.get("kind", type(model).__name__))
