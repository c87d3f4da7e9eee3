"""Fused kernels under autocast (mpjax/_src/interpreter/kernels.py): Pallas kernels (here in
Pallas's interpreter, so they run on a CPU) take the policy's half operands, their backward
kernels too, and keep the dtypes their author wrote; through the function form, the Flax
wrappers (linen and NNX attention_fn), FP8 policies and loss scaling. cuDNN's fused
attention is checked in the GPU programs (tests/test_gpu_program.py), splash attention in the
TPU's (tests/test_tpu_program.py)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.experimental import pallas as pl

import mpjax
import mpjax.flax
from mpjax._src.interpreter import interpret

pytestmark = pytest.mark.filterwarnings("ignore::mpjax.HardwareWarning")


# -- a user's own kernel: a gated scale, with a float32 statistic and a backward kernel ----------


def _forward_kernel(x_ref, w_ref, o_ref, s_ref):
    x = x_ref[...]
    o_ref[...] = (x * w_ref[...]).astype(o_ref.dtype)
    # the author's float32 statistic, whatever the operands' dtype
    s_ref[...] = jnp.sum(x.astype(jnp.float32) ** 2, axis=-1, keepdims=True)


def _backward_kernel(g_ref, x_ref, w_ref, dx_ref, dw_ref):
    g = g_ref[...]
    dx_ref[...] = (g * w_ref[...]).astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(g.astype(jnp.float32) * x_ref[...].astype(jnp.float32), 0, keepdims=True)


def _forward(x, w):
    shapes = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((x.shape[0], 1), jnp.float32),
    )
    return pl.pallas_call(_forward_kernel, out_shape=shapes, interpret=True)(x, w)


@jax.custom_vjp
def gated(x, w):
    return _forward(x, w)[0]


def _gated_fwd(x, w):
    out, stat = _forward(x, w)
    return out, (x, w, stat)


def _gated_bwd(res, g):
    x, w, _ = res
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32))
    dx, dw = pl.pallas_call(_backward_kernel, out_shape=shapes, interpret=True)(g, x, w)
    return dx, dw.astype(w.dtype)


gated.defvjp(_gated_fwd, _gated_bwd)


def _loss(params, x):
    h = gated(x @ params["a"], params["w"])
    return jnp.mean((h @ params["b"]) ** 2)


def _params():
    ka, kw, kb, kx = jax.random.split(jax.random.key(0), 4)
    params = {
        "a": jax.random.normal(ka, (16, 32)) / 4,
        "w": jax.random.normal(kw, (1, 32)),
        "b": jax.random.normal(kb, (32, 16)) / 4,
    }
    return params, jax.random.normal(kx, (16, 16))


def _pallas_calls(jaxpr):
    """(operand dtypes, result dtypes) of every pallas_call in `jaxpr`, bodies included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(
                (
                    tuple(str(v.aval.dtype) for v in eqn.invars),
                    tuple(str(v.aval.dtype) for v in eqn.outvars),
                )
            )
            continue
        for sub in interpret.bodies(eqn):  # every JAX version's higher-order params
            found += _pallas_calls(interpret.open_jaxpr(sub)[0])
    return found


def _relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_a_pallas_kernel_and_its_backward_kernel_run_in_half_as_written(level, half):
    """Under autocast the kernel's forward and backward pallas_calls take the half operands
    the hand-written half step gives them, and the float32 statistic its author wrote stays
    float32; the gradient is as close to float32's as the hand-written half step's. Before
    kernels.py, both kernels ran in float32 (the traced dtypes)."""
    params, x = _params()
    f = mpjax.autocast(_loss, mpjax.Policy.from_level(level, half))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.UntouchedWarning)
        closed = jax.make_jaxpr(jax.grad(f))(params, x)
        grads = jax.grad(f)(params, x)
    calls = _pallas_calls(closed.jaxpr)
    assert calls == [((half, half), (half, "float32")), ((half, half, half), (half, "float32"))]

    def hand(p, x):
        return _loss(jax.tree.map(lambda a: a.astype(half), p), x.astype(half)).astype(jnp.float32)

    want = jax.grad(_loss)(params, x)
    by_hand = jax.grad(hand)(params, x)
    for name in params:
        err = _relative_error(grads[name], want[name])
        assert err <= 1.5 * _relative_error(by_hand[name], want[name]) + 1e-3, name


def test_a_pallas_call_outside_a_custom_vjp_runs_in_half_and_its_result_is_half():
    """A pallas_call no custom_vjp encloses (inference): its float32 operands and results in
    half; the function still returns what it returned in float32, cast at the end."""

    def scale_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def f(x):
        y = pl.pallas_call(
            scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True
        )(x)
        return y + 1

    x = jnp.linspace(-3, 3, 64).reshape(8, 8)
    g = mpjax.autocast(f, mpjax.Policy.from_level("O2", "bfloat16"))
    closed = jax.make_jaxpr(g)(x)
    assert _pallas_calls(closed.jaxpr) == [(("bfloat16",), ("bfloat16",))]
    out = g(x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, f(x), rtol=2e-2, atol=1e-2)


def test_a_kernel_in_a_full_precision_region_and_at_o0_runs_in_float32():
    params, x = _params()

    def loss(params, x):
        with mpjax.full_precision():
            return _loss(params, x)

    closed = jax.make_jaxpr(jax.grad(mpjax.autocast(loss, mpjax.Policy.from_level("O2"))))(
        params, x
    )
    assert {d for ins, _ in _pallas_calls(closed.jaxpr) for d in ins} == {"float32"}
    o0 = jax.make_jaxpr(jax.grad(mpjax.autocast(_loss, mpjax.Policy.from_level("O0"))))(params, x)
    assert {d for ins, _ in _pallas_calls(o0.jaxpr) for d in ins} == {"float32"}


def test_a_kernel_that_refuses_half_operands_runs_in_float32_and_says_so():
    """A kernel whose author checks for float32 fails when traced in half: it runs as written,
    with an UntouchedWarning that names it, and the audit lists it."""

    def f32_only_kernel(x_ref, o_ref):
        assert x_ref.dtype == jnp.float32, "this kernel is written for float32"
        o_ref[...] = x_ref[...] * 3

    def f(x):
        y = pl.pallas_call(
            f32_only_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True
        )(x @ x)
        return jnp.sum(y)

    x = jnp.eye(8) * 0.5
    g = mpjax.autocast(f, mpjax.Policy.from_level("O2", "bfloat16"))
    with pytest.warns(mpjax.UntouchedWarning, match=r"f32_only_kernel cannot take bfloat16"):
        closed = jax.make_jaxpr(g)(x)
    assert _pallas_calls(closed.jaxpr) == [(("float32",), ("float32",))]
    np.testing.assert_allclose(g(x), f(x), rtol=1e-2)
    report = mpjax.audit(g, x)
    assert any("f32_only_kernel" in name for name in report.untouched), report.untouched
    assert any("failed with half operands" in why for why in report.untouched_why)


def test_a_jitted_kernel_traced_under_autocast_is_not_reused_outside():
    """JAX caches a jitted function's trace; the half trace made under autocast is keyed
    apart, so the same function called outside autocast afterwards runs in float32."""

    @jax.jit
    def inner(x, w):
        return gated(x, w)

    params, x = _params()
    h = x @ params["a"]
    g = mpjax.autocast(lambda h, w: inner(h, w), mpjax.Policy.from_level("O2", "bfloat16"))
    assert g(h, params["w"]).dtype == jnp.float32  # cast back: the function's output dtype
    closed = jax.make_jaxpr(g)(h, params["w"])
    assert _pallas_calls(closed.jaxpr)[0][0] == ("bfloat16", "bfloat16")
    outside = jax.make_jaxpr(inner)(h, params["w"])
    assert _pallas_calls(outside.jaxpr)[0][0] == ("float32", "float32")
    np.testing.assert_array_equal(inner(h, params["w"]), gated(h, params["w"]))


# -- attention: a Pallas flash-attention kernel as a Flax attention_fn ---------------------------


def _attention_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref):
    """Causal attention for one head, softmax statistics in float32 (as flash kernels keep
    them), matmuls in the operands' dtype with float32 accumulation."""
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    t = s.shape[0]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    s = jnp.where(causal, s, -1e30)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32) / denom
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log(denom))[:, 0]


def _attention_call(q, k, v, **compile_options):
    """q, k, v: [batch, length, heads, head_dim]. Run by Pallas's interpreter unless
    `compile_options` say how to compile it (tests/test_gpu_program.py: with Triton)."""
    b, t, h, d = q.shape
    spec = pl.BlockSpec((None, t, None, d), lambda i, j: (i, 0, j, 0))
    return pl.pallas_call(
        _attention_kernel,
        grid=(b, h),
        in_specs=[spec, spec, spec],
        out_specs=[spec, pl.BlockSpec((None, None, t), lambda i, j: (i, j, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        ],
        **(compile_options or {"interpret": True}),
    )(q, k, v)


@jax.custom_vjp
def flash(q, k, v):
    return _attention_call(q, k, v)[0]


def _flash_fwd(q, k, v):
    o, lse = _attention_call(q, k, v)
    return o, (q, k, v, o, lse)


def _flash_bwd(res, g):
    # The reference backward from the saved logsumexp, in float32 as a flash kernel's is.
    q, k, v, o, lse = res
    f32 = [a.astype(jnp.float32) for a in (q, k, v, o, g)]
    q32, k32, v32, o32, g32 = f32
    s = jnp.einsum("bqhd,bkhd->bhqk", q32, k32) * (q.shape[-1] ** -0.5)
    t = s.shape[-1]
    s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -1e30)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, g32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", g32, v32)
    ds = p * (dp - jnp.einsum("bqhd,bqhd->bhq", g32, o32)[..., None]) * (q.shape[-1] ** -0.5)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k32)
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q32)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention_fn(query, key, value, mask=None, **kwargs):
    """A Flax attention_fn: causal by construction (the models pass a causal mask)."""
    del mask, kwargs
    return flash(query, key, value)


class _LinenGPT(nn.Module):
    vocab: int = 64
    width: int = 32
    heads: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(2):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(
                num_heads=self.heads, attention_fn=flash_attention_fn
            )(h, h)
            x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _tokens():
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 64)
    return tokens, jnp.roll(tokens, -1, 1)


def test_linen_attention_fn_kernel_runs_in_half_under_wrap_with_loss_scaling():
    """A linen GPT whose attention_fn is a Pallas kernel, wrapped at O2 float16 and trained
    with mpjax.loss_scale: the kernel takes float16 q, k, v and keeps its float32 logsumexp,
    and the loss falls as float32's does."""
    tokens, labels = _tokens()
    model = _LinenGPT()
    params = model.init(jax.random.key(0), tokens)["params"]
    policy = mpjax.Policy.from_level("O2", "float16")
    wrapped = mpjax.flax.wrap(model, policy)
    mp_params = wrapped.init(jax.random.key(0), tokens)["params"]

    def loss(p, apply):
        logits = apply({"params": p}, tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.UntouchedWarning)
        closed = jax.make_jaxpr(jax.grad(lambda p: loss(p, wrapped.apply)))(mp_params)
    calls = _pallas_calls(closed.jaxpr)
    assert calls and all(c == (("float16",) * 3, ("float16", "float32")) for c in calls), calls

    def train(apply, p, scaled):
        opt = optax.chain(mpjax.loss_scale(), optax.adam(3e-3)) if scaled else optax.adam(3e-3)
        state = opt.init(p)

        @jax.jit
        def step(p, state):
            if scaled:
                _, grads = mpjax.scaled_value_and_grad(loss)(state, p, apply)
            else:
                grads = jax.grad(loss)(p, apply)
            updates, state = opt.update(grads, state, p)
            return optax.apply_updates(p, updates), state

        for _ in range(30):
            p, state = step(p, state)
        return float(loss(p, apply))

    start = float(loss(params, model.apply))
    f32_end = train(model.apply, params, scaled=False)
    mp_end = train(wrapped.apply, mp_params, scaled=True)
    assert mp_end < 0.8 * start
    assert abs(mp_end - f32_end) <= 0.05 * start, (start, f32_end, mp_end)


def test_nnx_attention_fn_kernel_runs_in_half_under_wrap():
    """The same kernel as an NNX MultiHeadAttention's attention_fn, wrapped at O1 bfloat16:
    forward and backward kernels take bfloat16 operands; the output matches float32's."""
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    layer = nnx.MultiHeadAttention(
        num_heads=2, in_features=32, attention_fn=flash_attention_fn, decode=False,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    want = layer(x)
    wrapped = mpjax.flax.wrap(layer, mpjax.Policy.from_level("O1", "bfloat16"))

    graphdef, state = nnx.split(wrapped)

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x).astype(jnp.float32) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.UntouchedWarning)
        got = wrapped(x)
        closed = jax.make_jaxpr(jax.grad(loss))(state, x)
    calls = _pallas_calls(closed.jaxpr)
    assert calls and all(c[0] == ("bfloat16",) * 3 for c in calls), calls
    assert _relative_error(got, want) < 2e-2


def test_fp8_policy_runs_the_kernel_in_its_base_half():
    """Under an FP8 policy the dots run in float8 and the kernel in the base policy's half."""
    params, x = _params()
    policy = mpjax.fp8.policy("O1")
    state = mpjax.fp8.init(_loss, policy, params, x)
    fn = functools.partial(mpjax.fp8.scaled_value_and_grad(_loss, policy), state)
    closed = jax.make_jaxpr(fn)(params, x)
    text = str(closed)
    assert "f8_e4m3fn" in text
    half = str(np.dtype(policy.base.compute_dtype))
    assert {d for ins, _ in _pallas_calls(closed.jaxpr) for d in ins} == {half}


def test_a_bare_pallas_call_keeps_the_float32_result_its_author_wrote():
    """The attention kernel above called without its custom_vjp (inference): its q, k, v and
    output in half, and its float32 logsumexp, which the kernel stores as float32 whatever
    the operands, left float32 (making every result half fails its trace, so each float32
    result is tried in turn). No warning: the kernel runs in half."""
    q, k, v = (
        jax.random.normal(key, (1, 16, 2, 16)) for key in jax.random.split(jax.random.key(7), 3)
    )
    g = mpjax.autocast(lambda q, k, v: _attention_call(q, k, v), mpjax.Policy.from_level("O2"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpjax.UntouchedWarning)
        closed = jax.make_jaxpr(g)(q, k, v)
        out, lse = g(q, k, v)
    assert _pallas_calls(closed.jaxpr)[-1] == (("float16",) * 3, ("float16", "float32"))
    want_out, want_lse = _attention_call(q, k, v)
    assert _relative_error(out, want_out) < 2e-3
    np.testing.assert_allclose(lse, want_lse, rtol=1e-2, atol=1e-2)
