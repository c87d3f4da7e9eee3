"""Tests of loss scaling as an optax transformation: skipping, unscaling, both forms, metrics."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_bit_identical

import mpjax

LEVELS = ["O0", "O1", "O2", "O3"]
HALVES = ["float16", "bfloat16"]


def init_mlp(key, sizes=(8, 16, 4), dtype=jnp.float32):
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": (jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in)).astype(dtype),
            "b": jnp.zeros((n_out,), dtype),
        }
    return params


def mlp(params, x, policy):
    """An MLP run under a policy: compute in compute_dtype, the loss side in float32."""
    params, x = policy.cast_to_compute((params, x))
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return policy.cast_to_output(x)


def mse(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def data(key, n=32):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, 8)), jax.random.normal(ky, (n, 4))


def make_step(tx, policy):
    @jax.jit
    def train_step(params, opt_state, x, y, inject):
        scale = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            return scale.scale(mse(mlp(p, x, policy), y))

        grads = jax.grad(loss_fn)(params)
        # Fault injection: multiply one leaf by inject (1.0, inf or nan).
        grads["layer0"]["w"] = grads["layer0"]["w"] * inject.astype(grads["layer0"]["w"].dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step


def test_design_card_train_step_trains():
    policy = mpjax.Policy.from_level("O1")
    tx = optax.chain(mpjax.loss_scale(), optax.sgd(0.05))
    params = policy.cast_to_param(init_mlp(jax.random.key(0)))
    opt_state = tx.init(params)
    x, y = data(jax.random.key(1))
    step = make_step(tx, policy)
    first = float(mse(mlp(params, x, policy), y))
    for _ in range(100):
        params, opt_state = step(params, opt_state, x, y, jnp.float32(1.0))
    last = float(mse(mlp(params, x, policy), y))
    assert last < 0.8 * first
    metrics = mpjax.loss_scale_metrics(opt_state)
    assert int(metrics["skipped_steps"]) == 0 and bool(metrics["last_step_finite"])


@pytest.mark.parametrize("form", ["chain", "wrap"])
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_injected_overflow_skips_exactly_those_steps(level, half, form):
    policy = mpjax.Policy.from_level(level, half)
    scale = mpjax.DynamicLossScale(2.0**10, period=3)
    if form == "chain":
        tx = optax.chain(mpjax.loss_scale(scale=scale), optax.sgd(0.05))
    else:
        # Stateful, so the inner state's bit-identity is checked. (Not adam: at O3 its eps
        # underflows in float16 and its updates become inf from finite gradients.)
        tx = mpjax.loss_scale(optax.sgd(0.05, momentum=0.9), scale=scale)
    params = policy.cast_to_param(init_mlp(jax.random.key(0)))
    opt_state = tx.init(params)
    x, y = data(jax.random.key(1))
    step = make_step(tx, policy)
    bad_steps = {2: np.inf, 3: np.nan, 9: -np.inf, 15: np.inf}
    expected_scale, counter = 2.0**10, 0
    for i in range(20):
        before, state_before = params, opt_state
        params, opt_state = step(params, opt_state, x, y, jnp.float32(bad_steps.get(i, 1.0)))
        assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(params))
        metrics = mpjax.loss_scale_metrics(opt_state)
        if i in bad_steps:
            assert_trees_bit_identical(params, before)
            if form == "wrap":
                assert_trees_bit_identical(opt_state.inner_state, state_before.inner_state)
            expected_scale, counter = max(1.0, expected_scale / 2), 0
            assert not bool(metrics["last_step_finite"])
        else:
            assert bool(metrics["last_step_finite"])
            changed = jax.tree_util.tree_map(lambda a, b: bool(jnp.any(a != b)), params, before)
            assert any(jax.tree_util.tree_leaves(changed)), f"step {i} did not update"
            counter += 1
            if counter == 3:
                expected_scale, counter = expected_scale * 2, 0
        assert float(metrics["loss_scale"]) == expected_scale, f"step {i}"
    assert int(metrics["skipped_steps"]) == len(bad_steps)
    assert int(metrics["consecutive_skips"]) == 0


def test_consecutive_skips_and_metrics_under_jit():
    tx = optax.chain(mpjax.loss_scale(), optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    bad = {"w": jnp.array([1.0, jnp.nan, 1.0])}
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update(bad, state, params)
    metrics = jax.jit(mpjax.loss_scale_metrics)(state)
    assert int(metrics["consecutive_skips"]) == 3 and int(metrics["skipped_steps"]) == 3
    assert float(metrics["loss_scale"]) == 2.0**12
    _, state = update({"w": jnp.ones(3)}, state, params)
    metrics = mpjax.loss_scale_metrics(state)
    assert int(metrics["consecutive_skips"]) == 0 and int(metrics["skipped_steps"]) == 3
    assert {k: v.dtype for k, v in metrics.items()} == {
        "loss_scale": np.float32,
        "skipped_steps": np.int32,
        "consecutive_skips": np.int32,
        "last_step_finite": np.bool_,
    }


def test_skipped_updates_are_negative_zero_so_params_keep_their_sign_bits():
    params = {"w": jnp.array([-0.0, 0.0, 1.0, -2.5])}
    grads = {"w": jnp.array([jnp.inf, 1.0, 1.0, 1.0])}
    # Wrap form, and the chain form with nothing after it: p + (-0.0) is p for every p.
    # (A transform after the chain form that negates, like sgd, turns -0.0 into +0.0, and
    # -0.0 + 0.0 is +0.0: there only params equal to -0.0 lose their sign bit.)
    for tx in (mpjax.loss_scale(optax.sgd(0.1)), mpjax.loss_scale()):
        updates, _ = tx.update(grads, tx.init(params), params)
        assert_trees_bit_identical(optax.apply_updates(params, updates), params)


@pytest.mark.parametrize("period", [1, 2])
def test_updates_equal_the_true_gradients_with_the_scale_that_made_them(rng, period):
    # With period=1 the scale doubles at every step: unscaling with the adjusted scale would
    # halve every update.
    w = jnp.asarray(rng.normal(size=5), jnp.float32)
    target = jnp.asarray(rng.normal(size=5), jnp.float32)

    def loss(p):
        return jnp.sum((p["w"] - target) ** 2)

    tx = optax.chain(mpjax.loss_scale(scale=mpjax.DynamicLossScale(2.0**4, period=period)))
    params = {"w": w}
    state = tx.init(params)
    for _ in range(4):
        scale = mpjax.get_loss_scale(state)
        grads = jax.grad(lambda p: scale.scale(loss(p)))(params)
        updates, state = tx.update(grads, state, params)
        true = jax.grad(loss)(params)
        np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(true["w"]), rtol=1e-6)


def test_clipping_after_it_sees_unscaled_gradients(rng):
    params = {"a": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.float32(0.7)}
    true_grads = {"a": jnp.asarray(rng.normal(size=(4, 3)) * 3, jnp.float32), "b": jnp.float32(2)}
    scale = mpjax.StaticLossScale(2.0**12)
    tx = optax.chain(mpjax.loss_scale(scale=scale), optax.clip_by_global_norm(1.0))
    updates, _ = tx.update(scale.scale(true_grads), tx.init(params), params)
    ref, _ = optax.clip_by_global_norm(1.0).update(true_grads, optax.EmptyState())
    for k in params:
        np.testing.assert_allclose(np.asarray(updates[k]), np.asarray(ref[k]), rtol=1e-6)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-6)


def test_wrap_form_keeps_adam_state_bit_identical_while_chain_form_advances_it():
    params = {"w": jnp.ones(3), "b": jnp.full((2,), 0.5)}
    grads = {"w": jnp.array([0.1, 0.2, 0.3]), "b": jnp.array([0.4, -0.5])}
    bad = {"w": jnp.array([0.1, jnp.inf, 0.3]), "b": jnp.array([0.4, -0.5])}
    wrap = mpjax.loss_scale(optax.adam(1e-2), scale=mpjax.NoOpLossScale())
    chain = optax.chain(mpjax.loss_scale(scale=mpjax.NoOpLossScale()), optax.adam(1e-2))
    for tx in (wrap, chain):
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # one good step: adam has momentum now
        updates, new_state = tx.update(bad, state, params)
        if tx is wrap:
            assert_trees_bit_identical(new_state.inner_state, state.inner_state)
            assert_trees_bit_identical(optax.apply_updates(params, updates), params)
        else:
            # Documented: a stateful transform after the chain form sees zero gradients and
            # still advances (adam's count and moments), so params may move.
            assert int(new_state[1][0].count) == int(state[1][0].count) + 1
            assert bool(jnp.any(updates["w"] != 0))


def test_state_structure_and_dtypes_are_stable_and_a_changing_scale_never_retraces():
    policy = mpjax.Policy.from_level("O2", "float16")
    tx = mpjax.loss_scale(optax.adamw(1e-3), scale=mpjax.DynamicLossScale(2.0**4, period=1))
    params = policy.cast_to_param(init_mlp(jax.random.key(0)))
    opt_state = tx.init(params)
    x, y = data(jax.random.key(1))
    traces = []

    @jax.jit
    def step(params, opt_state, inject):
        traces.append(1)
        return make_step(tx, policy).__wrapped__(params, opt_state, x, y, inject)

    def signature(tree):
        return jax.tree_util.tree_structure(tree), [
            (np.shape(v), np.asarray(v).dtype) for v in jax.tree_util.tree_leaves(tree)
        ]

    want = signature((params, opt_state))
    scales = set()
    for i in range(6):
        params, opt_state = step(params, opt_state, jnp.float32(np.inf if i == 3 else 1.0))
        assert signature((params, opt_state)) == want
        scales.add(float(mpjax.get_loss_scale(opt_state).loss_scale))
    assert len(scales) > 3 and len(traces) == 1


def test_half_params_and_grads_keep_their_dtype_through_the_update():
    policy = mpjax.Policy.from_level("O3", "float16")
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=mpjax.DynamicLossScale(2.0**8))
    params = policy.cast_to_param(init_mlp(jax.random.key(0)))
    x, y = data(jax.random.key(1))
    state = tx.init(params)
    new, _ = make_step(tx, policy)(params, state, x, y, jnp.float32(1.0))
    for leaf in jax.tree_util.tree_leaves(new):
        assert leaf.dtype == np.float16


# -- gradient accumulation ---------------------------------------------------------------------


def test_plain_multisteps_is_poisoned_by_one_nan_microbatch():
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for g in ([jnp.nan, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]):
        updates, state = tx.update({"w": jnp.array(g)}, state, params)
        params = optax.apply_updates(params, updates)
    assert not bool(jnp.all(jnp.isfinite(params["w"])))  # the trap mpjax's pattern avoids


def test_accumulation_pattern_skips_an_overflowing_microbatch_only(rng):
    k = 3
    tx = mpjax.loss_scale(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k))
    ref_tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k)
    params = {"w": jnp.asarray(rng.normal(size=4), jnp.float32)}
    ref_params = params
    state, ref_state = tx.init(params), ref_tx.init(params)
    micro = [jnp.asarray(rng.normal(size=4), jnp.float32) for _ in range(12)]
    update = jax.jit(tx.update)
    for i, g in enumerate(micro):
        scale = mpjax.get_loss_scale(state)
        if i == 4:  # an overflowing microbatch, skipped: the next good one takes its place
            bad = scale.scale({"w": g.at[0].set(jnp.inf)})
            updates, state = update(bad, state, params)
            params = optax.apply_updates(params, updates)
            scale = mpjax.get_loss_scale(state)  # backed off: the next loss uses the new scale
        updates, state = update(scale.scale({"w": g}), state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_tx.update({"w": g}, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(ref_params["w"]), rtol=1e-6)
    assert int(mpjax.loss_scale_metrics(state)["skipped_steps"]) == 1
    assert bool(jnp.all(jnp.isfinite(params["w"])))


# -- finding the state -------------------------------------------------------------------------


OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1, weight_decay=0.1),
    "lion": lambda: optax.lion(0.1),
    "adafactor": lambda: optax.adafactor(0.1),
}


@pytest.mark.parametrize("multisteps", [False, True], ids=["", "multisteps"])
@pytest.mark.parametrize("clip", [False, True], ids=["", "clip"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_recommended_form_skips_a_nonfinite_step_bit_identically(name, clip, multisteps):
    # The form the README recommends for a stateful optimizer: the wrap form, clipping and
    # MultiSteps inside it. A skipped step leaves params and every inner state leaf as they were.
    inner = OPTIMIZERS[name]()
    if clip:
        inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
    if multisteps:
        inner = optax.MultiSteps(inner, every_k_schedule=2)
    tx = mpjax.loss_scale(inner, scale=mpjax.StaticLossScale(4.0))
    key = jax.random.key(0)
    params = {"w": jax.random.normal(key, (4, 3)), "b": jnp.full((3,), 0.5)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(3):  # some real steps first: moments, counts and accumulators are nonzero
        grads = jax.tree_util.tree_map(lambda p: 4.0 * (p + 0.1 * i), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    bad = {"w": params["w"].at[1, 2].set(jnp.nan), "b": params["b"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.InexactSkipWarning)
        assert float(mpjax.get_loss_scale(state).loss_scale) == 4.0  # no warning: exact
    updates, new_state = update(bad, state, params)
    assert_trees_bit_identical(optax.apply_updates(params, updates), params)
    assert_trees_bit_identical(new_state.inner_state, state.inner_state)
    assert int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_chain_form_with_a_stateful_optimizer_warns_and_names_the_fix(name):
    tx = optax.chain(mpjax.loss_scale(), optax.clip_by_global_norm(1.0), OPTIMIZERS[name]())
    state = tx.init({"w": jnp.ones((2, 3))})
    with pytest.warns(mpjax.InexactSkipWarning, match=r"mpjax\.loss_scale\(optax\.chain"):
        jax.jit(mpjax.loss_scale_metrics)(state)


def test_a_stateful_transformation_before_loss_scale_warns_at_the_users_line():
    """Momentum before the chain-form loss_scale() sees the scaled, unchecked gradients: one
    inf step puts inf into its trace, and every later step is skipped while the scale halves.
    It warns, naming the fix, at the line that called mpjax (not inside mpjax)."""
    tx = optax.chain(optax.sgd(0.1, momentum=0.9), mpjax.loss_scale())
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    with pytest.warns(mpjax.InexactSkipWarning, match="Put mpjax.loss_scale\\(\\) first") as rec:
        mpjax.scaled_value_and_grad(lambda p: jnp.sum(p["w"]))(state, params)
    assert rec[0].filename == __file__
    # what it warns of: after one inf step every step is skipped
    update = jax.jit(tx.update)
    for g in (jnp.array([jnp.inf, 1.0, 1.0]), jnp.ones(3), jnp.ones(3)):
        _, state = update({"w": g}, state, params)
    assert int(mpjax.loss_scale_metrics(state)["skipped_steps"]) == 3


def test_chain_form_warning_points_at_the_users_line():
    state = optax.chain(mpjax.loss_scale(), optax.adam(0.1)).init({"v": jnp.ones(3)})
    with pytest.warns(mpjax.InexactSkipWarning) as rec:
        mpjax.scaled_value_and_grad(lambda p: jnp.sum(p["v"]))(state, {"v": jnp.ones(3)})
    assert rec[0].filename == __file__


def test_chain_form_warns_once_per_state_structure():
    state = optax.chain(mpjax.loss_scale(), optax.sgd(0.1, momentum=0.5)).init({"v": jnp.ones(3)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            mpjax.get_loss_scale(state)
    assert [w.category for w in caught] == [mpjax.InexactSkipWarning]


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(mpjax.loss_scale(), optax.sgd(0.1)),
        lambda: optax.chain(mpjax.loss_scale(), optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        lambda: mpjax.loss_scale(optax.chain(optax.clip(1.0), optax.adamw(1e-3))),
    ],
    ids=["sgd", "clip-sgd", "wrap-adamw"],
)
def test_exact_forms_do_not_warn(make):
    state = make().init({"w": jnp.ones(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.InexactSkipWarning)
        mpjax.loss_scale_metrics(state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.chain(mpjax.loss_scale(), optax.sgd(0.1)),
        lambda: mpjax.loss_scale(optax.adam(1e-3)),
        lambda: optax.chain(optax.trace(0.9), optax.chain(mpjax.loss_scale(), optax.sgd(0.1))),
        lambda: optax.inject_hyperparams(
            lambda learning_rate: optax.chain(mpjax.loss_scale(), optax.sgd(learning_rate))
        )(learning_rate=0.1),
        lambda: optax.MultiSteps(optax.chain(mpjax.loss_scale(), optax.sgd(0.1)), 2),
        lambda: mpjax.loss_scale(optax.MultiSteps(optax.sgd(0.1), 2)),
    ],
    ids=["chain", "wrap", "nested-chain", "inject_hyperparams", "multisteps-outside", "wrap-multi"],
)
def test_get_loss_scale_finds_the_state_anywhere(make):
    tx = make()
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert float(mpjax.get_loss_scale(state).loss_scale) == 2.0**15
    update = jax.jit(tx.update)
    for _ in range(2):  # two microbatches, so MultiSteps outside calls its inner once
        _, state = update({"w": jnp.full((2,), jnp.inf)}, state, params)
    skipped = int(mpjax.loss_scale_metrics(state)["skipped_steps"])
    assert skipped in (1, 2)
    assert float(jax.jit(mpjax.get_loss_scale)(state).loss_scale) == 2.0 ** (15 - skipped)


def test_get_loss_scale_errors_clearly():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="holds no mpjax.loss_scale\\(\\) state.*optax.chain"):
        mpjax.get_loss_scale(optax.adam(1e-3).init(params))
    two = optax.chain(mpjax.loss_scale(), mpjax.loss_scale(optax.sgd(0.1))).init(params)
    with pytest.raises(ValueError, match="holds 2 mpjax.loss_scale\\(\\) states"):
        mpjax.loss_scale_metrics(two)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "inner, match",
    [
        (optax.adam, "the function adam; call it first"),
        (2.0**15, "pass it by keyword"),
        (mpjax.StaticLossScale(8.0), "pass it by keyword"),
        ("adam", "takes an optax GradientTransformation"),
    ],
)
def test_loss_scale_rejects_a_bad_inner(inner, match):
    with pytest.raises(TypeError, match=match):
        mpjax.loss_scale(inner)


@pytest.mark.parametrize("scale", [2.0**15, "dynamic", jnp.float32(8.0)])
def test_loss_scale_rejects_a_bad_scale(scale):
    with pytest.raises(TypeError, match="scale must be a NoOpLossScale"):
        mpjax.loss_scale(scale=scale)


def test_a_tree_with_no_floats_is_an_error():
    tx = optax.chain(mpjax.loss_scale(), optax.sgd(0.1))
    with pytest.raises(ValueError, match="params has no floating-point arrays"):
        tx.init({"steps": jnp.arange(3)})
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="gradient tree has no floating-point arrays"):
        tx.update({"w": jnp.arange(2)}, state)
    with pytest.raises(TypeError, match="pass the state"):
        mpjax.loss_scale().update({"w": jnp.ones(2)}, optax.EmptyState())


def test_integer_leaves_pass_through_untouched():
    tx = mpjax.loss_scale(scale=mpjax.StaticLossScale(4.0))
    params = {"w": jnp.ones(2), "step": jnp.array(3)}
    grads = {"w": jnp.full((2,), 8.0), "step": jnp.array(5)}
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["step"].dtype == np.int32 and int(updates["step"]) == 5
    np.testing.assert_array_equal(np.asarray(updates["w"]), [2.0, 2.0])


def test_chain_form_makes_no_silent_upcasts_under_strict_promotion():
    with jax.numpy_dtype_promotion("strict"):
        tx = mpjax.loss_scale(scale=mpjax.DynamicLossScale(2.0**4, period=1))
        params = {"h": jnp.ones(3, jnp.float16), "f": jnp.ones(2), "i": jnp.arange(2)}
        state = tx.init(params)
        for g in (1.0, np.inf):
            grads = {"h": jnp.full((3,), g, jnp.float16), "f": jnp.ones(2), "i": jnp.arange(2)}
            updates, state = jax.jit(tx.update)(grads, state, params)
            assert updates["h"].dtype == np.float16
        assert int(mpjax.loss_scale_metrics(state)["skipped_steps"]) == 1


@pytest.mark.parametrize(
    "scale",
    [mpjax.StaticLossScale(0.5), mpjax.DynamicLossScale(0.5, min_loss_scale=0.25)],
    ids=["static", "dynamic"],
)
def test_a_scale_below_one_that_overflows_on_unscale_is_skipped(scale):
    # 40000 is finite in float16; divided by 0.5 it is 80000, which is not.
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=scale)
    params = {"h": jnp.ones(2, jnp.float16)}
    grads = {"h": jnp.array([40000.0, 1.0], jnp.float16)}
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert not bool(state.last_finite)
    assert_trees_bit_identical(optax.apply_updates(params, updates), params)


def test_wrap_form_keeps_a_prng_key_in_the_inner_state_on_a_skipped_step():
    # An inner transformation that draws noise each step (as a stochastic-rounding update
    # does): a skipped step leaves its key as it was, so a resumed run draws the same bits.
    def init(params):
        return {"key": jax.random.key(0), "count": jnp.zeros([], jnp.int32)}

    def update(updates, state, params=None):
        key, sub = jax.random.split(state["key"])
        noisy = jax.tree_util.tree_map(
            lambda u: u + 1e-3 * jax.random.normal(sub, u.shape), updates
        )
        return noisy, {"key": key, "count": state["count"] + 1}

    tx = mpjax.loss_scale(optax.GradientTransformation(init, update), scale=mpjax.NoOpLossScale())
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    _, state = jax.jit(tx.update)({"w": jnp.ones(3)}, state, params)
    updates, new = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, 1.0])}, state, params)
    assert_trees_bit_identical(optax.apply_updates(params, updates), params)
    assert bool(
        jnp.all(
            jax.random.key_data(new.inner_state["key"])
            == jax.random.key_data(state.inner_state["key"])
        )
    )
    assert int(new.inner_state["count"]) == 1


def test_accumulate_gradients_sums_half_gradients_in_float32():
    policy = mpjax.Policy.from_level("O3", "float16")
    rng = np.random.default_rng(0)
    w32 = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32) / 4
    batch = {
        "x": jnp.asarray(rng.normal(size=(64, 16)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(64, 4)), jnp.float32),
    }
    model = mpjax.autocast(lambda w, x: jnp.tanh(x @ w), policy)
    loss = lambda w, b: jnp.mean((model(w, b["x"]).astype(jnp.float32) - b["y"]) ** 2)
    # The reference: float32 params and program, the whole batch at once.
    ref = jax.grad(lambda w, b: jnp.mean((jnp.tanh(b["x"] @ w) - b["y"]) ** 2))(w32, batch)
    w16 = w32.astype(jnp.float16)
    wide = mpjax.accumulate_gradients(jax.grad(loss), w16, batch, 8)
    narrow = mpjax.accumulate_gradients(jax.grad(loss), w16, batch, 8, dtype=None)
    assert wide.dtype == narrow.dtype == jnp.float16
    err = lambda g: float(jnp.linalg.norm(g.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    whole = err(jax.grad(loss)(w16, batch))
    assert err(wide) <= 1.5 * whole + 1e-3, (err(wide), whole)
    # A sum of half gradients can overflow though every microbatch's is finite.
    big = lambda w, b: jnp.sum(b["x"]).astype(jnp.float16) * w  # gradient: sum(x), per slice
    x = {"x": jnp.full((8, 1), 1.5e4, jnp.float32)}
    g16 = mpjax.accumulate_gradients(jax.grad(big), jnp.float16(1), x, 4, dtype=None)
    g32 = mpjax.accumulate_gradients(jax.grad(big), jnp.float16(1), x, 4)
    assert not np.isfinite(float(g16)) and float(g32) == 3e4


def test_an_overflowing_microbatch_skips_the_whole_step():
    policy = mpjax.Policy.from_level("O2", "float16")
    params = {"w": jnp.ones((4, 2)) / 4}
    tx = mpjax.loss_scale(optax.adam(1e-2), scale=mpjax.DynamicLossScale(2.0**8))
    state = tx.init(params)
    model = mpjax.autocast(lambda p, x: x @ p["w"], policy)

    @jax.jit
    def step(params, state, x):
        scale = mpjax.get_loss_scale(state)
        grad_fn = jax.grad(lambda p, x: scale.scale(jnp.mean(model(p, x).astype(jnp.float32) ** 2)))
        grads = mpjax.accumulate_gradients(grad_fn, params, x, 4)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.ones((16, 4))
    params1, state1 = step(params, state, x)
    params2, state2 = step(params1, state1, x.at[13].set(7e4))  # one row of microbatch 1
    assert bool(mpjax.loss_scale_metrics(state1)["last_step_finite"])
    assert not bool(mpjax.loss_scale_metrics(state2)["last_step_finite"])
    for a, b in zip(
        jax.tree.leaves((params2, state2.inner_state)),
        jax.tree.leaves((params1, state1.inner_state)),
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert int(mpjax.loss_scale_metrics(state2)["skipped_steps"]) == 1


@pytest.mark.parametrize(
    "k, dtype, words",
    [(3, jnp.float32, "cannot be split into 3"), (0, jnp.float32, "positive int"),
     (2, jnp.int32, "not floating")],
)  # fmt: skip
def test_accumulate_gradients_bad_input_names_the_fix(k, dtype, words):
    with pytest.raises(ValueError, match=words):
        mpjax.accumulate_gradients(
            jax.grad(lambda w, x: jnp.sum(x * w)), 1.0, jnp.ones(8), k, dtype=dtype
        )


def test_float16_adam_eps_underflow_never_reaches_the_params():
    # O3 float16 params with optax.adam's default eps=1e-8, which is 0 in float16: a leaf
    # whose gradient is zero has a zero second moment, and its update is 0 / 0 = NaN from
    # finite gradients. The loss scale checks gradients; the wrap form checks the updates too.
    params = {"w": jnp.ones(4, jnp.float16), "frozen": jnp.ones(2, jnp.float16)}
    with pytest.warns(mpjax.HalfAdamWarning, match="eps=1e-4"):
        tx = mpjax.loss_scale(optax.adam(1e-3))
        state = tx.init(params)
    # Gradients of the loss scaled by the default 2**15: 0.5 once unscaled.
    grads = {"w": jnp.full(4, 2.0**14, jnp.float16), "frozen": jnp.zeros(2, jnp.float16)}
    step = jax.jit(
        lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(grads, s, p))
    )
    new, new_state = step(params, state)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(new))
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), new, params)
    )
    metrics = mpjax.loss_scale_metrics(new_state)
    assert int(metrics["skipped_steps"]) == 1 and not bool(metrics["last_step_finite"])
    # The inner state is the one before the step, bit for bit.
    same = jax.tree_util.tree_map(
        lambda a, b: bool((a == b).all()), new_state.inner_state, state.inner_state
    )
    assert jax.tree_util.tree_all(same)
    # A larger eps trains: no warning, and every step is taken and moves the params.
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.HalfAdamWarning)
        tx = mpjax.loss_scale(optax.adam(1e-3, eps=1e-4))
    state = tx.init(params)
    new, new_state = jax.jit(
        lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(grads, s, p))
    )(params, state)
    assert int(mpjax.loss_scale_metrics(new_state)["skipped_steps"]) == 0
    assert bool((new["w"] < 1).all())


def test_check_updates_is_off_for_float32_params_and_refused_in_the_chain_form():
    params = {"w": jnp.ones(3)}
    tx = mpjax.loss_scale(optax.sgd(jnp.inf))  # an inf update from finite gradients
    upd, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    assert int(mpjax.loss_scale_metrics(state)["skipped_steps"]) == 0  # float32: not checked
    tx = mpjax.loss_scale(optax.sgd(jnp.inf), check_updates=True)
    upd, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    assert int(mpjax.loss_scale_metrics(state)["skipped_steps"]) == 1
    assert bool((upd["w"] == 0).all())
    with pytest.raises(ValueError, match="wraps none"):
        mpjax.loss_scale(check_updates=True)


def test_value_and_grad_is_the_hand_scaled_step_bit_for_bit():
    # float16 activations whose gradients need the scale; the helper and the hand-written
    # step (scale.scale(loss), jax.grad) give the same losses, params and optimizer state.
    params = {"w": jnp.full((4, 4), 0.1, jnp.float32)}
    x = jnp.linspace(-1, 1, 16, dtype=jnp.float32).reshape(4, 4)
    loss_fn = lambda p, x: jnp.mean(
        (x.astype(jnp.float16) @ p["w"].astype(jnp.float16)) ** 2
    ).astype(jnp.float32)
    tx = mpjax.loss_scale(optax.adam(1e-2))
    runs = []
    for helper in (False, True):
        p, s = params, tx.init(params)

        @jax.jit
        def step(p, s):
            if helper:
                loss, g = mpjax.scaled_value_and_grad(loss_fn)(s, p, x)
            else:
                scale = mpjax.get_loss_scale(s)
                loss, g = jax.value_and_grad(lambda p: scale.scale(loss_fn(p, x)))(p)
                loss = scale.unscale(loss)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        losses = []
        for _ in range(4):
            p, s, loss = step(p, s)
            losses.append(loss)
        runs.append((p, s, losses))
    assert_trees_bit_identical(runs[0], runs[1])
    with pytest.raises(ValueError, match="loss"):
        mpjax.scaled_value_and_grad(loss_fn)(optax.adam(0.1).init(params), params, x)
