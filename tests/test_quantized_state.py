"""quantize_moments: optimizer moments in 8 bits, unbiased, exact under skipped steps, resumable,
and about 4 bytes per parameter with bfloat16 params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_bit_identical

import mpjax
from mpjax._src.optim.quantized_state import FORMATS


def _bytes(tree):
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3", "sqrt_e5m3", "sqrt_e4m4"])
def test_rounding_is_unbiased_over_the_formats_range(fmt):
    # Values from the block's largest down past the format's smallest normal code (into its
    # linear subnormal grid): each is stored exactly in expectation (a second moment in its
    # square root), and one draw is within a code's step of the value where codes are normal.
    f = FORMATS[fmt]
    depth = 2.0 ** -jnp.linspace(0.1, f.octaves + 2, 255)
    x = jnp.concatenate([jnp.ones(1), depth])
    if f.signed:
        x = x * jnp.where(jnp.arange(256) % 2 == 0, 1.0, -1.0)
    keys = jax.random.split(jax.random.key(1), 2000)
    quantize = lambda k: mpjax.QuantizedMoment.quantize(x, fmt, block_size=256, key=k)
    out = jax.vmap(lambda k: quantize(k).dequantize())(keys)
    stored = out if f.signed else jnp.sqrt(out)
    want = x if f.signed else jnp.sqrt(x)
    rel = jnp.abs(stored.mean(0) / want - 1)
    assert float(rel.max()) < 0.03, float(rel.max())
    assert bool((out != 0).any(axis=0).all())  # nothing flushed to zero for good
    one = quantize(keys[0]).dequantize()
    ratio = jnp.abs(one / x) if f.signed else jnp.sqrt(one / x)
    normal = jnp.concatenate([jnp.ones(1, bool), depth >= 2.0**-f.octaves])
    step = 1 + 2.0**-f.mantissa
    assert float(ratio[normal].max()) <= step * 1.0001, float(ratio[normal].max())
    assert float(ratio[normal].min()) >= 1 / step / 1.0001, float(ratio[normal].min())
    assert float(jnp.abs(one[0])) == 1.0  # the block's largest is exact


def test_e5m2_codes_are_float8_e5m2_bits_relative_to_the_block_scale():
    # Below the top exponent (where float8_e5m2 keeps inf and NaN, and mpjax the block's
    # largest), a code decodes as the same bits read as float8_e5m2, times 2**-16: the
    # format is e5m2 with its exponent bias moved so that the top code is the block scale.
    codes = jnp.arange(128, dtype=jnp.uint8)
    q = mpjax.QuantizedMoment(codes, jnp.ones((1, 1)), (128,), jnp.float32, "e5m2", 256)
    values = np.asarray(q.dequantize())
    as_f8 = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.float8_e5m2), np.float32)
    np.testing.assert_array_equal(values[:124], as_f8[:124] * 2.0**-16)
    assert values[124] == 1.0 and values[123] == 0.875 and values[0] == 0
    assert values[4] == 2.0**-30 and values[1] == 2.0**-32  # smallest normal, subnormal step


def test_blocks_run_along_trailing_axes_and_codes_keep_the_shape():
    m = jax.random.normal(jax.random.key(0), (6, 4, 100))
    q = mpjax.QuantizedMoment.quantize(m, "e5m2", block_size=256, key=jax.random.key(1))
    # 100 < 256, so a block row is the last two axes (400 values: blocks of 256 and 144).
    assert q.codes.shape == (6, 4, 100) and q.scales.shape == (6, 2)
    rows = np.abs(np.asarray(m).reshape(6, 400))
    np.testing.assert_array_equal(
        q.scales, np.stack([rows[:, :256].max(1), rows[:, 256:].max(1)], 1)
    )
    assert float(jnp.max(jnp.abs(q.dequantize() / m))) <= 1.25 + 1e-6


@pytest.mark.parametrize("recompute", [True, False])
def test_each_moments_scales_are_its_own_block_maxima(recompute):
    """The maxima of moments of one shape are taken in shared reductions (up to 8 moments
    each): every moment still gets exactly its own blocks' largest magnitudes, as quantizing
    that moment alone gives, for either source of the scales."""
    shapes = [(4, 300)] * 5 + [(600,), (3, 2, 256)]  # 10 moments of one shape: two groups
    draw = np.random.default_rng(0)
    params = {f"w{i}": jnp.zeros(s) for i, s in enumerate(shapes)}
    spread = lambda p: 10.0 ** draw.uniform(-3, 1, (p.shape[-1],))  # columns' magnitudes
    grads = {k: jnp.asarray(draw.normal(size=p.shape) * spread(p), jnp.float32)
             for k, p in params.items()}  # fmt: skip
    adam = optax.adam(1e-3)
    tx = mpjax.quantize_moments(adam, min_size=256, block_size=128, recompute=recompute)
    state = tx.init(params)
    for _ in range(2):
        old = state.inner_state
        _, state = jax.jit(tx.update)(grads, state, params)
    dequantized = jax.tree_util.tree_map(
        lambda x: x.dequantize() if isinstance(x, mpjax.QuantizedMoment) else x,
        old, is_leaf=lambda x: isinstance(x, mpjax.QuantizedMoment))  # fmt: skip
    _, expected = adam.update(grads, dequantized, params)
    for name in ("mu", "nu"):
        fmt = "e4m3" if name == "mu" else "sqrt_e5m3"
        for k in params:
            got = getattr(state.inner_state[0], name)[k]
            alone = mpjax.QuantizedMoment.quantize(
                getattr(expected[0], name)[k], fmt, block_size=128, key=jax.random.key(0)
            )
            np.testing.assert_allclose(got.scales, alone.scales, rtol=1e-6, err_msg=f"{name} {k}")


def test_four_bytes_per_param_with_bfloat16_params_and_half_updates():
    params = {"w": jnp.ones((512, 512), jnp.bfloat16), "b": jnp.zeros(512, jnp.bfloat16)}
    tx = mpjax.half_updates(mpjax.quantize_moments(optax.adam(1e-3)))
    state = tx.init(params)
    n = sum(p.size for p in jax.tree_util.tree_leaves(params))
    per_param = (_bytes(params) + _bytes(state)) / n
    # 2 (bfloat16) + 1 + 1 (codes) + 8/256 (scales); the 512-element bias stays float32.
    assert per_param <= 4.1, per_param
    w = state.inner_state.inner_state[0]
    assert w.mu["w"].codes.dtype == jnp.uint8 and w.nu["w"].codes.dtype == jnp.uint8
    assert w.mu["b"].dtype == jnp.float32  # under min_size


def _regression(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (256, 64))
    w_true = jax.random.normal(k2, (64, 64)) / 8
    return x, x @ w_true


@pytest.mark.slow
@pytest.mark.parametrize(
    "make", [optax.adam, optax.adamw, optax.lion, lambda lr: optax.sgd(lr, momentum=0.9)]
)
def test_trains_as_the_float32_state_does(make):
    # A linear least-squares fit: the 8-bit moments reach the float32 moments' loss.
    lr = {optax.lion: 1e-3, optax.adam: 1e-2, optax.adamw: 1e-2}.get(make, 3e-2)
    losses = {}
    for quantized in (False, True):
        finals = []
        for seed in range(3):
            x, y = _regression(seed)
            params = {"w": jnp.zeros((64, 64))}
            tx = make(lr)
            if quantized:
                tx = mpjax.quantize_moments(tx, key=seed)
            state = tx.init(params)

            @jax.jit
            def step(params, state):
                g = jax.grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
                u, state = tx.update(g, state, params)
                return optax.apply_updates(params, u), state

            for _ in range(400):
                params, state = step(params, state)
            finals.append(float(jnp.mean((x @ params["w"] - y) ** 2)))
        losses[quantized] = np.mean(finals)
    start = float(np.mean([jnp.mean(_regression(s)[1] ** 2) for s in range(3)]))
    assert losses[False] < 0.2 * start, (losses, start)
    assert losses[True] <= 1.1 * losses[False] + 1e-3 * start, losses


def _fit(tx, seed, steps=400):
    x, y = _regression(seed)
    params, state = {"w": jnp.zeros((64, 64))}, tx.init({"w": jnp.zeros((64, 64))})

    @jax.jit
    def step(params, state):
        g = jax.grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state

    for _ in range(steps):
        params, state = step(params, state)
    return float(jnp.mean((x @ params["w"] - y) ** 2))


def test_lion_needs_the_first_moments_mantissa():
    # Lion steps by the sign of its first moment (mixed with the gradient): rounding noise in
    # small entries flips signs. e4m3 (3 mantissa bits, the default) stays within 5% of the
    # float32 state's loss; e5m2 (2 bits) ends further above it.
    full = np.mean([_fit(optax.lion(1e-3), s) for s in range(3)])
    e4m3, e5m2 = (
        np.mean(
            [_fit(mpjax.quantize_moments(optax.lion(1e-3), first=f, key=s), s) for s in range(3)]
        )  # fmt: skip
        for f in ("e4m3", "e5m2")
    )
    assert e4m3 <= 1.05 * full and e4m3 < e5m2, (full, e4m3, e5m2)


def test_a_skipped_step_leaves_every_byte_and_resume_is_bit_identical(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    import mpjax.checkpoint

    params = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    tx = mpjax.loss_scale(mpjax.half_updates(mpjax.quantize_moments(optax.adam(1e-3))))
    state = tx.init(params)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    u, state = step({"w": jnp.full((64, 64), 2.0**14, jnp.bfloat16)}, state, params)
    params = optax.apply_updates(params, u)
    bad = {"w": jnp.full((64, 64), jnp.inf, jnp.bfloat16)}
    u, skipped = step(bad, state, params)
    assert_trees_bit_identical(skipped.inner_state, state.inner_state)
    assert int(mpjax.loss_scale_metrics(skipped)["skipped_steps"]) == 1
    # Save, restore into a fresh state, and take the same next step from both.
    policy = mpjax.Policy.from_level("O2", "bfloat16", master_weights=False)
    mpjax.checkpoint.save(tmp_path / "c", {"params": params, "opt": state}, policy)
    restored = mpjax.checkpoint.restore(
        tmp_path / "c", {"params": params, "opt": tx.init(params)}, policy
    )
    assert_trees_bit_identical(restored["opt"], state)
    g = {"w": jnp.full((64, 64), 2.0**13, jnp.bfloat16)}
    assert_trees_bit_identical(step(g, restored["opt"], params), step(g, state, params))


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="needs no wrapping"):
        mpjax.quantize_moments(optax.sgd(0.1)).init({"w": jnp.ones((128, 128))})
    with pytest.raises(ValueError, match="smaller min_size"):
        mpjax.quantize_moments(optax.adam(0.1)).init({"w": jnp.ones(10)})
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        mpjax.quantize_moments(optax.adam(0.1), block_size=0)
    with pytest.raises(TypeError, match=r"call it first, e.g. mpjax.quantize_moments\(optax.adam"):
        mpjax.quantize_moments(optax.adam)
    # A second moment in a format that cannot hold its range, a first moment in a square
    # root, an unknown format: each error names the formats to use.
    with pytest.raises(ValueError, match=r"cannot hold a second moment's range.*sqrt_e5m3"):
        mpjax.quantize_moments(optax.adam(0.1), second=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"cannot hold a second moment's range"):
        mpjax.quantize_moments(optax.adam(0.1), second="e5m2")
    with pytest.raises(ValueError, match=r"changes sign; use first='e4m3'"):
        mpjax.quantize_moments(optax.adam(0.1), first="sqrt_e5m3")
    unknown = r"not an 8-bit moment format; pass one of \['e4m3', 'e5m2'\]"
    with pytest.raises(ValueError, match=unknown):
        mpjax.quantize_moments(optax.adam(0.1), first=jnp.int8)
    # The float8 dtypes name the formats they are.
    tx = mpjax.quantize_moments(optax.adam(0.1), first=jnp.float8_e5m2, min_size=16)
    assert tx.init({"w": jnp.ones(64)}).inner_state[0].mu["w"].fmt == "e5m2"
