"""Every public function with wrong types, shapes and dtypes, empty trees, None leaves, and
integer params mixed with float params: a clear error that names the problem, or a
documented no-op; never an internal JAX traceback."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
import mpjax.flax

O1 = mpjax.Policy.from_level("O1", "bfloat16")
PARAMS = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}


def _update(grads, tx=None, params=PARAMS):
    tx = tx or mpjax.loss_scale(optax.sgd(0.1))
    return tx.update(grads, tx.init(params), params)


_OPT_STATE = mpjax.loss_scale(optax.sgd(0.1)).init(PARAMS)

ERRORS = [
    # (call, exception, words the message must contain)
    (lambda: mpjax.Policy(None, jnp.float32, jnp.float32), ValueError, "param_dtype is None"),
    (lambda: mpjax.Policy(jnp.int32, jnp.float32, jnp.float32), ValueError, "floating-point dtype"),
    (lambda: mpjax.Policy("fp16", "f32", "f32"), ValueError, "Unknown dtype 'fp16'"),
    (lambda: mpjax.Policy.from_level("O5"), ValueError, "Unknown level 'O5'"),
    (lambda: mpjax.Policy.from_level(None), TypeError, "level must be a string"),
    (lambda: mpjax.Policy.from_level("O1", "float64"), ValueError, "float16 or bfloat16"),
    (lambda: mpjax.Policy.from_level("O1", lower_ops={"matmul"}), ValueError, "Unknown op name"),
    (lambda: mpjax.Policy.from_level("O1", loss_scaling=0), ValueError, "positive finite float, got 0.0"),
    (lambda: mpjax.Policy.from_level("O1", loss_scaling=True), TypeError, "must be a float, got bool"),
    (lambda: mpjax.get_policy(None), TypeError, "takes a string"),
    (lambda: mpjax.get_policy("p=f32,c=fp8"), ValueError, "Unknown dtype 'fp8'"),
    (lambda: mpjax.get_policy("params=float32,compute=int32,output=float32"), ValueError, "Unknown dtype 'int32' must be full,half,float16,bfloat16 or a contraction thereof (jmp's words): a policy's dtypes are floating point, full (float32, f32)"),
    (lambda: mpjax.scaled_value_and_grad(_OPT_STATE), TypeError, "takes the loss function, got LossScaleState"),
    (lambda: mpjax.scaled_value_and_grad(lambda p: jnp.sum(p["w"]))(PARAMS, _OPT_STATE), ValueError, "the first argument, a dict, holds no mpjax.loss_scale() state"),
    (lambda: mpjax.scaled_value_and_grad(lambda p: jnp.sum(p["w"]), has_aux=True)(_OPT_STATE, PARAMS), TypeError, "return a pair (loss, aux); it returned a float32[] array"),
    (lambda: mpjax.get_policy("p:f32"), ValueError, "Unknown dtype 'p:f32'"),
    (lambda: mpjax.get_policy("p=f32,c=float8_e4m3fn,o=f32"), ValueError, "use mpjax.fp8.policy('O1')"),
    (lambda: mpjax.Policy.from_level("O2", "float8_e4m3fn"), ValueError, "FP8 is not a policy dtype"),
    (lambda: mpjax.Policy(jnp.float32, jnp.float8_e5m2, jnp.float32), ValueError, "compute_dtype is float8_e5m2. FP8 is not a policy dtype"),
    (lambda: mpjax.loss_scale(check_updates=True), ValueError, "the chain form wraps none"),
    (lambda: mpjax.parse_dtype("quarter"), ValueError, "Unknown dtype 'quarter'"),
    (lambda: mpjax.DynamicLossScale(jnp.ones(3)), TypeError, "scalar float, got shape (3,)"),
    (lambda: mpjax.StaticLossScale(np.ones((2, 2))), TypeError, "scalar float, got shape (2, 2)"),
    (lambda: mpjax.DynamicLossScale(None), TypeError, "must be a float"),
    (lambda: mpjax.DynamicLossScale(float("nan")), ValueError, "finite and >= 0, got nan"),
    (lambda: mpjax.DynamicLossScale(-2.0**15), ValueError, "finite and >= 0, got -32768.0"),
    (lambda: mpjax.StaticLossScale(-1.0), ValueError, "finite and >= 0, got -1.0"),
    (lambda: mpjax.DynamicLossScale(1.0, min_loss_scale=-1.0), ValueError, "min_loss_scale must be finite and >= 0"),
    (lambda: jax.jit(lambda s: mpjax.StaticLossScale(s))(2.0), TypeError, "must be a concrete number"),
    (lambda: mpjax.DynamicLossScale(1.0, period=0), ValueError, "period must be an int >= 1"),
    (lambda: mpjax.DynamicLossScale(1.0, growth_factor=0.9), ValueError, "growth factor must be > 1"),
    (lambda: mpjax.DynamicLossScale(1.0, backoff_factor=2.0), ValueError, "backoff_factor must be in"),
    (lambda: mpjax.StaticLossScale(float("nan")), ValueError, "finite and >= 0, got nan"),
    (lambda: mpjax.DynamicLossScale(4.0).adjust(jnp.ones(2, bool)), ValueError, "boolean scalar"),
    (lambda: mpjax.DynamicLossScale(4.0).adjust({"w": jnp.ones(2)}), TypeError, "pass mpjax.all_finite(grads), not the gradients"),
    (lambda: mpjax.DynamicLossScale(4.0).adjust([jnp.ones(2)]), TypeError, "not a list"),
    (lambda: mpjax.DynamicLossScale(2.0**15, min_loss_scale=2.0**20), ValueError, "min_loss_scale 1048576.0 is above loss_scale 32768.0"),
    (lambda: mpjax.DynamicLossScale(2.0**15, min_loss_scale=2.0**30), ValueError, "max_loss_scale (16777216.0) must be >= min_loss_scale"),
    (lambda: mpjax.select_tree(jnp.array(True), {"a": 1.0}, {"b": 1.0}), ValueError, "same structure"),
    (lambda: mpjax.loss_scale(optax.adam), TypeError, "call it first"),
    (lambda: mpjax.loss_scale(scale=1024.0), TypeError, "scale must be a NoOpLossScale"),
    (lambda: mpjax.loss_scale().init({}), ValueError, "params has no floating-point arrays"),
    (lambda: mpjax.loss_scale().init(None), ValueError, "params has no floating-point arrays"),
    (lambda: mpjax.loss_scale().init({"n": jnp.arange(3)}), ValueError, "no floating-point"),
    (lambda: _update({"w": jnp.ones((2, 3))}), ValueError, "different tree structures"),
    (lambda: _update({"w": jnp.ones((3, 2)), "b": jnp.zeros(3)}), ValueError, "['w'] has shape (3, 2)"),
    (lambda: _update({"w": jnp.ones((2, 3)), "b": None}), ValueError, "different tree structures"),
    (lambda: mpjax.loss_scale().update(PARAMS, optax.EmptyState()), TypeError, "pass the state"),
    (lambda: mpjax.get_loss_scale(None), ValueError, "holds no mpjax.loss_scale() state"),
    (lambda: mpjax.get_loss_scale(optax.sgd(0.1).init(PARAMS)), ValueError, "holds no"),
    (lambda: mpjax.loss_scale_metrics({}), ValueError, "holds no"),
    (lambda: mpjax.nonfinite_leaves(mpjax.loss_scale().init(PARAMS)), ValueError, "track_nonfinite=True"),
    (lambda: mpjax.autocast(jnp.tanh, "O1"), TypeError, "needs an mpjax.Policy"),
    (lambda: mpjax.autocast(None, O1), TypeError, "needs a function"),
    (lambda: mpjax.audit(None), TypeError, "audit needs a function"),
    (lambda: mpjax.find_nonfinite(jnp.tanh, "x"), TypeError, "takes arrays"),
    (lambda: mpjax.flax.wrap(nn.Dense(2), O1, rules="O2"), TypeError, "rules must be a dict"),
    (lambda: mpjax.flax.wrap(nn.Dense(2), O1, rules={nn.Dense: jnp.float16}), TypeError, "Policy or a level"),
    (lambda: mpjax.flax.wrap(object(), O1), TypeError, "linen.Module or a flax.nnx.Module"),
    (lambda: mpjax.Policy.from_level("O1", lower_ops={"matmul"}), ValueError, "'matmul' is not a primitive; JAX binds 'dot_general'"),
    (lambda: mpjax.Policy.from_level("O1", f32_ops={"softmax"}), ValueError, "JAX binds 'exp', 'reduce_sum'"),
    (lambda: mpjax.Policy.from_level("O1", f32_ops={"rsqr"}), ValueError, "did you mean 'rsqrt'"),
    (lambda: mpjax.autocast(nn.Dense(2), O1), TypeError, "wrap modules with mpjax.flax.wrap"),
    (lambda: mpjax.autocast(jnp.tanh, _fp8_policy()), TypeError, "runs through mpjax.fp8"),
    (lambda: mpjax.flax.wrap(mpjax.flax.wrap(nn.Dense(2), O1), O1), TypeError, "already wrapped by mpjax.flax.wrap"),
    (lambda: mpjax.flax.wrap(nn.Dense, O1), TypeError, "got the class Dense; pass Dense(...)"),
    (lambda: mpjax.flax.wrap(nn.Dense(2), O1, rules={"Dense_0": "O5"}), ValueError, "rules['Dense_0']: Unknown level 'O5'"),
    (lambda: mpjax.flax.wrap(nn.Dense(2), O1, rules={nn.Dense: "fast"}), ValueError, "rules[Dense]: Unknown level 'fast'"),
    (lambda: mpjax.get_loss_scale(mpjax.loss_scale(optax.chain(mpjax.loss_scale(), optax.sgd(0.1))).init(PARAMS)), ValueError, "holds 2 mpjax.loss_scale() states"),
    (lambda: mpjax.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=optax.chain(mpjax.loss_scale(), optax.adam(1e-3))), ValueError, "this tx already holds one; pass the bare optimizer"),
]  # fmt: skip


def _fp8_policy():
    import mpjax.fp8

    return mpjax.fp8.policy("O2")


@pytest.mark.parametrize("call, error, words", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_clear_errors(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value)
    # Raised by mpjax itself (or jmp-compatible assertion), not deep inside JAX.
    assert "mpjax" in info.traceback[-1].path.as_posix() or "test_bad_input" in str(
        info.traceback[-1].path
    )


WARNINGS = [
    # (call, words of the warning): jmp accepts these, so mpjax does, warning as jmp does or,
    # where jmp is silent about a setting that skips every step, with a warning of its own.
    (lambda: mpjax.DynamicLossScale(2**15), "Expected floating type for loss_scale, got int32"),
    (lambda: mpjax.DynamicLossScale(8.0, min_loss_scale=1), "Expected floating type for min_loss_scale, got int32"),
    (lambda: mpjax.StaticLossScale(0), "loss_scale=0 multiplies the loss by zero"),
    (lambda: mpjax.DynamicLossScale(0.0), "loss_scale=0 multiplies the loss by zero"),
]  # fmt: skip


@pytest.mark.parametrize("call, words", WARNINGS, ids=[w[1][:40] for w in WARNINGS])
def test_clear_warnings_for_what_jmp_accepts(call, words):
    with pytest.warns(UserWarning, match=words) as record:
        call()
    # Attributed to the caller's line, not to mpjax's internals.
    assert all(w.filename == __file__ for w in record), [w.filename for w in record]


MISUSE_WARNINGS = [
    # (call, words): a call that works but does nothing useful says so, from the caller's line.
    (lambda: mpjax.compare(lambda x: jnp.sin(x).sum(), None, jnp.ones(3)), "fn runs no mixed precision"),
    (lambda: mpjax.fp8.init(lambda w, x: jnp.tanh(x * w).sum(), mpjax.fp8.policy(), jnp.ones(3), jnp.ones(3)), "no dot_general that can run in FP8"),
]  # fmt: skip


@pytest.mark.parametrize("call, words", MISUSE_WARNINGS, ids=[w[1][:30] for w in MISUSE_WARNINGS])
def test_warnings_for_calls_that_do_nothing(call, words):
    with pytest.warns(UserWarning, match=words) as record:
        call()
    assert any(w.filename == __file__ for w in record), [w.filename for w in record]


def test_what_jmp_accepts_works():
    # An int scale (the old mpjax raised), a whole float period and a zero floor, as jmp.
    assert mpjax.StaticLossScale(2).loss_scale == 2.0
    assert mpjax.Policy.from_level("O2", "float16", loss_scaling=1024).loss_scale() == (
        mpjax.StaticLossScale(1024.0)
    )
    ls = mpjax.DynamicLossScale(4.0, period=5.0, min_loss_scale=0.0)
    assert (ls.period, ls.min_loss_scale) == (5, 0.0)
    for _ in range(5):
        ls = ls.adjust(jnp.array(False))
    assert float(ls.loss_scale) == 0.125  # no floor


def test_documented_no_ops():
    # Casts touch only floating arrays: None, strings, Python numbers, ints pass through.
    assert mpjax.cast_to_full(None) is None
    assert mpjax.cast_to_half({"s": "name", "f": 1.5, "i": jnp.arange(2)})["s"] == "name"
    assert O1.cast_to_compute({"i": jnp.arange(2)})["i"].dtype == jnp.int32
    # An empty tree and None leaves are finite (as jmp).
    assert bool(mpjax.all_finite({})) and bool(mpjax.all_finite({"a": None, "b": jnp.ones(2)}))
    # NoOp and Static scales: adjust is the identity.
    assert mpjax.NoOpLossScale().adjust(jnp.array(False)) == mpjax.NoOpLossScale()
    assert mpjax.StaticLossScale(8.0).adjust(jnp.array(False)).loss_scale == 8.0
    # Scale and unscale leave non-float leaves alone.
    out = mpjax.StaticLossScale(4.0).unscale(
        {"n": jnp.arange(3), "none": None, "x": jnp.full(2, 8.0)}
    )
    assert out["none"] is None and out["n"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out["x"]), [2.0, 2.0])


def test_integer_params_mixed_with_float_params_and_none_leaves():
    params = {"w": jnp.ones(3), "step": jnp.array(5), "frozen": None}
    grads = {"w": jnp.array([1.0, jnp.inf, 1.0]), "step": jnp.array(0), "frozen": None}
    tx = mpjax.loss_scale(optax.adam(1e-2), track_nonfinite=True)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert mpjax.nonfinite_leaves(state) == ["['w']"]
    new = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(np.asarray(new["w"]), np.ones(3))
    assert int(new["step"]) == 5 and new["frozen"] is None
    good = {"w": jnp.ones(3), "step": jnp.array(0), "frozen": None}
    updates, state = jax.jit(tx.update)(good, state, params)
    assert bool(state.last_finite) and not bool(jnp.all(updates["w"] == 0))


def test_autocast_with_wrong_shapes_reports_the_users_error():
    f = mpjax.autocast(lambda w, x: x @ w, O1)
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        f(jnp.ones((3, 4)), jnp.ones((2, 5)))


def test_o0_takes_float32_and_a_path_rule_on_a_leaf_module_names_the_fix():
    # O0 is float32 throughout: naming float32 as its dtype is no error
    assert mpjax.Policy.from_level("O0", "float32") == mpjax.Policy.from_level("O0")
    # a module without submodules has no paths: the message says so and names the class key
    model = mpjax.flax.wrap(nn.Dense(3), O1, rules={"Dens": "O0"})
    with pytest.raises(
        ValueError, match=r"Dense has no submodules.*use its class, \{Dense: \.\.\.\}"
    ):
        model.init(jax.random.key(0), jnp.ones((1, 2)))
