"""Tests of the loss-scale pytrees against jmp, torch's GradScaler and plain reference models."""

import pickle
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from conftest import assert_trees_bit_identical
from test_faults import reference

import mpjax

# -- plain reference models, written out as the peers document them ---------------------------


def jmp_reference(scale, steps, period=2000, factor=2.0, min_scale=1.0, max_scale=np.inf):
    """jmp's docstring rule, plus mpjax's cap, in float32."""
    scale, counter, out = np.float32(scale), 0, []
    for finite in steps:
        if finite:
            counter += 1
            if counter == period:
                counter = 0
                grown = np.float32(scale * np.float32(factor))
                scale = min(grown, np.float32(max_scale)) if np.isfinite(grown) else scale
        else:
            counter = 0
            scale = max(np.float32(min_scale), np.float32(scale / np.float32(factor)))
        out.append((float(scale), counter))
    return out


def torch_reference(scale, steps, growth=2.0, backoff=0.5, interval=2000):
    """torch's _amp_update_scale_: no minimum, growth skipped when it overflows."""
    scale, tracker, out = np.float32(scale), 0, []
    for finite in steps:
        if not finite:
            scale, tracker = np.float32(scale * np.float32(backoff)), 0
        else:
            tracker += 1
            if tracker == interval:
                grown = np.float32(scale * np.float32(growth))
                scale = grown if np.isfinite(grown) else scale
                tracker = 0
        out.append(float(scale))
    return out


def run(scale, steps, jit=False):
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    out = []
    for finite in steps:
        scale = adjust(scale, jnp.asarray(finite))
        out.append(scale)
    return out


def random_steps(rng, n, p_overflow):
    return [bool(x) for x in rng.random(n) > p_overflow]


# -- jmp parity ------------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("period, factor", [(1, 2), (3, 2), (5, 3), (2, 1.5)])
def test_dynamic_matches_jmp(rng, period, factor, jit):
    steps = random_steps(rng, 60, 0.3)
    ours = run(
        mpjax.DynamicLossScale(2.0**10, period=period, factor=factor, max_loss_scale=np.inf),
        steps,
        jit,
    )
    theirs = run(
        jmp.DynamicLossScale(jnp.float32(2.0**10), period=period, factor=factor), steps, jit
    )
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert float(a.loss_scale) == float(b.loss_scale), f"step {i}"
        assert int(a.counter) == int(b.counter), f"step {i}"
    ref = jmp_reference(2.0**10, steps, period, factor)
    assert [int(s.counter) for s in ours] == [c for _, c in ref]
    # XLA may turn "/ 3" into "* (1/3)" under jit, so only powers of two are exact here.
    rel = 0 if factor == 2 else 1e-6
    assert [float(s.loss_scale) for s in ours] == pytest.approx([v for v, _ in ref], rel=rel)


def test_dynamic_defaults_and_fields_match_jmp():
    ours, theirs = mpjax.DynamicLossScale(2.0**15), jmp.DynamicLossScale(jnp.float32(2.0**15))
    assert (ours.period, ours.factor) == (theirs.period, theirs.factor) == (2000, 2)
    assert ours.min_loss_scale == float(theirs.min_loss_scale) == 1.0
    assert int(ours.counter) == int(theirs.counter) == 0
    assert ours.counter.dtype == theirs.counter.dtype == np.int32
    # Positional arguments in jmp's order.
    pos = mpjax.DynamicLossScale(4.0, 3, 10, 4, 2.0)
    assert (float(pos.loss_scale), int(pos.counter), pos.period, pos.factor) == (4.0, 3, 10, 4)
    assert pos.min_loss_scale == 2.0


@pytest.mark.parametrize("cls", ["StaticLossScale", "DynamicLossScale", "NoOpLossScale"])
def test_scale_and_unscale_match_jmp_on_float32(rng, cls):
    args = () if cls == "NoOpLossScale" else (2.0**12,)
    ours = getattr(mpjax, cls)(*args)
    theirs = getattr(jmp, cls)(*[jnp.float32(a) for a in args])
    tree = {"a": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.float32(rng.normal())}
    for f in ("scale", "unscale"):
        a, b = getattr(ours, f)(tree), getattr(theirs, f)(tree)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(ours.loss_scale) == float(theirs.loss_scale)


@pytest.mark.parametrize("cls", ["StaticLossScale", "DynamicLossScale"])
def test_python_float_losses_are_scaled_as_jmp_scales_them(cls):
    # `scale.scale(loss)` with a Python float (a loss built with math, or a constant) came
    # back unscaled: the gradients were then 1/scale of what the update step assumed.
    ours, theirs = getattr(mpjax, cls)(4.0), getattr(jmp, cls)(jnp.float32(4.0))
    for f, x in (("scale", 1.5), ("unscale", 6.0)):
        a, b = getattr(ours, f)({"l": x, "n": 3}), getattr(theirs, f)({"l": x, "n": 3})
        assert a["l"].dtype == b["l"].dtype == jnp.float32
        assert float(a["l"]) == float(b["l"]) and a["n"] == 3
    assert float(ours.scale(1.5)) == 6.0 and float(ours.unscale(6.0)) == 1.5


def test_scale_promotes_half_losses_and_unscale_keeps_grad_dtypes(rng):
    ls = mpjax.DynamicLossScale(2.0**15)
    loss = jnp.asarray(rng.uniform(2.0, 3.0), jnp.float16)  # loss * 2**15 overflows float16
    scaled = ls.scale(loss)
    assert scaled.dtype == np.float32 and np.isfinite(float(scaled))
    grads = {
        "h": jnp.asarray(rng.normal(size=4) * 2.0**10, jnp.float16),
        "b": jnp.asarray(rng.normal(size=4) * 2.0**15, jnp.bfloat16),
        "f": jnp.asarray(rng.normal(size=4) * 2.0**15, jnp.float32),
        "i": jnp.arange(4),
    }
    out = ls.unscale(grads)
    for k in grads:
        assert out[k].dtype == grads[k].dtype, k
    np.testing.assert_array_equal(np.asarray(out["i"]), np.arange(4))
    for k in ("h", "b", "f"):
        # Times 2**-15 is exact in float64 and float32, so the only rounding is to the leaf's
        # dtype (float16 results may be subnormal: compare bits, not a relative tolerance).
        ref = (np.asarray(grads[k], np.float64) / 2.0**15).astype(grads[k].dtype)
        np.testing.assert_array_equal(np.asarray(out[k]), ref)


# -- pytree behaviour --------------------------------------------------------------------------


def test_pytree_shape_is_jmps():
    assert jax.tree_util.tree_leaves(mpjax.NoOpLossScale()) == []
    assert jax.tree_util.tree_leaves(mpjax.StaticLossScale(8.0)) == []
    leaves = jax.tree_util.tree_leaves(mpjax.DynamicLossScale(8.0))
    theirs = jax.tree_util.tree_leaves(jmp.DynamicLossScale(jnp.float32(8.0)))
    assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in theirs]
    # Optional state only when the knob is on.
    assert len(jax.tree_util.tree_leaves(mpjax.DynamicLossScale(8.0, hysteresis=3))) == 3
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_leaves_with_path(mpjax.DynamicLossScale(8.0, hysteresis=2))
    ]
    assert paths == [".loss_scale", ".counter", ".bad_steps"]


KNOBS = dict(
    period=7,
    min_loss_scale=0.5,
    growth_factor=4.0,
    backoff_factor=0.25,
    hysteresis=2,
    max_loss_scale=2.0**20,
)


def static_fields(ls):
    return tuple(getattr(ls, k) for k in ("period", "factor", *KNOBS))


def test_every_field_survives_tree_map_jit_lower_trace_vmap_and_pickle():
    ls = mpjax.DynamicLossScale(2.0**10, **KNOBS)
    want = static_fields(ls)
    assert static_fields(jax.tree_util.tree_map(lambda x: x, ls)) == want
    assert static_fields(jax.jit(lambda s: s)(ls)) == want
    assert static_fields(jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)) == want
    lowered = jax.jit(lambda s: s.adjust(jnp.array(True))).lower(ls)  # jmp 0.0.4 fails here
    assert static_fields(lowered.compile()(ls)) == want
    traced = jax.jit(lambda s: s.adjust(jnp.array(True))).trace(ls)
    assert static_fields(traced.lower().compile()(ls)) == want
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ls)
    out = jax.vmap(lambda s, f: s.adjust(f))(batch, jnp.array([True, False]))
    assert static_fields(out) == want
    np.testing.assert_array_equal(np.asarray(out.loss_scale), [2.0**10, 2.0**10])  # hysteresis
    np.testing.assert_array_equal(np.asarray(out.bad_steps), [0, 1])
    restored = pickle.loads(pickle.dumps(ls))
    assert static_fields(restored) == want
    assert_trees_bit_identical(restored, ls)
    # ShapeDtypeStruct leaves (as jax.eval_shape and checkpoint restore produce) are fine too.
    shapes = jax.eval_shape(lambda s: s.adjust(jnp.array(True)), ls)
    assert static_fields(shapes) == want and shapes.loss_scale.dtype == np.float32


def test_min_loss_scale_survives_jit_where_jmp_loses_it():
    ours = jax.jit(lambda s: s)(mpjax.DynamicLossScale(4.0, min_loss_scale=2.0))
    theirs = jax.jit(lambda s: s)(
        jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(2.0))
    )
    assert ours.min_loss_scale == 2.0
    assert float(theirs.min_loss_scale) == 1.0  # jmp's bug: reset to the default
    for _ in range(3):
        ours = ours.adjust(jnp.array(False))
    assert float(ours.loss_scale) == 2.0


def test_a_changing_scale_never_retraces():
    traces = []

    @jax.jit
    def step(ls, finite):
        traces.append(1)
        return ls.adjust(finite)

    ls = mpjax.DynamicLossScale(2.0**15, period=1)
    seen = set()
    for finite in [True, True, False, True, False, False, True]:
        ls = step(ls, jnp.asarray(finite))
        seen.add(float(ls.loss_scale))
    assert len(seen) > 2 and len(traces) == 1


def test_float16_scale_argument_is_kept_in_float32():
    ls = mpjax.DynamicLossScale(jnp.float16(2.0**15), period=1)
    assert ls.loss_scale.dtype == np.float32
    ls = ls.adjust(jnp.array(True))  # 2**16 overflows float16, not float32
    assert float(ls.loss_scale) == 2.0**16 and ls.loss_scale.dtype == np.float32
    static = mpjax.StaticLossScale(jnp.float16(1024.0))
    assert static.loss_scale == 1024.0


def test_growth_is_capped_so_the_scale_is_never_inf():
    ls = mpjax.DynamicLossScale(2.0**20, period=1)
    for _ in range(10):
        ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2.0**24  # apex's cap
    ls = mpjax.DynamicLossScale(2.0**126, period=1, max_loss_scale=np.inf)
    for _ in range(5):
        ls = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
        assert np.isfinite(float(ls.loss_scale))
    assert float(ls.loss_scale) == 2.0**127


# -- torch GradScaler --------------------------------------------------------------------------

# torch's GradScaler has no floor and no cap: min_loss_scale=0.0 is "no floor". The default
# factor 2 halves on overflow (exactly torch's * 0.5) and doubles on growth.
TORCH_LIKE = dict(period=2000, min_loss_scale=0.0, max_loss_scale=np.inf)
# float32's smallest normal: below it XLA flushes the scale to zero, torch's CPU kernel does not.
SMALLEST_NORMAL = 2.0**-126


def test_torch_configuration_follows_gradscaler_reference(rng):
    steps = random_steps(rng, 3000, 0.0005) + [False] * 20 + [True] * 2500 + [False] * 100
    ls = mpjax.DynamicLossScale(2.0**16, **TORCH_LIKE)
    step = jax.jit(lambda s, f: s.adjust(f))
    ours = []
    for finite in steps:
        ls = step(ls, jnp.asarray(finite))
        ours.append(float(ls.loss_scale))
    assert ours == torch_reference(2.0**16, steps)
    assert SMALLEST_NORMAL <= min(ours) < 2.0**-50  # far below 1: no floor


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "knobs",
    [{}, {"growth_factor": 2.0, "backoff_factor": 0.5}],
    ids=["jmp-factor", "torch-factors"],
)
def test_torch_configuration_matches_torch_gradscaler(rng, knobs, jit):
    torch = pytest.importorskip("torch")
    # Random steps, then 100 overflows in a row: the scale halves far below 1 (to between
    # 2**-123 and 2**-75, normal floats), then grows back.
    steps = random_steps(rng, 40, 0.25) + [True] * 7 + [False] * 100 + [True] * 12 + [False] * 3
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=5)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    ls = mpjax.DynamicLossScale(
        2.0**16, period=5, min_loss_scale=0.0, max_loss_scale=np.inf, **knobs
    )
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    seen = []
    for i, finite in enumerate(steps):
        opt.zero_grad()
        scaler.scale(param.sum()).backward()
        if not finite:
            param.grad[1] = float("inf")
        scaler.step(opt)
        scaler.update()
        ls = adjust(ls, jnp.asarray(finite))
        assert float(ls.loss_scale) == scaler.get_scale(), f"step {i}"
        if hasattr(scaler, "_get_growth_tracker"):  # private in torch; compared where present
            assert int(ls.counter) == int(scaler._get_growth_tracker()), f"step {i}"
        seen.append(float(ls.loss_scale))
    assert SMALLEST_NORMAL <= min(seen) < 2.0**-70


# -- hysteresis (Paddle's decr_every_n_nan_or_inf) ----------------------------------------------


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
def test_hysteresis_follows_paddle(rng, hysteresis):
    steps = random_steps(rng, 200, 0.4)
    ls = mpjax.DynamicLossScale(
        2.0**12,
        period=3,
        growth_factor=2.0,
        backoff_factor=0.5,
        hysteresis=hysteresis,
        max_loss_scale=np.inf,  # Paddle has no cap
    )
    # Paddle's update_loss_scaling kernel: good/bad counters, no cap.
    ref = reference(2.0**12, steps, 3, 2.0, 0.5, hysteresis, 1.0, np.inf)
    for i, (out, (scale, good, bad)) in enumerate(zip(run(ls, steps, jit=True), ref)):
        assert float(out.loss_scale) == scale, f"step {i}"
        assert int(out.counter) == good, f"step {i}"
        if hysteresis > 1:
            assert int(out.bad_steps) == bad, f"step {i}"


# -- helpers -----------------------------------------------------------------------------------


def test_all_finite_matches_jmp(rng):
    good = {"a": jnp.asarray(rng.normal(size=3), jnp.float32), "b": [jnp.float16(1.5)]}
    for bad_value in (np.inf, -np.inf, np.nan):
        bad = {"a": good["a"].at[1].set(bad_value), "b": good["b"]}
        assert bool(mpjax.all_finite(bad)) is bool(jmp.all_finite(bad)) is False
    assert bool(mpjax.all_finite(good)) is bool(jmp.all_finite(good)) is True
    assert bool(mpjax.all_finite({})) is bool(jmp.all_finite({})) is True
    # Integer leaves are finite by definition (jmp would run isfinite on them too).
    assert bool(mpjax.all_finite({"i": jnp.arange(3), "f": good["a"]}))
    assert bool(jax.jit(mpjax.all_finite)(good))


def test_select_tree_matches_jmp(rng):
    a = {"x": jnp.asarray(rng.normal(size=3), jnp.float32), "i": jnp.arange(3)}
    b = jax.tree_util.tree_map(lambda x: x + 1, a)
    for pred in (True, False):
        ours = mpjax.select_tree(jnp.array(pred), a, b)
        theirs = jmp.select_tree(jnp.array(pred), a, b)
        assert_trees_bit_identical(ours, theirs)
    with pytest.raises(AssertionError, match="boolean scalar"):
        mpjax.select_tree(jnp.array([True, False]), a, b)
    with pytest.raises(AssertionError, match="boolean scalar"):
        mpjax.select_tree(jnp.array(1), a, b)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [mpjax.StaticLossScale, mpjax.DynamicLossScale])
@pytest.mark.parametrize(
    "value, error, match",
    [
        (True, TypeError, "must be a float, got bool"),
        ("big", TypeError, "must be a float"),
        (None, TypeError, "must be a float"),
        (jnp.ones(3), TypeError, r"scalar float, got shape \(3,\)"),
        (jnp.complex64(1.0), TypeError, "must be a float, got dtype complex64"),
        (float("inf"), ValueError, "finite"),
        (float("nan"), ValueError, "finite"),
        (-1.0, ValueError, "finite and >= 0, got -1.0"),
        (-8, ValueError, "finite and >= 0, got -8.0"),
    ],
)
@pytest.mark.filterwarnings("ignore:Expected floating type")  # jmp's warning for -8 comes first
def test_bad_scale_values(cls, value, error, match):
    with pytest.raises(error, match=match):
        cls(value)


# -- what jmp accepts, mpjax accepts (and warns where jmp warns) --------------------------------


def warnings_of(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = make()
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("value", [2, 3, np.int64(1024), jnp.int32(8)], ids=str)
def test_int_static_scale_is_accepted_silently_as_jmp(rng, value):
    ours, our_warnings = warnings_of(lambda: mpjax.StaticLossScale(value))
    theirs, their_warnings = warnings_of(lambda: jmp.StaticLossScale(value))
    assert our_warnings == their_warnings == []
    assert ours.loss_scale == float(value) and isinstance(ours.loss_scale, float)
    tree = {"a": jnp.asarray(rng.normal(size=3), jnp.float32)}  # jmp scales int leaves too
    for f in ("scale", "unscale"):
        assert_trees_bit_identical(getattr(ours, f)(tree), getattr(theirs, f)(tree))


@pytest.mark.parametrize(
    "make_ours, make_theirs",
    [
        (
            lambda m: m.DynamicLossScale(2**15),
            lambda m: m.DynamicLossScale(2**15),
        ),
        (
            lambda m: m.DynamicLossScale(jnp.asarray(4, jnp.int32)),
            lambda m: m.DynamicLossScale(jnp.asarray(4, jnp.int32)),
        ),
        (
            lambda m: m.DynamicLossScale(4.0, min_loss_scale=2),
            lambda m: m.DynamicLossScale(jnp.float32(4.0), min_loss_scale=2),
        ),
        (
            lambda m: m.DynamicLossScale(8, min_loss_scale=jnp.asarray(1, jnp.int32)),
            lambda m: m.DynamicLossScale(8, min_loss_scale=jnp.asarray(1, jnp.int32)),
        ),
    ],
    ids=["python-int", "int32-array", "int-min", "both"],
)
def test_int_dynamic_settings_warn_with_jmps_words_and_work(make_ours, make_theirs):
    ours, our_warnings = warnings_of(lambda: make_ours(mpjax))
    _, their_warnings = warnings_of(lambda: make_theirs(jmp))
    assert our_warnings == their_warnings != []
    assert all(w.startswith("Expected floating type for ") for w in our_warnings)
    # Unlike jmp (whose int scale then fails in adjust), the state is float32 and it runs.
    assert ours.loss_scale.dtype == np.float32 and isinstance(ours.min_loss_scale, float)
    for finite in (False, True, False):
        ours = jax.jit(lambda s, f: s.adjust(f))(ours, jnp.asarray(finite))
    assert ours.loss_scale.dtype == np.float32 and np.isfinite(float(ours.loss_scale))


def test_float_settings_do_not_warn():
    _, caught = warnings_of(lambda: mpjax.DynamicLossScale(2.0**15, min_loss_scale=0.5))
    assert caught == []
    _, caught = warnings_of(lambda: mpjax.DynamicLossScale(jnp.float16(8.0), period=5.0))
    assert caught == []


@pytest.mark.filterwarnings("ignore:Expected floating type")
@pytest.mark.parametrize("cls", ["StaticLossScale", "DynamicLossScale"])
@pytest.mark.parametrize("zero", [0, 0.0], ids=["int", "float"])
def test_zero_scale_is_accepted_as_jmp_with_a_warning(cls, zero):
    with pytest.warns(UserWarning, match="multiplies the loss by zero.*every step is skipped"):
        ls = getattr(mpjax, cls)(zero)
    assert float(ls.loss_scale) == 0.0
    assert len(jax.tree_util.tree_leaves(ls)) == (0 if cls == "StaticLossScale" else 2)
    # A tree_map or a jit boundary does not warn again.
    _, caught = warnings_of(lambda: jax.jit(lambda s: s)(ls))
    assert caught == []


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    "period, factor, min_scale",
    [(5.0, 2.0, 0.0), (4, 2, 0.0), (3.0, 3, 0.37), (np.float32(6), 2.0, 0.5)],
    ids=["float-period-no-floor", "no-floor", "float-period", "np-float-period"],
)
def test_float_period_and_zero_floor_follow_jmp(rng, period, factor, min_scale, jit):
    # jmp's own test passes period=5.0 and min_loss_scale=0.0; both must run as jmp runs them.
    steps = random_steps(rng, 40, 0.3) + [False] * 60 + [True] * 13
    ours = mpjax.DynamicLossScale(10.0, 0, period, factor, min_scale, max_loss_scale=np.inf)
    assert ours.period == int(period) and isinstance(ours.period, int)
    assert ours.min_loss_scale == min_scale
    theirs = jmp.DynamicLossScale(
        jnp.float32(10.0), jnp.int32(0), period, factor, jnp.asarray(min_scale, jnp.float32)
    )
    # jmp runs eagerly only: under jit it loses min_loss_scale (see the test above).
    for i, (a, b) in enumerate(zip(run(ours, steps, jit), run(theirs, steps))):
        assert float(a.loss_scale) == pytest.approx(float(b.loss_scale), rel=1e-6), f"step {i}"
        assert int(a.counter) == int(b.counter), f"step {i}"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"growth_factor": 1.0}, "growth factor must be > 1"),
        ({"factor": 1}, "growth factor must be > 1"),
        ({"growth_factor": 0.5}, "growth factor must be > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"period": 0}, "period must be an int >= 1"),
        ({"period": 2.5}, "period must be an int >= 1"),
        ({"period": 0.0}, "period must be an int >= 1"),
        ({"period": True}, "period must be an int >= 1"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"min_loss_scale": -1.0}, "min_loss_scale must be finite and >= 0"),
        ({"min_loss_scale": float("nan")}, "min_loss_scale must be finite and >= 0"),
        ({"min_loss_scale": float("inf")}, "min_loss_scale must be finite and >= 0"),
        ({"max_loss_scale": 0.5}, "must be >= min_loss_scale"),
        ({"max_loss_scale": 2.0**10}, "above max_loss_scale"),
    ],
)
def test_bad_dynamic_knobs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mpjax.DynamicLossScale(2.0**15, **kwargs)


def test_adjust_needs_a_scalar():
    with pytest.raises(ValueError, match="boolean scalar.*all_finite"):
        mpjax.DynamicLossScale(2.0).adjust(jnp.array([True, True]))


def test_no_silent_upcasts_under_strict_dtype_promotion():
    # Strict promotion (as equinox's tests use) turns any implicit int/float or half/float32
    # mix in mpjax's own arithmetic into an error. jmp fails this; optax's adam does too.
    with jax.numpy_dtype_promotion("strict"):
        for ls in (
            mpjax.DynamicLossScale(2.0**15, hysteresis=2, backoff_factor=0.5),
            mpjax.DynamicLossScale(2.0**15),
            mpjax.StaticLossScale(8.0),
        ):
            tree = {
                "h": jnp.ones(3, jnp.float16),
                "b": jnp.ones(2, jnp.bfloat16),
                "i": jnp.arange(2),
            }
            assert ls.scale(tree)["h"].dtype == np.float32
            assert ls.unscale(tree)["b"].dtype == jnp.bfloat16
            for finite in (True, False):
                ls = jax.jit(lambda s, f: s.adjust(f))(ls, jnp.asarray(finite))
        assert bool(mpjax.all_finite(tree))


def test_all_finite_checks_leaves_of_one_shape_in_one_reduction(rng):
    """Twelve leaves of two shapes are checked by two reductions (and one over their two
    flags), not twelve: on a GPU each reduction is a kernel. Any inf or NaN in any leaf,
    half or float32, is still found."""
    tree = {
        "w": [jnp.asarray(rng.normal(size=(4, 8)), jnp.float32) for _ in range(6)],
        "b": [jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16) for _ in range(6)],
        "step": jnp.int32(3),
    }
    jaxpr = jax.make_jaxpr(mpjax.all_finite)(tree).jaxpr
    assert sum(e.primitive.name == "reduce_and" for e in jaxpr.eqns) == 3
    assert bool(mpjax.all_finite(tree))
    for group, bad in (("w", jnp.inf), ("b", jnp.nan), ("w", -jnp.inf)):
        for i in (0, 3, 5):
            hurt = jax.tree_util.tree_map(lambda a: a, tree)
            hurt[group][i] = hurt[group][i].at[1].set(bad)
            assert not bool(jax.jit(mpjax.all_finite)(hurt)), (group, i, bad)
