"""Tests of the audit, overflow localisation, find_nonfinite and hardware advice.

Tests with "autocast" in their name audit functions under ``mpjax.autocast``; every other
test audits plain jitted functions whose half dtypes are written by hand, so it checks the
audit alone, on every supported JAX: ``pytest tests/test_audit.py -k "not autocast"``.
"""

import inspect
import pathlib
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend.mlir import ir

import mpjax
from mpjax._src import hardware
from mpjax._src.interpreter.first_order import UNTOUCHED_SCOPE
from mpjax._src.tools import audit_hlo, audit_report, audit_stablehlo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import simplenet as benchmark  # noqa: E402

HALVES = ["float16", "bfloat16"]


def simplenet_params(key, width=64):
    return benchmark.init(key, width)


simplenet = benchmark.simplenet  # PaddlePaddle's AMP tutorial model, from the benchmark itself
_lines, _first = inspect.getsourcelines(simplenet)
MATMUL_LINE = f"simplenet.py:{_first + next(i for i, t in enumerate(_lines) if '@' in t)}"


def simplenet_step(policy, tx):
    model = mpjax.autocast(simplenet, policy)

    @jax.jit
    def step(params, opt_state, x, y):
        scale = mpjax.get_loss_scale(opt_state)

        def loss_fn(p):
            out = model(p, x).astype(jnp.float32)
            return scale.scale(jnp.mean((out - y) ** 2))

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def audit_step(level, half, reduce_dtype=None):
    policy = mpjax.Policy.from_level(level, half, reduce_dtype=reduce_dtype)
    tx = optax.chain(mpjax.loss_scale(scale=policy.loss_scale()), optax.sgd(1e-3))
    params = policy.cast_to_param(simplenet_params(jax.random.key(0)))
    x, y = jnp.ones((32, 64)), jnp.zeros((32, 64))
    return mpjax.audit(simplenet_step(policy, tx), params, tx.init(params), x, y)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level, share", [("O0", 0.0), ("O1", 1.0), ("O2", 1.0), ("O3", 1.0)])
def test_autocast_simplenet_step_half_flop_share_and_no_f32_list_op_in_half(level, share, half):
    report = audit_step(level, half)
    # 9 forward, 9 weight gradients, 8 input gradients (the data needs none).
    assert len(report.matmuls) == 26
    assert report.half_flop_share == share
    assert report.total_flops == 2 * 32 * 64 * 64 * 26
    # SimpleNet's loss is outside the model: its only sums are the bias gradients', over the
    # batch, which run in the policy's reduce dtype: half by default, as the hand-written step
    # (the audit lists them), float32 when asked for.
    risks = {(r.op, r.dtype, r.shape) for r in report.risks}
    assert risks == (set() if level == "O0" else {("reduce_sum", half, (64,))}), risks
    if level != "O0":
        wide = audit_step(level, half, reduce_dtype=jnp.float32)
        assert wide.risks == (), [str(r) for r in wide.risks]
        # The 9 weight gradients (they contract the batch) write float32 (from half operands;
        # on CPU, whose runtime rejects some such dots, from float32 ones: JAX 0.6 lowers both
        # of lax.platform_dependent's branches, so there each is listed twice); the rest is
        # half.
        weight = [m for m in wide.matmuls if m.operand_shapes == ((32, 64), (32, 64))]
        rest = [m for m in wide.matmuls if m not in weight]
        assert len(weight) in (9, 18) and {m.result_dtype for m in weight} == {"float32"}
        assert len(rest) == 17 and {m.operand_dtypes for m in rest} == {(half, half)}
    if level == "O0":
        assert report.converts < 5
    d = report.to_dict()
    assert d["half_flop_share"] == share and len(d["matmuls"]) == 26
    assert d["compiled_matmuls"], "the optimized HLO's matmuls are read too"


@pytest.mark.parametrize("level, risky", [("O1", False), ("O2", False), ("O3", True)])
def test_autocast_keeps_f32_list_ops_out_of_half_below_O3(level, risky):
    f = mpjax.autocast(
        lambda w, x: jax.nn.log_softmax(x @ w), mpjax.Policy.from_level(level, "float16")
    )
    report = mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
    ops = {r.op for r in report.risks}
    assert ({"exp", "log"} <= ops) if risky else not ops
    if risky:
        assert "f32-list ops in half" in str(report)
        assert all(r.dtype == "float16" and "test_audit.py" in r.source for r in report.risks)


def test_autocast_report_table_and_sources():
    report = audit_step("O2", "bfloat16")
    text = str(report)
    assert "100.0% of" in text and "| dot_general | bfloat16 x bfloat16 |" in text
    assert all(m.source and m.source.endswith(MATMUL_LINE) for m in report.matmuls)
    assert all(m.name and "dot_general" in m.name for m in report.matmuls)


def test_autocast_assert_matmuls_in_names_the_offending_op_and_line():
    audit_step("O2", "bfloat16").assert_matmuls_in(jnp.bfloat16)
    with pytest.raises(AssertionError, match=r"26 of 26 matmuls are not in bfloat16") as info:
        audit_step("O0", "bfloat16").assert_matmuls_in(jnp.bfloat16)
    assert "dot_general float32 x float32" in str(info.value)
    assert MATMUL_LINE in str(info.value)


def test_flops_of_batched_dots_and_convolutions():
    def f(a, b, x, k):
        y = jnp.einsum("bij,bjk->bik", a, b)
        z = lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=1
        )
        return y.sum() + z.sum()

    report = mpjax.audit(
        f, jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)), jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16))
    )
    dot, conv = report.matmuls
    assert dot.flops == 2 * 2 * 3 * 5 * 4
    assert conv.flops == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)
    assert (dot.kind, conv.kind) == ("dot_general", "convolution")


def test_autocast_alignment_advice():
    policy = mpjax.Policy.from_level("O2", "float16")
    f = mpjax.autocast(lambda w, x: x @ w, policy)
    aligned = mpjax.audit(f, jnp.ones((16, 32)), jnp.ones((8, 16)))
    assert aligned.misaligned == () and "advice" not in str(aligned)
    odd = mpjax.audit(f, jnp.ones((12, 32)), jnp.ones((8, 12)))
    assert len(odd.misaligned) == 1 and "multiple of 8" in str(odd)


def test_autocast_untouched_primitives_are_listed():
    f = mpjax.autocast(lambda a, x: lax.igamma(a, x @ x), mpjax.Policy.from_level("O2", "bfloat16"))
    report = mpjax.audit(f, jnp.full((8, 8), 2.0), jnp.ones((8, 8)))
    assert report.untouched == ("igamma",)
    assert "igamma" in str(report)


def test_autocast_audit_of_a_function_taking_an_equinox_module():
    eqx = pytest.importorskip("equinox")
    # The MLP holds jax.nn.relu (a custom_jvp, no array) as a field: a static leaf.
    mlp = eqx.nn.MLP(16, 8, 32, depth=2, key=jax.random.key(0))
    f = mpjax.autocast(lambda m, x: jax.vmap(m)(x), mpjax.Policy.from_level("O2", "float16"))
    report = mpjax.audit(f, mlp, jnp.ones((8, 16)))
    assert len(report.matmuls) == 3 and report.half_flop_share == 1.0
    report.assert_matmuls_in(jnp.float16)


def test_autocast_flax_where_column_tells_two_dense_layers_apart():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(24)(x))  # Dense_0: 32 -> 24
            return nn.Dense(16)(h)  # Dense_1: 24 -> 16

    x = jnp.ones((8, 32))
    model = mpjax.flax.wrap(Net(), mpjax.Policy.from_level("O2", "float16"))
    params = model.init(jax.random.key(0), x)
    report = mpjax.audit(jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2)), params)
    rows = [line.split("|")[1:-1] for line in str(report).splitlines()]
    rows = [[c.strip() for c in r] for r in rows if r and r[0].strip() == "dot_general"]
    assert len(rows) == len(report.matmuls) == 5  # 2 forward, 2 weight and 1 input gradient
    for row in rows:
        shapes, where = row[3], row[6]
        layer = 1 if "16]" in shapes else 0  # only Dense_1 has a dimension of 16, only Dense_0 32
        # Both layers run Flax's same line; the module path beside it tells them apart.
        assert re.fullmatch(rf"Net/Dense_{layer} \(linear\.py:\d+\)", where), row
    assert len({row[6] for row in rows}) == 2


# -- the audit alone: plain jitted functions, half dtypes written by hand ----------------------


def plain_step(dtype):
    """SimpleNet's SGD step with params and data in `dtype` (no autocast), loss in float32."""

    @jax.jit
    def step(params, x, y):
        def loss_fn(p):
            return jnp.mean((simplenet(p, x.astype(dtype)).astype(jnp.float32) - y) ** 2)

        grads = jax.grad(loss_fn)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads)

    return step


@pytest.mark.parametrize("dtype, share", [("float32", 0.0), ("float16", 1.0), ("bfloat16", 1.0)])
def test_plain_step_matmul_dtypes_flops_and_sources(dtype, share):
    params = jax.tree_util.tree_map(lambda p: p.astype(dtype), simplenet_params(jax.random.key(0)))
    report = mpjax.audit(plain_step(dtype), params, jnp.ones((32, 64)), jnp.zeros((32, 64)))
    # 9 forward, 9 weight gradients, 8 input gradients (the data needs none).
    assert len(report.matmuls) == 26
    assert report.total_flops == 2 * 32 * 64 * 64 * 26
    assert report.half_flop_share == share
    assert {(m.operand_dtypes, m.result_dtype) for m in report.matmuls} == {((dtype, dtype), dtype)}
    assert {m.operand_shapes for m in report.matmuls} == {
        ((32, 64), (64, 64)),  # forward
        ((32, 64), (32, 64)),  # weight gradient: contracts the batch
        ((32, 64), (64, 64)),  # input gradient
    }
    assert all(m.source.endswith(MATMUL_LINE) and "dot_general" in m.name for m in report.matmuls)
    # Each bias gradient sums the batch in `dtype`: in half, a risk (mpjax's reduce_dtype
    # chooses it).
    risks = {(r.op, r.dtype, r.shape, r.source.rsplit("/", 1)[-1]) for r in report.risks}
    assert risks == (set() if share == 0.0 else {("reduce_sum", dtype, (64,), MATMUL_LINE)})
    assert report.untouched == () and report.misaligned == ()
    assert f"| dot_general | {dtype} x {dtype} | {dtype} | [32,64] x [64,64] |" in str(report)
    assert report.compiled_matmuls, "the optimized HLO's matmuls are read too"
    report.assert_matmuls_in(dtype)
    if dtype != "float32":
        with pytest.raises(AssertionError, match="26 of 26 matmuls are not in float32") as info:
            report.assert_matmuls_in(jnp.float32)
        assert f"dot_general {dtype} x {dtype}" in str(info.value) and MATMUL_LINE in str(
            info.value
        )


SAFE_EXPS = {
    "sigmoid": jax.nn.sigmoid,  # lowered as 1 / (1 + exp(-x)): an overflow gives 0, the limit
    "silu": jax.nn.silu,
    "gelu_exact": lambda h: jax.nn.gelu(h, approximate=False),  # derivative: exp(-x*x) <= 1
    "exp_neg_abs": lambda h: jnp.exp(-jnp.abs(h)),
    "exp_neg_square": lambda h: jnp.exp(-h * h),
}
UNSAFE_EXPS = {
    "exp": jnp.exp,
    "softplus_by_hand": lambda h: jnp.log1p(jnp.exp(h)),
    "exp_square": lambda h: jnp.exp(h * h),
    # 1 / (1 + exp(x)) is safe forward, but its derivative multiplies by exp(x): inf * 0 = nan
    "reused_exp": lambda h: 1.0 / (1.0 + jnp.exp(h)),
}


@pytest.mark.parametrize("name", sorted(SAFE_EXPS) + sorted(UNSAFE_EXPS))
@pytest.mark.parametrize("dtype", HALVES)
def test_an_exp_that_cannot_overflow_is_not_a_risk(name, dtype):
    act = {**SAFE_EXPS, **UNSAFE_EXPS}[name]

    def loss(h):
        return jnp.sum(act(h.astype(dtype)).astype(jnp.float32))

    # Half-representable inputs far into float16's exp overflow range (exp(12) > 65504).
    h = np.concatenate([np.linspace(-40.0, 40.0, 61), [-500.0, 500.0, 0.0]])
    h = jnp.asarray(np.asarray(h, dtype).astype(np.float32))
    report = mpjax.audit(jax.value_and_grad(loss), h, compile=False)
    exps = [r for r in report.risks if r.op == "exp"]
    if name in UNSAFE_EXPS:
        assert exps, name
        return
    assert exps == [], exps
    # Not flagged because harmless: value and gradient finite and as float32 computes them.
    value, grad = jax.jit(jax.value_and_grad(loss))(h)
    ref_value, ref_grad = jax.value_and_grad(lambda h: jnp.sum(act(h)))(h)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    eps = float(jnp.finfo(dtype).eps)
    ref_abs = float(jnp.sum(jnp.abs(act(h))))
    assert abs(float(value) - float(ref_value)) <= 4 * eps * ref_abs
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=4 * eps, atol=4 * eps)


@pytest.mark.parametrize("dtype", HALVES)
def test_f32_list_ops_in_half_are_flagged(dtype):
    def f(w, x):
        h = x.astype(dtype) @ w.astype(dtype)
        zero, one = np.array(0, dtype), np.array(1, dtype)
        return (
            jax.nn.log_softmax(h),  # exp and log
            lax.reduce(h, zero, lax.add, (1,)),  # a sum that accumulates in half
            lax.reduce(h, one, lax.mul, (1,)),
            lax.rsqrt(h),
            h.astype(jnp.float32).sum(),  # in float32: no risk
        )

    report = mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
    assert [r.op for r in report.risks] == ["exp", "log", "reduce_sum", "reduce_prod", "rsqrt"]
    assert {r.dtype for r in report.risks} == {dtype}
    assert [r.shape for r in report.risks][2:] == [(4,), (4,), (4, 8)]
    assert all("test_audit.py" in r.source for r in report.risks)
    assert "f32-list ops in half" in str(report)
    full = mpjax.audit(lambda w, x: jax.nn.log_softmax(x @ w), jnp.ones((8, 8)), jnp.ones((4, 8)))
    assert full.risks == ()


def test_alignment_advice():
    f = lambda w, x: x.astype(jnp.float16) @ w.astype(jnp.float16)
    aligned = mpjax.audit(f, jnp.ones((16, 32)), jnp.ones((8, 16)))
    assert aligned.misaligned == () and "advice" not in str(aligned)
    odd = mpjax.audit(f, jnp.ones((12, 32)), jnp.ones((8, 12)))
    assert len(odd.misaligned) == 1 and "multiple of 8" in str(odd)
    full = mpjax.audit(lambda w, x: x @ w, jnp.ones((12, 32)), jnp.ones((8, 12)))
    assert full.misaligned == ()  # float32 does not run on tensor cores


def test_untouched_scope_markers_are_read_from_op_locations():
    def f(a, x):
        with jax.named_scope(f"{UNTOUCHED_SCOPE}:igamma"):
            return lax.igamma(a, x @ x)

    report = mpjax.audit(f, jnp.full((8, 8), 2.0), jnp.ones((8, 8)))
    assert report.untouched == ("igamma",)
    assert "igamma" in str(report)


def test_called_functions_loops_and_conditionals_are_walked():
    @jax.jit
    def layer(w, x):
        return x @ w

    def f(w, x):
        h = layer(w, layer(w, x))  # one function called twice: two matmuls run

        def body(c, _):
            return jnp.exp(layer(w, c)), None

        h, _ = lax.scan(body, h, None, length=3)  # a loop body counts once
        h = lax.cond(h.sum() > 0, lambda: jnp.log(h), lambda: h)
        return lax.fori_loop(0, 2, lambda i, v: v @ w, h)

    report = mpjax.audit(f, jnp.ones((8, 8), jnp.float16), jnp.ones((4, 8), jnp.float16))
    assert len(report.matmuls) == 4 and report.half_flop_share == 1.0
    assert report.total_flops == 4 * 2 * 4 * 8 * 8
    assert [r.op for r in report.risks] == ["exp", "log"]  # in program order
    assert all("test_audit.py" in r.source for r in report.risks)


def test_collectives_are_listed_with_their_dtypes():
    f = jax.pmap(lambda x: (lax.psum(x, "i"), lax.psum(x.astype(jnp.float32), "i")), axis_name="i")
    report = mpjax.audit(f, jnp.ones((1, 4), jnp.bfloat16))
    lowered = [(c.kind, c.dtypes) for c in report.collectives if c.stage == "lowered"]
    assert lowered == [("all-reduce", ("bfloat16",)), ("all-reduce", ("float32",))]
    assert "all-reduce bfloat16 (lowered)" in str(report)


def test_the_lowered_module_is_walked_never_read_as_text(monkeypatch):
    # StableHLO's text changes between JAX releases (generic and pretty forms, location
    # aliases); the audit reads the module's structure through the MLIR bindings instead.
    def no_text(*args, **kwargs):
        raise AssertionError("the audit read the lowered module as text")

    monkeypatch.setattr(jax.stages.Lowered, "as_text", no_text)
    compiler_ir = jax.stages.Lowered.compiler_ir
    modules = []

    def compiler_ir_without_text(self, *args, **kwargs):
        module = compiler_ir(self, *args, **kwargs)
        modules.append(module)
        for cls in vars(ir).values():  # once JAX has lowered: no op, type, attribute or location
            if isinstance(cls, type) and not issubclass(cls, BaseException):  # of it prints
                for name in ("__str__", "get_asm", "print"):
                    if hasattr(cls, name):
                        monkeypatch.setattr(cls, name, no_text)
        return module

    monkeypatch.setattr(jax.stages.Lowered, "compiler_ir", compiler_ir_without_text)

    @jax.jit
    def layer(w, x):
        with jax.named_scope(f"{UNTOUCHED_SCOPE}:tanh"):
            return jnp.tanh(x @ w)

    def f(w, x):
        h, _ = lax.scan(lambda c, _: (jnp.exp(layer(w, c)), None), layer(w, x), None, length=2)
        return h

    w, x = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((4, 8), jnp.bfloat16)
    report = mpjax.audit(f, w, x, compile=False)
    assert [m.operand_dtypes for m in report.matmuls] == [("bfloat16", "bfloat16")] * 2
    assert all(m.source and "test_audit.py" in m.source for m in report.matmuls)
    assert [(r.op, r.dtype) for r in report.risks] == [("exp", "bfloat16")]
    assert report.untouched == ("tanh",)
    with pytest.raises(AssertionError, match="as text"):  # the module was there, unprintable
        str(modules[0].operation)


# A module as a JAX release might print it: every op in generic form, a function called twice,
# a while loop, a reduction and a collective with their bodies, locations of every kind.
HAND_BUILT = """
module @hand_built {
  func.func public @main(%x: tensor<8x16xbf16>, %w: tensor<16x8xbf16>, %h: tensor<4xf16>) -> tensor<f16> {
    %0 = "func.call"(%x, %w) {callee = @layer} : (tensor<8x16xbf16>, tensor<16x8xbf16>) -> tensor<8x8xbf16>
    %1 = "func.call"(%x, %w) {callee = @layer} : (tensor<8x16xbf16>, tensor<16x8xbf16>) -> tensor<8x8xbf16>
    %2 = "stablehlo.while"(%h) ({
    ^bb0(%a: tensor<4xf16>):
      %c = "stablehlo.constant"() {value = dense<true> : tensor<i1>} : () -> tensor<i1>
      "stablehlo.return"(%c) : (tensor<i1>) -> ()
    }, {
    ^bb0(%a: tensor<4xf16>):
      %e = "stablehlo.exponential"(%a) : (tensor<4xf16>) -> tensor<4xf16> loc(fused["jit(step)/while/body/exp"("model.py":11:4), "other.py":1:0])
      "stablehlo.return"(%e) : (tensor<4xf16>) -> ()
    }) : (tensor<4xf16>) -> tensor<4xf16>
    %3 = "stablehlo.all_reduce"(%2) ({
    ^bb0(%a: tensor<f16>, %b: tensor<f16>):
      %s = "stablehlo.add"(%a, %b) : (tensor<f16>, tensor<f16>) -> tensor<f16>
      "stablehlo.return"(%s) : (tensor<f16>) -> ()
    }) {replica_groups = dense<[[0]]> : tensor<1x1xi64>} : (tensor<4xf16>) -> tensor<4xf16>
    %zero = "stablehlo.constant"() {value = dense<0.0> : tensor<f16>} : () -> tensor<f16>
    %4 = "stablehlo.reduce"(%3, %zero) ({
    ^bb0(%a: tensor<f16>, %b: tensor<f16>):
      %s = "stablehlo.add"(%a, %b) : (tensor<f16>, tensor<f16>) -> tensor<f16>
      "stablehlo.return"(%s) : (tensor<f16>) -> ()
    }) {dimensions = array<i64: 0>} : (tensor<4xf16>, tensor<f16>) -> tensor<f16> loc("jit(step)/reduce_sum"("model.py":12:4))
    "func.return"(%4) : (tensor<f16>) -> ()
  }
  func.func private @layer(%x: tensor<8x16xbf16>, %w: tensor<16x8xbf16>) -> tensor<8x8xbf16> {
    %0 = "stablehlo.dot_general"(%x, %w) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<8x16xbf16>, tensor<16x8xbf16>) -> tensor<8x8xbf16> loc("jit(step)/layer/dot_general"(callsite("layer"("model.py":7:8) at "<module>"("train.py":20:0))))
    %1 = "stablehlo.convert"(%0) : (tensor<8x8xbf16>) -> tensor<8x8xf32> loc("jit(step)/layer/mpjax_untouched:igamma/convert_element_type"("model.py":8:8))
    %2 = "stablehlo.convert"(%1) : (tensor<8x8xf32>) -> tensor<8x8xbf16>
    "func.return"(%2) : (tensor<8x8xbf16>) -> ()
  }
  func.func private @unreached(%a: tensor<2xf16>) -> tensor<2xf16> {
    %0 = "stablehlo.log"(%a) : (tensor<2xf16>) -> tensor<2xf16> loc("model.py":30:0)
    "func.return"(%0) : (tensor<2xf16>) -> ()
  }
}
"""  # noqa: E501 - one op a line reads best


def test_walk_of_a_hand_built_module():
    context = jax.jit(lambda: 0.0).lower().compiler_ir("stablehlo").context  # JAX's dialects
    found = audit_stablehlo.read_module(ir.Module.parse(HAND_BUILT, context))
    dot = audit_report.MatmulOp(
        kind="dot_general",
        operand_dtypes=("bfloat16", "bfloat16"),
        result_dtype="bfloat16",
        operand_shapes=((8, 16), (16, 8)),
        result_shape=(8, 8),
        flops=2 * 8 * 8 * 16,
        name="jit(step)/layer/dot_general",
        source="model.py:7",  # the callee's frame: the user's line, not its caller's
        aligned=True,
    )
    assert found.matmuls == [dot, dot]  # at each call
    assert found.converts == 4
    assert [(r.op, r.dtype, r.shape, r.name, r.source) for r in found.risks] == [
        ("exp", "float16", (4,), "jit(step)/while/body/exp", "model.py:11"),
        ("reduce_sum", "float16", (), "jit(step)/reduce_sum", "model.py:12"),
        ("log", "float16", (2,), None, "model.py:30"),  # a function no call reaches: read once
    ]
    assert found.untouched == ["igamma"]
    assert found.collectives == [audit_report.Collective("all-reduce", ("float16",), "lowered")]


def test_static_leaves_are_baked_in_and_shape_structs_stand_for_arrays():
    def f(w, x, scale, act):  # a Python float and a string: static, as autocast treats them
        return getattr(jax.nn, act)(x.astype(jnp.float16) @ w.astype(jnp.float16)) * scale

    w, x = jnp.ones((16, 8)), jnp.ones((4, 16))
    report = mpjax.audit(f, w, x, 2.0, act="relu")
    assert len(report.matmuls) == 1 and report.half_flop_share == 1.0
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (w, x)]
    assert mpjax.audit(f, *specs, 2.0, act="relu").matmuls == report.matmuls


def test_audit_of_an_eqx_filter_jit_function():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(16, 8, 32, depth=2, key=jax.random.key(0))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2))
    x = jnp.ones((8, 16))
    plain = mpjax.audit(grad, mlp, x)
    jitted = mpjax.audit(eqx.filter_jit(grad), mlp, x)  # its .lower() has no compiler_ir
    assert len(jitted.matmuls) == len(plain.matmuls) == 3 + 3 + 2  # forward, weight, input
    assert jitted.total_flops == plain.total_flops
    assert jitted.compiled_matmuls


def test_a_jitted_function_is_lowered_by_its_own_jit():
    # Options only a top-level jit may carry would fail in a jit around it.
    f = jax.jit(lambda w, x: x @ w, compiler_options={"xla_backend_optimization_level": 0})
    report = mpjax.audit(f, jnp.ones((16, 8)), jnp.ones((4, 16)))
    assert len(report.matmuls) == 1 and report.compiled_matmuls


@pytest.mark.parametrize(
    "name, path",
    [
        ("jit(step)/transpose(jvp(Net))/Dense_0/dot_general", "Net/Dense_0"),
        ("jit(f)/jit(main)/vmap()/while/body/dot_general", None),
        ("jit(f)/cond/branch_1_fun/attention/dot_general", "attention"),
        (
            "transpose(jvp(Net))/jvp(Net)/checkpoint/CheckpointBlock_0/proj/dot_general",
            "Net/CheckpointBlock_0/proj",
        ),
        ("jit(f)/mpjax:r0/mpjax_untouched:igamma/igamma", None),
        ("dot_general", None),
        (None, None),
    ],
)
def test_module_path_is_what_the_user_named_in_the_name_stack(name, path):
    assert audit_report._module_path(name) == path
    where = audit_report._where(name, "/site-packages/flax/linen/linear.py:287")
    assert where == (f"{path} (linear.py:287)" if path else "linear.py:287")


# -- overflow localisation -------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 4, 8])
def test_an_inf_in_one_layer_gradient_is_reported_by_its_path(layer):
    params = simplenet_params(jax.random.key(0), width=16)
    tx = mpjax.loss_scale(optax.adam(1e-3), track_nonfinite=True)
    state = tx.init(params)
    x, y = jnp.ones((4, 16)), jnp.zeros((4, 16))

    @jax.jit
    def step(params, state):
        scale = mpjax.get_loss_scale(state)
        grads = jax.grad(lambda p: scale.scale(jnp.mean((simplenet(p, x) - y) ** 2)))(params)
        grads[layer]["w"] = grads[layer]["w"].at[0, 0].set(jnp.inf)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, mpjax.loss_scale_metrics(state)

    new_params, state, metrics = step(params, state)
    assert mpjax.nonfinite_leaves(state) == [f"[{layer}]['w']"]
    assert int(metrics["nonfinite_leaves"].sum()) == 1
    assert int(metrics["skipped_steps"]) == 1
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: bool(jnp.all(a == b)), new_params, params)
    )


def test_nonfinite_tracking_errors():
    params = {"w": jnp.ones(2)}
    untracked = mpjax.loss_scale().init(params)
    with pytest.raises(ValueError, match="track_nonfinite=True"):
        mpjax.nonfinite_leaves(untracked)
    tx = mpjax.loss_scale(track_nonfinite=True)
    with pytest.raises(ValueError, match="different tree structures"):
        tx.update({"w": jnp.ones(2), "v": jnp.ones(2)}, tx.init(params), params)
    with pytest.raises(ValueError, match="float leaves but params had 1"):
        tx.update({"w": jnp.ones(2), "v": jnp.ones(2)}, tx.init(params))  # no params to compare


def test_find_nonfinite_names_the_first_bad_op_and_its_line():
    @jax.jit
    def inner(h):
        return jnp.log(h)  # nan for negative h: the culprit

    def f(w, x):
        h = jnp.tanh(x @ w) - 0.5
        return jnp.exp(inner(h)).sum()

    w, x = jnp.eye(3), jnp.array([[1.0, 0.1, 2.0]])
    origin = mpjax.find_nonfinite(f, w, x)
    assert (origin.primitive, origin.kind, origin.dtype, origin.shape) == (
        "log",
        "nan",
        "float32",
        (1, 3),
    )
    assert "test_audit.py" in origin.source and "inner" in str(origin)
    assert mpjax.find_nonfinite(f, w, jnp.full((1, 3), 2.0)) is None


def test_find_nonfinite_under_autocast_finds_a_half_overflow():
    def f(x):
        with mpjax.half_precision():
            return jnp.exp(x).sum()

    x = jnp.array([12.0, 1.0])  # exp(12) = 162755 overflows float16 (max 65504), not float32
    assert mpjax.find_nonfinite(f, x) is None
    origin = mpjax.find_nonfinite(mpjax.autocast(f, mpjax.Policy.from_level("O1", "float16")), x)
    assert (origin.primitive, origin.dtype, origin.kind) == ("exp", "float16", "inf")


def test_find_nonfinite_reports_a_nan_that_came_in_with_the_input():
    """None means every value was finite: a nan in the batch (or a nan constant) is named by
    its path, an op that made a new one still comes first, and an inf mask fill is not one."""
    loss = lambda params, batch: jnp.sum(params["w"] * batch["x"])  # noqa: E731
    w, x = {"w": jnp.ones(3)}, jnp.array([1.0, jnp.nan, 2.0])
    origin = mpjax.find_nonfinite(loss, w, {"x": x})
    assert (origin.primitive, origin.name, origin.kind) == ("input", "args[1]['x']", "nan")
    assert "args[1]['x']" in str(origin) and origin.shape == (3,)
    origin = mpjax.find_nonfinite(loss, w, batch={"x": x.at[1].set(jnp.inf)})
    assert (origin.name, origin.kind) == ("kwargs['batch']['x']", "inf")
    made = mpjax.find_nonfinite(lambda p, b: jnp.log(p["w"] - 1.0).sum() + loss(p, b), w, {"x": x})
    assert (made.primitive, made.kind) == ("log", "inf")
    nan, fill = jnp.array([jnp.nan]), jnp.array([-jnp.inf])
    assert mpjax.find_nonfinite(lambda v: v * nan, jnp.ones(1)).primitive == "constant"
    assert mpjax.find_nonfinite(lambda v: jnp.maximum(v, fill), jnp.ones(1)) is None


def test_find_nonfinite_takes_prng_keys():
    # A typed key's dtype (key<fry>) is not a NumPy dtype; dropout programs carry one.
    def dropout_log(key, x):
        return jnp.log(x * jax.random.bernoulli(key, 0.5, x.shape))

    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        dropout = lambda k, x: x * jax.random.bernoulli(k, 0.5, x.shape) / 0.5  # noqa: E731
        assert mpjax.find_nonfinite(dropout, key, jnp.ones(8)) is None
        origin = mpjax.find_nonfinite(dropout_log, key, jnp.ones(64))
        assert (origin.primitive, origin.kind) == ("log", "inf")


# -- hardware advice ---------------------------------------------------------------------------


def test_autocast_of_half_on_cpu_warns_once_and_never_fails(monkeypatch):
    monkeypatch.setattr(hardware, "_warned", set())
    policy = mpjax.Policy.from_level("O2", "bfloat16")
    with pytest.warns(mpjax.HardwareWarning, match="no fast half-precision math.*use O0"):
        f = mpjax.autocast(lambda x: x @ x, policy)
    assert f(jnp.ones((2, 2))).dtype == np.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpjax.autocast(lambda x: x @ x, policy)  # once per backend and dtype
        mpjax.autocast(lambda x: x, mpjax.Policy.from_level("O0"))
    assert mpjax.hardware_advice(mpjax.Policy.from_level("O0")) is None


class FakeGPU:
    platform = "gpu"
    device_kind = "Tesla P100"

    def __init__(self, cc):
        self.compute_capability = cc


@pytest.mark.parametrize(
    "cc, half, slow",
    [
        ("6.0", "float16", True),
        ("7.0", "float16", False),
        ("7.5", "bfloat16", True),
        ("8.0", "bfloat16", False),
    ],
)
def test_gpu_advice_follows_compute_capability(monkeypatch, cc, half, slow):
    monkeypatch.setattr(jax, "devices", lambda: [FakeGPU(cc)])
    message = mpjax.hardware_advice(mpjax.Policy.from_level("O1", half))
    assert (message is not None) is slow
    if slow:
        assert f"compute capability >= {hardware._MIN_CAPABILITY[half]}" in message


def test_untouched_primitives_are_named_cleanly_under_vmap():
    def f(a):
        return jnp.linalg.cholesky(a @ a.T + jnp.eye(3)).sum()

    g = jax.vmap(jax.vmap(mpjax.autocast(f, mpjax.Policy.from_level("O2", "bfloat16"))))
    assert mpjax.audit(g, jnp.ones((2, 2, 3, 3))).untouched == ("cholesky",)


def test_a_half_sum_over_size_one_axes_is_not_a_risk():
    # The transpose of broadcasting [2,4] to [2,1,1,4] sums over two size-1 axes: exact.
    def total(t, shape):  # a half reduce_sum (jnp.sum would accumulate float16 in float32)
        zero = jnp.zeros((), t.dtype)
        return jax.lax.reduce(
            jnp.broadcast_to(t[:, None, None, :], shape), zero, jax.lax.add, (1, 2)
        )

    t = jnp.ones((2, 4), jnp.float16)
    assert mpjax.audit(lambda t: total(t, (2, 1, 1, 4)), t).risks == ()
    assert [r.op for r in mpjax.audit(lambda t: total(t, (2, 5, 1, 4)), t).risks] == ["reduce_sum"]


def test_gpu_library_gemms_are_read_from_optimized_hlo():
    # The entry computation of SimpleNet's O2 bfloat16 train step (9 x Linear 8192, batch
    # 2048) as XLA compiled it for an NVIDIA H200 (JAX 0.11.2), metadata stripped. A GPU's
    # library gemm returns a tuple (the product and cuBLAS's workspace); the reader missed
    # every one of them, so the audit reported no gemms at all for this step.
    text = (pathlib.Path(__file__).parent / "data" / "h200_simplenet_o2_bf16.hlo.txt").read_text()
    found, _ = audit_hlo.parse_compiled(text)
    # 9 forward gemms, 9 weight-gradient gemms, 8 input-gradient gemms (none for the input).
    assert found == [("__cublas$lt$matmul", ("bfloat16", "bfloat16"))] * 26


def test_an_nnx_models_rows_name_its_modules_and_gradient_sums_get_advice():
    """Through mpjax.flax.wrap, NNX's ops are named by module path as linen's are
    (``Net/blocks_0/fc``: an nnx.List item as linen names a list's), and the bias
    gradients' half sums that O2 keeps come with what to do about them."""
    from flax import nnx

    import mpjax.flax

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.fc(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.head = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    if not hasattr(nnx, "List"):
        pytest.skip("this Flax has no nnx.List")
    model = mpjax.flax.wrap(Net(nnx.Rngs(0)), mpjax.Policy.from_level("O2", "bfloat16"))
    graphdef, state = nnx.split(model)

    def grads(state, x):
        loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(x).astype(jnp.float32) ** 2)
        return jax.grad(loss)(state)

    report = mpjax.audit(grads, state, jnp.ones((8, 16)))
    text = str(report)
    for path in ("Net/blocks_0/fc (linear.py", "Net/blocks_1/fc (linear.py", "Net/head (linear.py"):
        assert path in text, text
    sums = [r for r in report.risks if r.op == "reduce_sum"]
    assert len(sums) == 3 and all("transpose(" in r.name for r in sums)
    assert "advice: 3 of them are gradient sums of the backward pass" in text
    assert "reduce_dtype=jnp.float32" in text


def test_collectives_the_policys_float32_regions_move_are_its_own_choice():
    """assert_collectives_in allows what a norm's float32 region moves (its float32 params
    gathered, its cotangent resharded: keep_norm_fp32 asks for float32 there) and still names
    a float32 collective anywhere else."""
    from mpjax._src.tools.audit_report import AuditReport, Collective

    def report(*names):
        found = tuple(
            Collective("all-gather", ("float32",), "partitioned", (64,), 256, n) for n in names
        )
        return AuditReport((), 0, (), (), None, "cpu", found)

    policy = mpjax.Policy.from_level("O2", "bfloat16")
    norm = "jit(step)/jvp(LM)/Block_0/LayerNorm_0/mpjax:f32/convert_element_type"
    back = "jit(step)/transpose(jvp(LM))/Block_0/LayerNorm_0/mpjax:f32/all_to_all"
    report(norm, back).assert_collectives_in(policy)
    with pytest.raises(AssertionError, match=r"(?s)1 collectives move float32.*Dense_0"):
        report(norm, "jit(step)/jvp(LM)/Block_0/Dense_0/dot_general").assert_collectives_in(policy)
