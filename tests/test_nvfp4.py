"""NVFP4BlockScaling: NVIDIA's 4-bit training recipe, checked against NumPy's reference of it.

The recipe: E2M1 values in blocks of 16 along each gemm's contraction, an E4M3 scale per block
(its amax / 6) under a float32 scale per tensor (its amax / (6 x 448)); 16 x 16 tiles for the
weight; a random Hadamard transform on the weight gradient's operands; stochastic rounding of
the gradients. The models' training under it is in tests/test_fp8_models.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpjax
import mpjax.flax
import mpjax.fp8
from mpjax._src.float8.fp8_dot import (
    NVOptions,
    fp8_dot_nv,
    nv_quantize,
    nv_tensor_scale,
    rht,
)

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _rounded(x, dtype):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32))


def _nv_reference(x, axis, square=False, amax=None):
    """NumPy's NVFP4 round trip of `x` along `axis` (round to nearest even): float32 arithmetic
    as the recipe's, block scales rounded to E4M3 by the installed JAX's conversion (JAX 0.6's
    rounds some float32 values otherwise than ml_dtypes does), values to E2M1 by ml_dtypes'
    (mpjax rounds to E2M1 by arithmetic, to nearest even on every JAX: 0.6's conversion is
    off it for some values)."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    amax = np.float32(np.abs(x).max() if amax is None else amax)
    scale = amax / np.float32(6 * 448) if amax > 0 else np.float32(1)
    y = x / scale
    blocks = y.reshape(*y.shape[:-1], -1, 16)
    block_amax = np.abs(blocks).max(-1, keepdims=True)
    if square:
        rows, cols = blocks.shape[-3], blocks.shape[-2]
        tiles = block_amax.reshape(*blocks.shape[:-3], rows // 16, 16, cols, 1).max(-3)
        block_amax = np.repeat(tiles, 16, axis=-3)
    s = _rounded(block_amax / np.float32(6), jnp.float8_e4m3fn)
    q = np.clip(blocks / np.where(s > 0, s, 1), -6, 6).astype(ml_dtypes.float4_e2m1fn)
    q = q.astype(np.float32)
    back = q.astype(np.float64) * s * np.float64(scale)
    return np.moveaxis(back.reshape(x.shape), -1, axis)


def _dequantized(q, s, scale):
    blocks = np.asarray(q.astype(jnp.float32), np.float64).reshape(*q.shape[:-1], -1, 16)
    return (blocks * np.asarray(s, np.float64)[..., None] * float(scale)).reshape(q.shape)


def test_nvfp4_scales_blocks_of_16_in_e4m3_under_a_float32_tensor_scale():
    """Values on E2M1's grid, one E4M3 scale per 16 elements along the contraction that maps the
    block's amax to 6 (so nothing saturates past the scale's rounding), a tensor scale that
    puts the largest block scale at 448; a block of zeros stays zeros; the round trip is
    NumPy's. A block of small values keeps its own scale next to an outlier's block."""
    x = jax.random.normal(jax.random.key(0), (4, 64)) * 1e-2
    x = x.at[0, 3].set(50.0).at[2, 16:32].set(0.0)
    amax = jnp.max(jnp.abs(x))
    scale = nv_tensor_scale(amax)
    q, s = nv_quantize(x, 1, scale)
    assert q.dtype == jnp.float4_e2m1fn and s.shape == (4, 4)
    assert float(scale) == pytest.approx(50.0 / (6 * 448), rel=1e-7)
    s = np.asarray(s)
    assert np.all(s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == s)  # E4M3 values
    assert s[0, 0] == pytest.approx(448, rel=2**-4) and s[2, 1] == 0
    values = np.abs(np.asarray(q.astype(jnp.float32)))
    assert set(np.unique(values)) <= set(GRID) and values.max() == 6
    back = _dequantized(q, s, scale)
    np.testing.assert_array_equal(back, _nv_reference(x, 1))
    small = np.asarray(x)[1]  # its own blocks: errors of E2M1's, not flushed to zero
    assert np.max(np.abs(back[1] - small)) <= 0.25 * np.abs(small).max()
    assert np.count_nonzero(back[1]) > 48
    assert float(nv_tensor_scale(jnp.float32(0.0))) == float(nv_tensor_scale(jnp.inf)) == 1.0


def test_square_tiles_give_the_same_numbers_along_either_axis():
    """The weight's 16 x 16 tiles: its copy contracted along K and the one contracted along N
    dequantize to the same matrix (so the input gradient's gemm uses the forward's weight),
    which 1 x 16 blocks do not."""
    w = jax.random.normal(jax.random.key(1), (1, 48, 32)) * jnp.linspace(0.01, 3, 32)
    scale = nv_tensor_scale(jnp.max(jnp.abs(w)))
    along_k = _dequantized(*nv_quantize(w, 1, scale, square=True), scale)  # [1, 32, 48]
    along_n = _dequantized(*nv_quantize(w, 2, scale, square=True), scale)  # [1, 48, 32]
    np.testing.assert_array_equal(np.swapaxes(along_k, 1, 2), along_n)
    np.testing.assert_array_equal(along_n[0], _nv_reference(w[0], 1, square=True))
    rows_k = _dequantized(*nv_quantize(w, 1, scale), scale)
    rows_n = _dequantized(*nv_quantize(w, 2, scale), scale)
    assert np.any(np.swapaxes(rows_k, 1, 2) != rows_n)


def test_stochastic_rounding_is_unbiased_and_replays_with_its_seed():
    """Gradients round up with probability equal to their distance from the grid point below:
    the mean of many roundings is the value (round to nearest is off by its full bias), only
    the two neighbours occur, and the same tensor and seed give the same rounding."""
    x = jnp.full((1, 16 * 4096), 2.6)
    scale = jnp.float32(1.0)
    nearest = _dequantized(*nv_quantize(x, 1, scale), scale)
    q, s = nv_quantize(x, 1, scale, seed=7)
    rounded = _dequantized(q, s, scale)
    assert abs(nearest.mean() - 2.6) > 0.01
    assert abs(rounded.mean() - 2.6) < 2e-3
    block_scale = float(s[0, 0])
    assert set(np.unique(rounded / block_scale)) == {4.0, 6.0}  # 2.6 / (2.6 / 6) sits at 6
    y = jax.random.normal(jax.random.key(2), (8, 64))
    again = nv_quantize(y, 1, scale, seed=7)[0]
    np.testing.assert_array_equal(q.astype(jnp.float32), nv_quantize(x, 1, scale, seed=7)[0])
    assert np.array_equal(again, nv_quantize(y, 1, scale, seed=7)[0])
    assert not np.array_equal(again, nv_quantize(y, 1, scale, seed=8)[0])


def test_the_weight_gradient_contracts_hadamard_rotated_operands():
    """rht(a)^T rht(g) = a^T g (an orthonormal rotation along the tokens the weight gradient
    sums over), and with the transform on, the weight gradient is NumPy's reference of the
    rotated operands' NVFP4 copies, their tensor scales from 4 x the operands' amaxes (a bound
    on the rotated ones'); the input gradient does not rotate."""
    ka, kg, kb = jax.random.split(jax.random.key(3), 3)
    a = jax.random.normal(ka, (256, 32)).at[::16].multiply(30.0)  # an outlier token per block
    g = jax.random.normal(kg, (256, 48))
    b = jax.random.normal(kb, (32, 48))
    exact = np.asarray(a.T @ g, np.float64)
    np.testing.assert_allclose(rht(a[None], 0)[0].T @ rht(g[None], 0)[0], exact, rtol=1e-4,
                               atol=1e-3)  # fmt: skip
    opts = NVOptions(hadamard=True, stochastic=False, square=False, seed=5)
    dims = (((1,), (0,)), ((), ()))
    _, vjp = jax.vjp(lambda a, b: fp8_dot_nv(dims, jnp.float32, False, opts, a, b, jnp.zeros(3)),
                     a, b)  # fmt: skip
    da, db = vjp(g)
    ra, rg = rht(a[None], 5)[0], rht(g[None], 5)[0]
    assert np.abs(ra).max() <= 4 * np.abs(a).max() and np.abs(rg).max() <= 4 * np.abs(g).max()
    ref_a = _nv_reference(ra, 0, amax=4 * np.abs(a).max())
    ref_g = _nv_reference(rg, 0, amax=4 * np.abs(g).max())
    np.testing.assert_allclose(db, ref_a.T @ ref_g, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(da, _nv_reference(g, 1) @ _nv_reference(b, 1).T, rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    assert np.linalg.norm(np.asarray(db) - exact) / np.linalg.norm(exact) < 0.2


@pytest.mark.parametrize("square", [False, True])
def test_the_three_gemms_are_the_recipes_numbers(square):
    """With round to nearest and no Hadamard transform, the forward gemm, the input gradient
    and the weight gradient are NumPy's reference: each operand quantized from its
    full-precision value along the axis that gemm contracts (the weight in square tiles, or in
    1 x 16 blocks along each axis)."""
    ka, kb, kg = jax.random.split(jax.random.key(4), 3)
    a = jax.random.normal(ka, (64, 96))
    b = jax.random.normal(kb, (96, 32)) * 0.1
    g = jax.random.normal(kg, (64, 32)) * 1e-3
    dims = (((1,), (0,)), ((), ()))
    opts = NVOptions(hadamard=False, stochastic=False, square=square, seed=0)
    out, vjp = jax.vjp(
        lambda a, b: fp8_dot_nv(dims, jnp.float32, False, opts, a, b, jnp.zeros(3)), a, b
    )
    da, db = vjp(g)
    b_fwd = _nv_reference(b, 0, square)
    b_dgrad = _nv_reference(b, 1, square)
    np.testing.assert_allclose(out, _nv_reference(a, 1) @ b_fwd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(da, _nv_reference(g, 1) @ b_dgrad.T, rtol=1e-5, atol=1e-9)
    want_db = _nv_reference(a, 0).T @ _nv_reference(g, 0)
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-8)
    assert np.array_equal(b_fwd, b_dgrad) == square
    # and close to float32's: E2M1's error, not a wrong scale
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert np.linalg.norm(np.asarray(out) - exact) / np.linalg.norm(exact) < 0.2


def test_the_recipe_keeps_named_layers_and_small_dots_in_the_base_half(rng):
    """`high_precision` globs keep a layer's dots out of NVFP4 (module path or name scope), a
    dot whose sizes do not divide by 16 is no site, and the audit shows the E2M1 gemms: the
    forward, input-gradient and weight-gradient gemms of each site."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(64, name="body")(x))
            odd = nn.Dense(24, name="odd")(h)  # 24 wide: not in blocks of 16
            return nn.Dense(32, name="head")(h), odd

    x = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    for kept, sites in (((), 2), (("head",), 1)):
        recipe = mpjax.fp8.NVFP4BlockScaling(high_precision=kept)
        pol = mpjax.fp8.policy("O2", recipe=recipe)
        model = mpjax.flax.wrap(Net(), pol)
        params = model.init(jax.random.key(0), x)["params"]

        def loss(p, x):
            y, odd = model.apply({"params": p}, x)  # noqa: B023
            return jnp.mean(y**2) + jnp.mean(odd**2)

        state = mpjax.fp8.init(loss, pol, params, x)
        assert state.num_sites == sites, kept
        step = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))
        value, grads, state = step(state, params, x)
        report = mpjax.audit(step, state, params, x)
        fp4 = [m for m in report.fp8_matmuls if m.fp8_dtypes == ("float4_e2m1fn",) * 2]
        # body: forward and weight gradient (its input needs none); head: all three
        assert len(fp4) == {2: 5, 1: 2, 0: 0}[sites]
        assert len(report.matmuls) == 8  # the odd layer's three gemms in bfloat16
        ref_value = jax.jit(loss)(params, x)
        assert abs(float(value) / float(ref_value) - 1) < 0.1
    with pytest.raises(TypeError, match="tuple of module-path globs"):
        mpjax.fp8.NVFP4BlockScaling(high_precision="head")


def test_the_function_form_names_layers_by_name_scope():
    """Without Flax, `high_precision` matches jax.named_scope names."""

    def loss(w, x):
        with jax.named_scope("head"):
            return jnp.mean((x @ w) ** 2)

    w, x = jnp.ones((32, 16)) / 8, jnp.ones((16, 32))
    kept = mpjax.fp8.policy("O2", recipe=mpjax.fp8.NVFP4BlockScaling(high_precision=("head",)))
    run = mpjax.fp8.policy("O2", recipe=mpjax.fp8.NVFP4BlockScaling())
    with pytest.warns(UserWarning, match="no dot_general that can run in FP8"):
        assert mpjax.fp8.init(loss, kept, w, x).num_sites == 0
    assert mpjax.fp8.init(loss, run, w, x).num_sites == 1


def test_high_precision_globs_match_module_paths_from_the_top():
    """A glob names a module path below the top module (or from it): ``"Dense_0"`` keeps the
    head, not each block's first Dense, and ``"Block_1/*"`` keeps the last block, in the
    function form over a linen model as under ``wrap``."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(32)(nn.relu(nn.Dense(64)(x)))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = Block()(Block()(x))
            return nn.Dense(32)(x)

    x = jnp.ones((32, 32))
    params = Net().init(jax.random.key(0), x)["params"]
    loss = lambda p, x: jnp.mean(Net().apply({"params": p}, x) ** 2)
    for kept, sites in (((), 5), (("Dense_0",), 4), (("Block_1/*", "Net/Dense_0"), 2)):
        pol = mpjax.fp8.policy("O2", recipe=mpjax.fp8.NVFP4BlockScaling(high_precision=kept))
        assert mpjax.fp8.init(loss, pol, params, x).num_sites == sites, kept
        wrapped = mpjax.flax.wrap(Net(), pol)
        wloss = lambda p, x: jnp.mean(wrapped.apply({"params": p}, x) ** 2)  # noqa: B023
        assert mpjax.fp8.init(wloss, pol, params, x).num_sites == sites, kept


@pytest.mark.parametrize("recipe", ["MXFP8BlockScaling", "NVFP4BlockScaling"])
def test_a_block_recipe_site_does_not_depend_on_the_batch_size(recipe):
    """The rows (a Dense layer's batch) are padded with zero rows to the block, not a reason to
    leave the site: a state made on a batch of 64 runs a batch of 40 or 7 (evaluation's last
    batch), and the padded forward pass is the same numbers as the rows quantized alone (a
    zero row changes no block's amax): MXFP8's rows are the full batch's rows; NVFP4's tensor
    scale is the smaller batch's own."""
    w = jax.random.normal(jax.random.key(6), (64, 32)) / 8
    loss = lambda w, x: jnp.mean((x @ w) ** 2)
    pol = mpjax.fp8.policy("O2", recipe=getattr(mpjax.fp8, recipe)())
    state = mpjax.fp8.init(loss, pol, w, jnp.ones((64, 64)))
    assert state.num_sites == 1
    run = jax.jit(mpjax.fp8.apply(lambda w, x: x @ w, pol))
    x = jax.random.normal(jax.random.key(7), (64, 64))
    full = run(state, w, x)
    for rows in (40, 7):
        out = run(state, w, x[:rows])
        if recipe == "MXFP8BlockScaling":
            np.testing.assert_array_equal(out, full[:rows])
        else:
            # quantized from the float32 operands the program holds (no half copy first)
            x32 = np.asarray(x[:rows], np.float32)
            want = _nv_reference(x32, 1) @ _nv_reference(np.asarray(w), 0, square=True)
            # bfloat16's rounding of the result (0.4%), and a rare tie that XLA's division
            # rounds the other way: measured, 1 element of 2,560 quantized one grid step
            # apart, which moves its row by 8% and the whole by 1.4%; a wrong tensor scale
            # or a padded row in a block moves every row
            error = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
            assert error < 0.03, error
        value, grad, _ = jax.jit(mpjax.fp8.scaled_value_and_grad(loss, pol))(state, w, x[:rows])
        exact = jax.grad(loss)(w, x[:rows])
        assert np.linalg.norm(grad - exact) / np.linalg.norm(exact) < 0.3


def test_e2m1_rounding_is_round_to_nearest_even_by_arithmetic():
    """The rounding the quantizing kernel and XLA's program share (floor and selects, no
    conversion) is E2M1's round to nearest, ties to the even code, as ml_dtypes rounds: on
    every grid point, every midpoint and values between them, both signs."""
    from mpjax._src.float8.quantize_kernel import e2m1_magnitude

    y = np.concatenate([np.linspace(0, 6, 4801), (GRID[1:] + GRID[:-1]) / 2]).astype(np.float32)
    y = np.concatenate([y, -y])
    want = np.abs(y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(e2m1_magnitude(jnp.abs(jnp.asarray(y)), None)), want)


@pytest.mark.parametrize("role", ["input", "gradient", "weight", "weight, 1 x 16 blocks"])
def test_the_quantizing_kernel_is_the_emulations_numbers(role):
    """The Pallas kernel a B200 quantizes with (both copies from one read, run here by
    Pallas's interpreter) gives what XLA's program gives: a layer input's two copies (the
    second rotated by the Hadamard transform), a gradient's (rotated and rounded
    stochastically), a weight's (16 x 16 tiles: the two copies are the same numbers) and a
    weight's in 1 x 16 blocks. Bit for bit, but where a rotated value's float32 sum is
    summed in another order and its noise then differs (a few in ten thousand)."""
    from mpjax._src.float8.fp8_dot import nv_quantize_both

    k1, k2 = jax.random.split(jax.random.key(9))
    spread = jnp.exp(2 * jax.random.normal(k2, (2, 96, 1)))
    x = (jax.random.normal(k1, (2, 96, 64)) * spread).astype(jnp.bfloat16)
    x = x.at[0, :16, :16].set(0)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    opts = NVOptions(hadamard=True, stochastic=True, square=role == "weight", seed=3)
    weight = role.startswith("weight")
    seeds = (6, 7) if role == "gradient" else (None, None)
    kw = dict(weight=weight, seeds=seeds)
    want = nv_quantize_both(x, amax, False, opts, **kw)
    got = nv_quantize_both(x, amax, True, opts, interpret=True, **kw)
    for copy, (w, g) in enumerate(zip(want, got)):
        assert g[0].dtype == jnp.float4_e2m1fn and g[1].dtype == jnp.float8_e4m3fn
        assert g[0].shape == w[0].shape and float(g[2]) == float(w[2])
        np.testing.assert_array_equal(np.asarray(g[1], np.float32), np.asarray(w[1], np.float32))
        differ = np.mean(np.asarray(g[0], np.float32) != np.asarray(w[0], np.float32))
        assert differ <= (2e-3 if (copy, role) == (1, "gradient") else 0), (copy, differ)
