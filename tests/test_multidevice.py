"""Data parallel on 8 devices: jit with NamedSharding, shard_map and pmap.

JAX fixes the device count when it starts, so on a machine with fewer than 8 devices this
file re-runs itself in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import functools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import eqns, rel_err, slow_except
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._src.interpreter.autocast import UntouchedWarning

N = 8
MULTI = jax.device_count() >= N
needs_8 = pytest.mark.skipif(not MULTI, reason="runs in the 8-device subprocess")


@pytest.mark.skipif(MULTI, reason="already on 8 devices")
@pytest.mark.parametrize("marks", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_the_multidevice_suite_on_8_cpu_devices(marks):
    """The file again on 8 devices: its fast tests with the test command, its slow-marked
    ones with the slow set; only those MPJAX_MULTIDEVICE_SELECT names (a ``-k`` expression),
    where it is set (CI's JAX in between runs the shard_map tests alone)."""
    env = dict(
        os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={N}", JAX_PLATFORMS="cpu"
    )
    select = os.environ.get("MPJAX_MULTIDEVICE_SELECT")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, __file__,
         *(["-k", select] if select else [])],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout  # the launchers themselves skip there


def shard_map(f, *, mesh, in_specs, out_specs, check_vma=True):
    """jax.shard_map (JAX 0.7+), or its experimental form on JAX 0.6."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(
            f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    return experimental_shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma
    )


def mlp(params, x):
    for i, w in enumerate(params):
        x = x @ w
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def setup(policy, width=16):
    keys = jax.random.split(jax.random.key(0), 3)
    params = policy.cast_to_param([jax.random.normal(k, (width, width)) / 4 for k in keys])
    x = jax.random.normal(jax.random.key(1), (N * 4, width))
    return params, x, jnp.sin(x)


def replicas_agree(tree):
    """Every device holds the same value of every leaf."""
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        if not all(np.array_equal(shards[0], s) for s in shards[1:]):
            return False
    return True


@needs_8
@pytest.mark.parametrize("level, half", [("O1", "float16"), ("O2", "bfloat16"), ("O3", "float16")])
def test_jit_with_named_sharding_skips_globally(level, half):
    policy = mpjax.Policy.from_level(level, half)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, x, y = setup(policy)
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=mpjax.DynamicLossScale(2.0**8))
    model = mpjax.autocast(mlp, policy)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    state = jax.device_put(tx.init(params), replicated)
    batch = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(params, state, x, y):
        ls = mpjax.get_loss_scale(state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((model(p, x).astype(jnp.float32) - y) ** 2)))(
            params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    bad_x = x.at[5].set(jnp.inf)  # row 5 lives on device 1 only
    for data, finite in [(x, True), (bad_x, False), (x, True)]:
        before = params
        params, state = step(params, state, jax.device_put(data, batch), jax.device_put(y, batch))
        assert bool(state.last_finite) is finite
        assert replicas_agree((params, state))
        if not finite:
            for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(before)):
                assert np.array_equal(np.asarray(a), np.asarray(b))
    assert float(mpjax.get_loss_scale(state).loss_scale) == 2.0**7
    assert int(state.skipped_steps) == 1


@needs_8
@pytest.mark.parametrize("layout", ["data parallel", "fsdp x tp"])
@pytest.mark.parametrize("granularity", [None, "row", "mx", "nv"])
def test_fp8_step_under_sharding_matches_one_device(layout, granularity):
    """An FP8 step under jit with sharded params and batch: its dots stay FP8 dots, every
    amax is the whole tensor's (a global max, not a shard's), and the step agrees with the
    same step on one device."""
    import mpjax.fp8

    if granularity == "mx":  # MXFP8: blocks of 32 along each gemm's contraction
        recipe = mpjax.fp8.MXFP8BlockScaling()
    elif granularity == "nv":  # NVFP4: blocks of 16, a tensor scale from a global amax
        recipe = mpjax.fp8.NVFP4BlockScaling()
    else:
        recipe = granularity and mpjax.fp8.CurrentScaling(granularity=granularity)
    pol = mpjax.fp8.policy("O2", recipe=recipe)
    keys = jax.random.split(jax.random.key(0), 3)
    params = [jax.random.normal(k, (32, 32)) / 6 for k in keys]
    x = jax.random.normal(jax.random.key(1), (N * 4, 32))
    y = jnp.sin(x)
    loss = lambda p, x, y: jnp.mean((mlp(p, x).astype(jnp.float32) - y) ** 2)
    state = mpjax.fp8.init(loss, pol, params, x, y)
    f = mpjax.fp8.scaled_value_and_grad(loss, pol)
    ref = jax.jit(f)(state, params, x, y)
    if layout == "data parallel":
        mesh = Mesh(np.array(jax.devices()), ("data",))
        p_spec, x_spec = P(), P("data")
    else:
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
        p_spec, x_spec = P("data", "model"), P("data")
    put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))
    args = (put(state, P()), put(params, p_spec), put(x, x_spec), put(y, x_spec))
    step = jax.jit(f)
    value, grads, new = step(*args)
    np.testing.assert_allclose(float(value), float(ref[0]), rtol=1e-3)
    # Against float32's gradient, as close as on one device: a tensor-parallel dot sums its
    # shards' half results, in another order, so FP8 roundings downstream differ a little.
    exact = jax.grad(loss)(params, x, y)
    for a, b, e in zip(grads, ref[1], exact, strict=True):
        assert rel_err(a, e) < 1.05 * rel_err(b, e) + 0.005, (rel_err(a, e), rel_err(b, e))
    # The forward operands' amaxes are exact maxima of whole tensors; the gradient's, close.
    np.testing.assert_array_equal(new.amax_history[:, :2], ref[2].amax_history[:, :2])
    # The block recipes set no scale from it (its amax is what describe shows), and a block's
    # scale that another summation order moves across a rounding boundary moves the whole
    # block: 3% measured for MXFP8.
    rtol = 0.05 if granularity in ("mx", "nv") else 2**-6
    np.testing.assert_allclose(new.amax_history[:, 2], ref[2].amax_history[:, 2], rtol=rtol)
    report = mpjax.audit(step, *args)
    assert len(report.fp8_matmuls) == len(report.matmuls) == 3 * state.num_sites - 1


def shard_map_step(policy, tx, mesh, all_reduce_in_tx):
    model = mpjax.autocast(mlp, policy)

    def per_shard(params, state, x, y):
        ls = mpjax.get_loss_scale(state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((model(p, x).astype(jnp.float32) - y) ** 2)))(
            params
        )
        if not all_reduce_in_tx:  # the user all-reduces in the gradient dtype
            grads = jax.lax.pmean(grads, "data")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(
        shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P()),
            check_vma=False,
        )  # fmt: skip
    )


@needs_8
@pytest.mark.parametrize("reduce_dtype, expect", [(jnp.float32, "float32"), (None, "float16")])
def test_shard_map_all_reduce_in_float32_and_every_replica_skips(reduce_dtype, expect):
    policy = mpjax.Policy.from_level("O3", "float16")  # half params: half gradients
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, x, y = setup(policy)
    tx = optax.chain(
        mpjax.all_reduce_gradients("data", dtype=reduce_dtype),
        mpjax.loss_scale(scale=mpjax.DynamicLossScale(2.0**4)),
        optax.sgd(0.1),
    )
    state = tx.init(params)
    step = shard_map_step(policy, tx, mesh, all_reduce_in_tx=True)
    report = mpjax.audit(step, params, state, x, y)
    reduces = [c for c in report.collectives if c.kind == "all-reduce" and c.stage == "lowered"]
    assert reduces and all(c.dtypes and set(c.dtypes) == {expect} for c in reduces), reduces
    assert "all-reduce" in str(report)
    new_params, state = step(params, state, x, y)
    assert bool(state[1].last_finite)
    before = new_params
    new_params, state = step(new_params, state, x.at[5].set(jnp.nan), y)
    assert not bool(state[1].last_finite)
    assert replicas_agree((new_params, state))
    for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(before)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@needs_8
def test_without_an_all_reduce_axis_name_makes_the_finite_check_global():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jnp.ones((N, 3)).at[2, 0].set(jnp.inf)  # only device 2's local gradient overflows

    def per_shard(axis_name):
        tx = mpjax.loss_scale(scale=mpjax.DynamicLossScale(8.0), axis_name=axis_name)

        def f(g):
            _, state = tx.update({"w": g}, tx.init({"w": g}))
            return state.last_finite[None], state.loss_scale.loss_scale[None]

        return jax.jit(
            shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))
        )

    local_finite, local_scale = per_shard(None)(x)
    assert np.asarray(local_finite).tolist().count(False) == 1  # replicas disagree: the trap
    global_finite, global_scale = per_shard("data")(x)
    assert not np.asarray(global_finite).any() and set(np.asarray(global_scale).tolist()) == {4.0}


@needs_8
def test_pmap_with_axis_name():
    tx = mpjax.loss_scale(optax.sgd(0.1), scale=mpjax.DynamicLossScale(8.0), axis_name="i")
    params = {"w": jnp.ones((N, 3))}

    @functools.partial(jax.pmap, axis_name="i")
    def run(p, g):
        state = tx.init(p)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state.loss_scale.loss_scale, state.last_finite

    grads = {"w": jnp.ones((N, 3)).at[6, 1].set(jnp.nan)}
    new, scales, finite = run(params, grads)
    assert not np.asarray(finite).any() and set(np.asarray(scales).tolist()) == {4.0}
    assert np.array_equal(np.asarray(new["w"]), np.asarray(params["w"]))


@needs_8
def test_audit_shows_the_all_reduce_xla_inserts_for_sharded_jit():
    # Under jit with sharded arrays XLA inserts the gradient all-reduce itself, in the dtype of
    # the gradient at that point (float16 here: jax#27496); the audit makes it visible.
    policy = mpjax.Policy.from_level("O2", "float16")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, x, y = setup(policy)
    model = mpjax.autocast(mlp, policy)

    def grads(params, x, y):
        return jax.grad(lambda p: jnp.mean((model(p, x).astype(jnp.float32) - y) ** 2))(params)

    params = jax.device_put(params, NamedSharding(mesh, P()))
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    report = mpjax.audit(jax.jit(grads), params, x, y)
    inserted = [c for c in report.collectives if c.stage == "compiled" and c.kind == "all-reduce"]
    assert inserted and all(c.dtypes for c in inserted)
    assert "(compiled)" in str(report)


def explicit_mesh():
    """An 8-device mesh with an Explicit axis, and the context that makes it current."""
    explicit = (jax.sharding.AxisType.Explicit,)
    mesh = jax.make_mesh((N,), ("data",), axis_types=explicit)
    use = jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh
    return mesh, use(mesh)


def mlp_block(dtype):
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.gelu(nn.Dense(256, dtype=dtype)(nn.LayerNorm(dtype=dtype)(x)))
            return x + nn.Dense(64, dtype=dtype)(h)

    return Block()


def partitioned_step(model, mesh, x):
    """The audit of a jitted data-parallel SGD step (params replicated, `x` sharded)."""
    params = jax.jit(lambda x: model.init(jax.random.key(0), x))(x)
    params = jax.device_put(params, NamedSharding(mesh, P()))

    def step(p, x):
        g = jax.grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    return mpjax.audit(jax.jit(step), params, x)


@needs_8
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_explicit_data_parallel_moves_what_the_hand_written_step_moves(level, half):
    import mpjax.flax

    mesh, context = explicit_mesh()
    with context:
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (N * 8, 64)), NamedSharding(mesh, P("data"))
        )
        hand = partitioned_step(mlp_block(jnp.dtype(half)), mesh, x).collective_bytes()
        policy = mpjax.Policy.from_level(level, half)
        report = partitioned_step(mpjax.flax.wrap(mlp_block(None), policy), mesh, x)
    ours = report.collective_bytes()
    gathers = [c for c in report.collectives if c.stage == "partitioned" and c.kind == "all-gather"]
    # The broadcasts autocast adds (a bias's, so that its gradient sums in float32) carry the
    # batch sharding: a replicated one all-gathered the whole activation cotangent.
    assert not gathers, gathers
    # Kernel gradients reduce in half as by hand; the bias gradients, summed in float32,
    # reduce in float32 (measured: 1.8 KiB of 66 KiB, 1.01x the hand-written step's bytes).
    assert ours[half] <= hand[half]
    assert sum(ours.values()) <= 1.02 * sum(hand.values()), (ours, hand)


def attention_block(dtype):
    nn = pytest.importorskip("flax.linen")

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.MultiHeadDotProductAttention(4, dtype=dtype)(x, x, mask=mask)
            return x + nn.Dense(32, dtype=dtype)(h)

    return Attention()


@needs_8
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_explicit_data_parallel_masked_softmax_island_trains(half):
    """A masked attention softmax (a float32 island differentiated from its half output)
    under an Explicit batch axis: the step compiles, its gradients agree with float32's and
    it moves no more than the hand-written step."""
    import mpjax.flax

    mesh, context = explicit_mesh()
    with context:
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (N, 16, 32)), NamedSharding(mesh, P("data"))
        )
        hand = partitioned_step(attention_block(jnp.dtype(half)), mesh, x).collective_bytes()
        policy = mpjax.Policy.from_level("O2", half)
        model = mpjax.flax.wrap(attention_block(None), policy)
        ours = partitioned_step(model, mesh, x).collective_bytes()
        params = jax.jit(lambda x: attention_block(None).init(jax.random.key(0), x))(x)
        loss = lambda m: lambda p: jnp.mean(m.apply(p, x).astype(jnp.float32) ** 2)
        got = jax.jit(jax.grad(loss(model)))(params)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(jax.grad(loss(attention_block(None))))(params)
    flat = lambda t: np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(t)])
    err = rel_err(flat(got), flat(want))
    assert err < (2e-2 if half == "bfloat16" else 4e-3), err
    assert sum(ours.values()) <= 1.02 * sum(hand.values()), (ours, hand)


def embed_model(dtype, positions=False, norm=False):
    nn = pytest.importorskip("flax.linen")

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(128, 64, dtype=dtype)(ids)
            if positions:  # a learned positional table, added to every row of the batch
                pos = self.param("pos", nn.initializers.normal(0.02), (ids.shape[1], 64))
                x = x + (pos.astype(dtype) if dtype else pos)
            if norm:  # the looked-up rows go straight into a (float32) norm
                x = nn.LayerNorm(dtype=dtype)(x)
            x = nn.gelu(nn.Dense(128, dtype=dtype)(x))
            return nn.Dense(128, dtype=dtype)(x).astype(jnp.float32)

    return LM()


def fsdp_tp_mesh_and_ids():
    """A 4x2 ("data", "model") mesh of Auto axes, and a batch of token ids sharded over data."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    ids = jax.device_put(
        np.random.default_rng(0).integers(0, 128, (16, 32)).astype(np.int32),
        NamedSharding(mesh, P("data")),
    )
    return mesh, ids


def fsdp_tp_collectives(model, mesh, ids):
    """The audit of an FSDP x tensor-parallel train step (Auto axes)."""

    def spec(path, a):
        name = jax.tree_util.keystr(path)
        if a.ndim == 2:
            return P("model", "data") if "embedding" in name else P("data", "model")
        return P()

    params = model.init(jax.random.key(0), ids[:2])
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, a: NamedSharding(mesh, spec(p, a)), params
    )
    params = jax.device_put(params, shardings)

    def step(p, ids):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
            model.apply(p, ids)[:, :-1], ids[:, 1:]
        ).mean()
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p))

    return mpjax.audit(jax.jit(step, out_shardings=shardings), params, ids)


@needs_8
@pytest.mark.parametrize(
    "level, positions, norm",
    [
        ("O1", False, False),
        ("O2", False, False),
        ("O2", True, False),
        # Under Shardy the cotangent is resharded inside the float32 norm's backward (an
        # all-to-all of float32, where the hand-written step reshards half after the norm):
        # the policy's float32 region, which assert_collectives_in allows; fewer bytes.
        ("O2", False, True),
    ],
)
def test_auto_fsdp_tp_moves_embeddings_in_half(level, positions, norm):
    import mpjax.flax

    mesh, ids = fsdp_tp_mesh_and_ids()
    hand = fsdp_tp_collectives(embed_model(jnp.bfloat16, positions, norm), mesh, ids)
    policy = mpjax.Policy.from_level(level, "bfloat16")
    model = mpjax.flax.wrap(embed_model(None, positions, norm), policy)
    ours = fsdp_tp_collectives(model, mesh, ids)
    # Autocast casts the table before the lookup and the positional table before its
    # broadcast (it moves half, as `.astype` first does): nothing moves float32 where the
    # hand-written step moves half, forward or backward (before: the lookup's all-reduce and
    # the positional table's all-gather, in float32). At O2 a lookup is half even where a
    # float32 norm takes the rows, as the hand-written step's.
    ours.assert_collectives_in(policy, reference=hand)
    total = lambda r: sum(r.collective_bytes().values())
    assert total(ours) <= 1.0 * total(hand), (ours.collective_bytes(), hand.collective_bytes())


@needs_8
def test_the_policy_reduce_dtype_is_the_dtype_of_the_gradient_collectives():
    import mpjax.flax

    mesh, context = explicit_mesh()
    with context:
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (N * 8, 64)), NamedSharding(mesh, P("data"))
        )
        reports = {"hand": (None, partitioned_step(mlp_block(jnp.bfloat16), mesh, x))}
        for reduce in (None, jnp.float32):
            policy = mpjax.Policy.from_level("O2", "bfloat16", reduce_dtype=reduce)
            model = mpjax.flax.wrap(mlp_block(None), policy)
            reports[reduce] = (policy, partitioned_step(model, mesh, x))
        shapes = jax.eval_shape(lambda: mlp_block(None).init(jax.random.key(0), x))
    sizes = {a.size for a in jax.tree_util.tree_leaves(shapes)}  # kernels, biases, norm scales

    def grad_reduces(report):
        return sorted(
            (c.shape, c.dtypes[0])
            for c in report.collectives
            if c.stage == "partitioned" and c.kind == "all-reduce" and math.prod(c.shape) in sizes
        )

    hand = grad_reduces(reports["hand"][1])
    assert len(hand) == 6  # two kernels, two biases, the norm's scale and bias
    # By default every gradient is reduced in the dtype the hand-written step reduces it in:
    # the Dense ones in half, the norm's in float32 (Flax's LayerNorm computes in float32).
    policy, report = reports[None]
    assert grad_reduces(report) == hand
    report.assert_collectives_in(policy, reference=reports["hand"][1])
    # Asked for float32, all are: kernels from half matmuls that write float32, biases from
    # float32 sums.
    policy, report = reports[jnp.float32]
    assert grad_reduces(report) == sorted((shape, "float32") for shape, _ in hand)
    report.assert_collectives_in(policy)
    half, wide = (sum(reports[r][1].collective_bytes().values()) for r in (None, jnp.float32))
    assert 1.8 * half <= wide <= 2.05 * half, (half, wide)


@needs_8
def test_auto_fsdp_tp_lookup_into_a_norm_moves_half_forward():
    import collections

    import mpjax.flax

    mesh, ids = fsdp_tp_mesh_and_ids()
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    hand = fsdp_tp_collectives(embed_model(jnp.bfloat16, norm=True), mesh, ids)
    ours = fsdp_tp_collectives(mpjax.flax.wrap(embed_model(None, norm=True), policy), mesh, ids)

    def forward_f32(report):
        return collections.Counter(
            (c.kind, c.shape)
            for c in report.collectives
            if c.stage == "partitioned" and "transpose(" not in c.name and c.dtypes[0] == "float32"
        )

    # The rows go straight into a float32 norm; at O2 the table is half (as apex's O2 model and
    # the hand-written step's), so the lookup's all-reduce moves half (it moved float32): the
    # forward's float32 collectives are the norm's statistics, as the hand-written step's.
    assert forward_f32(ours) - forward_f32(hand) == collections.Counter(), forward_f32(ours)


# -- autocast inside shard_map on real Flax models ----------------------------------------------
#
# A float32 island in a shard_map body (the attention's softmax, a norm, a lookup's rows) makes
# autocast trace the body twice; a regression made that second trace fail inside the body's
# axis environment, and the whole body then ran silently in float32. These models have every
# such island.


def _linen_gpt():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            y = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(y, y, mask=mask)
            y = nn.Dense(64)(nn.LayerNorm()(x))
            return x + nn.Dense(16)(nn.gelu(y))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(32, 16)(ids)
            pos = self.param("pos", nn.initializers.normal(0.02), (8, 16))
            x = x + pos[None, : ids.shape[1]]
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(32)(nn.LayerNorm()(x))

    model = GPT()
    ids = jnp.zeros((N * 2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)
    return model.apply, params, ids


def _nnx_gpt():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1, self.ln2 = nnx.LayerNorm(16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(4, 16, decode=False, rngs=rngs)
            self.up, self.down = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            y = self.ln1(x)
            x = x + self.attn(y, y, mask=mask)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(32, 16, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (8, 16)) * 0.02)
            self.block1, self.block2 = Block(rngs), Block(rngs)
            self.ln, self.head = nnx.LayerNorm(16, rngs=rngs), nnx.Linear(16, 32, rngs=rngs)

        def __call__(self, ids):
            x = self.embed(ids) + self.pos[None, : ids.shape[1]]
            x = self.block2(self.block1(x))
            return self.head(self.ln(x))

    graphdef, state = nnx.split(GPT(nnx.Rngs(0)))
    return (lambda s, ids: nnx.merge(graphdef, s)(ids)), state, jnp.zeros((N * 2, 8), jnp.int32)


_GPT_GRID = [
    (flavour, level, half, vma)
    for flavour in ("linen", "nnx")
    for level in ("O1", "O2")
    for half in ("float16", "bfloat16")
    for vma in (False, True)
]


@needs_8
@pytest.mark.parametrize(
    "flavour, level, half, vma",
    slow_except({("linen", "O2", "float16", False), ("nnx", "O1", "bfloat16", True)}, _GPT_GRID),
)
def test_autocast_around_a_shard_mapped_flax_transformer_runs_half_dots(flavour, level, half, vma):
    import warnings

    fwd, params, ids = (_linen_gpt if flavour == "linen" else _nnx_gpt)()
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((N,), ("data",), axis_types=auto)
    sharded = shard_map(
        fwd, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"), check_vma=vma
    )
    f = mpjax.autocast(sharded, mpjax.Policy.from_level(level, half))
    grad = jax.grad(lambda p: f(p, ids).astype(jnp.float32).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntouchedWarning)
        forward = mpjax.audit(f, params, ids, compile=False)
        backward = mpjax.audit(grad, params, compile=False)
    fwd_dots = [m.operand_dtypes for m in forward.matmuls if m.kind == "dot_general"]
    grad_dots = [m.operand_dtypes for m in backward.matmuls if m.kind == "dot_general"]
    # 2 blocks x (q, k, v, scores, mix, out, up, down) + the head: 17 forward dots.
    assert len(fwd_dots) == 17 and len(grad_dots) > len(fwd_dots)
    assert all(d == (half, half) for d in fwd_dots + grad_dots), fwd_dots + grad_dots
    # The shard_map body was rebuilt, not left as traced: the audit lists nothing untouched.
    assert forward.untouched == () and backward.untouched == ()
    # And it agrees with the float32 model.
    ref = jax.jit(sharded)(params, ids)
    got = jax.jit(f)(params, ids).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))


# -- a lookup's gradient sums in float32 where no partitioner splits the sum ---------------------


def _scatter_dtypes(jaxpr):
    """The dtypes of every scatter-add in `jaxpr` and its sub-jaxprs."""
    return [str(e.outvars[0].aval.dtype) for e in eqns(jaxpr, "scatter-add")]


@needs_8
def test_a_lookup_sums_its_gradient_in_float32_in_shard_map_and_in_half_under_jit():
    # Inside shard_map each device sums its own rows (the psum is the user's): float32, one
    # rounding per row. Under jit's partitioner the scatter-add's cross-device sum would move
    # float32, where the policy's reduce dtype says half: there it stays half.
    table = 1.0 + 0.1 * jax.random.normal(jax.random.key(0), (64, 32))
    ids = jax.random.randint(jax.random.key(1), (N * 512,), 0, 8)  # 8 rows, 512 times each
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def local_loss(t, i):
        return jax.lax.psum(jnp.sum(jnp.take(t, i, axis=0).astype(jnp.float32) ** 2), "data")

    loss = shard_map(local_loss, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    ref = jax.grad(loss)(table, ids)
    grad = jax.grad(mpjax.autocast(loss, policy))
    # Half params (O2 without float32 masters): before, their rows summed in bfloat16 (0.03).
    half_table = table.astype(jnp.bfloat16)
    got = jax.jit(grad)(half_table, ids)
    assert rel_err(got, ref) < 0.01, rel_err(got, ref)
    assert "float32" in _scatter_dtypes(jax.make_jaxpr(grad)(half_table, ids).jaxpr)

    plain = lambda t, i: jnp.sum(jnp.take(t, i, axis=0).astype(jnp.float32) ** 2)
    sharded_ids = jax.device_put(ids, NamedSharding(mesh, P("data")))
    jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(plain, policy)))(table, sharded_ids).jaxpr
    assert _scatter_dtypes(jaxpr) == ["bfloat16"], _scatter_dtypes(jaxpr)


@needs_8
def test_8_bit_adam_state_under_explicit_axes_quantizes_what_stays_local():
    """quantize_moments under an Explicit mesh (jax.make_mesh's default on recent JAX): a
    moment sharded on its first axis is quantized in blocks along its other axes (no data
    moves between devices), and its updates equal the unsharded optimizer's; one sharded on
    another axis has no local block view and stays as the inner optimizer keeps it."""
    mesh, ctx = explicit_mesh()
    tx = mpjax.quantize_moments(optax.adam(1e-3), min_size=1024)
    rows = jax.random.normal(jax.random.key(0), (N * 8, 32))
    cols = jax.random.normal(jax.random.key(1), (4, N * 8, 32))
    with ctx:
        params = {
            "rows": jax.device_put(rows, NamedSharding(mesh, P("data"))),
            "cols": jax.device_put(cols, NamedSharding(mesh, P(None, "data"))),
        }
        grads = jax.tree_util.tree_map(lambda p: 0.1 * p, params)
        state = tx.init(params)
        updates, state = jax.jit(tx.update)(grads, state, params)
    mu = state.inner_state[0].mu
    assert isinstance(mu["rows"], mpjax.QuantizedMoment)
    assert not isinstance(mu["cols"], mpjax.QuantizedMoment)
    local = {"rows": rows, "cols": cols}
    expected, _ = jax.jit(tx.update)(
        jax.tree_util.tree_map(lambda p: 0.1 * p, local), tx.init(local), local
    )
    np.testing.assert_allclose(np.asarray(updates["rows"]), np.asarray(expected["rows"]))
