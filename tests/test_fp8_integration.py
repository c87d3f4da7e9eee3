"""mpjax.fp8 with the rest of mpjax: Flax wrappers, the optax chain, transforms, audit, overflow."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_bit_identical, eqns, exact_jit
from flax import nnx

import mpjax
import mpjax.flax
import mpjax.fp8

F32 = np.dtype(np.float32)
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


@pytest.fixture(autouse=True)
def _no_hardware_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mpjax.HardwareWarning)
        yield


class MLP(nn.Module):
    """Three Dense layers whose sizes are multiples of 16 (FP8 sites), a LayerNorm between."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64)(x)
        x = nn.relu(nn.LayerNorm()(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(16)(x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l0 = nnx.Linear(48, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.l1 = nnx.Linear(64, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.l0(x)))
        return self.l2(nnx.relu(self.l1(x)))


def _data(rng, scale=1.0):
    x = jnp.asarray(rng.normal(size=(32, 48)) * scale, jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    return x, y


def _linen(pol, rng, rules=None, model=None):
    wrapped = mpjax.flax.wrap(model or MLP(), pol, rules=rules)
    x, y = _data(rng)
    params = wrapped.init(jax.random.key(int(rng.integers(1 << 30))), x)["params"]

    def loss(p, x, y):
        return jnp.mean((wrapped.apply({"params": p}, x) - y) ** 2)

    return loss, params, x, y


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _cos(a, b):
    a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
    return a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def _steps(loss, pol, state, params, x, y, n=3, exact=False):
    step = (exact_jit if exact else jax.jit)(mpjax.fp8.scaled_value_and_grad(loss, pol))
    for _ in range(n):
        value, grads, state = step(state, params, x, y)
    return value, grads, state


def _train_step(loss, pol, tx):
    """A jitted step: FP8 gradients, then the optax update; the FP8 state threaded beside."""

    @jax.jit
    def train_step(params, opt_state, fp8_state, x, y):
        grad_fn = mpjax.fp8.scaled_value_and_grad(loss, pol)
        value, grads, fp8_state = grad_fn(fp8_state, params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fp8_state, value

    return train_step


# -- Flax -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["base_policy", "fp8_policy"])
def test_linen_wrap_runs_dense_dots_in_fp8(rng, form):
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol.base if form == "base_policy" else pol, rng)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    assert state.num_sites == 3  # the three Dense layers
    assert jax.tree_util.tree_leaves(params)[0].dtype == F32  # O2 master weights
    value, grads, state = _steps(loss, pol, state, params, x, y)
    with warnings.catch_warnings():  # the wrapper alone: bf16 O2 (outside mpjax.fp8: it says so)
        warnings.simplefilter("ignore", UserWarning)
        ref_value, ref_grads = jax.value_and_grad(loss)(params, x, y)
    assert _rel(value, ref_value) < 0.05
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        # E5M2 gradients keep 2 mantissa bits, and the LayerNorm backward amplifies what the
        # layers above it lose (bf16 O2 itself is 2-9% off float32 at Dense_0, 0.4% at Dense_2).
        # Over 170 random draws the worst leaf (always Dense_0's kernel) had cosine >= 0.940
        # (median 0.972) and relative distance <= 0.352 to bf16 O2.
        assert g.dtype == F32 and _cos(g, r) > 0.88 and _rel(g, r) < 0.5
    # The delayed-scaling state moved: every tensor's scale is set from a finite amax.
    rows = mpjax.fp8.describe(state)
    assert all(0 < r[f"{t}_amax"] < np.inf for r in rows for t in ("input", "kernel", "grad"))


def test_linen_rules_and_keep_norm_fp32_still_apply(rng):
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol, rng, rules={"Dense_1": "O0"})
    state = mpjax.fp8.init(loss, pol, params, x, y)
    assert state.num_sites == 2  # Dense_1 stays in float32, out of FP8
    report = mpjax.audit(mpjax.fp8.apply(loss, pol), state, params, x, y)
    dtypes = [m.operand_dtypes for m in report.matmuls]
    assert dtypes.count(("float32", "float32")) == 1 and len(report.fp8_matmuls) == 2

    def f32_elementwise(pol):
        loss, params, x, y = _linen(pol, rng)
        state = mpjax.fp8.init(loss, pol, params, x, y)
        jaxpr = jax.make_jaxpr(mpjax.fp8.apply(loss, pol))(state, params, x, y).jaxpr
        found = [e for e in eqns(jaxpr) if e.primitive.name in ("mul", "add")]
        return sum(all(v.aval.dtype == F32 for v in e.invars) for e in found)

    off = mpjax.fp8.FP8Policy(mpjax.Policy.from_level("O2", "bfloat16", keep_norm_fp32=False))
    # The LayerNorm's scale and shift run in float32 only when kept (its statistics always).
    assert f32_elementwise(pol) >= f32_elementwise(off) + 2


def test_a_half_level_rule_other_than_the_base_stays_out_of_fp8(rng):
    pol = mpjax.fp8.policy("O2")
    o1_f16 = mpjax.Policy.from_level("O1", "float16")
    loss, params, x, y = _linen(pol, rng, rules={"Dense_1": o1_f16})
    state = mpjax.fp8.init(loss, pol, params, x, y)
    assert state.num_sites == 2  # Dense_1 runs its own policy (O1 float16), not FP8
    report = mpjax.audit(mpjax.fp8.apply(loss, pol), state, params, x, y)
    dtypes = [m.operand_dtypes for m in report.matmuls]
    assert dtypes.count(("float16", "float16")) == 1 and len(report.fp8_matmuls) == 2


def test_nnx_split_merge_params_train_in_fp8(rng):
    pol = mpjax.fp8.policy("O2")
    model = mpjax.flax.wrap(NNXMLP(nnx.Rngs(int(rng.integers(1 << 30)))), pol)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = _data(rng)

    def loss(params, x, y):
        return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

    state = mpjax.fp8.init(loss, pol, params, x, y)
    assert state.num_sites == 3
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)

    train_step = _train_step(loss, pol, tx)

    losses = []
    for _ in range(20):
        params, opt_state, state, value = train_step(params, opt_state, state, x, y)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0]
    nnx.update(model, params)  # the trained params go back into the module
    np.testing.assert_allclose(
        float(mpjax.fp8.apply(loss, pol)(state, params, x, y)), losses[-1], rtol=0.2
    )
    # A per-module rule keeps that layer in float32 and out of FP8, as for linen.
    ruled = mpjax.flax.wrap(NNXMLP(nnx.Rngs(0)), pol, rules={"l1": "O0"})
    graphdef, params, rest = nnx.split(ruled, nnx.Param, ...)
    assert mpjax.fp8.init(loss, pol, params, x, y).num_sites == 2


class GatedMLP(nn.Module):
    """nn.cond between two Dense heads (Flax lifts it to lax.cond): each head is a site."""

    def setup(self):
        self.body = nn.Dense(64)
        self.head_a, self.head_b = nn.Dense(16), nn.Dense(16)

    def __call__(self, x, use_a):
        h = nn.relu(self.body(x))
        if self.is_initializing():  # nn.cond needs both branches' params made up front
            self.head_a(h), self.head_b(h)
        return nn.cond(use_a, lambda mdl, h: mdl.head_a(h), lambda mdl, h: mdl.head_b(h), self, h)


def test_linen_nn_cond_heads_are_sites_and_the_taken_one_updates(rng):
    pol = mpjax.fp8.policy("O2")
    wrapped = mpjax.flax.wrap(GatedMLP(), pol)
    x, y = _data(rng)
    params = wrapped.init(jax.random.key(int(rng.integers(1 << 30))), x, True)["params"]
    raw = GatedMLP()

    def loss(p, x, y, use_a, model=wrapped):
        return jnp.mean((model.apply({"params": p}, x, use_a) - y) ** 2)

    state = mpjax.fp8.init(loss, pol, params, x, y, True)
    assert state.num_sites == 3  # the first Dense, then the heads (false branch first)
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    for use_a, taken, head in ((True, 2, "head_a"), (False, 1, "head_b")):
        value, grads, new = step(state, params, x, y, use_a)
        ref_value, ref_grads = jax.value_and_grad(loss)(params, x, y, use_a, raw)  # float32
        assert _rel(value, ref_value) < 0.05
        assert np.all(np.asarray(new.amax_history[taken, :, 0]) > 0)
        np.testing.assert_array_equal(np.asarray(new.amax_history[3 - taken]), 0.0)
        np.testing.assert_array_equal(np.asarray(new.scale[3 - taken]), 1.0)
        g, r = grads[head]["kernel"], ref_grads[head]["kernel"]
        assert _cos(g, r) > 0.95


# -- the optax chain and transforms -------------------------------------------------------------


def test_optax_chain_never_sees_the_fp8_state(rng):
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol, rng)
    fp8_state = mpjax.fp8.init(loss, pol, params, x, y)
    tx = mpjax.loss_scale(optax.adamw(1e-3, weight_decay=0.1))
    opt_state = tx.init(params)
    # The optimizer state holds the params' moments and the loss scale, nothing of FP8.
    fp8_shapes = {leaf.shape for leaf in jax.tree_util.tree_leaves(fp8_state)}
    assert not fp8_shapes & {leaf.shape for leaf in jax.tree_util.tree_leaves(opt_state)}
    traces = []

    @exact_jit  # compared with another compilation below
    def train_step(params, opt_state, fp8_state, x, y):
        traces.append(1)
        scale = mpjax.get_loss_scale(opt_state)
        grad_fn = mpjax.fp8.scaled_value_and_grad(lambda p, x, y: scale.scale(loss(p, x, y)), pol)
        value, grads, new_fp8 = grad_fn(fp8_state, params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_fp8, scale.unscale(value)

    for _ in range(3):
        expected = exact_jit(
            lambda o, f, p, x, y: mpjax.fp8.scaled_value_and_grad(
                lambda p, x, y: mpjax.get_loss_scale(o).scale(loss(p, x, y)), pol
            )(f, p, x, y)[2]
        )(opt_state, fp8_state, params, x, y)
        params, new_opt, fp8_state, _ = train_step(params, opt_state, fp8_state, x, y)
        # Only scaled_value_and_grad's new state updates it (the scales outside the step).
        np.testing.assert_allclose(fp8_state.scale, expected.scale, rtol=1e-5)
        np.testing.assert_allclose(fp8_state.amax_history, expected.amax_history, rtol=1e-5)
        assert jax.tree_util.tree_structure(new_opt) == jax.tree_util.tree_structure(opt_state)
        opt_state = new_opt
    assert len(traces) == 1  # scales change, shapes do not: one compilation
    assert int(mpjax.loss_scale_metrics(opt_state)["skipped_steps"]) == 0


@pytest.mark.xfail(
    jax.__version_info__ < (0, 7),
    reason="on JAX 0.6.0 and 0.6.2 the jitted jax.grad of mpjax.fp8.apply differs from the "
    "same function run eagerly (up to one e4m3 step, 4-6% rms on this MLP), with excess "
    "precision off; eager, and the jitted scaled_value_and_grad, agree exactly (JAX 0.10.2: "
    "all agree). Not root-caused.",
    strict=False,
)
def test_grad_of_apply_matches_value_and_grad(rng):
    pol = mpjax.fp8.policy("O1")
    loss, params, x, y = _linen(pol, rng)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    _, _, state = _steps(loss, pol, state, params, x, y, n=1)
    # Two compilations of one computation: compared with every rounding kept (exact_jit).
    _, grads, _ = exact_jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, params, x, y)
    by_grad = exact_jit(jax.grad(lambda p: mpjax.fp8.apply(loss, pol)(state, p, x, y)))(params)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(by_grad)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


class RematMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(64, name="Dense_0")(x)  # MLP's names, so MLP's params
        x = nn.relu(nn.LayerNorm()(x))
        x = nn.relu(nn.remat(nn.Dense)(32, name="Dense_1")(x))
        return nn.Dense(16, name="Dense_2")(x)


@pytest.mark.parametrize("how", ["nn.remat", "jax.checkpoint"])
@pytest.mark.parametrize("granularity", [None, "row"])
def test_remat_keeps_the_sites_and_the_numbers(rng, how, granularity):
    recipe = granularity and mpjax.fp8.CurrentScaling(granularity=granularity)
    pol = mpjax.fp8.policy("O2", recipe=recipe)
    loss, params, x, y = _linen(pol, rng)
    if how == "nn.remat":
        loss_r, params_r, _, _ = _linen(pol, rng, model=RematMLP())
        assert jax.tree_util.tree_structure(params_r) == jax.tree_util.tree_structure(params)
    else:
        loss_r = jax.checkpoint(loss)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    assert mpjax.fp8.init(loss_r, pol, params, x, y).num_sites == state.num_sites == 3
    v, g, s = _steps(loss, pol, state, params, x, y, n=2, exact=True)
    vr, gr, sr = _steps(loss_r, pol, state, params, x, y, n=2, exact=True)
    np.testing.assert_allclose(float(vr), float(v), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(gr), jax.tree_util.tree_leaves(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sr.scale, s.scale, rtol=1e-4)
    np.testing.assert_allclose(sr.amax_history, s.amax_history, rtol=1e-4)


def test_vmap_over_an_ensemble_of_models(rng):
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol, rng)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    members = [MLP().init(jax.random.key(i), x)["params"] for i in range(2)]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *members)
    states = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), state)
    f = mpjax.fp8.scaled_value_and_grad(loss, pol)
    values, grads, new = jax.jit(jax.vmap(f, in_axes=(0, 0, None, None)))(states, stacked, x, y)
    for i, p in enumerate(members):
        vi, gi, si = jax.jit(f)(state, p, x, y)
        # Batched matmuls may sum in another order; FP8 rounding can then flip a few values.
        np.testing.assert_allclose(float(values[i]), float(vi), rtol=1e-3)
        for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(gi)):
            assert _cos(a[i], b) > 0.999 and _rel(a[i], b) < 0.02
        np.testing.assert_allclose(new.scale[i], si.scale, rtol=1e-2)
    with pytest.raises(ValueError, match="batched"):
        mpjax.fp8.describe(new)
    assert len(mpjax.fp8.describe(jax.tree_util.tree_map(lambda a: a[1], new))) == 3


# -- audit and describe ---------------------------------------------------------------------------


def test_audit_reports_the_fp8_dots_of_a_train_step(rng):
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol, rng)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    tx = optax.chain(mpjax.loss_scale(), optax.sgd(0.1))
    opt_state = tx.init(params)

    train_step = _train_step(loss, pol, tx)

    report = mpjax.audit(train_step, params, opt_state, state, x, y)
    fp8 = report.fp8_matmuls
    # Forward: 3 dots; backward: 3 weight gradients and 2 input gradients (the first layer's
    # input needs none): each takes float8 operands (E5M2 gradients backward) and writes its
    # result in bfloat16, which the scales then multiply (XLA folds them into the gemm).
    assert len(fp8) == len(report.matmuls) == 8
    assert sum(m.fp8_dtypes == (E4M3, E4M3) for m in fp8) == 3
    assert all(E5M2 in m.fp8_dtypes for m in fp8 if m.fp8_dtypes != (E4M3, E4M3))
    assert all(m.operand_dtypes == m.fp8_dtypes for m in fp8)
    assert all(m.result_dtype == "bfloat16" for m in fp8)
    assert report.fp8_flop_share == 1.0 and report.to_dict()["fp8_matmuls"] == 8
    assert "in FP8" in str(report) and f"{E5M2} x {E4M3}" in str(report)
    # The wrapper alone (no FP8 state) runs bf16 dots: none counts as FP8.
    with pytest.warns(UserWarning, match="runs outside mpjax.fp8"):
        plain = mpjax.audit(jax.grad(loss), params, x, y)
    assert plain.fp8_matmuls == () and plain.fp8_flop_share == 0.0 and "FP8" not in str(plain)


def test_describe_rows_follow_the_recipe(rng):
    recipe = mpjax.fp8.DelayedScaling(margin=1, amax_history_len=4)
    pol = mpjax.fp8.policy("O2", recipe=recipe)
    loss, params, x, y = _linen(pol, rng)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    fresh = mpjax.fp8.describe(state)
    assert [r["site"] for r in fresh] == [0, 1, 2]
    assert all(r["input_scale"] == 1.0 and r["grad_amax"] == 0.0 for r in fresh)
    _, _, state = _steps(loss, pol, state, params, x, y, n=2)
    fmax = {"input": 448.0, "kernel": 448.0, "grad": 57344.0}
    for r in mpjax.fp8.describe(state):
        for t, m in fmax.items():
            np.testing.assert_allclose(r[f"{t}_scale"], m / r[f"{t}_amax"] / 2.0, rtol=1e-6)
    # The first site's input is the batch itself: its amax is max |x| (rounded to bfloat16).
    np.testing.assert_allclose(
        mpjax.fp8.describe(state)[0]["input_amax"], float(jnp.max(jnp.abs(x))), rtol=1e-2
    )
    with pytest.raises(TypeError, match="FP8State"):
        mpjax.fp8.describe(params)


# -- overflow -------------------------------------------------------------------------------------


class Overflowing(nn.Module):
    """Dense layers whose float16 outputs overflow for inputs near the FP8 maximum (the
    second layer's input, inf, saturates to E4M3's maximum when it is quantized, so its
    float16 result overflows again)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, kernel_init=nn.initializers.constant(100.0))(x)
        return nn.Dense(16, kernel_init=nn.initializers.constant(100.0))(nn.relu(x))


def test_fp8_dot_overflow_is_found_skipped_and_keeps_the_scales(rng):
    pol = mpjax.fp8.policy("O2", "float16")
    loss, params, x, y = _linen(pol, rng, model=Overflowing())
    state = mpjax.fp8.init(loss, pol, params, x, y)
    tx = mpjax.loss_scale(optax.adamw(1e-3), scale=mpjax.DynamicLossScale(2.0**15))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, fp8_state, x, y):
        grad_fn = mpjax.fp8.scaled_value_and_grad(loss, pol)
        _, grads, new_fp8 = grad_fn(fp8_state, params, x, y, opt_state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_fp8, grads

    big = jnp.clip(jnp.abs(x) * 400.0, 100.0, 400.0)  # E4M3-representable range, at scale 1
    new_params, new_opt, new_fp8, grads = train_step(params, opt_state, state, big, y)
    # Sums of ~250 * 100 overflow float16: the step's loss and gradients are not finite...
    assert not all(bool(jnp.isfinite(g).all()) for g in jax.tree_util.tree_leaves(grads))
    # ... so the loss scale skips it: params and the inner state are bit-identical.
    assert_trees_bit_identical(new_params, params)
    assert_trees_bit_identical(new_opt.inner_state, opt_state.inner_state)
    metrics = mpjax.loss_scale_metrics(new_opt)
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**14
    # The FP8 state: finite amaxes set new scales, non-finite ones keep the previous scale.
    amax = np.asarray(new_fp8.amax_history[..., 0])
    ok = np.isfinite(amax) & (amax > 0)
    assert not ok.all()  # the overflowed activation (an inf amax) and gradients after it
    np.testing.assert_array_equal(np.asarray(new_fp8.scale)[~ok], np.asarray(state.scale)[~ok])
    fmax = np.broadcast_to(np.array([448.0, 448.0, 57344.0]), amax.shape)
    # (the recorded gradient amaxes are the unscaled gradients': see the loss-scale test)
    np.testing.assert_allclose(np.asarray(new_fp8.scale)[ok], (fmax / amax)[ok], rtol=1e-6)
    assert np.isfinite(new_fp8.scale).all()
    # find_nonfinite names where the FP8 dot's result overflowed, in the layer that ran it:
    # the gemm writes float32, and its scaled result overflows as it is written in float16.
    origin = mpjax.find_nonfinite(mpjax.fp8.apply(loss, pol), state, params, big, y)
    assert origin is not None and origin.primitive == "convert_element_type"
    assert "Dense_0" in origin.name and origin.dtype == "float16" and origin.kind == "inf"


def test_inf_input_saturates_in_fp8_and_keeps_the_scale(rng):
    # An inf reaching an FP8 site is clipped to the FP8 maximum (as in Flax's fp8_ops and
    # TransformerEngine), so the step stays finite; the amax records the inf, and the recipe
    # keeps the previous scale. A NaN is not clipped: the step is skipped.
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol, rng)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    _, _, state = _steps(loss, pol, state, params, x, y, n=1)
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    value, grads, new = step(state, params, x.at[3, 5].set(jnp.inf), y)
    assert np.isfinite(float(value))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree_util.tree_leaves(grads))
    assert mpjax.fp8.describe(new)[0]["input_amax"] == np.inf
    assert float(new.scale[0, 0]) == float(state.scale[0, 0])
    assert mpjax.find_nonfinite(mpjax.fp8.apply(loss, pol), state, params, x, y) is None

    tx = mpjax.loss_scale(optax.adamw(1e-3))
    opt_state = tx.init(params)
    _, grads, new = step(state, params, x.at[3, 5].set(jnp.nan), y)
    updates, new_opt = tx.update(grads, opt_state, params)
    assert_trees_bit_identical(optax.apply_updates(params, updates), params)
    assert int(mpjax.loss_scale_metrics(new_opt)["skipped_steps"]) == 1
    nan = np.isnan(np.asarray(new.amax_history[..., 0]))
    assert nan.any()
    np.testing.assert_array_equal(np.asarray(new.scale)[nan], np.asarray(state.scale)[nan])


# -- a float16 base and the loss scale ------------------------------------------------------------


def _f16_problem():
    # float32 loss 0.90: operands scaled toward 448 make sums past float16's 65504
    x = jax.random.normal(jax.random.key(0), (32, 32))
    w = jax.random.normal(jax.random.key(1), (32, 16)) / 6
    return (lambda w, x: jnp.mean((x @ w) ** 2)), w, x


@pytest.mark.parametrize("granularity", [None, "tensor", "row"])
def test_a_float16_base_trains_with_the_loss_scale(granularity):
    """The FP8 gemm writes float32 under a float16 base, so the scaled operands' sums do not
    overflow before the scales bring them back (before: every step after the first skipped
    under delayed scaling, inf at once under current scaling)."""
    recipe = granularity and mpjax.fp8.CurrentScaling(granularity=granularity)
    pol = mpjax.fp8.policy("O1", "float16", recipe=recipe)
    loss, w, x = _f16_problem()
    tx = mpjax.loss_scale(optax.sgd(0.3))
    opt_state, fp8_state = tx.init(w), mpjax.fp8.init(loss, pol, w, x)

    @jax.jit
    def train_step(w, opt_state, fp8_state, x):
        grad_fn = mpjax.fp8.scaled_value_and_grad(loss, pol)
        value, grads, fp8_state = grad_fn(fp8_state, w, x, opt_state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, fp8_state, value

    losses = []
    for _ in range(6):
        before = w
        w, opt_state, fp8_state, value = train_step(w, opt_state, fp8_state, x)
        losses.append(float(value))
        assert abs(float(value) / float(loss(before, x)) - 1) < 0.02, (value, loss(before, x))
    assert int(mpjax.loss_scale_metrics(opt_state)["skipped_steps"]) == 0
    assert losses[-1] < 0.8 * losses[0]
    value = mpjax.fp8.apply(loss, pol)(fp8_state, w, x)
    assert abs(float(value) / float(loss(w, x)) - 1) < 0.02


def test_the_loss_scale_scales_the_gradients_exactly_and_not_the_fp8_state():
    """With opt_state=, the gradients are those of the scaled loss, bit for bit S times the
    unscaled step's (the gradient is quantized at its scale / S), the value is the loss as
    computed, and the FP8 state is the unscaled step's: a scale that halves or doubles moves
    no gradient scale."""
    pol = mpjax.fp8.policy("O2")
    loss, w, x = _f16_problem()
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=mpjax.DynamicLossScale(2.0**12))
    opt_state, state = tx.init(w), mpjax.fp8.init(loss, pol, w, x)
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    for _ in range(2):  # the second step runs at scales set from the first's amaxes
        plain = step(state, w, x)
        scaled = step(state, w, x, opt_state=opt_state)
        state = plain[2]
    assert float(scaled[0]) == float(plain[0])
    np.testing.assert_array_equal(np.asarray(scaled[1]), 2.0**12 * np.asarray(plain[1]))
    assert_trees_bit_identical(scaled[2], plain[2])


@pytest.mark.parametrize("recipe", ["DelayedScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"])
def test_train_state_and_checkpoint_take_the_fp8_policy(rng, tmp_path, recipe):
    """TrainState.create and mpjax.checkpoint take the FP8 policy as wrap does: the loss scale
    is the base level's, and the checkpoint records the recipe beside the base policy, so it
    is restored under the same FP8 policy only."""
    import mpjax.checkpoint

    pol = mpjax.fp8.policy("O2", "float16", recipe=getattr(mpjax.fp8, recipe)())
    loss, params, x, y = _linen(pol, rng)
    state = mpjax.flax.TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1), policy=pol
    )
    assert float(state.loss_scale.loss_scale) == float(pol.base.loss_scale().loss_scale)
    fp8_state = mpjax.fp8.init(loss, pol, params, x, y)
    value, grads, fp8_state = mpjax.fp8.scaled_value_and_grad(loss, pol)(
        fp8_state, state.params, x, y, opt_state=state
    )
    state = state.apply_gradients(grads=grads)
    assert int(state.opt_state.skipped_steps) == 0
    tree = {"state": state, "fp8": fp8_state}
    mpjax.checkpoint.save(tmp_path / "ckpt", tree, pol)
    assert recipe in mpjax.checkpoint.saved_policy(tmp_path / "ckpt")["fp8_recipe"]
    restored = mpjax.checkpoint.restore(tmp_path / "ckpt", tree, pol)
    assert_trees_bit_identical(restored["fp8"], fp8_state)
    with pytest.raises(ValueError, match=f"FP8 {recipe}"):
        mpjax.checkpoint.restore(tmp_path / "ckpt", tree, pol.base)


def test_a_wrapped_fp8_model_outside_mpjax_fp8_says_its_dots_are_not_fp8(rng):
    pol = mpjax.fp8.policy("O2")
    loss, params, x, y = _linen(pol, rng)
    with pytest.warns(UserWarning, match="runs outside mpjax.fp8, so its dots run in bfloat16"):
        jax.grad(loss)(params, x, y)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        mpjax.fp8.scaled_value_and_grad(loss, pol)(state, params, x, y)
        mpjax.fp8.apply(loss, pol)(state, params, x, y)
    model = mpjax.flax.wrap(NNXMLP(nnx.Rngs(0)), pol)
    with pytest.warns(UserWarning, match="NNXMLP was wrapped with an FP8 policy"):
        model(x)


@pytest.mark.parametrize("form", ["linen", "nnx"])
def test_block_recipes_quantize_the_float32_master_weight_under_wrap(form):
    """Under ``wrap`` at O2 the policy casts each float32 param to bfloat16 before its dot; a
    block recipe's site quantizes the float32 weight itself (TransformerEngine's rule: no
    half copy first, one pass and one rounding fewer), so its kernel amax is the float32
    weight's, and the weight gradient still comes back in float32."""
    import flax.linen as nn

    pol = mpjax.fp8.policy("O2", recipe=mpjax.fp8.MXFP8BlockScaling())
    x = jax.random.normal(jax.random.key(1), (32, 64))
    if form == "linen":
        model = mpjax.flax.wrap(nn.Dense(32, use_bias=False), pol)
        params = model.init(jax.random.key(0), x)["params"]
        loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
        kernel = params["kernel"]
    else:
        wrapped = mpjax.flax.wrap(nnx.Linear(64, 32, use_bias=False, rngs=nnx.Rngs(0)), pol)
        graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)
        loss = lambda p, x: jnp.mean(nnx.merge(graphdef, p, rest)(x) ** 2)
        kernel = params["inner"]["kernel"][...]
    assert kernel.dtype == jnp.float32
    wide, narrow = float(jnp.abs(kernel).max()), float(jnp.abs(kernel.astype(jnp.bfloat16)).max())
    assert wide != narrow  # the two copies tell apart
    state = mpjax.fp8.init(loss, pol, params, x)
    assert state.num_sites == 1
    _, grads, state = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, params, x)
    assert mpjax.fp8.describe(state)[0]["kernel_amax"] == wide
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
    exact = jax.grad(loss)(params, x)
    for g, e in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(exact)):
        assert float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e)) < 0.06
