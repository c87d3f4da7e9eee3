"""One name per job: the old names work for one release and warn with the new name."""

import re
import warnings

import jax.numpy as jnp
import optax
import pytest

import mpjax
import mpjax.flax
import mpjax.fp8


def _warns_with(new):
    return pytest.warns(FutureWarning, match=re.escape(new))


def test_value_and_grad_is_scaled_value_and_grad():
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=mpjax.StaticLossScale(8.0))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    loss = lambda p, x: jnp.sum(p["w"] * x)
    with _warns_with("mpjax.scaled_value_and_grad"):
        old = mpjax.value_and_grad(loss)(state, params, jnp.full(2, 3.0))
    new = mpjax.scaled_value_and_grad(loss)(state, params, jnp.full(2, 3.0))
    assert float(old[0]) == float(new[0]) == 6.0
    assert old[1]["w"].tolist() == new[1]["w"].tolist() == [24.0, 24.0]
    assert "value_and_grad" not in mpjax.__all__ and "scaled_value_and_grad" in mpjax.__all__


def test_nnx_value_and_grad_is_scaled_value_and_grad_with_the_optimizer_first():
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=mpjax.StaticLossScale(4.0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loss = lambda m: jnp.sum(m(jnp.ones((3, 2))))
    with _warns_with("mpjax.scaled_value_and_grad(fun)(optimizer, model, ...)"):
        old_value, old = mpjax.flax.value_and_grad(loss, optimizer)(model)
    new_value, new = mpjax.scaled_value_and_grad(loss)(optimizer, model)
    assert float(old_value) == float(new_value)
    assert old["kernel"][...].tolist() == new["kernel"][...].tolist()
    assert "value_and_grad" not in mpjax.flax.__all__


def test_fp8_value_and_grad_is_fp8_scaled_value_and_grad():
    loss = lambda w, x: jnp.mean((x @ w) ** 2)
    pol = mpjax.fp8.policy("O1")
    w, x = jnp.full((32, 16), 0.5), jnp.ones((16, 32))
    state = mpjax.fp8.init(loss, pol, w, x)
    with _warns_with("mpjax.fp8.scaled_value_and_grad"):
        old = mpjax.fp8.value_and_grad(loss, pol)(state, w, x)
    new = mpjax.fp8.scaled_value_and_grad(loss, pol)(state, w, x)
    assert float(old[0]) == float(new[0]) and old[1].tolist() == new[1].tolist()
    assert "value_and_grad" not in mpjax.fp8.__all__


def test_from_level_loss_scale_keyword_is_loss_scaling():
    with _warns_with("loss_scaling="):
        old = mpjax.Policy.from_level("O2", "float16", loss_scale=1024.0)
    assert old == mpjax.Policy.from_level("O2", "float16", loss_scaling=1024.0)
    assert old.loss_scaling == 1024.0
    with pytest.raises(TypeError, match="both loss_scaling= and loss_scale="):
        mpjax.Policy.from_level("O2", "float16", loss_scaling=8.0, loss_scale=8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        mpjax.Policy.from_level("O2", "float16", loss_scaling="dynamic")


def test_public_names_are_sorted():
    for module in (mpjax, mpjax.flax, mpjax.fp8):
        names = list(module.__all__)
        assert names == sorted(names, key=lambda n: (n.lower(), n)), module.__name__


def test_fp8_max_is_jnp_finfo():
    with _warns_with("float(jnp.finfo(dtype).max)"):
        assert mpjax.fp8.fp8_max(jnp.float8_e4m3fn) == float(jnp.finfo(jnp.float8_e4m3fn).max)
    assert "fp8_max" not in mpjax.fp8.__all__
