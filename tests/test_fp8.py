"""Tests for mpjax.fp8: qdq, the FP8 dot, the delayed-scaling state and the autocast hook."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import exact_jit
from flax.linen import fp8_ops

import mpjax
import mpjax.fp8

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F8MAX = np.array([448.0, 448.0, 57344.0], np.float32)


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _fp8_grid(rng, shape, dtype, lo=0.1, hi=4.0):
    """Random values already representable in `dtype` (and in bfloat16)."""
    x = rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape)
    return jnp.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


@pytest.mark.parametrize("q_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 37.5, 0.01])
def test_qdq_matches_flax(rng, q_dtype, dtype, scale):
    x = jnp.asarray(rng.normal(size=(64, 48)) * 3.0, dtype)
    s = jnp.float32(scale)
    ours = mpjax.fp8.qdq(x, q_dtype, s)
    theirs = fp8_ops.qdq(x, q_dtype, 1.0 / s, x.dtype)
    assert ours.dtype == x.dtype
    np.testing.assert_allclose(
        np.asarray(ours, np.float32), np.asarray(theirs, np.float32), atol=1e-6, rtol=0
    )


def _loss(w, x, dy):
    return jnp.sum((x @ w) * dy)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_representable_inputs_match_bf16_reference(rng, level):
    # flax's test_fp8_dot_general_injection: inputs representable in float8 at scale 1 go
    # through quantization unchanged.
    x = _fp8_grid(rng, (16, 32), E4M3)
    w = _fp8_grid(rng, (32, 64), E4M3)
    dy = _fp8_grid(rng, (16, 64), E5M2)
    pol = mpjax.fp8.policy(level)
    state = mpjax.fp8.init(_loss, pol, w, x, dy)
    assert state.num_sites == 1
    out = jax.jit(mpjax.fp8.apply(lambda w, x: x @ w, pol))(
        mpjax.fp8.init(lambda w, x: x @ w, pol, w, x), w, x
    )
    # The FP8 dot sums the exact products in float32 and rounds once to bfloat16, where the
    # bf16 reference's result is rounded too: within bfloat16's half ulp of each other.
    ref_out = mpjax.autocast(lambda w, x: x @ w, pol.base)(w, x)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=2.0**-8, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2.0**-7, atol=1e-2)

    loss, grads, _ = jax.jit(mpjax.fp8.scaled_value_and_grad(_loss, pol))(state, w, x, dy)
    ref_loss, ref_grads = jax.value_and_grad(mpjax.autocast(_loss, pol.base))(w, x, dy)
    # The loss's terms cancel: judge it against the sum of their magnitudes (the bf16
    # reference rounds each product before the sum, FP8 accumulates in float32).
    magnitude = float(jnp.sum(jnp.abs((x @ w) * dy)))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=0, atol=1e-2 * magnitude)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(ref_grads), atol=1e-4)


def test_random_normal_relative_error(rng):
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 48)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32)
    pol = mpjax.fp8.policy("O1")
    state = mpjax.fp8.init(_loss, pol, w, x, dy)
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(_loss, pol))
    _, _, state = step(state, w, x, dy)  # the first step sets the scales from the amaxes
    loss, grads, _ = step(state, w, x, dy)
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    ref_loss = np.sum((x64 @ w64) * dy64)
    ref_grad = x64.T @ dy64

    def rel(a, b):
        return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)

    # the loss is a sum of terms of both signs: judge its error against their magnitude
    assert abs(float(loss) - ref_loss) <= 5e-2 * np.sum(np.abs((x64 @ w64) * dy64))
    # E5M2 keeps 2 mantissa bits: rounding alone is ~5% RMS relative error per element, so
    # gradients get a looser bound than the E4M3 forward pass.
    assert rel(grads, ref_grad) <= 8e-2
    out = mpjax.fp8.apply(lambda w, x: x @ w, pol)(
        mpjax.fp8.FP8State(state.scale, state.amax_history, state.recipe), w, x
    )
    assert rel(out, x64 @ w64) <= 5e-2


def _oracle(amaxes, length, margin, algo):
    """TransformerEngine's DelayedScaling, plainly: per step, the amax enters the history
    (newest first), and scale = fp8_max / amax / 2**margin unless amax is 0 or not finite."""
    scale = np.ones(amaxes[0].shape, np.float32)
    hist = np.zeros((*amaxes[0].shape, length), np.float32)
    for a in amaxes:
        hist = np.concatenate([a[..., None], hist[..., :-1]], axis=-1)
        amax = hist.max(-1) if algo == "max" else hist[..., 0]
        with np.errstate(divide="ignore"):
            new = F8MAX / amax / 2.0**margin
        scale = np.where((amax > 0) & np.isfinite(amax), new, scale).astype(np.float32)
    return scale, hist


def _two_site_loss(params, x, dy, x2, dy2):
    w, w2 = params
    return jnp.sum((x @ w) * dy) + jnp.sum((x2 @ w2) * dy2)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_state_matches_numpy_recipe(rng, algo, margin):
    recipe = mpjax.fp8.DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=algo)
    pol = mpjax.fp8.policy("O1", recipe=recipe)

    def draw(step):
        f = 2.0**step
        x = rng.normal(size=(16, 32)) * f
        if step == 3:
            x = np.zeros_like(x)  # an amax of zero keeps the previous scale
        return [
            (jnp.asarray(rng.normal(size=(32, 16)) / f, jnp.float32),
             jnp.asarray(rng.normal(size=(32, 48)), jnp.float32)),
            jnp.asarray(x, jnp.float32),
            jnp.asarray(rng.normal(size=(16, 16)) * 3 * f, jnp.float32),
            jnp.asarray(rng.normal(size=(32, 32)), jnp.float32),
            jnp.asarray(rng.normal(size=(32, 48)) / f, jnp.float32),
        ]  # fmt: skip

    steps = [draw(i) for i in range(5)]
    state = mpjax.fp8.init(_two_site_loss, pol, *steps[0])
    assert state.num_sites == 2
    step_fn = jax.jit(mpjax.fp8.scaled_value_and_grad(_two_site_loss, pol))
    expected = []
    for (w, w2), x, dy, x2, dy2 in steps:
        state = step_fn(state, (w, w2), x, dy, x2, dy2)[2]
        # what each dot sees: bfloat16 operands; its output gradient is dy (in bfloat16)
        expected.append(
            np.array(
                [[np.abs(_bf16(a)).max() for a in (x, w, dy)],
                 [np.abs(_bf16(a)).max() for a in (x2, w2, dy2)]],
                np.float32,
            )
        )  # fmt: skip
    scale, hist = _oracle(expected, 3, margin, algo)
    np.testing.assert_allclose(np.asarray(state.amax_history), hist, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(state.scale), scale, rtol=1e-3)
    assert state.scale.dtype == jnp.float32 and state.amax_history.dtype == jnp.float32


def test_no_retrace_after_first_step(rng):
    traces = []

    def loss(w, x):
        traces.append(1)
        return jnp.mean((x @ w) ** 2)

    pol = mpjax.fp8.policy("O1", recipe=mpjax.fp8.DelayedScaling(amax_history_len=4))
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    state = mpjax.fp8.init(loss, pol, w, x)
    traces.clear()
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    for _ in range(4):
        _, g, new = step(state, w, x)
        assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
        for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(state)):
            assert a.shape == b.shape and a.dtype == b.dtype
        state, w = new, w - 0.01 * g
    assert len(traces) == 1


def test_merge_keeps_the_max_amax(rng):
    recipe = mpjax.fp8.DelayedScaling(margin=1, amax_history_len=2)
    pol = mpjax.fp8.policy("O1", recipe=recipe)
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    xs = [jnp.asarray(rng.normal(size=(16, 32)) * f, jnp.float32) for f in (1.0, 5.0, 2.0)]
    dys = [jnp.asarray(rng.normal(size=(16, 16)) * f, jnp.float32) for f in (3.0, 1.0, 2.0)]
    state = mpjax.fp8.init(_loss, pol, w, xs[0], dys[0])
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(_loss, pol))
    news = [step(state, w, x, dy)[2] for x, dy in zip(xs, dys)]
    merged = jax.jit(mpjax.fp8.merge)(news)
    amax = np.array(
        [[max(np.abs(_bf16(x)).max() for x in xs), np.abs(_bf16(w)).max(),
          max(np.abs(_bf16(d)).max() for d in dys)]], np.float32
    )  # fmt: skip
    scale, hist = _oracle([amax], 2, 1, "max")
    np.testing.assert_allclose(np.asarray(merged.amax_history), hist, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(merged.scale), scale, rtol=1e-3)
    # the same as one step on the whole batch
    whole = step(state, w, jnp.concatenate(xs), jnp.concatenate(dys))[2]
    np.testing.assert_allclose(np.asarray(merged.scale), np.asarray(whole.scale), rtol=1e-3)


def test_merge_keeps_previous_scale_where_amax_is_not_finite():
    r = mpjax.fp8.DelayedScaling(amax_history_len=1)
    s0 = mpjax.fp8.FP8State(jnp.full((1, 3), 2.0), jnp.zeros((1, 3, 1)), r)
    a = mpjax.fp8.update(s0, jnp.array([[1.0, 0.0, np.inf]]))
    b = mpjax.fp8.update(s0, jnp.array([[2.0, 0.0, 4.0]]))
    merged = mpjax.fp8.merge([a, b])
    np.testing.assert_allclose(np.asarray(merged.scale), [[224.0, 2.0, 2.0]])


def test_shared_weight_two_sites_by_hand():
    # One weight used by two dots is two sites, each with its own amax (nothing summed).
    w = jnp.ones((16, 16), jnp.float32)
    x1 = jnp.full((16, 16), 2.0, jnp.float32)
    x2 = jnp.full((16, 16), 3.0, jnp.float32)

    def loss(w, x1, x2):
        return jnp.sum(x1 @ w) * 0.5 + jnp.sum(x2 @ w) * 0.25

    pol = mpjax.fp8.policy("O1", recipe=mpjax.fp8.DelayedScaling(amax_history_len=1))
    state = mpjax.fp8.init(loss, pol, w, x1, x2)
    _, grads, state = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, w, x1, x2)
    np.testing.assert_array_equal(
        np.asarray(state.amax_history[..., 0]), [[2.0, 1.0, 0.5], [3.0, 1.0, 0.25]]
    )
    # dL/dw = x1^T 0.5 + x2^T 0.25 = 16 * (1 + 0.75)
    np.testing.assert_allclose(np.asarray(grads), np.full((16, 16), 28.0))


def test_small_dots_and_while_bodies_stay_in_half(rng):
    def loss(w, x, m):
        small = x[:8] @ w  # 8 rows: not a multiple of 16
        # A while loop (no reverse-mode gradient to carry amaxes out): its dot stays in half.
        _, h = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ m), (0, x))
        return jnp.sum(small * small) + jnp.sum(jnp.tanh(h) * w[:16])

    pol = mpjax.fp8.policy("O1")
    w = jnp.asarray(rng.normal(size=(32, 32)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    m = jnp.asarray(rng.normal(size=(32, 32)) * 0.2, jnp.float32)
    with pytest.warns(UserWarning, match="no dot_general that can run in FP8"):
        state = mpjax.fp8.init(loss, pol, w, x, m)
    assert state.num_sites == 0
    value, grads, _ = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, w, x, m)
    ref_value, ref_grads = jax.value_and_grad(mpjax.autocast(loss, pol.base))(w, x, m)
    # bfloat16-level agreement (XLA may fuse the two programs differently); FP8 would be ~5% off
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(ref_grads), rtol=2e-2, atol=2e-2)


def _branchy(branch):
    """x @ w0, then branch k of lax.switch: (c_k h) @ w_{k+1}; the loss is the mean."""
    c = (1.0, 2.0, 0.5)

    def loss(ws, x):
        h = x @ ws[0]
        fns = [lambda h, k=k: (c[k] * h) @ ws[k + 1] for k in range(3)]
        return jnp.mean(jax.lax.switch(branch, fns, h))

    return loss


@pytest.mark.parametrize("branch", [0, 1, 2])
def test_switch_branch_sites_by_hand(branch):
    # x = 1 (16x32), w0 = 1/4, so h = 8; branch k scales h by c_k = (1, 2, 1/2) and multiplies
    # by w_{k+1} = 2^-(k+1). Every value is a power of two, exact in FP8 at scale 1. Site 0 is
    # the top dot, sites 1-3 the branches in index order; the taken branch's site sees input
    # amax 8 c_k, kernel amax 2^-(k+1) and output-gradient amax 1/(16*32); site 0 sees the
    # gradient c_k 2^-(k+1) 32 / 512. The branches not taken see nothing: amax 0, scale kept.
    x = jnp.ones((16, 32), jnp.float32)
    ws = [jnp.full((32, 32), 0.25, jnp.float32)]
    ws += [jnp.full((32, 32), 2.0 ** -(k + 1), jnp.float32) for k in range(3)]
    pol = mpjax.fp8.policy("O1", recipe=mpjax.fp8.DelayedScaling(amax_history_len=1))
    loss = _branchy(jnp.int32(branch))
    state = mpjax.fp8.init(loss, pol, ws, x)
    assert state.num_sites == 4
    value, grads, new = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, ws, x)
    c, kmax, g = (1.0, 2.0, 0.5)[branch], 2.0 ** -(branch + 1), 1.0 / 512
    expected = np.zeros((4, 3))
    expected[0] = [1.0, 0.25, c * kmax * 32 * g]
    expected[1 + branch] = [8.0 * c, kmax, g]
    np.testing.assert_array_equal(np.asarray(new.amax_history[..., 0]), expected)
    seen = expected > 0
    np.testing.assert_array_equal(
        np.asarray(new.scale)[seen], (F8MAX * np.ones((4, 1)))[seen] / expected[seen]
    )
    np.testing.assert_array_equal(np.asarray(new.scale)[~seen], 1.0)
    ref_value, ref_grads = jax.value_and_grad(_branchy(branch))(ws, x)  # float32
    np.testing.assert_array_equal(float(value), float(ref_value))
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
    # The audit shows all four dots in FP8 (a cond lowers every branch).
    report = mpjax.audit(mpjax.fp8.apply(loss, pol), new, ws, x)
    assert len(report.fp8_matmuls) == 4


def test_cond_sites_on_random_inputs_follow_the_taken_branch(rng):
    def loss(ws, x, pick):
        h = jnp.tanh(x @ ws[0])
        h = jax.lax.cond(pick, lambda h: jnp.tanh(h @ ws[1]), lambda h: h @ ws[2] * 2.0, h)
        return jnp.mean(h * h)

    ws = [jnp.asarray(rng.normal(size=(32, 32)) * 0.2, jnp.float32) for _ in range(3)]
    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    pol = mpjax.fp8.policy("O2")
    state = mpjax.fp8.init(loss, pol, ws, x, True)
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    for pick in (True, False):
        value, grads, new = step(state, ws, x, pick)
        ref_value, ref_grads = jax.value_and_grad(loss)(ws, x, pick)  # float32
        assert abs(float(value) - float(ref_value)) <= 5e-2 * abs(float(ref_value))
        taken, other = (2, 1) if pick else (1, 2)  # branches in index order: false, true
        assert np.all(np.asarray(new.amax_history[taken, :, 0]) > 0)
        np.testing.assert_array_equal(np.asarray(new.amax_history[other]), 0.0)
        unused = 2 if pick else 1  # the weight of the branch not taken gets no gradient
        np.testing.assert_array_equal(np.asarray(grads[unused]), 0.0)
        for i in (0, 3 - unused):
            a, b = np.ravel(grads[i]), np.ravel(ref_grads[i])
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.95


def _scan_layers(ws, x):
    def body(h, w):
        return h @ w, None

    return jax.lax.scan(body, x, ws)[0]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_scan_site_amax_is_max_over_layers_by_hand(jit):
    # Three layers h <- h @ (c_l * I) with c = (2, 4, 1/2), x = 1 and dL/dh_3 = 1, so each
    # layer sees input amax (1, 2, 8), kernel amax (2, 4, 1/2) and output-gradient amax
    # (c_3 c_2, c_3, 1) = (2, 1/2, 1): powers of two, exact in FP8 at scale 1.
    def loss(ws, x, dy):
        return jnp.sum(_scan_layers(ws, x) * dy)

    c = jnp.array([2.0, 4.0, 0.5], jnp.float32)
    ws = c[:, None, None] * jnp.eye(32, dtype=jnp.float32)
    x = jnp.ones((32, 32), jnp.float32)
    dy = jnp.ones((32, 32), jnp.float32)
    pol = mpjax.fp8.policy("O1", recipe=mpjax.fp8.DelayedScaling(amax_history_len=2))
    state = mpjax.fp8.init(loss, pol, ws, x, dy)
    assert state.num_sites == 1  # one dot in the body, however many times it runs
    step = mpjax.fp8.scaled_value_and_grad(loss, pol)
    step = jax.jit(step) if jit else step
    value, grads, new = step(state, ws, x, dy)
    amax = np.asarray(new.amax_history[0, :, 0])
    np.testing.assert_array_equal(amax, [8.0, 4.0, 2.0])  # the max over the layers
    assert not np.allclose(amax, [11.0, 6.5, 3.5])  # not their sum
    np.testing.assert_array_equal(np.asarray(new.scale[0]), F8MAX / amax)
    ref_value, ref_grads = jax.value_and_grad(mpjax.autocast(loss, pol.base))(ws, x, dy)
    np.testing.assert_array_equal(float(value), float(ref_value))
    np.testing.assert_array_equal(np.asarray(grads), np.asarray(ref_grads))
    out = mpjax.fp8.apply(_scan_layers, pol)(mpjax.fp8.init(_scan_layers, pol, ws, x), ws, x)
    np.testing.assert_array_equal(np.asarray(out), np.full((32, 32), 4.0))


def _unrolled(kind):
    def run(ws, x):
        ws = ws.reshape(-1, *ws.shape[-2:])
        for w in ws[::-1] if kind == "reverse" else ws:
            x = x @ w
        return x

    return run


def _scanned(kind):
    def layer(h, w):
        return h @ w, None

    def run(ws, x):
        if kind == "nested":  # blocks of layers: a scan in a scan
            return jax.lax.scan(lambda h, wb: (jax.lax.scan(layer, h, wb)[0], None), x, ws)[0]
        if kind == "remat":
            return jax.lax.scan(jax.checkpoint(layer), x, ws)[0]
        if kind == "checkpointed":  # the whole scan under remat
            return jax.checkpoint(lambda ws, x: jax.lax.scan(layer, x, ws)[0])(ws, x)
        unroll = 2 if kind == "unroll" else 1
        return jax.lax.scan(layer, x, ws, reverse=kind == "reverse", unroll=unroll)[0]

    return run


@pytest.mark.parametrize("kind", ["scan", "reverse", "unroll", "remat", "checkpointed", "nested"])
def test_scan_site_matches_unrolled_layers(rng, kind):
    # Layers of signed permutations times powers of two, on FP8-grid inputs: every value is
    # exact in FP8 at scale 1, so the scan's one site must see exactly the max, per tensor, of
    # what the unrolled layers' sites see, and both must give the bfloat16 reference's numbers.
    shape = (2, 3, 32, 32) if kind == "nested" else (3, 32, 32)
    n = int(np.prod(shape[:-2]))
    perms = [np.eye(32)[rng.permutation(32)] * rng.choice([-1.0, 1.0], 32) for _ in range(n)]
    c = np.array([2.0, 0.5, 4.0, 0.25, 2.0, 0.5])[:n]  # values stay in FP8's normal range
    ws = jnp.asarray((np.stack(perms) * c[:, None, None]).reshape(shape), jnp.float32)
    x = _fp8_grid(rng, (16, 32), E4M3, lo=0.5)
    dy = _fp8_grid(rng, (16, 32), E5M2, lo=0.05, hi=1.0)
    pol = mpjax.fp8.policy("O1", recipe=mpjax.fp8.DelayedScaling(amax_history_len=1))

    def top(run):  # a top-level dot before the layers: site 0
        return lambda ws, x, dy: jnp.sum(run(ws, x @ ws.reshape(-1, 32, 32)[0]) * dy)

    scan_loss, unrolled_loss = top(_scanned(kind)), top(_unrolled(kind))
    state = mpjax.fp8.init(scan_loss, pol, ws, x, dy)
    state_u = mpjax.fp8.init(unrolled_loss, pol, ws, x, dy)
    assert state.num_sites == 2 and state_u.num_sites == 1 + n
    value, grads, new = jax.jit(mpjax.fp8.scaled_value_and_grad(scan_loss, pol))(state, ws, x, dy)
    value_u, grads_u, new_u = jax.jit(mpjax.fp8.scaled_value_and_grad(unrolled_loss, pol))(
        state_u, ws, x, dy
    )
    amax, amax_u = np.asarray(new.amax_history[..., 0]), np.asarray(new_u.amax_history[..., 0])
    np.testing.assert_array_equal(amax[0], amax_u[0])
    np.testing.assert_array_equal(amax[1], amax_u[1:].max(axis=0))
    assert np.all(amax[1] < amax_u[1:].sum(axis=0))
    np.testing.assert_array_equal(float(value), float(value_u))
    np.testing.assert_array_equal(np.asarray(grads), np.asarray(grads_u))
    ref_value, ref_grads = jax.value_and_grad(mpjax.autocast(scan_loss, pol.base))(ws, x, dy)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads), np.asarray(ref_grads), rtol=1e-6)


def test_vmap_and_has_aux(rng):
    pol = mpjax.fp8.policy("O2")

    def loss(w, x):
        y = x @ w
        return jnp.mean(y**2), y

    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(4, 16, 32)), jnp.float32)
    state = mpjax.fp8.init(lambda w, x: loss(w, x)[0], pol, w, xs[0])
    f = mpjax.fp8.scaled_value_and_grad(lambda w, x: loss(w, x)[0], pol)
    # Against eager per-example runs: the vmapped compilation keeps every rounding (exact_jit).
    (losses, grads, states) = exact_jit(jax.vmap(f, in_axes=(None, None, 0)))(state, w, xs)
    for i in range(4):
        li, gi, si = f(state, w, xs[i])
        np.testing.assert_allclose(float(losses[i]), float(li), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grads[i]), np.asarray(gi), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(states.scale[i]), np.asarray(si.scale), rtol=1e-6)
    (value, aux), _, _ = mpjax.fp8.scaled_value_and_grad(loss, pol, has_aux=True)(state, w, xs[0])
    np.testing.assert_allclose(float(value), float(jnp.mean(aux**2)), rtol=1e-6)
    assert aux.dtype == jnp.float32  # outputs in the base policy's output dtype


def test_errors():
    with pytest.raises(ValueError, match="most_recent"):
        mpjax.fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="half-precision base"):
        mpjax.fp8.FP8Policy(mpjax.Policy.from_level("O0"))
    with pytest.raises(TypeError, match="FP8Policy"):
        mpjax.fp8.scaled_value_and_grad(_loss, mpjax.Policy.from_level("O1"))
    pol = mpjax.fp8.policy()
    w, x = jnp.ones((32, 16)), jnp.ones((16, 32))
    state = mpjax.fp8.init(lambda w, x: jnp.sum(x @ w), pol, w, x)
    with pytest.raises(ValueError, match="dot sites"):
        mpjax.fp8.scaled_value_and_grad(lambda w, x: jnp.sum(x @ w @ w.T), pol)(state, w, x)


def test_current_scaling_quantizes_each_tensor_with_its_own_amax(rng):
    """With a fresh delayed-scaling state (scale 1) an input of magnitude 4000 saturates at
    E4M3's 448; current scaling takes this step's amax and keeps it, forward and backward.
    The state records the step's amaxes and its scales follow them."""
    x = jnp.asarray(rng.normal(size=(32, 64)) * 1000.0, jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 48)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    errors = {}
    for name, recipe in (("delayed", None), ("current", mpjax.fp8.CurrentScaling())):
        pol = mpjax.fp8.policy("O1", recipe=recipe)
        state = mpjax.fp8.init(_loss, pol, w, x, dy)
        out = jax.jit(mpjax.fp8.apply(lambda w, x: x @ w, pol))(state, w, x)
        errors[name] = np.linalg.norm(np.asarray(out, np.float64) - exact) / np.linalg.norm(exact)
        loss, grads, new = jax.jit(mpjax.fp8.scaled_value_and_grad(_loss, pol))(state, w, x, dy)
        ref = jax.grad(_loss)(w, x, dy)
        grad_err = float(jnp.linalg.norm(grads - ref) / jnp.linalg.norm(ref))
        if name == "current":
            assert errors[name] < 0.06 and grad_err < 0.08, (errors[name], grad_err)
            # the amaxes of the operands the dot takes: cast to bfloat16 first (O1)
            amax = np.asarray(new.amax_history[0, :, 0])
            np.testing.assert_allclose(amax[:2], [np.abs(x).max(), np.abs(w).max()], rtol=2**-8)
            np.testing.assert_allclose(np.asarray(new.scale[0, :2]), 448.0 / amax[:2], rtol=1e-6)
    assert errors["delayed"] > 0.5  # saturated at 448 where values reach ~4000


def test_current_scaling_of_a_zero_or_inf_tensor_quantizes_at_scale_one():
    pol = mpjax.fp8.policy("O2", recipe=mpjax.fp8.CurrentScaling())
    w, dy = jnp.ones((32, 16)), jnp.ones((16, 16))
    state = mpjax.fp8.init(_loss, pol, w, jnp.zeros((16, 32)), dy)
    assert state.num_sites == 1
    loss, grads, _ = mpjax.fp8.scaled_value_and_grad(_loss, pol)(state, w, jnp.zeros((16, 32)), dy)
    assert float(loss) == 0.0 and bool(jnp.isfinite(grads).all())
    x = jnp.ones((16, 32)).at[0, 0].set(jnp.inf)
    out = mpjax.fp8.apply(lambda w, x: x @ w, pol)(state, w, x)
    assert bool(jnp.isfinite(out).all())  # the inf saturated at E4M3's maximum


def test_row_scaling_keeps_small_rows_that_one_tensor_scale_loses(rng):
    """Rows of magnitudes 2^-12..2^6: one scale per tensor flushes the small rows to E4M3's
    subnormals (or zero); a scale per row keeps each row's output within float8's rounding,
    and both gradients close to float64's."""
    x = rng.normal(size=(32, 64)) * np.exp2(np.linspace(-12, 6, 32))[:, None]
    w = rng.normal(size=(64, 48)) * 0.1
    dy = rng.normal(size=(32, 48))
    x, w, dy = (jnp.asarray(a, jnp.float32) for a in (x, w, dy))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    gw_ref, gx_ref = (np.asarray(g, np.float64) for g in jax.grad(_loss, (0, 1))(w, x, dy))
    row_err = lambda a, b: np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    worst = {}
    for granularity in ("tensor", "row"):
        pol = mpjax.fp8.policy("O1", recipe=mpjax.fp8.CurrentScaling(granularity=granularity))
        state = mpjax.fp8.init(_loss, pol, w, x, dy)
        out = jax.jit(mpjax.fp8.apply(lambda w, x: x @ w, pol))(state, w, x)
        worst[granularity] = row_err(np.asarray(out, np.float64), exact).max()
        if granularity == "row":
            _, gw, new = jax.jit(mpjax.fp8.scaled_value_and_grad(_loss, pol))(state, w, x, dy)
            gx = jax.jit(jax.grad(mpjax.fp8.apply(_loss, pol), 2))(state, w, x, dy)
            rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
            assert rel(gw, gw_ref) < 0.08 and rel(gx, gx_ref) < 0.08
            # the state records each tensor's amax, as per-tensor scaling does
            amax = np.asarray(new.amax_history[0, :, 0])
            np.testing.assert_allclose(amax[:2], [np.abs(x).max(), np.abs(w).max()], rtol=2**-8)
    # The worst row's error over 300 draws: mean 4.9%, largest 6.3% (1 in 100 above 6%).
    assert worst["row"] < 0.08 < 0.5 < worst["tensor"], worst


@pytest.mark.parametrize(
    "spec,lhs_shape,rhs_shape",
    [
        ("bij,bjk->bik", (2, 32, 48), (2, 48, 16)),  # batched (attention-like)
        ("ijk,jkl->il", (16, 4, 8), (4, 8, 32)),  # two contracting axes (DenseGeneral)
        ("ki,kj->ij", (48, 16), (48, 32)),  # contracting the lhs's first axis
    ],
)
def test_row_scaling_follows_any_dimension_numbers(rng, spec, lhs_shape, rhs_shape):
    a = jnp.asarray(rng.normal(size=lhs_shape), jnp.float32)
    b = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
    f = lambda a, b: jnp.einsum(spec, a, b)
    loss = lambda a, b: jnp.sum(f(a, b) ** 2) * 0.5
    pol = mpjax.fp8.policy(
        "O1", recipe=mpjax.fp8.CurrentScaling(granularity="row"), batched_dots=True
    )
    state = mpjax.fp8.init(loss, pol, a, b)
    assert state.num_sites == 1
    out = jax.jit(mpjax.fp8.apply(f, pol))(state, a, b)
    ref = np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert out.shape == ref.shape
    assert np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref) < 0.06
    ga, gb = jax.jit(jax.grad(mpjax.fp8.apply(loss, pol), (1, 2)))(state, a, b)
    ra, rb = jax.grad(loss, (0, 1))(a, b)
    for g, r in ((ga, ra), (gb, rb)):
        assert g.shape == r.shape
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 0.1


@pytest.mark.parametrize("dtype", [jnp.float8_e5m2, "float8_e4m3fn"])
def test_a_float8_base_dtype_is_refused_with_the_roles(dtype):
    with pytest.raises(ValueError, match="fixed by role: E4M3 .* E5M2"):
        mpjax.fp8.policy("O2", dtype)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_scale_that_is_zero_or_not_finite_is_refused(bad):
    with pytest.raises(ValueError, match="must be positive and finite.*mpjax.fp8.init"):
        mpjax.fp8.qdq(jnp.ones(3), E4M3, jnp.float32(bad))
    pol = mpjax.fp8.policy("O2")
    w, x, dy = jnp.ones((32, 16)), jnp.ones((16, 32)), jnp.ones((16, 16))
    state = mpjax.fp8.init(_loss, pol, w, x, dy)
    broken = mpjax.fp8.FP8State(state.scale.at[0, 1].set(bad), state.amax_history, state.recipe)
    with pytest.raises(ValueError, match="the FP8 state's scales must be positive and finite"):
        mpjax.fp8.scaled_value_and_grad(_loss, pol)(broken, w, x, dy)
    with pytest.raises(ValueError, match="the FP8 state's scales must be positive and finite"):
        mpjax.fp8.apply(lambda w, x: x @ w, pol)(broken, w, x)


def test_a_granularity_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="granularity must be 'tensor' or 'row'"):
        mpjax.fp8.CurrentScaling(granularity="block")


def test_a_recipe_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="recipe must be mpjax.fp8.DelayedScaling"):
        mpjax.fp8.policy("O2", recipe="current")
    with pytest.raises(ValueError, match="margin must be >= 0"):
        mpjax.fp8.CurrentScaling(margin=-1)


# -- MXFP8 ---------------------------------------------------------------------------------------


def _mx_reference(x, axis):
    """NumPy's MXFP8 round trip of `x` along `axis`: blocks of 32, each scaled by the power of
    two that its amax / 448 rounds up to, values rounded to E4M3 by the installed JAX's
    conversion (JAX 0.6's rounds some values of float32 otherwise than ml_dtypes does)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448)), 1.0)
    scaled = jnp.asarray(np.clip(blocks / scale, -448, 448), jnp.float32)
    q = np.asarray(scaled.astype(jnp.float8_e4m3fn), np.float64)
    return np.moveaxis((q * scale).reshape(x.shape), -1, axis)


def test_mxfp8_scales_each_block_of_32_by_a_power_of_two_rounded_up():
    """One scale per 32 consecutive elements along the contraction: amax / 448 rounded up to a
    power of two, so nothing saturates; a block of zeros has scale 1; one outlier coarsens its
    own block only (a per-tensor scale would flush the small blocks' values)."""
    from mpjax._src.float8.fp8_dot import mx_quantize

    x = jax.random.normal(jax.random.key(0), (4, 128)) * 1e-3
    x = x.at[0, 5].set(3000.0).at[2, 32:64].set(0.0)
    q, scale, amax = mx_quantize(x, axis=1)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (4, 4) and float(amax) == 3000.0
    s = np.asarray(scale)
    assert np.all(np.frexp(s)[0] == 0.5)  # exact powers of two (E8M0)
    assert s[0, 0] == 2.0 ** np.ceil(np.log2(3000 / 448)) and s[2, 1] == 1.0
    blocks = np.abs(np.asarray(x)).reshape(4, 4, 32).max(-1)
    assert np.all(blocks / s <= 448) and np.all((blocks / s > 224) | (blocks == 0))
    back = np.asarray(q, np.float64).reshape(4, 4, 32) * s[..., None]
    np.testing.assert_array_equal(back.reshape(4, 128), _mx_reference(x, 1))
    small = np.asarray(x)[1]
    assert np.max(np.abs(back.reshape(4, 128)[1] - small) / np.abs(small)) <= 2.0**-4


def test_the_quantizing_kernels_run_where_the_traced_for_gpu_has_them():
    """What a program is traced for decides which quantizing kernels it gets: the H100
    (compute capability 9.0) writes float8 from its own kernels but scales no blocks, the
    B200 (10.0) does both, this machine's CPU neither; and they run only in a program for
    one device (a compile-only target is one)."""
    from mpjax._src import hardware
    from mpjax._src.tools import gpu_program

    for target, capability, blocks in (("h100", 9.0, False), ("b200", 10.0, True)):
        with hardware.tracing_for(gpu_program.target_config(target)):
            assert hardware.traced_capability() == capability
            assert hardware.fp8_kernels() and hardware.block_scaled_gemms() == blocks
        assert hardware.one_device()  # a compile-only target is one GPU
    if jax.default_backend() == "cpu":
        assert hardware.traced_capability() is None and not hardware.fp8_kernels()


@pytest.mark.parametrize("q_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_per_row_quantizing_kernel_is_the_emulations_numbers(q_dtype):
    """The Pallas kernel a GPU with float8 kernels quantizes per-row operands with (both
    copies from one read, run here by Pallas's interpreter) gives XLA's numbers bit for bit:
    each row and each column with its own current scale, a row of zeros (scale 1), an inf
    (saturates), the copy along the rows transposed."""
    from mpjax._src.float8.fp8_dot import _rows_both
    from mpjax._src.float8.quantize_kernel import rows_quantize_both

    k1, k2 = jax.random.split(jax.random.key(5))
    x = jax.random.normal(k1, (2, 48, 64)) * jnp.exp(2 * jax.random.normal(k2, (2, 48, 1)))
    x = x.astype(jnp.bfloat16).at[0, 3].set(0).at[1, 7, 9].set(jnp.inf)
    want = _rows_both(x, q_dtype, 0, kernel=False)
    (_, row_scale), (_, col_scale), _ = want
    rows, cols = rows_quantize_both(x, row_scale, col_scale, q_dtype=q_dtype, interpret=True)
    assert rows.dtype == q_dtype and cols.shape == (2, 64, 48)
    as_f32 = lambda v: np.asarray(v, np.float32)
    np.testing.assert_array_equal(as_f32(rows), as_f32(want[0][0]))
    np.testing.assert_array_equal(as_f32(jnp.swapaxes(cols, 1, 2)), as_f32(want[1][0]))


def test_mxfp8_scale_is_the_power_of_two_at_or_above_amax_over_448_exactly():
    """A block whose amax / 448 is a power of two takes that power as its scale, so its
    largest value is stored as 448 exactly. ``ceil(log2(.))`` in float32 rounded some of these
    up one more power (losing a bit of the block's precision); the scale is now made from
    the float32 bits. Any other amax rounds up to the next power."""
    from mpjax._src.float8.fp8_dot import mx_quantize

    exact = [448 * 2.0**e for e in range(-20, 12)]
    above = [v * (1 + 2.0**-10) for v in exact]
    x = jnp.zeros((2 * len(exact), 32)).at[:, 0].set(jnp.array(exact + above))
    q, scale, _ = mx_quantize(x, axis=1)
    want = [2.0**e for e in range(-20, 12)]
    np.testing.assert_array_equal(scale[:, 0], want + [2 * w for w in want])
    assert np.all(np.asarray(q[: len(exact), 0], np.float32) == 448.0)


def test_mxfp8_quantizing_kernel_is_the_emulations_numbers():
    """The Pallas kernel a B200 quantizes with (both orientations from one read, run here by
    Pallas's interpreter) gives mx_quantize's values, scales and amax bit for bit: batched,
    tiles of 32 and 128, heavy-tailed rows, a block of zeros (scale 1), an inf (saturates,
    scale 1), and an amax / 448 that is a power of two."""
    from mpjax._src.float8.fp8_dot import mx_quantize_both
    from mpjax._src.float8.quantize_kernel import mx_quantize_both as kernel

    k1, k2 = jax.random.split(jax.random.key(7))
    spread = jnp.exp(3 * jax.random.normal(k2, (2, 96, 1)))
    x = (jax.random.normal(k1, (2, 96, 256)) * spread).astype(jnp.bfloat16)
    x = x.at[0, 3, :32].set(0).at[1, 5, 40].set(jnp.inf).at[0, 0, 0].set(448 * 2.0**-15)
    want, got = mx_quantize_both(x, False), kernel(x, interpret=True)
    for (wq, ws), (gq, gs) in zip(want[:2], got[:2]):
        assert gq.dtype == jnp.float8_e4m3fn and gs.dtype == jnp.float8_e8m0fnu
        np.testing.assert_array_equal(np.asarray(gq, np.float32), np.asarray(wq, np.float32))
        np.testing.assert_array_equal(np.asarray(gs, np.float32), np.asarray(ws, np.float32))
    assert got[1][0].shape == (2, 256, 96) and got[1][1].shape == (2, 256, 3)
    assert float(got[2]) == float(want[2]) == np.inf


@pytest.mark.parametrize("cudnn", [False])
def test_mxfp8_quantizes_each_operand_along_each_gemms_contraction(cudnn):
    """The forward gemm and both gradient gemms are E4M3 with each operand quantized from its
    full-precision value along the axis that gemm contracts, as the recipe has it: mpjax's
    numbers are NumPy's reference of the recipe. A transposed forward copy (the input
    quantized along K, reused for the weight gradient that contracts M) gives other numbers."""
    from mpjax._src.float8.fp8_dot import fp8_dot_mx

    ka, kb, kg = jax.random.split(jax.random.key(1), 3)
    # [M, K], its columns alternately of size 1 and 1e-6: blocks along K hold both sizes
    a = jax.random.normal(ka, (64, 96)) * 10.0 ** (-6 * (jnp.arange(96) % 2))
    b = jax.random.normal(kb, (96, 32))  # [K, N]
    g = jax.random.normal(kg, (64, 32)) * 1e-3  # the output's cotangent
    dims = (((1,), (0,)), ((), ()))
    out, vjp = jax.vjp(lambda a, b: fp8_dot_mx(dims, jnp.float32, cudnn, a, b, jnp.zeros(3)), a, b)
    da, db = vjp(g)
    np.testing.assert_allclose(out, _mx_reference(a, 1) @ _mx_reference(b, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        da, _mx_reference(g, 1) @ _mx_reference(b, 1).T, rtol=1e-5, atol=1e-9
    )
    want_db = _mx_reference(a, 0).T @ _mx_reference(g, 0)
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-7)
    transposed = _mx_reference(a, 1).T @ _mx_reference(g, 0)  # the small columns flushed
    tiny = np.abs(want_db[1::2])
    assert np.max(np.abs(transposed - want_db)[1::2]) > 0.5 * np.max(tiny)
    np.testing.assert_allclose(np.asarray(db)[1::2], want_db[1::2], rtol=1e-5, atol=1e-12)


def test_mxfp8_recipe_runs_e4m3_only_and_leaves_dots_off_the_blocks_in_half():
    """Under MXFP8BlockScaling every FP8 gemm is E4M3 (no E5M2 gradient), a dot whose sizes do
    not divide into blocks of 32 (48 wide here) is no site and runs in the base half, the
    audit counts the emulated gemms as FP8 ones, and describe shows each site's amaxes."""
    w1 = jax.random.normal(jax.random.key(2), (64, 48)) / 8
    w2 = jax.random.normal(jax.random.key(3), (48, 64)) / 8
    w3 = jax.random.normal(jax.random.key(4), (64, 32)) / 8
    x = jax.random.normal(jax.random.key(5), (32, 64))
    loss = lambda p, x: jnp.mean((jax.nn.relu(jax.nn.relu(x @ p[0]) @ p[1]) @ p[2]) ** 2)
    params = (w1, w2, w3)
    pol = mpjax.fp8.policy("O2", recipe=mpjax.fp8.MXFP8BlockScaling())
    state = mpjax.fp8.init(loss, pol, params, x)
    assert state.num_sites == 1  # x @ w1 and h @ w2 are 48 wide: only h @ w3 divides
    assert mpjax.fp8.policy("O2").recipe != pol.recipe
    assert mpjax.fp8.init(loss, mpjax.fp8.policy("O2"), params, x).num_sites == 3
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    value, grads, state = step(state, params, x)
    text = str(jax.make_jaxpr(step)(state, params, x))
    assert "f8_e4m3fn" in text and "f8_e5m2" not in text
    report = mpjax.audit(step, state, params, x)
    # its forward gemm, its input's gradient and its weight's
    assert [m.fp8_dtypes for m in report.fp8_matmuls] == [("float8_e4m3fn",) * 2] * 3
    row = mpjax.fp8.describe(state)[0]
    # the float32 weight's: a block recipe quantizes the master weight, not its half copy
    kernel_amax = float(jnp.abs(w3).max())
    assert row["input_amax"] > 0 and row["kernel_amax"] == kernel_amax
    ref_value, ref_grads = jax.value_and_grad(loss)(params, x)
    assert abs(float(value) / float(ref_value) - 1) < 0.03
    for got, want in zip(grads, ref_grads, strict=True):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.06
