"""NNX lifted transforms under mpjax.flax.wrap: rules and keep_norm_fp32 reach the modules
that nnx.scan, vmap, remat, jit, cond and the loops hand to their bodies."""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_autocast import F32, HALF, RTOL, eqns, in_dtypes, rel_err

import mpjax
import mpjax.flax

F16 = HALF["float16"]
DEPTH, WIDTH = 3, 16
# Flax 0.12 has tree mode (graph=False) in the NNX transforms; Flax 0.11 has graph mode only.
GRAPH_MODES = [None, False] if "graph" in inspect.signature(nnx.scan).parameters else [None]


class Block(nnx.Module):
    """Linear, LayerNorm, gelu. The norm's gain keeps activations in the hundreds, so every
    LayerNorm's sums of squares (~1e6) overflow float16 (max 65504) unless kept in float32."""

    def __init__(self, rngs, linear=nnx.Linear):
        self.lin = linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, scale_init=nnx.initializers.constant(500.0), rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.norm(self.lin(x)))


def apply_scan(blocks, x, graph=None):
    kw = {} if graph is None else {"graph": graph}

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **kw)
    def body(x, block):
        return block(x)

    return body(x, blocks)


def apply_remat_scan(blocks, x, graph=None):
    kw = {} if graph is None else {"graph": graph}

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **kw)
    @nnx.remat(**kw)
    def body(x, block):
        return block(x)

    return body(x, blocks)


def layers(blocks):
    """The stacked blocks one by one, as separate modules (for the unrolled forms)."""
    graphdef, state = nnx.split(blocks)
    return [
        nnx.merge(graphdef, jax.tree_util.tree_map(lambda a: a[i], state)) for i in range(DEPTH)
    ]


def apply_unrolled(blocks, x, graph=None):
    for block in layers(blocks):
        x = block(x)
    return x


def apply_jit(blocks, x, graph=None):
    kw = {} if graph is None else {"graph": graph}
    for block in layers(blocks):
        x = nnx.jit(lambda b, x: b(x), **kw)(block, x)
    return x


def apply_cond(blocks, x, graph=None):
    kw = {} if graph is None else {"graph": graph}
    for block in layers(blocks):
        x = nnx.cond(x.sum() < np.inf, lambda b, x: b(x), lambda b, x: -b(x), block, x, **kw)
    return x


def apply_fori_loop(blocks, x, graph=None):
    kw = {} if graph is None else {"graph": graph}
    for block in layers(blocks):
        # Applies the block once, inside the loop body.
        _, x = nnx.fori_loop(0, 1, lambda i, bx: (bx[0], bx[0](bx[1])), (block, x), **kw)
    return x


def apply_while_loop(blocks, x, graph=None):
    kw = {} if graph is None else {"graph": graph}
    for block in layers(blocks):
        _, x, _ = nnx.while_loop(
            lambda s: s[2] < 1, lambda s: (s[0], s[0](s[1]), s[2] + 1), (block, x, 0), **kw
        )
    return x


APPLY = {
    "scan": apply_scan,
    "remat_scan": apply_remat_scan,
    "unrolled": apply_unrolled,
    "jit": apply_jit,
    "cond": apply_cond,
    "fori_loop": apply_fori_loop,
    "while_loop": apply_while_loop,
}


class Stack(nnx.Module):
    """The scan-over-layers pattern of the Flax NNX docs: nnx.vmap makes the stacked blocks,
    a transform from APPLY runs them."""

    def __init__(self, rngs, apply="scan", graph=None, linear=nnx.Linear):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs, linear)

        self.blocks = create(rngs)
        self.apply = apply
        self.graph = graph

    def __call__(self, x):
        return APPLY[self.apply](self.blocks, x, self.graph)


class Ensemble(nnx.Module):
    """Members made and run with nnx.vmap (one member per input row)."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=DEPTH)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.members = create(rngs)

    def __call__(self, x):
        return nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))(self.members, x)


def big_inputs(rng, shape=(4, WIDTH)):
    """Values of a few hundred, either sign: their squares overflow float16."""
    return jnp.asarray(rng.uniform(300, 1000, size=shape) * rng.choice([-1, 1], shape), F32)


def reference(x, apply="unrolled"):
    """The same model (same seed) unrolled, in float32 at full matmul precision."""
    with jax.default_matmul_precision("highest"):
        return Stack(nnx.Rngs(0), apply)(x)


def traced(model, x, name="dot_general"):
    graphdef, state = nnx.split(model)
    fn = lambda state: nnx.merge(graphdef, state)(x)
    return in_dtypes(fn, state, name=name)


def f32_elementwise(model, x):
    """How many sub, mul and add equations run on float32 operands only."""
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda state: nnx.merge(graphdef, state)(x))(state).jaxpr
    ops = [e for name in ("sub", "mul", "add") for e in eqns(jaxpr, name)]
    return sum(all(v.aval.dtype == F32 for v in e.invars) for e in ops)


@pytest.mark.parametrize("graph", GRAPH_MODES, ids=lambda g: "tree" if g is False else "graph")
@pytest.mark.parametrize("apply", list(APPLY))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_keep_norm_fp32_reaches_layers_inside_nnx_transforms(level, apply, graph, rng):
    x = big_inputs(rng)
    ref = reference(x)
    policy = mpjax.Policy.from_level(level, "float16")
    model = mpjax.flax.wrap(Stack(nnx.Rngs(0), apply, graph), policy)
    for out in (model(x), nnx.jit(lambda m, x: m(x))(model, x)):
        assert out.dtype == F32 and np.isfinite(np.asarray(out)).all()
        assert rel_err(out, ref) < RTOL["float16"], (apply, rel_err(out, ref))
    # The matmuls still run in half; only the norms were kept in float32.
    assert set(traced(model, x)) == {(F16, F16)}
    if level == "O2":  # (O1 runs a norm in float32 anyway: its params are float32)
        # The norms' elementwise math (the centring, scale and shift) is float32 only when
        # kept. (Autocast keeps the statistics in float32 on its own, so outputs alone
        # cannot tell.)
        off = mpjax.Policy.from_level(level, "float16", keep_norm_fp32=False)
        unkept = mpjax.flax.wrap(Stack(nnx.Rngs(0), apply, graph), off)
        assert f32_elementwise(model, x) > f32_elementwise(unkept, x)


def test_every_layernorm_variance_overflows_float16(rng):
    # Guards the tests here: a LayerNorm whose statistics ran in half would overflow.
    x = big_inputs(rng)
    for block in layers(Stack(nnx.Rngs(0)).blocks):
        h = block.lin(x)
        # The sum of squares behind each row's variance, as a half reduction would hold it.
        assert (jnp.square(h).sum(axis=-1) > np.finfo(np.float16).max).all()
        x = block(x)


def test_gradients_through_the_scanned_stack_are_finite_and_match_float32(rng):
    x = big_inputs(rng)
    target = jnp.asarray(rng.normal(size=x.shape) * 100, F32)

    def loss(model):
        return jnp.mean((model(x).astype(F32) - target) ** 2)

    def grads(model):
        leaves = jax.tree_util.tree_leaves(nnx.state(nnx.jit(nnx.grad(loss))(model), nnx.Param))
        assert len(leaves) == 4 and {g.dtype for g in leaves} == {F32}
        return np.concatenate([np.ravel(g) for g in leaves])

    with jax.default_matmul_precision("highest"):
        ref = grads(Stack(nnx.Rngs(0), "unrolled"))
    policy = mpjax.Policy.from_level("O2", "float16")
    scanned = grads(mpjax.flax.wrap(Stack(nnx.Rngs(0), "scan"), policy))
    assert np.isfinite(scanned).all()
    # The scanned stack runs what the same stack written out layer by layer runs...
    unrolled = grads(mpjax.flax.wrap(Stack(nnx.Rngs(0), "unrolled"), policy))
    assert rel_err(scanned, unrolled) < 1e-5
    # ...and both are near float32: the half matmul's rounding (O1's too) is amplified by
    # each norm's mean subtraction and gain of 500, to a few 1e-3 with a long tail (600
    # draws, JAX 0.6.0 and 0.10.2 alike: mean 3e-3, 90% below 6e-3, max 6.9e-2, 5 above 5e-2).
    assert rel_err(scanned, ref) < 10 * RTOL["float16"]


@pytest.mark.parametrize(
    "rules",
    [{nnx.Linear: "O0"}, {"blocks/lin": "O0"}, {"blocks/*": "O0"}],
    ids=["class", "path", "glob"],
)
@pytest.mark.parametrize("apply", ["scan", "remat_scan", "jit", "cond", "while_loop"])
def test_rules_reach_layers_inside_nnx_transforms(apply, rules, rng):
    x = big_inputs(rng)
    policy = mpjax.Policy.from_level("O2", "float16")
    model = mpjax.flax.wrap(Stack(nnx.Rngs(0), apply), policy, rules=rules)
    dots = traced(model, x)  # one per layer, per scan body, per branch of a cond
    assert dots and set(dots) == {(F32, F32)}
    assert rel_err(model(x), reference(x)) < RTOL["float16"]


class OwnCallLinear(nnx.Linear):
    def __call__(self, x):  # replaces nnx.Linear's __call__ (no super() call)
        return x @ self.kernel[...] + self.bias[...]


@pytest.mark.parametrize("apply", ["scan", "remat_scan"])
def test_class_rules_reach_a_subclass_with_its_own_call_inside_nnx_scan(apply, rng):
    x = big_inputs(rng)
    policy = mpjax.Policy.from_level("O2", "float16")
    stack = Stack(nnx.Rngs(0), apply, linear=OwnCallLinear)
    model = mpjax.flax.wrap(stack, policy, rules={nnx.Linear: "O0"})
    assert traced(model, x) == [(F32, F32)]
    model = mpjax.flax.wrap(stack, policy, rules={nnx.Linear: "O0", OwnCallLinear: "O2"})
    assert traced(model, x) == [(F16, F16)]


def test_rules_reach_members_of_an_nnx_vmap_ensemble(rng):
    x = big_inputs(rng, (DEPTH, 2, WIDTH))
    policy = mpjax.Policy.from_level("O2", "float16")
    model = mpjax.flax.wrap(Ensemble(nnx.Rngs(0)), policy, rules={"members/lin": "O0"})
    assert traced(model, x) == [(F32, F32)]
    model = mpjax.flax.wrap(Ensemble(nnx.Rngs(0)), policy)
    assert traced(model, x) == [(F16, F16)]
    with jax.default_matmul_precision("highest"):
        ref = Ensemble(nnx.Rngs(0))(x)
    assert rel_err(model(x), ref) < RTOL["float16"]


def test_rule_inside_nnx_scan_shows_in_the_audit(rng):
    x = big_inputs(rng)
    policy = mpjax.Policy.from_level("O2", "float16")

    def audit(rules):
        model = mpjax.flax.wrap(Stack(nnx.Rngs(0)), policy, rules=rules)
        graphdef, state = nnx.split(model)
        return mpjax.audit(lambda s: nnx.merge(graphdef, s)(x), state, compile=False)

    report = audit(None)
    assert {m.operand_dtypes for m in report.matmuls} == {("float16", "float16")}
    assert report.risks == ()  # the norms' statistics are not reduced in half
    report = audit({nnx.Linear: "O0"})
    assert {m.operand_dtypes for m in report.matmuls} == {("float32", "float32")}


def test_marks_stay_off_the_callers_module_and_classes(rng):
    x = big_inputs(rng)
    inner = Stack(nnx.Rngs(0))
    graphdef = nnx.graphdef(inner)
    model = mpjax.flax.wrap(inner, mpjax.Policy.from_level("O2", "float16"), {nnx.Linear: "O0"})
    model(x)
    assert nnx.graphdef(model.inner) == graphdef
    modules = [m for _, m in nnx.iter_graph(model.inner) if isinstance(m, nnx.Module)]
    assert len(modules) == 4 and not any(hasattr(m, "_mpjax_marker") for m in modules)
    assert "marked" not in repr(nnx.Linear.__call__) and "marked" not in repr(Block.__call__)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        norm = nn.LayerNorm(scale_init=nn.initializers.constant(500.0))
        return nn.gelu(norm(nn.Dense(WIDTH)(x))), None


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            nn.remat(LinenBlock), variable_axes={"params": 0}, split_rngs={"params": True},
            length=DEPTH,
        )  # fmt: skip
        return scan(name="blocks")(x, None)[0]


@pytest.mark.skipif(
    not hasattr(jax.sharding.NamedSharding, "update"),
    reason="Flax's nn.scan needs NamedSharding.update, which JAX 0.6.0 lacks",
)
@pytest.mark.parametrize("rules", [None, {nn.Dense: "O0"}, {"blocks/Dense_0": "O0"}])
def test_linen_scan_and_remat_keep_the_rules_as_nnx_does(rules, rng):
    x = big_inputs(rng)
    variables = LinenStack().init(jax.random.key(0), x)
    with jax.default_matmul_precision("highest"):
        ref = LinenStack().apply(variables, x)
    model = mpjax.flax.wrap(LinenStack(), mpjax.Policy.from_level("O2", "float16"), rules)
    assert rel_err(model.apply(variables, x), ref) < RTOL["float16"]
    dots = in_dtypes(model.apply, variables, x, name="dot_general")
    assert dots == [(F16, F16) if rules is None else (F32, F32)]


class Bridged(nnx.Module):
    """A linen layer inside an NNX model (nnx.bridge.ToNNX reads its attributes as variables)."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.linen = nnx.bridge.ToNNX(nn.Dense(WIDTH), rngs=rngs)
        nnx.bridge.lazy_init(self.linen, jnp.ones((1, WIDTH)))

    def __call__(self, x):
        return self.linen(self.lin(x))


@pytest.mark.parametrize(
    "rules, dots",
    [
        (None, [(F16, F16)] * 2),
        ({"linen": "O0"}, [(F16, F16), (F32, F32)]),
        ({nnx.bridge.ToNNX: "O0"}, [(F16, F16), (F32, F32)]),
        ({nnx.Linear: "O0"}, [(F32, F32), (F16, F16)]),
    ],
)
def test_rules_reach_a_linen_module_bridged_into_nnx(rules, dots, rng):
    x = jnp.asarray(rng.normal(size=(2, WIDTH)), F32)
    model = mpjax.flax.wrap(Bridged(nnx.Rngs(0)), mpjax.Policy.from_level("O2", "float16"), rules)
    assert model(x).dtype == F32
    assert traced(model, x) == dots
