"""Never lose a step: fault injection in real training loops, and property tests of the
loss-scale state machine and of loss_scale()'s skip semantics against plain references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_bit_identical
from hypothesis import given, settings
from hypothesis import strategies as st

import mpjax

LEVELS = ["O0", "O1", "O2", "O3"]
HALVES = ["float16", "bfloat16"]
STEPS = 300


def regression_data(key, n=256, d=16):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, d))
    w_true = jax.random.normal(kw, (d, 1)) / np.sqrt(d)
    return x, jnp.tanh(x @ w_true) + 0.5 * x[:, :1] ** 2


def init(key, sizes=(16, 32, 32, 1)):
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append(
            {"w": jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros(n_out)}
        )
    return params


def mlp(params, x):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one-leaf", "every-leaf"])
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_fault_injection_in_a_real_training_loop(level, half, mode, rng):
    policy = mpjax.Policy.from_level(level, half)
    min_scale, max_scale = 1.0, 2.0**20
    scale = mpjax.DynamicLossScale(
        2.0**12, period=25, min_loss_scale=min_scale, max_loss_scale=max_scale
    )
    tx = mpjax.loss_scale(optax.sgd(0.05, momentum=0.9), scale=scale)
    model = mpjax.autocast(mlp, policy)
    x, y = regression_data(jax.random.key(0))
    params = policy.cast_to_param(init(jax.random.key(1)))
    state = tx.init(params)
    n_leaves = len(jax.tree_util.tree_leaves(params))

    @jax.jit
    def loss_of(params):
        return jnp.mean((model(params, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(params, state, inject):
        ls = mpjax.get_loss_scale(state)
        grads = jax.grad(lambda p: ls.scale(loss_of(p)))(params)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves = [g * inject[i].astype(g.dtype) for i, g in enumerate(leaves)]
        updates, state = tx.update(jax.tree_util.tree_unflatten(treedef, leaves), state, params)
        return optax.apply_updates(params, updates), state

    first = float(loss_of(params))
    faults = set(rng.choice(np.arange(STEPS), size=STEPS // 10, replace=False).tolist())
    skipped = 0
    for i in range(STEPS):
        inject = np.ones(n_leaves, np.float32)
        if i in faults:
            bad = rng.choice([np.inf, -np.inf, np.nan])
            if mode == "one-leaf":
                inject[rng.integers(n_leaves)] = bad
            else:
                inject[:] = bad
        before_params, before_state = params, state
        params, state = step(params, state, jnp.asarray(inject))
        metrics = mpjax.loss_scale_metrics(state)
        value = float(metrics["loss_scale"])
        assert np.isfinite(value) and min_scale <= value <= max_scale
        assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(params)), i
        if not bool(metrics["last_step_finite"]):
            skipped += 1
            assert_trees_bit_identical(params, before_params)
            assert_trees_bit_identical(state.inner_state, before_state.inner_state)
        else:
            assert i not in faults
    assert skipped >= len(faults)  # every fault skipped (plus genuine overflows, if any)
    assert int(metrics["skipped_steps"]) == skipped
    last = float(loss_of(params))
    assert last < 0.5 * first, (first, last)


def test_a_long_overflow_run_backs_off_to_the_minimum_and_recovers():
    scale = mpjax.DynamicLossScale(2.0**10, period=2, min_loss_scale=4.0)
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=scale)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(20):
        _, state = update({"w": jnp.full(3, jnp.nan)}, state, params)
    metrics = mpjax.loss_scale_metrics(state)
    assert float(metrics["loss_scale"]) == 4.0 and int(metrics["consecutive_skips"]) == 20
    for _ in range(4):
        _, state = update({"w": jnp.ones(3)}, state, params)
    assert float(mpjax.loss_scale_metrics(state)["loss_scale"]) == 16.0


# -- property tests ----------------------------------------------------------------------------


def reference(scale, steps, period, growth, backoff, hysteresis, min_scale, max_scale):
    """The documented rule, plainly: Paddle's counters, torch's factors, apex's cap."""
    scale, good, bad, out = np.float32(scale), 0, 0, []
    for finite in steps:
        if finite:
            bad, good = 0, good + 1
            if good == period:
                grown = np.float32(scale * np.float32(growth))
                scale = np.float32(min(grown, max_scale)) if np.isfinite(grown) else scale
                good = 0
        else:
            good, bad = 0, bad + 1
            if bad >= hysteresis:
                scale = np.float32(
                    max(np.float32(min_scale), np.float32(scale * np.float32(backoff)))
                )
                bad = 0
        out.append((float(scale), good, bad))
    return out


@jax.jit
def trajectory(ls, finite):
    def body(ls, f):
        ls = ls.adjust(f)
        return ls, (ls.loss_scale, ls.counter)

    return jax.lax.scan(body, ls, finite)[1]


@pytest.mark.slow  # 150 scanned state-machine runs: about 40 s on 2 cores
@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.booleans(), min_size=70, max_size=150),
    period=st.integers(1, 8),
    growth=st.sampled_from([2.0, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.25, 0.75]),
    hysteresis=st.integers(1, 4),
    min_exp=st.integers(-3, 3),
    span=st.integers(2, 20),
    start=st.integers(0, 20),
)
def test_property_dynamic_loss_scale_matches_reference(
    steps, period, growth, backoff, hysteresis, min_exp, span, start
):
    # >= 150 examples x >= 70 steps: over 10,000 steps in all, jitted with lax.scan.
    min_scale, max_scale = 2.0**min_exp, 2.0 ** (min_exp + span)
    init = 2.0 ** (min_exp + min(start, span))
    ls = mpjax.DynamicLossScale(
        init, period=period, growth_factor=growth, backoff_factor=backoff,
        hysteresis=hysteresis, min_loss_scale=min_scale, max_loss_scale=max_scale,
    )  # fmt: skip
    scales, counters = trajectory(ls, jnp.asarray(steps))
    ref = reference(init, steps, period, growth, backoff, hysteresis, min_scale, max_scale)
    assert [float(s) for s in scales] == [s for s, _, _ in ref]
    assert [int(c) for c in counters] == [c for _, c, _ in ref]
    assert bool(jnp.all((scales >= min_scale) & (scales <= max_scale)))


@pytest.mark.slow  # 40 compiled train-step runs: about 25 s on 2 cores
@settings(max_examples=40, deadline=None)
@given(
    pattern=st.lists(st.sampled_from(["ok", "inf", "nan", "-inf"]), min_size=1, max_size=25),
    wrap=st.booleans(),
)
def test_property_loss_scale_skips_exactly_the_non_finite_steps(pattern, wrap):
    if wrap:
        tx = mpjax.loss_scale(optax.adam(0.1), scale=mpjax.DynamicLossScale(8.0, period=3))
    else:
        tx = optax.chain(
            mpjax.loss_scale(scale=mpjax.DynamicLossScale(8.0, period=3)), optax.sgd(0.1)
        )
    params = {"a": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    run, skipped = 0, 0
    for kind in pattern:
        value = {"ok": 1.0, "inf": np.inf, "nan": np.nan, "-inf": -np.inf}[kind]
        grads = {"a": jnp.array([0.3, value]), "b": jnp.array(0.7)}
        updates, new_state = update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        ls_state = new_state if wrap else new_state[0]
        if kind == "ok":
            run = 0
            assert bool(ls_state.last_finite)
            assert not bool(jnp.all(new_params["a"] == params["a"]))
        else:
            run, skipped = run + 1, skipped + 1
            assert not bool(ls_state.last_finite)
            assert_trees_bit_identical(new_params, params)
            if wrap:
                assert_trees_bit_identical(new_state.inner_state, state.inner_state)
        assert int(ls_state.skipped_steps) == skipped
        assert int(ls_state.consecutive_skips) == run
        params, state = new_params, new_state
