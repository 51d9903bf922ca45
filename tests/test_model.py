"""Model gradients against finite differences; optimizer updates against their formulas."""

import numpy as np
import pytest

from mpitrain.core.model import MLP
from mpitrain.core.optim import Optimizer, decayed_lr


def _numeric_grad(model, params, x, y, idx, eps=1e-3):
    out = []
    for i in idx:
        p = params.astype(np.float64).copy()
        plus, minus = params.copy(), params.copy()
        plus[i] = p[i] + eps
        minus[i] = p[i] - eps
        g = np.empty_like(params)
        lp = model.loss_and_grad(plus, x, y, g)
        lm = model.loss_and_grad(minus, x, y, g)
        out.append((lp - lm) / (2 * eps))
    return np.array(out)


@pytest.mark.parametrize("sizes,l2", [((12, 5), 0.0), ((12, 7, 5), 0.01), ((12, 8, 6, 5), 0.05)])
def test_gradient_matches_finite_differences(sizes, l2):
    rng = np.random.default_rng(3)
    model = MLP(sizes, l2=l2)
    params = model.init_params(seed=1)
    params += rng.normal(0, 0.1, params.shape).astype(np.float32)  # softmax starts at zero: move off it
    x = rng.random((9, sizes[0]), dtype=np.float32)
    y = rng.integers(0, sizes[-1], 9)
    grad = np.empty_like(params)
    model.loss_and_grad(params, x, y, grad)
    idx = rng.choice(model.n_params, size=60, replace=False)
    # every layer's weights and biases get checked, not only the first slots
    for w, _, b in model.slices:
        idx = np.concatenate([idx, [w.start, w.stop - 1, b.start, b.stop - 1]])
    numeric = _numeric_grad(model, params, x, y, idx)
    np.testing.assert_allclose(grad[idx], numeric, rtol=2e-2, atol=2e-4)


def test_layout_is_one_flat_buffer_with_views():
    model = MLP((4, 3, 2))
    assert model.n_params == 4 * 3 + 3 + 3 * 2 + 2
    flat = np.zeros(model.n_params, np.float32)
    (W0, b0), (W1, b1) = model.layers(flat)
    W1[...] = 7
    assert np.shares_memory(W1, flat) and flat[4 * 3 + 3 : 4 * 3 + 3 + 6].tolist() == [7] * 6
    assert W0.shape == (4, 3) and b1.shape == (2,)


def test_softmax_starts_at_zero_and_mlp_does_not():
    assert not MLP((6, 3)).init_params(0).any()
    p = MLP((6, 5, 3)).init_params(0)
    assert p.dtype == np.float32 and p.std() > 0
    np.testing.assert_array_equal(p, MLP((6, 5, 3)).init_params(0))  # seeded


def test_evaluate_reports_accuracy_and_loss():
    model = MLP((2, 2))
    params = np.array([5, -5, -5, 5, 0, 0], np.float32)  # class = argmax of the features
    x = np.array([[1, 0], [0, 1], [1, 0]], np.float32)
    loss, acc, pred = model.evaluate(params, x, np.array([0, 1, 1]))
    assert acc == pytest.approx(2 / 3)
    assert pred.tolist() == [0, 1, 0]
    assert loss > 0


def _run(kind, steps, lr=0.1, **kw):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=5).astype(np.float32) for _ in range(steps)]
    p = np.ones(5, np.float32)
    opt = Optimizer(kind, 5, **kw)
    for g in grads:
        opt.step(p, g, lr)
    return p, grads


@pytest.mark.parametrize("blas", [False, True])
def test_sgd_update(blas):
    p, grads = _run("sgd", 3, blas=blas)
    np.testing.assert_allclose(p, 1 - 0.1 * sum(grads), rtol=1e-6)


@pytest.mark.parametrize("blas", [False, True])
def test_momentum_update(blas):
    p, grads = _run("momentum", 3, momentum=0.5, blas=blas)
    v, ref = np.zeros(5), np.ones(5)
    for g in grads:
        v = 0.5 * v + g
        ref -= 0.1 * v
    np.testing.assert_allclose(p, ref, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sgd", "momentum"])
def test_a_blas_step_updates_a_view_of_a_larger_array_in_place(kind):
    """The shm store hands its optimizer views of one shared segment: the one-pass BLAS update must
    land in them, contiguous (a shard) or not (f2py then works on a copy, which is written back)."""
    rng = np.random.default_rng(1)
    g = rng.normal(size=4).astype(np.float32)
    for view in (slice(2, 6), slice(0, 8, 2)):
        segment, ref = np.ones(10, np.float32), np.ones(4, np.float32)
        Optimizer(kind, 4, blas=True).step(segment[view], g, 0.5)
        Optimizer(kind, 4).step(ref, g, 0.5)
        np.testing.assert_allclose(segment[view], ref, rtol=1e-6)
        untouched = np.ones(10, bool)
        untouched[view] = False
        assert (segment[untouched] == 1).all()


def test_adam_update():
    p, grads = _run("adam", 4, lr=0.01)
    m = v = np.zeros(5)
    ref = np.ones(5)
    for t, g in enumerate(grads, 1):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        ref -= 0.01 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    np.testing.assert_allclose(p, ref, rtol=1e-4)


def test_exponential_decay_per_epoch_of_global_data():
    assert decayed_lr(0.5, 0.99, 0, 1000) == 0.5
    assert decayed_lr(0.5, 0.99, 1000, 1000) == pytest.approx(0.5 * 0.99)
    assert decayed_lr(0.5, 0.99, 2500, 1000) == pytest.approx(0.5 * 0.99**2.5)


def test_the_model_registry_builds_what_the_flags_and_the_fingerprint_describe():
    from mpitrain.core.model import HIDDEN, build, from_sizes

    assert set(HIDDEN) == {"softmax", "mlp"}
    assert build("softmax", 64, (32,), 10).sizes == (64, 10)  # --hidden is ignored by softmax
    mlp = build("mlp", 64, (32, 16), 10)
    assert mlp.sizes == (64, 32, 16, 10) and from_sizes(list(mlp.sizes)).n_params == mlp.n_params
