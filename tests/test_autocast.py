"""Tests of op-level autocast: op lists, regions, transformations, custom rules, numerics."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import eqns
from jax import lax

import mpjax
from mpjax._src.interpreter import ops as mpjax_ops

HALF = {"float16": np.dtype("float16"), "bfloat16": np.dtype(jnp.bfloat16)}
F32 = np.dtype("float32")
# Relative tolerance against the float32 reference, per half dtype (a few units of roundoff
# through a few layers).
RTOL = {"float16": 1e-2, "bfloat16": 5e-2}


def in_dtypes(fn, *args, name):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = [
        tuple(
            np.dtype(v.aval.dtype) for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)
        )
        for e in eqns(jaxpr, name)
    ]
    assert found, f"no {name} in the jaxpr"
    return found


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# -- models in plain JAX ------------------------------------------------------------------------


def mlp(p, x):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def cnn(p, x):
    y = lax.conv_general_dilated(
        x, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    with mpjax.full_precision():  # batch norm: keep_norm_fp32, written out for plain JAX
        mean = y.mean(axis=(0, 1, 2))
        var = y.var(axis=(0, 1, 2))
        y = (y - mean) * lax.rsqrt(var + 1e-5)
    y = jax.nn.gelu(y)  # smooth: a ReLU kink flipped by rounding makes the test flaky
    return y.mean(axis=(1, 2)) @ p["w"]


def transformer_block(p, x):
    @mpjax.full_precision()
    def layer_norm(z):
        mu = z.mean(-1, keepdims=True)
        return (z - mu) * lax.rsqrt(((z - mu) ** 2).mean(-1, keepdims=True) + 1e-6)

    h = layer_norm(x)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    x = x + jnp.einsum("bts,bsd->btd", att, v) @ p["wo"]
    return x + jax.nn.gelu(layer_norm(x) @ p["w1"]) @ p["w2"]


def make(kind, rng):
    def n(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    if kind == "mlp":
        return (
            mlp,
            {
                "w1": n(16, 32, scale=0.25),
                "b1": n(32, scale=0.1),
                "w2": n(32, 8, scale=0.18),
                "b2": n(8, scale=0.1),
            },
            n(4, 16),
        )
    if kind == "cnn":
        return cnn, {"k": n(3, 3, 3, 8, scale=0.2), "w": n(8, 5, scale=0.35)}, n(2, 8, 8, 3)
    d = 16
    return (
        transformer_block,
        {k: n(d, d, scale=d**-0.5) for k in ("wq", "wk", "wv", "wo")}
        | {"w1": n(d, 4 * d, scale=d**-0.5), "w2": n(4 * d, d, scale=(4 * d) ** -0.5)},
        n(2, 6, d),
    )


# fmt: skip


# -- op lists ----------------------------------------------------------------------------------


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_lower_ops_get_half_operands(kind, level, half, rng):
    fn, params, x = make(kind, rng)
    f = mpjax.autocast(fn, mpjax.Policy.from_level(level, half))
    name = "conv_general_dilated" if kind == "cnn" else "dot_general"
    for dtypes in in_dtypes(f, params, x, name=name):
        assert set(dtypes) == {HALF[half]}


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_f32_list_ops_run_in_float32_at_o1_and_o2(level, half, rng):
    def loss(p, x, labels):
        logits = transformer_block(p, x).mean(axis=1)
        logp = jax.nn.log_softmax(logits)
        ce = -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()
        return ce + jax.scipy.special.logsumexp(logits) + jnp.mean(jax.nn.softmax(logits) ** 2)

    _, params, x = make("transformer", rng)
    labels = jnp.array([1, 3])
    f = mpjax.autocast(loss, mpjax.Policy.from_level(level, half))
    for name in ("exp", "log", "reduce_sum", "rsqrt"):
        for dtypes in in_dtypes(f, params, x, labels, name=name):
            assert set(dtypes) == {F32}, name
    # And the gradient's: exp/log/reductions of the backward pass in float32 too.
    g = jax.grad(f)
    for name in ("exp", "log"):
        for dtypes in in_dtypes(g, params, x, labels, name=name):
            assert set(dtypes) == {F32}, name


@pytest.mark.parametrize("half", HALF)
def test_o3_runs_everything_in_half(half, rng):
    _, params, x = make("mlp", rng)
    f = mpjax.autocast(
        lambda p, x: jax.nn.log_softmax(mlp(p, x)), mpjax.Policy.from_level("O3", half)
    )
    for name in ("exp", "log", "reduce_sum", "add", "dot_general"):
        for dtypes in in_dtypes(f, params, x, name=name):
            assert set(dtypes) == {HALF[half]}, name
    assert f(params, x).dtype == HALF[half]


def test_o1_follow_ops_take_the_widest_and_weak_scalars_do_not_promote(rng):
    f = mpjax.autocast(
        lambda w, x: jnp.tanh((x @ w) * 2.0), mpjax.Policy.from_level("O1", "float16")
    )
    w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
    assert in_dtypes(f, w, x, name="mul") == [(HALF["float16"],) * 2]  # 2.0 is weak: half
    assert in_dtypes(f, w, x, name="tanh") == [(HALF["float16"],)]
    g = mpjax.autocast(lambda w, r, x: x @ w + r, mpjax.Policy.from_level("O1", "float16"))
    assert in_dtypes(g, w, jnp.ones((2, 4)), x, name="add") == [(F32, F32)]  # half + f32: f32


@pytest.mark.parametrize("layer", ["dense", "conv"])
def test_o1_bias_add_is_part_of_the_matmul(layer, rng):
    """As torch's nn.Linear/conv under autocast (the bias inside the GEMM): the biased result
    stays half, so the activations after it are not promoted to float32."""
    if layer == "dense":
        w, b = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), jnp.ones(4)
        x = jnp.asarray(rng.normal(size=(2, 3)), jnp.float32)
        fn = lambda w, b, x: jax.nn.gelu(x @ w + b)
    else:
        w, b = jnp.asarray(rng.normal(size=(3, 3, 2, 4)), jnp.float32), jnp.ones(4)
        x = jnp.asarray(rng.normal(size=(1, 5, 5, 2)), jnp.float32)
        conv = lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        fn = lambda w, b, x: jax.nn.gelu(conv(x, w) + b.reshape(1, 1, 1, -1))
    f = mpjax.autocast(fn, mpjax.Policy.from_level("O1", "float16"))
    assert in_dtypes(f, w, b, x, name="add")[0] == (HALF["float16"],) * 2
    assert in_dtypes(f, w, b, x, name="tanh") == [(HALF["float16"],)]
    assert f(w, b, x).dtype == F32  # outputs in output_dtype
    np.testing.assert_allclose(f(w, b, x), fn(w, b, x), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("half", list(HALF))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_float32_preferred_element_type_on_half_operands_is_kept(level, half, rng):
    # Half inputs, float32 accumulation and result: the precise, fast matmul (flax#4890).
    h = HALF[half]
    dims = (((1,), (0,)), ((), ()))

    def f(x, w):
        y = lax.dot_general(x.astype(h), w.astype(h), dims, preferred_element_type=jnp.float32)
        return y * 3.0

    x = jnp.asarray(rng.normal(size=(8, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    g = mpjax.autocast(f, mpjax.Policy.from_level(level, half), cast_outputs=False)
    (dot,) = eqns(jax.make_jaxpr(g)(x, w).jaxpr, "dot_general")
    assert [np.dtype(v.aval.dtype) for v in dot.invars] == [h, h]
    assert np.dtype(dot.outvars[0].aval.dtype) == F32
    assert g(x, w).dtype == F32
    # Exactly the hand-written result: half products, float32 sums.
    np.testing.assert_array_equal(np.asarray(g(x, w)), np.asarray(f(x, w)))


def test_o2_keeps_what_f32_ops_produce_in_float32(rng):
    f = mpjax.autocast(
        lambda w, x: jax.scipy.special.logsumexp(x @ w), mpjax.Policy.from_level("O2", "bfloat16")
    )
    w, x = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), jnp.ones((2, 3))
    for name in ("abs", "log", "exp"):
        assert set(in_dtypes(f, w, x, name=name)[0]) == {F32}, name


def test_o0_returns_the_function_unchanged():
    def f(x):
        return x * 2

    assert mpjax.autocast(f, mpjax.Policy.from_level("O0")) is f


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_custom_lists(level):
    policy = mpjax.Policy.from_level(
        level, "bfloat16", lower_ops={"reduce_sum"}, f32_ops={"dot_general"}
    )
    f = mpjax.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), policy)
    w, x = jnp.ones((3, 4)), jnp.ones((2, 3))
    assert in_dtypes(f, w, x, name="dot_general") == [(F32, F32)]
    assert in_dtypes(f, w, x, name="reduce_sum") == [(HALF["bfloat16"],)]


# -- regions -----------------------------------------------------------------------------------


def test_full_precision_region_keeps_matmuls_in_float32():
    def f(w, x):
        h = x @ w
        with mpjax.full_precision():
            g = jax.jit(lambda a: a @ w.T)(h)  # through a nested jit too
        return jnp.tanh(g)

    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    dots = in_dtypes(
        mpjax.autocast(f, mpjax.Policy.from_level("O2", "float16")), w, x, name="dot_general"
    )
    assert dots == [(HALF["float16"],) * 2, (F32, F32)]


def test_regions_work_without_parentheses_as_torch_users_write_them():
    # `with mpjax.full_precision:` (torch's `with torch.autocast(...)` habit) failed with
    # "'function' object does not support the context manager protocol"; it is the same
    # region as `with mpjax.full_precision():`, nested and in threads too.
    def f(w, x):
        h = x @ w
        with mpjax.full_precision:
            g = h @ w.T
            with mpjax.half_precision:
                k = g @ w
            m = k @ w.T
        return jnp.tanh(m @ w)

    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    run = mpjax.autocast(f, mpjax.Policy.from_level("O2", "float16"))
    h16 = (HALF["float16"],) * 2
    assert in_dtypes(run, w, x, name="dot_general") == [h16, (F32, F32), h16, (F32, F32), h16]
    assert repr(mpjax.full_precision) == "mpjax.full_precision"


def test_half_precision_decorator_forces_half_even_for_f32_ops():
    @mpjax.half_precision()
    def softplus_in_half(z):
        return jnp.log1p(jnp.exp(z))

    f = mpjax.autocast(
        lambda x: softplus_in_half(x) + jnp.exp(x), mpjax.Policy.from_level("O1", "bfloat16")
    )
    exps = in_dtypes(f, jnp.ones(3), name="exp")
    assert exps == [(HALF["bfloat16"],), (F32,)]
    assert in_dtypes(f, jnp.ones(3), name="log1p") == [(HALF["bfloat16"],)]


def test_regions_change_nothing_outside_autocast():
    def f(x):
        with mpjax.half_precision():
            return jnp.exp(x)

    assert f(jnp.ones(2)).dtype == F32


# -- transformations ---------------------------------------------------------------------------


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_outputs_and_gradients_match_float32(kind, level, half, rng):
    fn, params, x = make(kind, rng)
    policy = mpjax.Policy.from_level(level, half)
    loss = lambda p, x: jnp.sum(fn(p, x) ** 2)
    ref_out = jax.jit(fn)(params, x)
    with jax.default_matmul_precision("highest"):
        ref_out = jax.jit(fn)(params, x)
        ref_grads = jax.grad(loss)(params, x)
    f = mpjax.autocast(fn, policy)
    out = jax.jit(f)(params, x)
    assert out.dtype == F32
    assert rel_err(out, ref_out) < RTOL[half]
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x) ** 2)))(params, x)
    for k in params:
        assert grads[k].dtype == F32, k  # master params' gradients in float32
        assert rel_err(grads[k], ref_grads[k]) < 2 * RTOL[half], k


def test_grad_value_and_grad_vjp_jvp_vmap_scan_and_jit(rng):
    policy = mpjax.Policy.from_level("O2", "float16")
    fn, params, x = make("mlp", rng)
    f = mpjax.autocast(fn, policy)
    # Squares: a plain sum of the outputs can cancel to near zero, and its relative error with it.
    loss = lambda p: jnp.sum(f(p, x) ** 2)
    ref = lambda p: jnp.sum(fn(p, x) ** 2)
    v, g = jax.value_and_grad(loss)(params)
    assert rel_err(v, ref(params)) < 2e-2
    assert rel_err(g["w1"], jax.grad(ref)(params)["w1"]) < 4e-2
    out, pullback = jax.vjp(lambda x: f(params, x), x)
    assert pullback(jnp.ones_like(out))[0].dtype == F32
    _, tangent = jax.jvp(lambda x: f(params, x), (x,), (jnp.ones_like(x),))
    assert rel_err(tangent, jax.jvp(lambda x: fn(params, x), (x,), (jnp.ones_like(x),))[1]) < 4e-2
    batched = jax.vmap(f, in_axes=(None, 0))(params, x[:, None, :])
    assert batched.shape == (4, 1, 8)
    autocast_of_vmap = mpjax.autocast(jax.vmap(fn, in_axes=(None, 0)), policy)
    assert rel_err(autocast_of_vmap(params, x), fn(params, x)) < 2e-2

    def scan_body(carry, xi):
        return carry + f(params, xi[None])[0] ** 2, None

    total, _ = jax.jit(lambda xs: lax.scan(scan_body, jnp.zeros(8), xs))(x)
    assert rel_err(total, (fn(params, x) ** 2).sum(0)) < 2e-2


def test_recurses_into_control_flow_and_remat(rng):
    def f(w, x):
        h = jax.checkpoint(lambda z: jnp.tanh(z @ w))(x)
        c, _ = lax.scan(lambda c, r: (c + r @ w.T, None), jnp.zeros(w.shape[0]), h)
        h = lax.cond(c.sum() > 0, lambda a: a @ w.T @ w, lambda a: a, h)
        _, h = lax.while_loop(
            lambda s: s[0] < 2, lambda s: (s[0] + 1, jnp.tanh(s[1] @ w.T @ w)), (0, h)
        )
        return h

    w = jnp.asarray(rng.normal(size=(4, 4)) * 0.5, jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    g = mpjax.autocast(f, mpjax.Policy.from_level("O1", "bfloat16"))
    for dtypes in in_dtypes(g, w, x, name="dot_general"):
        assert set(dtypes) == {HALF["bfloat16"]}
    assert rel_err(jax.jit(g)(w, x), f(w, x)) < 8e-2
    no_while = lambda w: jnp.sum(jax.checkpoint(lambda z: jnp.tanh(z @ w))(x) ** 2)
    grads = jax.grad(mpjax.autocast(no_while, mpjax.Policy.from_level("O1", "bfloat16")))(w)
    assert grads.dtype == F32
    assert rel_err(grads, jax.grad(no_while)(w)) < 8e-2


def test_custom_jvp_and_custom_vjp_rules_are_kept():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x @ x.T)

    f.defjvp(
        lambda primals, tangents: (f(primals[0]), 42.0 * jnp.sum(tangents[0]) * jnp.ones((2, 2)))
    )

    @jax.custom_vjp
    def g(x):
        return jnp.cos(x @ x.T)

    g.defvjp(lambda x: (g(x), None), lambda res, ct: (7.0 * jnp.ones((2, 3)),))
    policy = mpjax.Policy.from_level("O2", "float16")
    x = jnp.ones((2, 3))
    grad_f = jax.grad(lambda x: mpjax.autocast(f, policy)(x).sum())(x)
    np.testing.assert_allclose(np.asarray(grad_f), 4 * 42.0)
    grad_g = jax.grad(lambda x: mpjax.autocast(g, policy)(x).sum())(x)
    np.testing.assert_allclose(np.asarray(grad_g), 7.0)
    assert in_dtypes(mpjax.autocast(f, policy), x, name="dot_general") == [(HALF["float16"],) * 2]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_custom_jvp_rules_with_symbolic_zeros_in_and_out(level):
    # equinox's filter_custom_jvp (diffrax, optimistix, lineax) passes symbolic zeros into
    # the rule and returns them for outputs with no tangent.
    from jax.custom_derivatives import SymbolicZero, zero_from_primal

    @jax.custom_jvp
    def f(w, s):
        return jnp.tanh(w @ w.T) * s, s

    def f_jvp(primals, tangents):
        (w, s), (tw, ts) = primals, tangents
        assert isinstance(ts, SymbolicZero)  # s is not differentiated
        out, s_out = f(w, s)
        dt = (1 - jnp.tanh(w @ w.T) ** 2) * (tw @ w.T + w @ tw.T) * s
        return (out, s_out), (dt, zero_from_primal(s_out, symbolic_zeros=True))

    f.defjvp(f_jvp, symbolic_zeros=True)
    loss = lambda w, s: jnp.sum(f(w, s)[0])
    w, s = jnp.linspace(-1, 1, 12).reshape(3, 4), jnp.float32(2.0)
    policy = mpjax.Policy.from_level(level, "float16")
    got = jax.grad(mpjax.autocast(loss, policy))(w, s)
    want = jax.grad(loss)(w, s)
    assert got.dtype == F32
    assert rel_err(got, want) < RTOL["float16"]


def test_integers_bools_and_keys_are_never_cast():
    def f(key, idx, mask, x):
        noise = jax.random.normal(key, x.shape)
        y = (x + noise)[idx]
        return jnp.where(mask, y @ jnp.ones((3, 3)), 0.0), idx * 2

    policy = mpjax.Policy.from_level("O3", "bfloat16")
    out, idx = mpjax.autocast(f, policy)(
        jax.random.key(0), jnp.array([1, 0]), jnp.array([[True], [False]]), jnp.ones((2, 3))
    )
    assert out.dtype == HALF["bfloat16"] and idx.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(idx), [2, 0])
    assert float(jnp.abs(out[1]).sum()) == 0.0


def test_non_array_arguments_are_static():
    def f(x, n, activation="tanh"):
        for _ in range(n):
            x = getattr(jnp, activation)(x @ jnp.eye(2))
        return x

    g = mpjax.autocast(f, mpjax.Policy.from_level("O2", "float16"))
    assert (
        len(in_dtypes(lambda x: g(x, 3, activation="sin"), jnp.ones((2, 2)), name="dot_general"))
        == 3
    )
    assert len(in_dtypes(lambda x: g(x, 3, activation="sin"), jnp.ones((2, 2)), name="sin")) == 3


def test_unknown_primitives_run_in_their_traced_dtype_and_are_marked():
    f = mpjax.autocast(lambda a, x: lax.igamma(a, x @ x), mpjax.Policy.from_level("O3", "bfloat16"))
    a, x = jnp.full((2, 2), 2.0), jnp.ones((2, 2))
    assert in_dtypes(f, a, x, name="igamma") == [(F32, F32)]
    assert "mpjax_untouched" in jax.jit(f).lower(a, x).as_text(debug_info=True)


def _public_primitives():
    import jax.extend.core as jex

    modules = [jax.lax]
    try:
        import jax.extend.core.primitives as prims

        modules.append(prims)
    except ImportError:
        pass
    return {
        v.name
        for m in modules
        for k in dir(m)
        if isinstance(v := getattr(m, k, None), jex.Primitive)
    }


def test_every_primitive_of_this_jax_has_a_record_in_the_one_table():
    from mpjax._src.interpreter import interpret, ops

    found = _public_primitives()
    assert len(found) > 150  # the enumeration itself works
    missing = sorted(found - set(ops.PRIMITIVES))
    assert not missing, f"primitives without a record in ops.PRIMITIVES: {missing}"
    # The interpreter runs the body of exactly the primitives recorded as higher order.
    assert {n for layout in interpret.LAYOUTS for n in layout.names} == ops.HIGHER_ORDER_OPS


def test_every_list_of_primitives_is_derived_from_the_table():
    """A trait given in one record reaches every rule that reads it: the rules' lists are the
    table's, not copies, so adding a primitive is one record."""
    from mpjax._src.interpreter import first_order, islands, ops, rules
    from mpjax._src.tools import f32_search, shadow

    T = ops.Trait
    assert "reshape" in rules.MOVE_OPS and ops.PRIMITIVES["reshape"].traits & T.MOVES
    for name, op in ops.PRIMITIVES.items():
        assert (name in rules.MOVE_OPS) == bool(op.traits & T.MOVES), name
        assert (name in rules.PASS_OPS) == bool(op.traits & T.PASSES), name
        assert (name in rules.DECISION_OPS) == bool(op.traits & T.DECIDES), name
        assert (name in rules.CARRY_OPS) == bool(op.traits & T.CARRIES), name
        assert (name in islands.ISLAND_OPS) == bool(op.traits & T.ISLAND), name
        assert (name in first_order._CAST_FIRST_OPS) == bool(op.traits & T.CAST_FIRST), name
        assert (name in shadow.NO_OWN_ERROR) == bool(op.traits & (T.MOVES | T.PASSES)), name
        in_table_kind = op.kind in (ops.Kind.LOWER, ops.Kind.F32, ops.Kind.FOLLOW)
        assert (name in ops.KNOWN_OPS) == in_table_kind, name
        if op.kind is not ops.Kind.UNTOUCHED:
            assert name not in ops.UNTOUCHED_OPS, name
    assert "convert_element_type" in f32_search.NOT_CANDIDATES
    assert not any(op.traits for op in ops.PRIMITIVES.values() if op.kind is ops.Kind.UNTOUCHED)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_stack_tile_scatters_and_cotangent_sums_follow_the_policy(level, rng):
    h = HALF["bfloat16"]
    idx = jnp.array([0, 2, 2, 1])

    def f(x, u, w):
        y = u @ w
        s = jax.ops.segment_sum(jnp.tanh(y), idx, 4).at[idx].max(y) + x.at[idx].add(y)
        g = jax.grad(lambda y: jnp.sum(jnp.sin(y) * y))(y)  # add_any of two cotangents
        return jnp.stack([s + g, jnp.tile(s[:1], (4, 1))]) @ w.T

    x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    u = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 3)) / 3, jnp.float32)
    policy = mpjax.Policy.from_level(level, "bfloat16")
    g = mpjax.autocast(f, policy)
    jaxpr = jax.make_jaxpr(g)(x, u, w).jaxpr
    names = {"scatter-add", "scatter-max", "stack", "add_any"}
    if hasattr(jax.lax, "tile_p"):
        names.add("tile")
    seen = {}
    for e in eqns(jaxpr):
        if e.primitive.name in names:
            seen.setdefault(e.primitive.name, set()).update(
                np.dtype(v.aval.dtype)
                for v in e.invars
                if jnp.issubdtype(v.aval.dtype, jnp.floating)
            )
    if level == "O2":  # bulk math in half: every one of them ran in bfloat16
        assert {k: v for k, v in seen.items() if v != {h}} == {}, seen
    assert "mpjax_untouched" not in str(jax.jit(g).lower(x, u, w).as_text())
    assert rel_err(g(x, u, w), f(x, u, w)) < RTOL["bfloat16"]


def _half_sums(jaxpr):
    """reduce_sums in half that add more than one element (a sum over size-1 axes is exact)."""
    out = []
    for e in eqns(jaxpr, "reduce_sum"):
        (x,) = e.invars
        extent = int(np.prod([x.aval.shape[a] for a in e.params["axes"]]))
        if np.dtype(x.aval.dtype).itemsize < 4 and extent > 1:
            out.append((str(x.aval), e.params["axes"]))
    return out


@pytest.mark.parametrize("half", list(HALF))
@pytest.mark.parametrize("level", [pytest.param("O1", marks=pytest.mark.slow), "O2"])
def test_backward_sums_of_broadcast_half_activations_accumulate_in_float32(level, half, rng):
    def unet(h, temb, w, w2):
        t = jax.nn.silu(temb @ w)  # a half time embedding, added to every pixel
        return jnp.mean(jnp.tanh((h + t[:, None, None, :]) @ w2))

    def gqa(q, k, wq, wk):  # grouped-query attention's repeated keys
        qh = (q @ wq).reshape(2, 8, 4, 4)  # 4 query heads
        kh = jnp.repeat((k @ wk).reshape(2, 8, 1, 4), 4, axis=2)  # 1 key head, repeated
        return jnp.mean(jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", qh, kh)))

    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    cases = [(unet, (r(2, 16, 16, 8), r(2, 6), r(6, 8) / 3, r(8, 8) / 3)),
             (gqa, (r(2, 8, 16), r(2, 8, 16), r(16, 16) / 4, r(16, 4) / 4))]  # fmt: skip
    for fn, args in cases:
        grad = jax.grad(mpjax.autocast(fn, mpjax.Policy.from_level(level, half)), argnums=(1, 2))
        assert _half_sums(jax.make_jaxpr(grad)(*args).jaxpr) == [], fn.__name__
        want = jax.grad(fn, argnums=(1, 2))(*args)
        for got, ref in zip(grad(*args), want):
            assert got.dtype == F32 and rel_err(got, ref) < 2 * RTOL[half], fn.__name__


def test_bad_input():
    with pytest.raises(TypeError, match="needs an mpjax.Policy"):
        mpjax.autocast(jnp.tanh, "O1")
    with pytest.raises(TypeError, match="needs a function"):
        mpjax.autocast(3, mpjax.Policy.from_level("O1"))


def _shard_map(f, **kw):
    """jax.shard_map, or its experimental form on JAX 0.6.0."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, **kw)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, **kw)


def _psum_of_a_layer(w, x):
    from jax.sharding import Mesh, PartitionSpec

    def body(w, x):
        return lax.psum(jnp.tanh(x @ w).sum(0, keepdims=True), "d")

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    specs = dict(in_specs=(PartitionSpec(), PartitionSpec("d")), out_specs=PartitionSpec())
    return _shard_map(body, mesh=mesh, **specs)(w, x)


def test_recurses_into_shard_map_and_keeps_collectives_in_their_traced_dtype():
    f = _psum_of_a_layer

    w = jnp.full((3, 3), 0.1)
    x = jnp.ones((4, 3))
    g = mpjax.autocast(f, mpjax.Policy.from_level("O2", "bfloat16"))
    assert in_dtypes(g, w, x, name="dot_general") == [(HALF["bfloat16"],) * 2]
    psums = [e for e in eqns(jax.make_jaxpr(g)(w, x).jaxpr) if e.primitive.name.startswith("psum")]
    assert psums and all(v.aval.dtype == F32 for e in psums for v in e.invars)
    assert rel_err(g(w, x), f(w, x)) < 5e-2
    grads = jax.grad(lambda w: g(w, x).sum())(w)
    assert rel_err(grads, jax.grad(lambda w: f(w, x).sum())(w)) < 5e-2


def test_a_body_autocast_cannot_rebuild_warns_is_audited_and_strict_raises(monkeypatch):
    from mpjax._src import jax_compat
    from mpjax._src.interpreter.autocast import UntouchedWarning

    def cannot(params):
        raise jax_compat.CannotRebuild("a JAX without this internal")

    monkeypatch.setattr(jax_compat, "shard_map_context", cannot)
    w, x = jnp.full((3, 3), 0.1), jnp.ones((4, 3))
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    g = mpjax.autocast(_psum_of_a_layer, policy)
    with pytest.warns(UntouchedWarning, match="shard_map .*a JAX without this internal"):
        report = mpjax.audit(g, w, x, compile=False)
    # The body ran in float32, as traced, and the audit says so and why.
    assert [m.operand_dtypes for m in report.matmuls] == [("float32", "float32")]
    assert report.untouched == ("shard_map",)
    assert "could not rebuild its body" in report.untouched_why[0]
    assert "shard_map: autocast could not rebuild" in str(report)
    strict = mpjax.autocast(_psum_of_a_layer, policy, strict=True)
    with pytest.raises(ValueError, match="strict=True.*shard_map.*a JAX without this internal"):
        strict(w, x)


def test_a_sub_program_left_by_design_is_audited_with_its_reason_and_strict_raises():
    def f(x):  # a reduction with a body of the user's: runs as traced, by design, silently
        return lax.reduce(x, 0.0, lambda a, b: a + b * b, (0,)) @ x

    x = jnp.ones((4, 4))
    policy = mpjax.Policy.from_level("O1", "float16")
    report = mpjax.audit(mpjax.autocast(f, policy), x, compile=False)
    assert report.untouched == ("reduce",)
    assert report.untouched_why == (mpjax_ops.UNTOUCHED_OPS["reduce"],)
    with pytest.raises(ValueError, match=r"strict=True\): the reduce at .*a generic reduction"):
        mpjax.autocast(f, policy, strict=True)(x)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_softmax_is_one_float32_island_from_its_row_max(half):
    """At O2 a softmax's row max runs in float32 with its exp and sum (the same value: a max
    is exact in any dtype), so that the island is the whole softmax, which XLA's GPU pipeline
    fuses into one kernel forward and one backward as it does the half softmax; the scores'
    matmul stays half and so does the mask that makes them."""

    def attend(q, k, mask):
        scores = jnp.where(mask, jnp.einsum("bqd,bkd->bqk", q, k), -1e4)
        return jax.nn.softmax(scores)

    q = jnp.ones((2, 8, 16))
    mask = jnp.tril(jnp.ones((8, 8), bool))
    f = mpjax.autocast(attend, mpjax.Policy.from_level("O2", half))
    assert in_dtypes(f, q, q, mask, name="reduce_max") == [(F32,)]
    assert in_dtypes(f, q, q, mask, name="dot_general") == [(HALF[half],) * 2]
    assert set(in_dtypes(f, q, q, mask, name="select_n")[0]) == {HALF[half]}


# -- a lookup's gradient: rows taken many times sum in float32 --------------------------------


def _lookup_loss(table, ids, w):
    """An embedding lookup into a small head: the rows of `ids` (a frequent token repeated)."""
    return jnp.mean((jnp.take(table, ids, axis=0) @ w).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_row_looked_up_many_times_sums_its_gradient_in_float32(level, half):
    # 4096 lookups of 8 rows: each row's gradient is a sum of 512 cotangents. Summed in half
    # one row at a time (JAX's own transpose of a half gather), a half sum stalls once its
    # spacing passes the addends: before, 0.32 relative error in bfloat16 and 0.03 in
    # float16, at O1 and O2. torch's embedding backward accumulates in float32, and so does
    # autocast's, rounding each row once.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    table = 1.0 + 0.1 * jax.random.normal(k1, (64, 32))
    ids = jax.random.randint(k2, (4096,), 0, 8)
    w = jax.random.normal(k3, (32, 16)) / 6
    policy = mpjax.Policy.from_level(level, half)
    half_table = table.astype(HALF[half])  # O2's half params too (master_weights=False)
    ref = jax.grad(_lookup_loss)(table, ids, w)
    for params in (table, half_table) if level == "O2" else (table,):
        got = jax.jit(jax.grad(mpjax.autocast(_lookup_loss, policy)))(params, ids, w)
        assert rel_err(got, ref) < RTOL[half] / 5, (params.dtype, rel_err(got, ref))
    # Forward values and forward mode are the plain gather's.
    f = mpjax.autocast(lambda t: jnp.take(t, ids, axis=0), policy)
    _, tangent = jax.jvp(f, (half_table,), (jnp.ones_like(half_table),))
    np.testing.assert_array_equal(f(half_table), jnp.take(half_table, ids, axis=0))
    np.testing.assert_array_equal(tangent, jnp.ones((4096, 32), tangent.dtype))
