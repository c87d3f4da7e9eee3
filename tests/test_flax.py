"""Tests of the Flax linen and NNX wrappers, per-module rules and the TrainState helper."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_bit_identical
from flax import nnx
from test_autocast import F32, HALF, RTOL, eqns, in_dtypes, rel_err

import mpjax
import mpjax.flax

LEVELS_HALF = [(lv, h) for lv in ("O1", "O2") for h in HALF]


# -- linen models ------------------------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.gelu(nn.Dense(32)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(10)(x)


class ResBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        y = nn.Conv(8, (3, 3))(x)
        y = nn.BatchNorm(use_running_average=not train)(y)
        y = nn.gelu(y)
        y = nn.Conv(8, (3, 3))(y)
        y = nn.BatchNorm(use_running_average=not train)(y)
        y = nn.gelu(y + nn.Conv(8, (1, 1))(x))
        return nn.Dense(10)(y.mean(axis=(1, 2)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, h)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(h)))
        return nn.Dense(10)(x.mean(axis=1))


LINEN = {"mlp": (MLP, (4, 12)), "cnn": (ResBlock, (2, 8, 8, 3)), "transformer": (Block, (2, 5, 16))}


def setup_linen(kind, policy, rng, rules=None):
    cls, shape = LINEN[kind]
    model = mpjax.flax.wrap(cls(), policy, rules)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    return model, variables, x


def ce_loss(logits, labels):
    logits = logits.astype(jnp.float32)  # outside autocast: the loss runs in float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def linen_loss(model, variables, x, labels):
    def loss(params):
        out, updates = model.apply(
            {**variables, "params": params}, x, train=True,
            rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"],
        )  # fmt: skip
        return ce_loss(out, labels), updates

    return loss


def hlo_ops(text, op):
    """(operand types, result type) of every `op` in StableHLO text."""
    found = []
    for line in text.splitlines():
        if f"stablehlo.{op}" in line:
            sig = line.rsplit(":", 1)[-1]
            types = re.findall(r"tensor<[^>]*x(f16|bf16|f32)>", sig)
            found.append(types)
    return found


# -- linen -------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_linen_init_stores_params_in_param_dtype_and_stats_in_f32(level, half, rng):
    policy = mpjax.Policy.from_level(level, half)
    _, variables, _ = setup_linen("cnn", policy, rng)
    for leaf in jax.tree_util.tree_leaves(variables["params"]):
        assert leaf.dtype == policy.param_dtype
    for leaf in jax.tree_util.tree_leaves(variables["batch_stats"]):
        assert leaf.dtype == F32
    assert policy.param_dtype == (HALF[half] if level == "O3" else F32)


@pytest.mark.parametrize("level, half", LEVELS_HALF)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_linen_train_step_hlo_has_half_matmuls_and_f32_softmax_norms_and_master_grads(
    kind, level, half, rng
):
    policy = mpjax.Policy.from_level(level, half)
    model, variables, x = setup_linen(kind, policy, rng)
    labels = jnp.arange(x.shape[0]) % 10
    loss = linen_loss(model, variables, x, labels)

    def step(params):
        (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, grads

    text = jax.jit(step).lower(variables["params"]).as_text()
    h = {"float16": "f16", "bfloat16": "bf16"}[half]
    ops = hlo_ops(text, "dot_general") + hlo_ops(text, "convolution")
    assert ops
    for types in ops:
        assert set(types[:2]) == {h}, types  # operands in half
    # The forward pass's f32-list ops. (The backward pass's ops run in the dtype of the
    # forward op they differentiate, as in torch.amp: a half bias add's gradient sum is half.)
    forward = jax.make_jaxpr(loss)(variables["params"]).jaxpr
    for name in ("exp", "log", "rsqrt", "reduce_sum"):
        for e in eqns(forward, name):
            assert all(v.aval.dtype == F32 for v in e.invars), (name, e)
    _, grads = jax.jit(step)(variables["params"])
    assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}


@pytest.mark.parametrize("level, half", LEVELS_HALF)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_linen_outputs_and_gradients_match_float32(kind, level, half, rng):
    cls, shape = LINEN[kind]
    ref_model = cls()
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    variables = ref_model.init(jax.random.key(0), x)
    labels = jnp.arange(x.shape[0]) % 10
    with jax.default_matmul_precision("highest"):
        ref_out = ref_model.apply(variables, x)
        ref_grads = jax.grad(
            lambda p: ce_loss(ref_model.apply({**variables, "params": p}, x), labels)
        )(variables["params"])
    model = mpjax.flax.wrap(cls(), mpjax.Policy.from_level(level, half))
    out = jax.jit(model.apply)(variables, x)
    assert out.dtype == F32 and rel_err(out, ref_out) < RTOL[half]
    grads = jax.jit(
        jax.grad(lambda p: ce_loss(model.apply({**variables, "params": p}, x), labels))
    )(variables["params"])
    flat, ref_flat = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)
    total = rel_err(
        np.concatenate([np.ravel(g) for g in flat]), np.concatenate([np.ravel(g) for g in ref_flat])
    )
    assert total < 2 * RTOL[half]


def test_linen_o0_is_bit_identical_to_the_unwrapped_model(rng):
    model, variables, x = setup_linen("transformer", mpjax.Policy.from_level("O0"), rng)
    assert_trees_bit_identical(
        jax.jit(model.apply)(variables, x), jax.jit(Block().apply)(variables, x)
    )


@pytest.mark.parametrize("half", HALF)
def test_linen_o3_is_half_throughout(half, rng):
    model, variables, x = setup_linen("cnn", mpjax.Policy.from_level("O3", half), rng)
    out, state = model.apply(variables, x, train=True, mutable=["batch_stats"])
    assert out.dtype == HALF[half]
    assert {v.dtype for v in jax.tree_util.tree_leaves(state)} == {F32}  # stats stay f32


def test_linen_rules_by_class_subclass_and_path(rng):
    class MyDense(nn.Dense):
        pass

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, name="encoder")(x)
            x = MyDense(8, name="special")(x)
            return nn.Dense(4, name="decoder")(jnp.tanh(x))

    x = jnp.ones((2, 3))
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    model = mpjax.flax.wrap(Net(), policy, rules={nn.Dense: "O2", MyDense: "O0", "decoder*": "O0"})
    variables = model.init(jax.random.key(0), x)
    dots = in_dtypes(model.apply, variables, x, name="dot_general")
    assert dots == [(HALF["bfloat16"],) * 2, (F32, F32), (F32, F32)]
    # A path rule beats a class rule on the same module.
    model = mpjax.flax.wrap(Net(), policy, rules={MyDense: "O0", "special": "O2"})
    assert in_dtypes(model.apply, variables, x, name="dot_general")[1] == (HALF["bfloat16"],) * 2


def test_linen_keep_norm_fp32_runs_norm_layers_in_f32(rng):
    policy = mpjax.Policy.from_level("O2", "float16")
    model, variables, x = setup_linen("transformer", policy, rng)

    def f32_elementwise(model):
        jaxpr = jax.make_jaxpr(model.apply)(variables, x).jaxpr
        return sum(
            all(v.aval.dtype == F32 for v in e.invars)
            for name in ("mul", "add")
            for e in eqns(jaxpr, name)
        )

    off = mpjax.Policy.from_level("O2", "float16", keep_norm_fp32=False)
    # Two LayerNorms: the scale and shift of each run in float32 only when kept. (Not the
    # statistics: autocast keeps those in float32 anyway, as producers of f32-list ops.)
    assert f32_elementwise(model) >= f32_elementwise(mpjax.flax.wrap(Block(), off)) + 4


@pytest.mark.parametrize("level, half", [("O2", "float16"), ("O1", "bfloat16")])
def test_linen_trainstate_with_batch_stats_and_dropout_trains(level, half, rng):
    policy = mpjax.Policy.from_level(level, half)
    model, variables, x = setup_linen("cnn", policy, rng)
    labels = jnp.arange(x.shape[0]) % 10
    state = mpjax.flax.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2), policy=policy
    )
    stats = variables["batch_stats"]

    @jax.jit
    def step(state, stats):
        def loss_fn(params):
            out, updates = state.apply_fn(
                {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return ce_loss(out, labels), updates["batch_stats"]

        (loss, new_stats), grads = state.grad(loss_fn, has_aux=True)
        return state.apply_gradients(grads=grads), new_stats, loss

    losses = []
    for _ in range(30):
        state, stats, loss = step(state, stats)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
    assert {v.dtype for v in jax.tree_util.tree_leaves(stats)} == {F32}
    assert {v.dtype for v in jax.tree_util.tree_leaves(state.params)} == {F32}
    assert isinstance(
        state.loss_scale, mpjax.DynamicLossScale if half == "float16" else mpjax.NoOpLossScale
    )
    assert int(state.metrics()["skipped_steps"]) < 10


# -- NNX ---------------------------------------------------------------------------------------


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(12, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.gelu(self.l1(x))))


class NNXResBlock(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.c2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(8, rngs=rngs)
        self.skip = nnx.Conv(3, 8, (1, 1), rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        y = nnx.gelu(self.bn1(self.c1(x)))
        y = nnx.gelu(self.bn2(self.c2(y)) + self.skip(x))
        return self.head(y.mean(axis=(1, 2)))


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(16, rngs=rngs)
        self.att = nnx.MultiHeadAttention(
            num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(16, rngs=rngs)
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.att(h, h)
        x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
        return self.head(x.mean(axis=1))


NNX = {
    "mlp": (NNXMLP, (4, 12)),
    "cnn": (NNXResBlock, (2, 8, 8, 3)),
    "transformer": (NNXBlock, (2, 5, 16)),
}


@pytest.mark.parametrize("level, half", LEVELS_HALF + [("O3", "bfloat16")])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_nnx_wrapper_trains_with_nnx_optimizer(kind, level, half, rng):
    cls, shape = NNX[kind]
    policy = mpjax.Policy.from_level(level, half)
    model = mpjax.flax.wrap(cls(nnx.Rngs(0)), policy)
    for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)):
        assert leaf.dtype == policy.param_dtype
    optimizer = nnx.Optimizer(
        model, mpjax.loss_scale(optax.adam(1e-2), scale=policy.loss_scale()), wrt=nnx.Param
    )
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    labels = jnp.arange(shape[0]) % 10

    @nnx.jit
    def step(model, optimizer):
        scale = mpjax.get_loss_scale(optimizer.opt_state)

        def loss_fn(model):
            return scale.scale(ce_loss(model(x), labels))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return scale.unscale(loss)

    losses = [float(step(model, optimizer)) for _ in range(25)]
    assert losses[-1] < 0.5 * losses[0], losses
    for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)):
        assert leaf.dtype == policy.param_dtype
    for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.BatchStat)):
        assert leaf.dtype == F32
    metrics = mpjax.loss_scale_metrics(optimizer.opt_state)
    assert int(metrics["skipped_steps"]) < 10
    if level != "O3":
        h = HALF[half]
        name = "conv_general_dilated" if kind == "cnn" else "dot_general"
        graphdef, state = nnx.split(model)
        fn = lambda state: nnx.merge(graphdef, state)(x)
        for dtypes in in_dtypes(fn, state, name=name):
            assert set(dtypes) == {h}


def test_nnx_outputs_match_float32(rng):
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    ref = NNXBlock(nnx.Rngs(0))
    with jax.default_matmul_precision("highest"):
        ref_out = ref(x)
    model = mpjax.flax.wrap(NNXBlock(nnx.Rngs(0)), mpjax.Policy.from_level("O2", "bfloat16"))
    out = model(x)
    assert out.dtype == F32 and rel_err(out, ref_out) < RTOL["bfloat16"]


def test_nnx_rules_by_class_and_path(rng):
    policy = mpjax.Policy.from_level("O2", "float16")
    model = mpjax.flax.wrap(NNXMLP(nnx.Rngs(0)), policy, rules={"l2": "O0"})
    x = jnp.ones((2, 12))
    graphdef, state = nnx.split(model)
    fn = lambda state: nnx.merge(graphdef, state)(x)
    assert in_dtypes(fn, state, name="dot_general") == [(HALF["float16"],) * 2, (F32, F32)]
    model = mpjax.flax.wrap(NNXMLP(nnx.Rngs(0)), policy, rules={nnx.Linear: "O0"})
    graphdef2, state = nnx.split(model)
    fn2 = lambda state: nnx.merge(graphdef2, state)(x)  # a new function: jax caches by identity
    assert in_dtypes(fn2, state, name="dot_general") == [(F32, F32), (F32, F32)]
    assert nnx.Linear.__call__.__name__ == "__call__" and "marked" not in repr(nnx.Linear.__call__)


# -- bad input ---------------------------------------------------------------------------------


def test_wrap_bad_input():
    policy = mpjax.Policy.from_level("O1")
    with pytest.raises(TypeError, match="linen.Module or a flax.nnx.Module.*autocast"):
        mpjax.flax.wrap(lambda x: x, policy)
    with pytest.raises(TypeError, match="needs an mpjax.Policy"):
        mpjax.flax.wrap(nn.Dense(3), "O1")
    with pytest.raises(TypeError, match="module classes or path globs"):
        mpjax.flax.wrap(nn.Dense(3), policy, rules={3: "O0"})
    with pytest.raises(TypeError, match="Policy or a level string"):
        mpjax.flax.wrap(nn.Dense(3), policy, rules={nn.Dense: 3})
    with pytest.raises(ValueError, match="Unknown level"):
        mpjax.flax.wrap(nn.Dense(3), policy, rules={nn.Dense: "O5"})


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))


@pytest.mark.parametrize(
    "rules, words",
    [
        ({"dense_0": "O0"}, "path key 'dense_0' matches no module path.*closest paths: 'Dense_0'"),
        ({"Dense": "O0"}, "'Dense' is a class name: use the class itself"),
        ({nn.BatchNorm: "O0"}, "class key BatchNorm matches no module.*Dense, TwoDense"),
        ({"Dense_0": "O0", "decoder/*": "O0"}, "path key 'decoder/\\*' matches no module"),
    ],
)
def test_linen_rule_that_matches_no_module_is_an_error(rules, words):
    model = mpjax.flax.wrap(TwoDense(), mpjax.Policy.from_level("O2", "float16"), rules=rules)
    with pytest.raises(ValueError, match=words):
        model.init(jax.random.key(0), jnp.ones((1, 3)))


def test_linen_rule_check_also_runs_on_apply_of_restored_params():
    variables = TwoDense().init(jax.random.key(0), jnp.ones((1, 3)))  # e.g. from a checkpoint
    policy = mpjax.Policy.from_level("O2", "float16")
    model = mpjax.flax.wrap(TwoDense(), policy, rules={"Dense_2": "O0"})
    with pytest.raises(ValueError, match="'Dense_2' matches no module path"):
        model.apply(variables, jnp.ones((1, 3)))
    ok = mpjax.flax.wrap(TwoDense(), policy, rules={"Dense_1": "O0", nn.Dense: "O2"})
    assert ok.apply(variables, jnp.ones((1, 3))).shape == (1, 2)


def test_nnx_rule_that_matches_no_module_is_an_error_at_wrap():
    policy = mpjax.Policy.from_level("O2", "float16")
    with pytest.raises(ValueError, match="path key 'L2' matches no module path.*closest.*'l2'"):
        mpjax.flax.wrap(NNXMLP(nnx.Rngs(0)), policy, rules={"L2": "O0"})
    with pytest.raises(ValueError, match="class key Conv matches no module"):
        mpjax.flax.wrap(NNXMLP(nnx.Rngs(0)), policy, rules={nnx.Conv: "O0"})


def test_explicit_module_dtype_is_honoured_under_a_policy_of_the_other_half(rng):
    # Dense_0 asks for bfloat16 itself; the policy is float16: the module's choice stands
    # (Keras honours a layer's dtype policy), the other layer follows the policy.
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8, dtype=jnp.bfloat16, name="mine")(x)
            return nn.Dense(4, name="policy")(nn.relu(h))

    x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    model = mpjax.flax.wrap(Net(), mpjax.Policy.from_level("O2", "float16"))
    variables = model.init(jax.random.key(0), x)
    dots = in_dtypes(model.apply, variables, x, name="dot_general")
    assert dots == [(HALF["bfloat16"],) * 2, (HALF["float16"],) * 2]
    ref = Net().apply(variables, x)  # unwrapped: "mine" in bfloat16, the rest in float32
    assert rel_err(model.apply(variables, x), ref) < 1e-2


class _Collections(nn.Module):
    """Every kind of collection a linen call can return: sown intermediates, a perturbation,
    batch stats and a cache variable updated in place."""

    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dense(8)(x)
        self.sow("intermediates", "h", h)
        h = self.perturb("hp", h)
        h = nn.BatchNorm(use_running_average=not train)(h)
        count = self.variable("cache", "n", lambda: jnp.zeros((), jnp.float32))
        count.value = count.value + h.mean()
        return nn.Dense(2)(nn.relu(h))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_linen_collections_come_back_as_without_mpjax(level):
    """apply(..., mutable=...) and capture_intermediates return every collection with the
    structure, shapes and dtypes the module gives without mpjax, also when the call changes a
    collection's structure (sown intermediates passed back in grow by one)."""
    module = _Collections()
    wrapped = mpjax.flax.wrap(module, mpjax.Policy.from_level(level, "bfloat16"))
    x = jax.random.normal(jax.random.key(1), (4, 3))
    variables = module.init(jax.random.key(0), x)
    mutable = ["intermediates", "batch_stats", "cache"]
    like = lambda a, b: jax.tree.map(lambda p, q: (p.shape, p.dtype) == (q.shape, q.dtype), a, b)  # noqa: E731
    _, state = wrapped.apply(variables, x, mutable=mutable)
    _, expected = module.apply(variables, x, mutable=mutable)
    assert all(jax.tree.leaves(like(state, expected)))
    again = {**variables, **state}
    _, state = wrapped.apply(again, x, mutable=mutable)
    _, expected = module.apply(again, x, mutable=mutable)
    assert len(state["intermediates"]["h"]) == 2
    assert all(jax.tree.leaves(like(state, expected)))
    _, captured = wrapped.apply(variables, x, capture_intermediates=True, mutable=mutable)
    _, expected = module.apply(variables, x, capture_intermediates=True, mutable=mutable)
    assert jax.tree.structure(captured) == jax.tree.structure(expected)
    assert all(jax.tree.leaves(like(captured, expected)))
    tol = 0.05 if level != "O3" else 0.1
    for got, ref in zip(jax.tree.leaves(captured), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def _counted(calls):
    class Counted(nn.Module):
        """A Dense that counts how often Python runs it (once per trace)."""

        @nn.compact
        def __call__(self, x, scale=1.0):
            calls.append(None)
            return nn.Dense(3)(x) * scale

    return Counted()


def test_wrapped_modules_are_traced_once_per_signature():
    """A retrace (a new jit of the step, an eager call) with shapes seen before reuses the
    wrapper's trace, as jax.jit reuses its own: the module's Python runs once per signature,
    a new shape, static argument, method or mutable set traces again, and every call's
    result is the one a fresh wrapper gives."""
    calls: list = []
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    model = mpjax.flax.wrap(_counted(calls), policy)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    v = model.init(jax.random.key(0), x)
    calls.clear()
    first = jax.jit(lambda v, x: model.apply(v, x))(v, x)
    assert len(calls) == 1
    again = jax.jit(lambda v, x: model.apply(v, x) + 0)(v, x)  # a new jit: a retrace
    eager = model.apply(v, x)
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(eager))
    model.apply(v, x[:1])  # a new shape
    model.apply(v, x, scale=2.0)  # a new static argument
    model.apply(v, x, mutable=["intermediates"])  # a new mutable set
    assert len(calls) == 4
    fresh = mpjax.flax.wrap(_counted([]), policy).apply(v, x, scale=2.0)
    np.testing.assert_array_equal(np.asarray(model.apply(v, x, scale=2.0)), np.asarray(fresh))
    assert len(calls) == 4


def _counted_nnx(calls, rngs):
    class Counted(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            calls.append(None)
            return self.linear(x)

    return Counted()


def test_wrapped_nnx_modules_are_traced_once_per_graph_and_signature():
    """The NNX wrapper reuses its trace while the module's graph and the shapes stay the
    same, including after an optimizer step changes the params' values."""
    calls: list = []
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    model = mpjax.flax.wrap(_counted_nnx(calls, nnx.Rngs(0)), policy)
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    before = model(x)
    model(x)
    assert len(calls) == 1
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(model)
    optimizer.update(model, grads)
    traced = len(calls)  # nnx.grad may trace again (its Variables can carry other metadata)
    after = model(x)
    assert len(calls) == traced <= 2
    assert not np.array_equal(np.asarray(before), np.asarray(after))
    kernel = model.inner.linear.kernel[...].astype(jnp.float32)
    ref = x.astype(jnp.bfloat16).astype(jnp.float32) @ kernel.astype(jnp.bfloat16).astype(
        jnp.float32
    ) + model.inner.linear.bias[...].astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(after, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_nnx_value_and_grad_is_the_hand_scaled_step_bit_for_bit(half, rng):
    # The helper does what the hand-written NNX step does (scale, differentiate, return the
    # loss unscaled) through the optimizer's own scale: the same params, state and losses.
    policy = mpjax.Policy.from_level("O2", half)
    cls, shape = NNX["mlp"]
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    labels = jnp.arange(shape[0]) % 10
    runs = []
    for helper in (False, True):
        model = mpjax.flax.wrap(cls(nnx.Rngs(0)), policy)
        tx = mpjax.loss_scale(optax.adam(1e-2), scale=policy.loss_scale())
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            if helper:
                fn = lambda m: ce_loss(m(x), labels)
                loss, grads = mpjax.scaled_value_and_grad(fn)(optimizer, model)
            else:
                scale = mpjax.get_loss_scale(optimizer.opt_state)
                fn = lambda m: scale.scale(ce_loss(m(x), labels))
                loss, grads = nnx.value_and_grad(fn)(model)
                loss = scale.unscale(loss)
            optimizer.update(model, grads)
            return loss

        losses = [step(model, optimizer) for _ in range(5)]
        runs.append((losses, nnx.state(model, nnx.Param), optimizer.opt_state))
    assert_trees_bit_identical(runs[0], runs[1])
    assert float(runs[1][0][-1]) < float(runs[1][0][0])
    # has_aux: (loss, aux) comes back as the function returned it, the loss unscaled (the
    # MLP has dropout, so the loss is compared with the one the call itself computed).
    fn = lambda m: (lambda loss: (loss, loss * 1.0))(ce_loss(m(x), labels))
    (loss, aux), _ = mpjax.scaled_value_and_grad(fn, has_aux=True)(optimizer, model)
    assert float(loss) == float(aux) and 0 < float(loss) < 10


def test_nnx_value_and_grad_needs_a_loss_scale_in_the_optimizer():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="loss"):
        mpjax.scaled_value_and_grad(lambda m: m(jnp.ones((1, 2))).sum())(optimizer, model)


def test_loss_scale_metrics_of_an_nnx_optimizer_are_arrays():
    """nnx.Optimizer wraps each array of its optax state in a Variable (nnx.OptArray);
    loss_scale_metrics gives arrays, so ``bool(m["last_step_finite"])`` works as for optax."""
    from flax import nnx

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, mpjax.loss_scale(optax.adam(1e-3)), wrt=nnx.Param)
    x = jnp.ones((2, 8))

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    step(model, opt)
    metrics = mpjax.loss_scale_metrics(opt.opt_state)
    assert all(isinstance(v, jax.Array) for v in metrics.values()), metrics
    assert bool(metrics["last_step_finite"]) and int(metrics["skipped_steps"]) == 0
    assert metrics["loss_scale"].dtype == jnp.float32


def test_8_bit_adam_state_in_an_nnx_optimizer_trains_as_in_optax():
    """quantize_moments in an nnx.Optimizer, updated inside nnx.jit: its moments stay 8-bit
    across steps (Flax wraps each array of the state; a moment wrapped whole came back as its
    parts), and the params move as the same optimizer moves them through optax."""
    from flax import nnx

    tx = mpjax.quantize_moments(optax.adam(1e-2), min_size=64)
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jnp.linspace(-1.0, 1.0, 32).reshape(2, 16)
    loss = lambda m: jnp.mean(m(x) ** 2)
    graphdef, params = nnx.split(model)
    params = jax.tree_util.tree_map(jnp.copy, params)  # not the model's own Variables
    state = tx.init(params)

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(loss)(model))

    for _ in range(3):
        step(model, opt)
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p)))(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert isinstance(opt.opt_state.inner_state[0].mu["kernel"], mpjax.QuantizedMoment)
    trained = jax.tree_util.tree_leaves(nnx.state(model))
    for got, want in zip(trained, jax.tree_util.tree_leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
