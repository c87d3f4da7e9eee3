"""Tests of the audit, overflow localisation, find_nonfinite and hardware advice."""

import inspect
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import mpjax
from mpjax._src import hardware

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


def audit_step(level, half):
    policy = mpjax.Policy.from_level(level, half)
    tx = optax.chain(mpjax.loss_scale(scale=policy.loss_scale()), optax.sgd(1e-3))
    params = policy.cast_to_param(simplenet_params(jax.random.key(0)))
    x, y = jnp.ones((32, 64)), jnp.zeros((32, 64))
    return mpjax.audit(simplenet_step(policy, tx), params, tx.init(params), x, y)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level, share", [("O0", 0.0), ("O1", 1.0), ("O2", 1.0), ("O3", 1.0)])
def test_simplenet_step_half_flop_share_and_no_f32_list_op_in_half(level, share, half):
    report = audit_step(level, half)
    # 9 forward, 9 weight gradients, 8 input gradients (the data needs none).
    assert len(report.matmuls) == 26
    assert report.half_flop_share == share
    assert report.total_flops == 2 * 32 * 64 * 64 * 26
    # (JAX lowers half sums with float32 accumulation, and SimpleNet's loss is outside the
    # model, so even O3 has no f32-list op in half here; see the softmax test below.)
    assert report.risks == (), [str(r) for r in report.risks]
    if level == "O0":
        assert report.converts < 5
    d = report.to_dict()
    assert d["half_flop_share"] == share and len(d["matmuls"]) == 26
    assert d["compiled_matmuls"], "the optimized HLO's matmuls are read too"


@pytest.mark.parametrize("level, risky", [("O1", False), ("O2", False), ("O3", True)])
def test_f32_list_ops_in_half_are_flagged(level, risky):
    f = mpjax.autocast(
        lambda w, x: jax.nn.log_softmax(x @ w), mpjax.Policy.from_level(level, "float16")
    )
    report = mpjax.audit(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
    ops = {r.op for r in report.risks}
    assert ({"exp", "log"} <= ops) if risky else not ops
    if risky:
        assert "f32-list ops in half" in str(report)
        assert all(r.dtype == "float16" and "test_audit.py" in r.source for r in report.risks)


def test_report_table_and_sources():
    report = audit_step("O2", "bfloat16")
    text = str(report)
    assert "100.0% of" in text and "| dot_general | bfloat16 x bfloat16 |" in text
    assert all(m.source and m.source.endswith(MATMUL_LINE) for m in report.matmuls)
    assert all(m.name and "dot_general" in m.name for m in report.matmuls)


def test_assert_matmuls_in_names_the_offending_op_and_line():
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


def test_alignment_advice():
    policy = mpjax.Policy.from_level("O2", "float16")
    f = mpjax.autocast(lambda w, x: x @ w, policy)
    aligned = mpjax.audit(f, jnp.ones((16, 32)), jnp.ones((8, 16)))
    assert aligned.misaligned == () and "advice" not in str(aligned)
    odd = mpjax.audit(f, jnp.ones((12, 32)), jnp.ones((8, 12)))
    assert len(odd.misaligned) == 1 and "multiple of 8" in str(odd)


def test_untouched_primitives_are_listed():
    f = mpjax.autocast(lambda a, x: lax.igamma(a, x @ x), mpjax.Policy.from_level("O2", "bfloat16"))
    report = mpjax.audit(f, jnp.full((8, 8), 2.0), jnp.ones((8, 8)))
    assert report.untouched == ("igamma",)
    assert "igamma" in str(report)


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


def test_find_nonfinite_under_a_policy_finds_a_half_overflow():
    def f(x):
        with mpjax.half_precision():
            return jnp.exp(x).sum()

    x = jnp.array([12.0, 1.0])  # exp(12) = 162755 overflows float16 (max 65504), not float32
    assert mpjax.find_nonfinite(f, x) is None
    origin = mpjax.find_nonfinite(mpjax.autocast(f, mpjax.Policy.from_level("O1", "float16")), x)
    assert (origin.primitive, origin.dtype, origin.kind) == ("exp", "float16", "inf")


# -- hardware advice ---------------------------------------------------------------------------


def test_half_on_cpu_warns_once_and_never_fails(monkeypatch):
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
