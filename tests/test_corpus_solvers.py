"""Held-out corpus: differential-equation, root-finding and linear-solve programs built on
equinox's custom-rule helpers (diffrax, optimistix, lineax), differentiated through autocast.

These libraries build their adjoints with ``equinox.filter_custom_jvp``/``filter_custom_vjp``,
which pass symbolic zeros and non-differentiable leaves through ``custom_jvp``/``custom_vjp``
rules. Each program is trained under ``eqx.filter_value_and_grad`` at O1/O2 in both halves and
checked against the same program in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")
diffrax = pytest.importorskip("diffrax")
optx = pytest.importorskip("optimistix")
lx = pytest.importorskip("lineax")

from conftest import slow_except  # noqa: E402

import mpjax  # noqa: E402

# Relative tolerance on the loss and gradients against float32, per half dtype.
RTOL = {"float16": 2e-2, "bfloat16": 8e-2}
# The README's test command runs the quick cells (diffrax's compile alone takes 10 s, and
# tests/test_autocast.py checks its class, symbolic zeros through custom rules, by itself);
# `pytest -m slow` runs all of them.
FAST = {("O1", "bfloat16", n) for n in ("optimistix-newton", "lineax-cholesky")}


class Field(eqx.Module):
    """dy/dt = mlp(y): an equinox MLP with a function-valued (static) leaf."""

    mlp: eqx.nn.MLP

    def __call__(self, t, y, args):
        return self.mlp(y)


def ode_loss(field, y0, adjoint):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
        adjoint=adjoint,
        max_steps=64,
    )
    return jnp.mean((sol.ys[-1] - 0.25) ** 2)


class Fixed(eqx.Module):
    """A deep-equilibrium layer: y = tanh(W y + U x), found by a Newton root find.

    Its residual runs in half (W y is a matmul), so the tolerance is one half can meet: a
    bfloat16 residual has a resolution near 4e-3, and Newton to 1e-5 would run out of steps
    (equinox raises). For a tighter tolerance, keep the solve in float32 (`tight` below)."""

    w: jax.Array
    u: jax.Array
    tol: float = eqx.field(static=True, default=1e-2)
    tight: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        fn = lambda y, x: y - jnp.tanh(self.w @ y + self.u @ x)
        solver = optx.Newton(rtol=self.tol, atol=self.tol)
        y0 = jnp.zeros(self.w.shape[0])
        if self.tight:
            with mpjax.full_precision():
                return optx.root_find(fn, solver, y0, x).value
        return optx.root_find(fn, solver, y0, x).value


def root_loss(model, x):
    return jnp.mean((jax.vmap(model)(x) - 0.1) ** 2)


class Ridge(eqx.Module):
    """A linear solve in the forward pass: (A^T A + I) z = A^T b, by lineax (Cholesky)."""

    a: jax.Array

    def __call__(self, b):
        gram = self.a.T @ self.a + jnp.eye(self.a.shape[1])
        op = lx.MatrixLinearOperator(gram, lx.positive_semidefinite_tag)
        return lx.linear_solve(op, self.a.T @ b, lx.Cholesky()).value


def solve_loss(model, b):
    return jnp.mean(jax.vmap(model)(b) ** 2)


def programs():
    key = jax.random.key(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    field = Field(eqx.nn.MLP(4, 4, 32, 2, activation=jnp.tanh, key=k1))
    fixed = Fixed(0.3 * jax.random.normal(k2, (16, 16)) / 4, jax.random.normal(k3, (16, 8)) / 3)
    ridge = Ridge(jax.random.normal(k4, (32, 16)) / 5)
    y0 = jnp.linspace(-1.0, 1.0, 4)
    x = jax.random.normal(k2, (6, 8))
    b = jax.random.normal(k3, (6, 32))
    return {
        "diffrax-pid": (ode_loss, field, (y0, diffrax.RecursiveCheckpointAdjoint())),
        "diffrax-backsolve": (ode_loss, field, (y0, diffrax.BacksolveAdjoint())),
        "optimistix-newton": (root_loss, fixed, (x,)),
        "optimistix-newton-tight": (root_loss, Fixed(fixed.w, fixed.u, 1e-5, True), (x,)),
        "lineax-cholesky": (solve_loss, ridge, (b,)),
    }


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


NAMES = ["diffrax-pid", "diffrax-backsolve", "optimistix-newton", "optimistix-newton-tight",
         "lineax-cholesky"]  # fmt: skip


@pytest.mark.parametrize(
    "level, half, name",
    slow_except(
        FAST, [(lv, h, n) for lv in ("O1", "O2") for h in ("float16", "bfloat16") for n in NAMES]
    ),
)
def test_trains_under_grad_close_to_float32(level, half, name):
    if name.startswith("optimistix") and jax.__version_info__ < (0, 6, 2):
        # Without mpjax, jax.grad of jaxpr_as_fun(make_jaxpr(loss)) raises on JAX 0.6.0 (with
        # lineax 0.0.8, the newest it takes) on an internal Zero from the vmapped implicit jvp,
        # and autocast re-evaluates jaxprs. JAX 0.6.2 (lineax 0.1.0) and later can.
        pytest.skip("JAX < 0.6.2 cannot differentiate a vmapped optimistix root find's jaxpr")
    loss, model, args = programs()[name]
    policy = mpjax.Policy.from_level(level, half)
    grad_f32 = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    grad_mp = eqx.filter_jit(eqx.filter_value_and_grad(mpjax.autocast(loss, policy)))
    ref_model = mp_model = model
    for _ in range(3):  # a few SGD steps: both runs stay close along the way
        (l_ref, g_ref), (l_mp, g_mp) = grad_f32(ref_model, *args), grad_mp(mp_model, *args)
        assert np.isfinite(float(l_mp)), name
        assert rel(l_mp, l_ref) < RTOL[half], (name, float(l_mp), float(l_ref))
        leaves_mp, leaves_ref = jax.tree_util.tree_leaves(g_mp), jax.tree_util.tree_leaves(g_ref)
        assert [a.dtype for a in leaves_mp] == [b.dtype for b in leaves_ref]  # float32 grads
        flat = lambda leaves: np.concatenate([np.ravel(x) for x in leaves])
        assert rel(flat(leaves_mp), flat(leaves_ref)) < RTOL[half], name
        sgd = lambda m, g: eqx.apply_updates(m, jax.tree_util.tree_map(lambda t: -0.1 * t, g))
        ref_model, mp_model = sgd(ref_model, g_ref), sgd(mp_model, g_mp)
    assert float(l_mp) < float(grad_mp(model, *args)[0])  # it trained
