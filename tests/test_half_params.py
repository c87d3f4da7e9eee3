"""Half params without float32 masters: stochastic rounding against a float64 oracle, the
compensated update against a float32 accumulation, and half_updates composed with loss_scale,
MultiSteps, nnx.Optimizer, TrainState and orbax checkpoints."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_bit_identical, bits, slow_except

import mpjax

HALVES = ["bfloat16", "float16"]
MODES = ["stochastic", "kahan", "nearest"]
DT = {"bfloat16": np.dtype(jnp.bfloat16), "float16": np.dtype(jnp.float16)}
F32 = np.dtype(np.float32)


# -- the float64 oracle -----------------------------------------------------------------------


def neighbours(x, dtype):
    """The two `dtype` values around each float32 `x` (toward zero, away from zero), as float64."""
    x = np.asarray(x, np.float32)
    nearest = x.astype(dtype)  # ml_dtypes rounds to nearest
    b = nearest.view(np.uint16).astype(np.int64)
    n64, x64 = nearest.astype(np.float64), x.astype(np.float64)
    # Sign and magnitude: +-1 on the raw bits moves the magnitude by one step.
    other = np.where(np.abs(n64) > np.abs(x64), b - 1, b + 1).astype(np.uint16).view(dtype)
    o64 = other.astype(np.float64)
    exact = n64 == x64
    low = np.where(np.abs(n64) <= np.abs(o64), n64, o64)
    high = np.where(np.abs(n64) <= np.abs(o64), o64, n64)
    return np.where(exact, x64, low), np.where(exact, x64, high)


def joined(half, rest):
    """The float32 value a "kahan" param and its int16 buffer stand for."""
    if half.dtype == DT["bfloat16"]:  # the high and the low 16 bits of a float32
        high = half.view(np.uint16).astype(np.int64) << 16
        return ((high + rest.astype(np.int64)) % 2**32).astype(np.uint32).view(np.float32)
    exponent = np.maximum((half.view(np.uint16) >> 10) & 0x1F, 1).astype(np.int64)
    return (half.astype(np.float64) + rest * np.exp2(exponent - 40.0)).astype(np.float32)


def draw(rng, dtype, n=128):
    """Fresh float32 values over the normal range and the subnormal range of `dtype`."""
    tiny = jnp.finfo(dtype).smallest_normal
    normal = np.exp2(rng.uniform(-12, 12, n)) * rng.choice([-1, 1], n)
    sub = rng.uniform(0, float(tiny), n) * rng.choice([-1, 1], n)
    return np.concatenate([normal, sub]).astype(np.float32)


# -- stochastic_round ---------------------------------------------------------------------------


@pytest.mark.parametrize("half", HALVES)
def test_stochastic_rounding_is_unbiased(half, rng):
    dtype = DT[half]
    x = draw(rng, dtype)
    draws = 4000
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), draws)
    y = jax.jit(jax.vmap(lambda k: mpjax.stochastic_round(k, x, half)))(keys)
    assert y.dtype == dtype and y.shape == (draws, x.size)
    y64 = np.asarray(y).astype(np.float64)
    low, high = neighbours(x, dtype)
    x64 = x.astype(np.float64)
    p = np.where(high != low, (x64 - low) / np.where(high != low, high - low, 1), 0.0)
    stderr = np.abs(high - low) * np.sqrt(p * (1 - p) / draws)
    error = np.abs(y64.mean(axis=0) - x64)
    # 5.5 standard errors: a false alarm in ~1e-6 of runs per element.
    assert np.all(error <= 5.5 * stderr + 1e-300), (x[error > 5.5 * stderr], error.max())
    assert np.mean(error / np.where(stderr > 0, stderr, 1)) < 1.2  # |z| averages sqrt(2/pi)


@pytest.mark.parametrize("half", HALVES)
def test_stochastic_rounding_stays_on_the_two_neighbours(half, rng):
    dtype = DT[half]
    x = draw(rng, dtype, 512)
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 64)
    y = np.asarray(jax.vmap(lambda k: mpjax.stochastic_round(k, x, half))(keys)).astype(np.float64)
    low, high = neighbours(x, dtype)
    assert np.all((y == low) | (y == high))
    both = (low != high) & ((x - low) / (high - low) > 0.2) & ((x - low) / (high - low) < 0.8)
    assert np.all((y == low).any(axis=0)[both]) and np.all((y == high).any(axis=0)[both])


@pytest.mark.parametrize("half", HALVES)
def test_special_values_round_like_a_plain_cast(half):
    dtype = DT[half]
    info = jnp.finfo(dtype)
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max),
         float(info.smallest_subnormal), -3 * float(info.smallest_subnormal),
         float(info.smallest_normal), 1.0, -2.5, 1.001 * float(info.max)],
        np.float32,
    )  # fmt: skip
    beyond = np.nextafter(np.float32(info.max), np.float32(np.inf))  # beyond max: as a cast
    special = np.concatenate([special, [beyond, -beyond, np.float32(3.4e38)]])
    keys = jax.random.split(jax.random.key(0), 50)
    for key in keys:
        y = mpjax.stochastic_round(key, special, half)
        np.testing.assert_array_equal(bits(y), bits(jnp.asarray(special).astype(dtype)))


@pytest.mark.parametrize("half", HALVES)
def test_stochastic_round_is_reproducible_and_the_same_under_jit(half, rng):
    x = jnp.asarray(rng.normal(size=(33, 7)), jnp.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    eager = mpjax.stochastic_round(key, x, half)
    np.testing.assert_array_equal(bits(eager), bits(mpjax.stochastic_round(key, x, half)))
    jitted = jax.jit(mpjax.stochastic_round, static_argnums=2)(key, x, half)
    np.testing.assert_array_equal(bits(eager), bits(jitted))
    raw = mpjax.stochastic_round(jax.random.key_data(key), x, half)  # a raw uint32 key works
    np.testing.assert_array_equal(bits(eager), bits(raw))
    other = mpjax.stochastic_round(jax.random.fold_in(key, 1), x, half)
    assert not np.array_equal(bits(eager), bits(other))
    # Half inputs widen exactly; float32 and same-dtype targets are plain casts.
    assert mpjax.stochastic_round(key, x, "float32").dtype == F32
    same = x.astype(half)
    np.testing.assert_array_equal(bits(mpjax.stochastic_round(key, same, half)), bits(same))


# -- half_updates: the update itself ------------------------------------------------------------


def constant_steps(tx, params, update, steps):
    """`steps` applications of the same float32 `update` through `tx` (optax.identity inside)."""

    def body(carry, _):
        p, state = carry
        u, state = tx.update(update, state, p)
        return (optax.apply_updates(p, u), state), None

    (p, state), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return p, state


@pytest.mark.parametrize("half", HALVES)
def test_kahan_reproduces_a_float32_accumulation_of_tiny_updates(half, rng):
    dtype = DT[half]
    gap = 2.0 ** -jnp.finfo(dtype).nmant  # between neighbours in [1, 2)
    p0 = (rng.uniform(1.0, 2.0, 64) * rng.choice([-1, 1], 64)).astype(dtype)
    # Every update is far below half the gap: round-to-nearest loses all of them.
    u = (rng.uniform(0.01, 0.05, 64) * gap * rng.choice([-1, 1], 64)).astype(np.float32)
    steps = 10_000
    acc32 = np.asarray(
        jax.lax.fori_loop(0, steps, lambda _, a: a + u, jnp.asarray(p0, jnp.float32))
    ).astype(np.float64)
    exact = p0.astype(np.float64) + steps * u.astype(np.float64)
    drift = steps * np.abs(u.astype(np.float64))
    assert np.all(np.abs(acc32 - exact) < 0.02 * drift)  # float32 keeps them, to 2%

    run = jax.jit(constant_steps, static_argnums=(0, 3))
    params = {"w": jnp.asarray(p0)}
    near, _ = run(mpjax.half_updates(optax.identity(), "nearest"), params, {"w": u}, steps)
    np.testing.assert_array_equal(bits(near["w"]), bits(p0))  # every update lost

    kahan, state = run(mpjax.half_updates(optax.identity(), "kahan"), params, {"w": u}, steps)
    assert kahan["w"].dtype == dtype and state.compensation["w"].dtype == np.int16
    # The half param is the float32 sum rounded to nearest...
    np.testing.assert_array_equal(bits(kahan["w"]), bits(acc32.astype(np.float32).astype(dtype)))
    # ...and param and buffer together are that float32 sum, bit for bit.
    master = joined(np.asarray(kahan["w"]), np.asarray(state.compensation["w"]))
    np.testing.assert_array_equal(bits(master), bits(acc32.astype(np.float32)))


@pytest.mark.parametrize("half", HALVES)
def test_stochastic_updates_accumulate_tiny_updates_in_expectation(half, rng):
    dtype = DT[half]
    gap = 2.0 ** -jnp.finfo(dtype).nmant  # between neighbours in [1, 2)
    p0 = rng.uniform(1.0, 1.5, 16).astype(dtype)
    u = (rng.uniform(0.1, 0.4, 16) * gap).astype(np.float32)
    steps, runs = int(0.45 / (0.4 * gap)), 64  # the sum stays below 2, with one gap

    def one(seed):
        tx = mpjax.half_updates(optax.identity(), key=seed)
        return constant_steps(tx, {"w": jnp.asarray(p0)}, {"w": u}, steps)[0]["w"]

    out = np.asarray(jax.jit(jax.vmap(one))(jnp.arange(runs))).astype(np.float64)
    exact = p0.astype(np.float64) + steps * u.astype(np.float64)
    # Each step adds at most gap**2 / 4 of variance: a random walk around the exact sum.
    bound = 6 * np.sqrt(steps * gap**2 / 4 / runs)
    assert np.all(np.abs(out.mean(axis=0) - exact) < bound)
    assert np.all(out.mean(axis=0) - p0 > 0.5 * steps * u)  # it moved (nearest would not)


@pytest.mark.parametrize("half", HALVES)
def test_emitted_updates_give_the_rounded_params_through_optax_apply_updates(half, rng):
    dtype = DT[half]
    n = 4096
    p = (np.exp2(rng.uniform(-20, 5, n)) * rng.choice([-1, 1], n)).astype(dtype)
    # Targets from far below to far above each weight, crossing zero half the time.
    limit = 15 if half == "bfloat16" else 12
    ratio = np.exp2(rng.uniform(-limit, 6, n)) * rng.choice([-1, 1], n)
    target = (p.astype(np.float64) * ratio).astype(np.float32)
    inner = optax.GradientTransformation(
        lambda params: optax.EmptyState(), lambda g, s, params=None: (g, s)
    )
    for mode in MODES:
        tx = mpjax.half_updates(inner, mode, key=int(rng.integers(2**31)))
        params = {"w": jnp.asarray(p)}
        grads = {"w": jnp.asarray(target - p.astype(np.float32))}
        updates, _ = tx.update(grads, tx.init(params), params)
        assert updates["w"].dtype == F32
        new = optax.apply_updates(params, updates)["w"]
        reference = np.asarray(params["w"]).astype(np.float32) + np.asarray(grads["w"])
        low, high = neighbours(reference, dtype)
        got = np.asarray(new).astype(np.float64)
        assert np.all((got == low) | (got == high)), mode
        if mode == "stochastic":
            continue
        nearest = reference.astype(dtype).astype(np.float64)
        if mode == "kahan" and half == "bfloat16":  # a tie rounds away from zero
            tie = (reference.view(np.uint32) & 0xFFFF) == 0x8000
            nearest = np.where(tie, np.where(np.abs(low) == np.abs(high), low, high), nearest)
        np.testing.assert_array_equal(got, nearest)  # value for value (a zero comes back +0)


@pytest.mark.parametrize("half", HALVES)
def test_second_moment_in_bfloat16_decays_as_float32_does(half, rng):
    # Adam's b2=0.999 moves v by 1e-3 of itself per step, under bfloat16's half gap (2**-9):
    # rounded to nearest it would never decay; rounded stochastically it decays on average.
    params = {"w": jnp.asarray(rng.uniform(0.5, 1.0, 2048), DT[half])}
    tx = mpjax.half_updates(optax.scale_by_adam(), state_dtype="bfloat16", key=3)
    state = tx.init(params)
    big = {"w": jnp.ones(2048, jnp.float32)}
    zero = {"w": jnp.zeros(2048, jnp.float32)}
    step = jax.jit(lambda g, s, p: tx.update(g, s, p)[1])
    state = step(big, state, params)
    assert state.inner_state.nu["w"].dtype == np.dtype(jnp.bfloat16)
    v0 = np.asarray(state.inner_state.nu["w"]).astype(np.float64)
    for _ in range(500):
        state = step(zero, state, params)
    v = np.asarray(state.inner_state.nu["w"]).astype(np.float64)
    exact = v0 * 0.999**500
    assert abs(v.mean() / exact.mean() - 1) < 0.02
    assert state.inner_state.mu["w"].dtype == np.dtype(jnp.bfloat16)
    assert state.inner_state.count.dtype == np.int32  # scalars stay as they are


# -- training: composition with loss_scale, MultiSteps, Flax and checkpoints --------------------


def problem(half, seed=0):
    from test_faults import init, mlp, regression_data

    x, y = regression_data(jax.random.key(seed))
    params = jax.tree_util.tree_map(lambda a: a.astype(half), init(jax.random.key(seed + 1)))

    def loss(p, x=x, y=y):
        return jnp.mean((mlp(p, x).astype(jnp.float32) - y) ** 2)

    return params, loss, (x, y)


def make_step(tx, loss):
    @jax.jit
    def step(params, opt_state, inject=1.0):
        scale = mpjax.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss(p)))(params)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaves[0] = leaves[0] * jnp.asarray(inject, leaves[0].dtype)  # inf: an overflow in one leaf
        grads = jax.tree_util.tree_unflatten(treedef, leaves)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


VARIANTS = [
    ("stochastic", None),
    ("stochastic", "bfloat16"),
    ("kahan", None),
    ("kahan", "bfloat16"),
]


def half_state(opt_state):
    found = [
        s
        for s in jax.tree_util.tree_leaves(
            opt_state, is_leaf=lambda s: isinstance(s, mpjax.HalfUpdatesState)
        )
        if isinstance(s, mpjax.HalfUpdatesState)
    ]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(
    "half, mode, state_dtype",
    slow_except(
        [
            ("bfloat16", "stochastic", "bfloat16"),
            ("bfloat16", "kahan", "bfloat16"),
            ("float16", "stochastic", None),
        ],
        [(h, m, d) for h in HALVES for m, d in VARIANTS],
    ),
)
def test_a_skipped_step_is_as_if_never_called(half, mode, state_dtype):
    params, loss, _ = problem(half)
    tx = mpjax.loss_scale(
        mpjax.half_updates(optax.adam(1e-2), mode, key=7, state_dtype=state_dtype),
        scale=mpjax.StaticLossScale(2.0**3),
    )
    step = make_step(tx, loss)
    state = tx.init(params)
    for _ in range(3):
        params, state = step(params, state)
    skipped_params, skipped = step(params, state, jnp.float32(jnp.inf))
    assert int(mpjax.loss_scale_metrics(skipped)["skipped_steps"]) == 1
    assert_trees_bit_identical(skipped_params, params)
    assert_trees_bit_identical(half_state(skipped), half_state(state))
    # And the run goes on as if the skipped step had never been called.
    a = step(*step(skipped_params, skipped))
    b = step(*step(params, state))
    assert_trees_bit_identical(a[0], b[0])
    assert_trees_bit_identical(half_state(a[1]), half_state(b[1]))


@pytest.mark.parametrize("mode, state_dtype", VARIANTS)
def test_trains_as_float32_masters_do_and_nearest_falls_behind(mode, state_dtype):
    params, loss, _ = problem("bfloat16")
    lr, steps = 1e-3, 300
    masters = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    runs = {
        "f32": (optax.adam(lr), masters),
        "half": (mpjax.half_updates(optax.adam(lr), mode, state_dtype=state_dtype), params),
        "nearest": (mpjax.half_updates(optax.adam(lr), "nearest"), params),
    }
    final = {}
    for name, (tx, p) in runs.items():

        @jax.jit
        def run(p, tx=tx):
            def body(carry, _):
                p, s = carry
                u, s = tx.update(jax.grad(loss)(p), s, p)
                return (optax.apply_updates(p, u), s), None

            return jax.lax.scan(body, (p, tx.init(p)), None, length=steps)[0][0]

        final[name] = float(loss(jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), run(p))))
    start = float(loss(masters))
    assert final["f32"] < 0.6 * start
    assert abs(final["half"] - final["f32"]) < 0.05 * (start - final["f32"]), final
    assert final["nearest"] - final["f32"] > 3 * abs(final["half"] - final["f32"]), final


@pytest.mark.parametrize("half", slow_except(["bfloat16"], HALVES))
def test_multisteps_accumulates_and_applies_once(half):
    params, loss, (x, y) = problem(half)
    k = 3
    inner = mpjax.half_updates(optax.adam(1e-2), key=5)
    tx = mpjax.loss_scale(optax.MultiSteps(inner, k), scale=mpjax.StaticLossScale(1.0))
    state = tx.init(params)
    batches = [(x[i::k], y[i::k]) for i in range(k)]
    grads = [jax.jit(jax.grad(loss))(params, *b) for b in batches]
    update = jax.jit(tx.update)
    p = params
    for i, g in enumerate(grads):
        before = half_state(state)
        u, state = update(g, state, p)
        p = optax.apply_updates(p, u)
        if i < k - 1:  # accumulating: params, moments and key untouched
            assert_trees_bit_identical(p, params)
            assert_trees_bit_identical(half_state(state), before)
    # One half_updates step on MultiSteps' mean gradient (float32, cast like the gradients).
    acc = jax.tree_util.tree_map(lambda *gs: jnp.zeros(gs[0].shape, jnp.float32), *grads)
    for n, g in enumerate(grads):
        acc = jax.tree_util.tree_map(lambda a, g: a + (g - a) / (n + 1), acc, g)
    mean = jax.tree_util.tree_map(lambda a, g: a.astype(g.dtype), acc, grads[0])
    u, _ = jax.jit(inner.update)(mean, inner.init(params), params)
    assert_trees_bit_identical(p, optax.apply_updates(params, u))


def test_nnx_optimizer_matches_the_functional_step():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            kw = {"param_dtype": jnp.bfloat16, "dtype": jnp.bfloat16}
            self.a = nnx.Linear(8, 16, rngs=rngs, **kw)
            self.b = nnx.Linear(16, 1, rngs=rngs, **kw)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x))).astype(jnp.float32)

    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jnp.sin(x[:, :1])

    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    tx = mpjax.loss_scale(mpjax.half_updates(optax.adam(1e-2), "kahan", state_dtype="bf16"))
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer):
        scale = mpjax.get_loss_scale(optimizer.opt_state)
        grads = nnx.grad(lambda m: scale.scale(loss_fn(m)))(model)
        optimizer.update(model, grads)

    # The same steps on the pure state of an identical model.
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

    @jax.jit
    def ref_step(params, opt_state):
        scale = mpjax.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(nnx.merge(graphdef, p))))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(5):
        nnx_step(model, optimizer)
        params, opt_state = ref_step(params, opt_state)
    got = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    assert_trees_bit_identical(got, jax.tree_util.tree_leaves(params))
    assert all(leaf.dtype == np.dtype(jnp.bfloat16) for leaf in got)
    assert not np.array_equal(bits(got[0]), bits(jax.tree_util.tree_leaves(
        nnx.state(MLP(nnx.Rngs(0)), nnx.Param))[0]))  # fmt: skip


def test_train_state_wraps_it_in_loss_scale_and_matches_the_functional_step():
    import flax.linen as nn

    import mpjax.flax

    policy = mpjax.Policy.from_level("O2", "float16", master_weights=False, loss_scaling="dynamic")
    model = mpjax.flax.wrap(nn.Dense(4), policy)
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y = jnp.cos(x[:, :4])
    params = model.init(jax.random.key(1), x)["params"]
    assert all(leaf.dtype == np.float16 for leaf in jax.tree_util.tree_leaves(params))
    inner = mpjax.half_updates(optax.adam(1e-3), key=2)
    state = mpjax.flax.TrainState.create(
        apply_fn=model.apply, params=params, tx=inner, policy=policy
    )

    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

    @jax.jit
    def train_step(state):
        _, grads = state.grad(loss_fn)
        return state.apply_gradients(grads=grads)

    tx = mpjax.loss_scale(inner, scale=policy.loss_scale())
    step = make_step(tx, loss_fn)
    p, s = params, tx.init(params)
    for _ in range(6):
        state = train_step(state)
        p, s = step(p, s)
    assert_trees_bit_identical(state.params, p)
    assert_trees_bit_identical(state.opt_state, s)
    assert isinstance(state.loss_scale, mpjax.DynamicLossScale)


@pytest.mark.parametrize("mode, state_dtype", slow_except([("stochastic", None)], VARIANTS))
def test_orbax_resume_is_bit_identical(tmp_path, mode, state_dtype):
    pytest.importorskip("orbax.checkpoint")
    import mpjax.checkpoint

    policy = mpjax.Policy.from_level("O2", "bfloat16", master_weights=False)

    def fresh():
        params, loss, _ = problem("bfloat16")
        tx = mpjax.loss_scale(
            mpjax.half_updates(optax.adam(1e-2), mode, key=11, state_dtype=state_dtype),
            scale=mpjax.DynamicLossScale(2.0**4, period=3),
        )
        return make_step(tx, loss), {"params": params, "opt": tx.init(params)}

    def run(step, state, start, stop):
        for i in range(start, stop):
            inject = jnp.float32(jnp.inf if i % 5 == 2 else 1.0)
            params, opt = step(state["params"], state["opt"], inject)
            state = {"params": params, "opt": opt}
        return state

    step, state = fresh()
    reference = run(step, state, 0, 12)
    midway = run(step, state, 0, 7)
    mpjax.checkpoint.save(tmp_path / "ckpt", midway, policy)
    _, target = fresh()
    restored = mpjax.checkpoint.restore(tmp_path / "ckpt", target, policy)
    assert_trees_bit_identical(restored, midway)
    assert_trees_bit_identical(run(step, restored, 7, 12), reference)


@pytest.mark.parametrize("mode, state_dtype", VARIANTS + [("nearest", None)])
@pytest.mark.parametrize("half", HALVES)
def test_state_structure_and_dtypes_are_stable_and_nothing_retraces(half, mode, state_dtype):
    params, loss, _ = problem(half)
    params[0]["b"] = params[0]["b"].astype(jnp.float32)  # a float32 leaf among half ones
    tx = mpjax.half_updates(optax.adamw(1e-2, mu_dtype=jnp.bfloat16), mode, state_dtype=state_dtype)
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    shapes = jax.eval_shape(lambda: (params, state))
    for _ in range(3):
        params, state = step(params, state)
        assert jax.eval_shape(lambda: (params, state)) == shapes
    assert len(traces) == 1
    assert isinstance(state, mpjax.HalfUpdatesState)
    assert (state.key is None) == (mode != "stochastic" and state_dtype is None)
    assert (state.compensation is None) == (mode != "kahan")
    if mode == "kahan":
        assert state.compensation[0]["b"].shape == (0,)  # nothing to compensate in float32


@pytest.mark.parametrize("mode", slow_except(["stochastic"], MODES))
def test_eager_and_jit_agree(mode, rng):
    params, _, _ = problem("bfloat16")
    grads = [
        jax.tree_util.tree_map(
            lambda p: jnp.asarray(1e-3 * rng.normal(size=p.shape), jnp.float32), params
        )
        for _ in range(3)
    ]
    # XLA may contract a multiply and an add into one FMA under jit (optax's lr * g + p), which
    # rounds once where eager rounds twice: bitwise equality holds for the same float32 sums.
    for inner, exact in [(optax.identity(), True), (optax.adam(1e-2), False)]:
        tx = mpjax.half_updates(inner, mode, state_dtype="bfloat16")

        def step(params, state, g):
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state

        eager = jitted = (params, tx.init(params))
        for g in grads:
            eager = step(*eager, g)
            jitted = jax.jit(step)(*jitted, g)
        if exact:  # the same float32 sums, rounded alike
            assert_trees_bit_identical(eager, jitted)
        else:
            # A float32 sum that differs by an FMA's rounding can fall on the other side of the
            # boundary a mode rounds at: a midpoint (nearest), the random threshold (stochastic,
            # seen: 1 of 1024 weights, seed 221546915804415521) or the cut between a float32's
            # two halves (kahan, seen: seed 11179530193769646341). So the half params agree
            # within one ulp, and kahan's float32 values (param and buffer) within a few float32
            # ulps of the steps taken.
            for x, y in zip(
                jax.tree_util.tree_leaves(eager[0]), jax.tree_util.tree_leaves(jitted[0])
            ):
                np.testing.assert_allclose(
                    np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=2**-7
                )
            if mode == "kahan":
                pairs = zip(
                    jax.tree_util.tree_leaves(eager[0]),
                    jax.tree_util.tree_leaves(eager[1].compensation),
                    jax.tree_util.tree_leaves(jitted[0]),
                    jax.tree_util.tree_leaves(jitted[1].compensation),
                )
                for he, ce, hj, cj in pairs:
                    if ce.size == 0:  # a float32 param: nothing to compensate
                        continue
                    np.testing.assert_allclose(
                        joined(np.asarray(he), np.asarray(ce)),
                        joined(np.asarray(hj), np.asarray(cj)),
                        rtol=2**-20,
                        atol=1e-2 * 2**-18,  # a few float32 ulps of Adam's steps (lr 1e-2)
                    )


@pytest.mark.slow
def test_replicas_sharing_a_state_round_alike():
    params, loss, (x, y) = problem("bfloat16")
    tx = mpjax.half_updates(optax.adam(1e-2), key=1)
    n = jax.local_device_count()
    xs, ys = x[: 32 * n].reshape(n, 32, -1), y[: 32 * n].reshape(n, 32, -1)

    def step(params, state, x, y):
        grads = jax.lax.pmean(jax.grad(lambda p: loss(p, x, y))(params), "d")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    replicate = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), t)
    p, s = replicate(params), replicate(tx.init(params))
    for _ in range(2):
        p, s = jax.pmap(step, axis_name="d")(p, s, xs, ys)
    for leaf in jax.tree_util.tree_leaves((p, s)):
        for i in range(1, n):
            np.testing.assert_array_equal(bits(leaf[i]), bits(leaf[0]))
    # vmap with an axis name stands in for replicas on one device: four of them stay equal.
    p4, s4 = jax.jit(jax.vmap(step, axis_name="d", in_axes=(None, None, 0, 0)))(
        params, tx.init(params), x[:128].reshape(4, 32, -1), y[:128].reshape(4, 32, -1)
    )
    for leaf in jax.tree_util.tree_leaves((p4, s4)):
        for i in range(1, 4):
            np.testing.assert_array_equal(bits(leaf[i]), bits(leaf[0]))


# -- bad input --------------------------------------------------------------------------------


def test_bad_input_gets_errors_that_name_the_fix():
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    with pytest.raises(ValueError, match=r"param \['step'\] has dtype int32.*multi_transform"):
        mpjax.half_updates(optax.adam(1e-3)).init({**params, "step": jnp.zeros([], jnp.int32)})
    with pytest.raises(ValueError, match=r"Unknown mode 'sr'.*mode='stochastic'"):
        mpjax.half_updates(optax.adam(1e-3), "sr")
    with pytest.raises(ValueError, match=r"mode='kahan'"):
        mpjax.half_updates(optax.adam(1e-3), "compensated")
    with pytest.raises(ValueError, match=r"Unknown dtype 'bfloat'.*'bfloat16'"):
        mpjax.stochastic_round(jax.random.key(0), jnp.ones(2), "bfloat")
    with pytest.raises(ValueError, match=r"bfloat16 or float16"):
        mpjax.stochastic_round(jax.random.key(0), jnp.ones(2), "float64")
    with pytest.raises(TypeError, match=r"floating-point arrays, got int32"):
        mpjax.stochastic_round(jax.random.key(0), jnp.ones(2, jnp.int32), "bfloat16")
    with pytest.raises(ValueError, match=r"state_dtype='float16' cannot hold.*bfloat16"):
        mpjax.half_updates(optax.adam(1e-3), state_dtype="float16")
    with pytest.raises(ValueError, match=r"Unknown dtype 'half16'"):
        mpjax.half_updates(optax.adam(1e-3), state_dtype="half16")
    with pytest.raises(TypeError, match=r"call it first, e.g. mpjax.half_updates\(optax.adam"):
        mpjax.half_updates(optax.adam)
    with pytest.raises(TypeError, match=r"int seed or a PRNG key"):
        mpjax.half_updates(optax.adam(1e-3), key=1.5)
    tx = mpjax.half_updates(optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"needs the current params.*tx.update\(grads"):
        tx.update(params, tx.init(params))
    with pytest.raises(TypeError, match=r"pass the state that this transformation's init"):
        tx.update(params, optax.adam(1e-3).init(params), params)
    with pytest.raises(ValueError, match=r"different structures"):
        tx.update({"v": jnp.ones(3)}, tx.init(params), params)
    with pytest.warns(UserWarning, match=r"no param is float16 or bfloat16"):
        tx.init({"w": jnp.ones(3)})


# -- the example --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_corpus_models_train_in_bfloat16_as_float32_masters_do(name):
    # Hugging Face's Flax GPT-2 and BERT (tests/test_corpus_models.py), wrapped at O2: 60 Adam
    # steps at lr 1e-4 with float32 masters, and with bfloat16 params three ways.
    from test_corpus_models import CASES

    case = CASES[name]()
    final = {}
    for run in ("masters", "nearest", "stochastic", "kahan"):
        if run == "masters":
            policy, tx = mpjax.Policy.from_level("O2", "bfloat16"), optax.adam(1e-4)
        else:
            policy = mpjax.Policy.from_level("O2", "bfloat16", master_weights=False)
            state_dtype = None if run == "nearest" else "bfloat16"
            tx = mpjax.half_updates(optax.adam(1e-4), run, key=1, state_dtype=state_dtype)
        params, loss = case.init(policy), case.loss(policy)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, loss=loss, tx=tx):
            (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, case.batch, case.key)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        for _ in range(60):
            params, opt_state, value = step(params, opt_state)
        want = np.float32 if run == "masters" else jnp.bfloat16
        assert all(leaf.dtype == want for leaf in jax.tree_util.tree_leaves(params))
        final[run] = float(value)
    lost = final["nearest"] - final["masters"]
    assert lost > 0.01, final  # round to nearest loses updates
    for run in ("stochastic", "kahan"):
        assert abs(final[run] - final["masters"]) < 0.25 * lost, final


@pytest.mark.slow
def test_half_params_example_quick(tmp_path):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    example = pytest.importorskip("half_params")
    # a smoke run: one epoch of digits and a few LM steps (the example's --quick is longer)
    argv = ["--quick", "--seeds", "1", "--digits-epochs", "1", "--lm-steps", "5"]
    results = example.main([*argv, "--out", str(tmp_path)])
    assert (tmp_path / "half_params.png").stat().st_size > 10_000
    assert (tmp_path / "half_params.json").exists()
    runs = {r["run"] for r in results["runs"]}
    assert {"float32", "O2 float32 masters", "bf16 nearest"} <= runs
    for r in results["runs"]:
        assert r["bytes_per_param"] > 0
