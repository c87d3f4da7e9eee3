"""FP8 runs wherever O2 runs: attention, norms, tied embeddings, remat and scan over layers,
through ``mpjax.flax.wrap`` (linen and NNX) and the function form, under every recipe.

A model whose softmax feeds a dot, wrapped by ``mpjax.flax.wrap`` and differentiated by
``mpjax.fp8.scaled_value_and_grad``, once crashed ("Transpose rule for 'name'"): the wrapper
runs the base policy, and FP8 runs autocast again over that program, whose softmax island
carries a derivative rule (a ``custom_jvp``) with a float32 statistic of tangents. Each case
here trains two steps (the first sets the scales from its amaxes, the second runs at them)
and checks the second step against the float32 program: the loss, the gradients' direction
and norm, every site's amaxes, and that the step's dots ran in FP8.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err
from flax import nnx

import mpjax
import mpjax.flax
import mpjax.fp8

VOCAB, D, HEADS, B, T = 64, 32, 2, 2, 16

# FP8's tolerance against float32 (the FP8 guide states it): E4M3 keeps 3 mantissa bits and
# E5M2 2, so each dot's result is a few percent off elementwise, and the errors of a deep
# step's dots add up in the gradients. Measured over the 5 models x 2 levels x 3 recipes below:
# the loss within 1.3% of float32's, 1 - cos(grads) 0.0023-0.0156 (bfloat16 O2 without FP8:
# 0.00001-0.0001) and the gradient norm within 2.7%. The bounds are about twice those.
LOSS_RTOL, MAX_1_MINUS_COS, NORM_RTOL = 0.03, 0.03, 0.06


@pytest.fixture(autouse=True)
def _no_hardware_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mpjax.HardwareWarning)
        yield


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(B, T + 1))
    return jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])


def _xent(logits, labels):
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# -- linen ----------------------------------------------------------------------------------------


class HandAttention(nn.Module):
    """The issue's repro: a softmax between two einsums, after a Dense."""

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(D)(x)
        a = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, q) / np.sqrt(D))
        return jnp.einsum("bqk,bkd->bqd", a, q)


class Block(nn.Module):
    """A pre-norm Transformer block: Flax's attention (causal), LayerNorm, a GELU MLP."""

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h, mask=mask)
        h = nn.Dense(2 * D)(nn.LayerNorm()(x))
        return x + nn.Dense(D)(nn.gelu(h))


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Block()(x), None


class LM(nn.Module):
    """Embedding, blocks (one by one, or ``nn.scan`` over ``nn.remat`` layers), a final
    LayerNorm and the head tied to the embedding (``Embed.attend``)."""

    layers: int = 2
    scan: bool = False
    hand: bool = False

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D)
        x = embed(ids)
        if self.hand:
            x = x + HandAttention()(nn.LayerNorm()(x))
        elif self.scan:
            layers = nn.scan(
                nn.remat(ScanBlock),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            x, _ = layers()(x, None)
        else:
            for _ in range(self.layers):
                x = Block()(x)
        return embed.attend(nn.LayerNorm()(x))


def _linen_case(model, pol):
    ids, labels = _tokens()
    params = model.init(jax.random.key(0), ids)["params"]
    wrapped = mpjax.flax.wrap(model, pol)
    loss = lambda p, ids, labels: _xent(wrapped.apply({"params": p}, ids), labels)
    ref = lambda p, ids, labels: _xent(model.apply({"params": p}, ids), labels)
    return loss, ref, params, (ids, labels)


# -- NNX ------------------------------------------------------------------------------------------


class NNXLM(nnx.Module):
    """NNX's attention, norms and a tied head, with one block under ``nnx.remat``."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)
        self.norm3 = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        h = self.norm1(x)
        x = x + self.attn(h, h, mask=nnx.make_causal_mask(ids))
        x = x + nnx.remat(lambda h: self.down(nnx.gelu(self.up(h))))(self.norm2(x))
        return self.embed.attend(self.norm3(x))


def _nnx_case(pol):
    ids, labels = _tokens()
    model = NNXLM(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    wrapped = mpjax.flax.wrap(NNXLM(nnx.Rngs(0)), pol)
    wgraph, _ = nnx.split(wrapped, nnx.Param)

    def loss(p, ids, labels):
        return _xent(nnx.merge(wgraph, p)(ids), labels)

    def ref(p, ids, labels):
        return _xent(nnx.merge(graphdef, p)(ids), labels)

    return loss, ref, params, (ids, labels)


# -- the function form ----------------------------------------------------------------------------


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _fn_layer(x, w):
    h = _rms(x, w["g1"])
    q, k, v = (jnp.einsum("btd,dhk->bthk", h, w[n]) for n in "qkv")
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    x = x + jnp.einsum("bthk,hkd->btd", o, w["o"])
    h = _rms(x, w["g2"])
    return x + jax.nn.silu(h @ w["up"]) @ w["down"]


def _fn_loss(params, ids, labels):
    """A float32 JAX program (no Flax): lookup, RMSNorm, ``jax.nn.dot_product_attention``,
    SwiGLU-less SiLU MLP, layers under ``lax.scan`` of ``jax.checkpoint``, tied head."""
    x = params["embed"][ids]
    layer = jax.checkpoint(lambda x, w: (_fn_layer(x, w), None))
    x, _ = jax.lax.scan(layer, x, params["layers"])
    return _xent(_rms(x, params["g"]) @ params["embed"].T, labels)


def _fn_case():
    ks = iter(jax.random.split(jax.random.key(0), 8))
    n, hk = 2, D // HEADS
    normal = lambda shape, fan: jax.random.normal(next(ks), shape) / np.sqrt(fan)
    params = {
        "embed": normal((VOCAB, D), 1.0) * 0.5,
        "g": jnp.ones(D),
        "layers": {
            "g1": jnp.ones((n, D)),
            "g2": jnp.ones((n, D)),
            "q": normal((n, D, HEADS, hk), D),
            "k": normal((n, D, HEADS, hk), D),
            "v": normal((n, D, HEADS, hk), D),
            "o": normal((n, HEADS, hk, D), D),
            "up": normal((n, D, 2 * D), D),
            "down": normal((n, 2 * D, D), 2 * D),
        },
    }
    return _fn_loss, _fn_loss, params, _tokens()


# -- the grid -------------------------------------------------------------------------------------

# Each model's FP8 sites: its eligible dots (contracting and free sizes multiples of 16), a
# scanned body's counted once, without and with attention's batched dots (q.k and weights.v,
# FP8Policy.batched_dots). Hand-written attention: the Dense and the tied head (2), with q.k
# and weights.v (4). A Flax block: query, key, value, out, the MLP's two (6; 8). NNX: one
# block and the head (7; 9). The function form: one scanned layer's q, k, v, o, up, down, and
# the head (7; 9).
CASES = {
    "linen hand attention": (lambda pol: _linen_case(LM(hand=True), pol), (2, 4)),
    "linen MHA x2, tied": (lambda pol: _linen_case(LM(), pol), (13, 17)),
    "linen scan(remat), tied": (lambda pol: _linen_case(LM(scan=True), pol), (7, 9)),
    "nnx MHA, remat, tied": (_nnx_case, (7, 9)),
    "function scan(checkpoint)": (lambda pol: _fn_case(), (7, 9)),
}
RECIPES = {
    "delayed": None,
    "current": mpjax.fp8.CurrentScaling(),
    "row": mpjax.fp8.CurrentScaling(granularity="row"),
    "mx": mpjax.fp8.MXFP8BlockScaling(),
    "nv": mpjax.fp8.NVFP4BlockScaling(),
}
# NVFP4's E2M1 values carry one mantissa bit: each gemm's error is some 10 to 15% of its
# result, and these models' gradients pass 4 to 8 of them. Measured on the grid: loss within
# 3.7%, 1 - cos up to 0.184 (0.10 with round-to-nearest and no Hadamard transform, the error
# of the 4-bit values alone), norms within 5.2%. A wrong gradient (a transposed scale, a lost
# tensor scale) is far off these bounds; the recipe's numbers are checked exactly against
# NumPy's in tests/test_nvfp4.py, and its training by the FP8 accuracy benchmark.
TOLERANCES = {"nv": (0.06, 0.25, 0.1)}


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(tree)])


# Flax 0.11's nn.scan calls NamedSharding.update, which JAX 0.6.0 lacks (the model's own
# init fails there, without mpjax); lax.scan over layers (the function form) runs on every JAX.
LINEN_SCAN = pytest.mark.skipif(
    not hasattr(jax.sharding.NamedSharding, "update"),
    reason="Flax's nn.scan needs NamedSharding.update, which JAX 0.6.0 lacks",
)


def _grid():
    # The test command runs every model at O2 with the default recipe, some models under the
    # other recipes and with attention's dots in FP8. The slow set covers the rest in pairs,
    # not as a full product (the product took a quarter of CI's slow set): every model under
    # every recipe at O2; every model with attention's dots in FP8 (delayed) and at O1
    # (current); every recipe with attention's dots in FP8 and each Hopper recipe at O1, on
    # the scanned models (the layouts whose sites are hardest to keep).
    fast = {(m, "O2", "delayed", False) for m in CASES}
    fast |= {("linen hand attention", "O1", "current", False)}
    fast |= {("nnx MHA, remat, tied", "O2", "row", False)}
    fast |= {
        ("linen hand attention", "O2", "delayed", True),
        ("linen MHA x2, tied", "O1", "row", True),
    }
    for block in ("mx", "nv"):
        fast |= {(m, "O2", block, False) for m in ("linen MHA x2, tied", "nnx MHA, remat, tied")}
        fast |= {("function scan(checkpoint)", "O2", block, True)}
    slow = {(m, "O2", r, False) for m in CASES for r in RECIPES}
    slow |= {(m, "O2", "delayed", True) for m in CASES}
    slow |= {(m, "O1", "current", False) for m in CASES}
    scanned = ("linen scan(remat), tied", "function scan(checkpoint)")
    slow |= {(m, "O2", r, True) for m in scanned for r in RECIPES}
    slow |= {(m, "O1", r, b) for m in scanned for r in ("delayed", "row") for b in (False, True)}
    out = []
    for cell in sorted(fast | slow, key=lambda c: (list(CASES).index(c[0]), *c[1:])):
        model, level, recipe, batched = cell
        marks = [] if cell in fast else [pytest.mark.slow]
        if model.startswith("linen scan"):
            marks.append(LINEN_SCAN)
        name = f"{model}-{level}-{recipe}" + ("-attention" if batched else "")
        out.append(pytest.param(*cell, marks=marks, id=name))
    return out


@pytest.mark.parametrize("model,level,recipe,batched_dots", _grid())
def test_fp8_trains_the_model_as_float32_does(model, level, recipe, batched_dots):
    make, sites = CASES[model]
    # MXFP8's blocks of 32 leave the test models' attention dots (sizes of 16) in half;
    # NVFP4's blocks of 16 take them
    sites = sites[batched_dots and recipe != "mx"]
    pol = mpjax.fp8.policy(level, "bfloat16", recipe=RECIPES[recipe], batched_dots=batched_dots)
    loss, ref, params, batch = make(pol)
    state = mpjax.fp8.init(loss, pol, params, *batch)
    assert state.num_sites == sites
    step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
    for _ in range(2):  # the first step sets the scales, the second runs at them
        value, grads, state = step(state, params, *batch)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref))(params, *batch)
    g, r = _flat(grads), _flat(ref_grads)
    assert np.isfinite(float(value)) and np.all(np.isfinite(g))
    loss_rtol, max_1_minus_cos, norm_rtol = TOLERANCES.get(
        recipe, (LOSS_RTOL, MAX_1_MINUS_COS, NORM_RTOL)
    )
    assert abs(float(value) / float(ref_value) - 1) < loss_rtol, (float(value), float(ref_value))
    assert 1 - g @ r / (np.linalg.norm(g) * np.linalg.norm(r)) < max_1_minus_cos
    assert abs(np.linalg.norm(g) / np.linalg.norm(r) - 1) < norm_rtol
    # every site saw its input, kernel and output gradient
    assert np.all(np.asarray(state.amax_history[..., 0]) > 0)
    report = mpjax.audit(step, state, params, *batch, compile=False)
    assert len(report.fp8_matmuls) >= sites  # at least each site's forward dot


def test_wrapped_attention_under_fp8_is_as_accurate_as_the_function_given_to_fp8():
    """The wrapped model (its base policy applied by the wrapper, FP8 around it) and the same
    float32 model given to mpjax.fp8 as a function are equally close to float32 (measured:
    0.0868 and 0.0869 relative error of the gradients), with attention's dots in FP8."""
    pol = mpjax.fp8.policy("O2", batched_dots=True)
    loss, ref, params, batch = _linen_case(LM(hand=True), pol)
    state = mpjax.fp8.init(loss, pol, params, *batch)
    wrapped = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, params, *batch)
    plain = jax.jit(mpjax.fp8.scaled_value_and_grad(ref, pol))(state, params, *batch)
    exact = _flat(jax.jit(jax.grad(ref))(params, *batch))
    np.testing.assert_allclose(float(wrapped[0]), float(plain[0]), rtol=1e-3)
    assert rel_err(_flat(wrapped[1]), exact) < 1.05 * rel_err(_flat(plain[1]), exact)


def test_autocast_of_an_autocast_program_differentiates():
    """The class of the crash without FP8: autocast over a program autocast already made (a
    wrapped model inside ``mpjax.autocast``) differentiates, as accurately as autocast once
    (measured: 0.0118 and 0.0119 relative error of the gradients against float32)."""
    pol = mpjax.Policy.from_level("O2", "bfloat16")
    loss, _, params, batch = _fn_case()
    grad = lambda f: _flat(jax.jit(jax.grad(f))(params, *batch))
    exact, once = grad(loss), grad(mpjax.autocast(loss, pol))
    twice = grad(mpjax.autocast(mpjax.autocast(loss, pol), pol))
    assert np.all(np.isfinite(twice))
    assert rel_err(twice, exact) < 1.05 * rel_err(once, exact)
