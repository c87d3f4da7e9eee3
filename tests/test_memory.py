"""What a cast mpjax inserts costs: one convert, as a hand-written ``.astype``.

Counted exactly from the jaxpr of the backward pass's residuals (what reverse-mode AD saves),
never timed: no boolean masks from casts, no float32 copy of a value also saved in half, and
no more residual bytes than the hand-written half step.
"""

import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpjax
import mpjax.flax
from mpjax._src import jax_compat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import memory  # noqa: E402  (the benchmark's exact counts)

HALVES = [jnp.float16, jnp.bfloat16]
_COPIES = {"convert_element_type", "reshape", "broadcast_in_dim", "transpose", "squeeze", "copy"}


class Block(nn.Module):
    """A pre-LayerNorm Transformer block and an MLP head: attention with a causal mask, gelu."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(tokens)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(32)(nn.gelu(nn.Dense(64)(h)))
        return nn.Dense(64)(nn.LayerNorm()(x))


class ConvNet(nn.Module):
    """Convolutions, BatchNorm and relu, average pooling, a Dense head."""

    @nn.compact
    def __call__(self, x):
        for width in (8, 16):
            x = nn.Conv(width, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def _losses(module, x, y, policy):
    """The loss of params under the policy (mpjax.flax.wrap) and hand-written (.astype)."""
    half = policy.compute_dtype
    variables = module.init(jax.random.key(0), x)
    stats = variables.get("batch_stats")

    def loss_with(apply, cast):
        def loss(params):
            p, xx = (
                (memory.half_tree(params, half), memory.half_tree(x, half)) if cast else (params, x)
            )
            if stats is None:
                logits = apply({"params": p}, xx)
            else:
                logits, _ = apply({"params": p, "batch_stats": stats}, xx, mutable=["batch_stats"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
            return ce.mean()

        return loss

    wrapped = mpjax.flax.wrap(module, policy)
    return loss_with(wrapped.apply, False), loss_with(module.apply, True), variables["params"]


def _copies_saved_twice(loss, params):
    """Residual pairs where one is the other converted (through reshapes): a value saved in two
    dtypes. Read from the jaxpr that makes the VJP's residuals."""
    closed = jax.make_jaxpr(lambda p: jax.tree.leaves(jax.vjp(loss, p)[1]))(params)
    producer = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    residuals = {v for v in closed.jaxpr.outvars if hasattr(v, "aval")}
    pairs = []
    for r in residuals:
        v = r
        while v in producer and producer[v].primitive.name in _COPIES:
            v = producer[v].invars[0]
            if isinstance(v, jax_compat.Literal):
                break
            if v in residuals and v.aval.dtype != r.aval.dtype:
                pairs.append((str(v.aval), str(r.aval), str(producer[r].source_info.name_stack)))
    return pairs


@pytest.fixture(scope="module")
def tokens():
    t = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    return t, jnp.roll(t, -1, axis=1)


@pytest.fixture(scope="module")
def images():
    x = jax.random.normal(jax.random.key(2), (4, 16, 16, 3))
    return x, jax.random.randint(jax.random.key(3), (4,), 0, 10)


@pytest.mark.parametrize("half", HALVES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("model", ["transformer", "convnet"])
def test_o2_saves_no_cast_masks_and_no_float32_copies(model, half, tokens, images, request):
    module, (x, y) = (Block(), tokens) if model == "transformer" else (ConvNet(), images)
    o2, hand, params = _losses(module, x, y, mpjax.Policy.from_level("O2", half))
    ours, theirs = memory.residual_bytes(o2, params), memory.residual_bytes(hand, params)
    # Boolean residuals are relu's and the attention mask's, as in the hand-written step; a
    # saturating cast would add one per cast activation.
    assert ours.get("bool", 0) == theirs.get("bool", 0), (ours, theirs)
    assert _copies_saved_twice(o2, params) == []
    # Residual bytes: the hand-written step's, within 5%.
    assert sum(ours.values()) <= 1.05 * sum(theirs.values()), (ours, theirs)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_autocast_mlp_saves_what_the_hand_written_step_saves(level):
    k = jax.random.split(jax.random.key(0), 4)
    p = {"w1": jax.random.normal(k[0], (64, 128)) / 8, "b1": jnp.zeros(128),
         "w2": jax.random.normal(k[1], (128, 64)) / 11}  # fmt: skip
    x, t = jax.random.normal(k[2], (32, 64)), jax.random.normal(k[3], (32, 64))

    def mlp(p, x):
        return jnp.tanh(jax.nn.gelu(x @ p["w1"] + p["b1"])) @ p["w2"]

    def loss(y):
        return jnp.mean((y.astype(jnp.float32) - t) ** 2)

    ours_fn = mpjax.autocast(mlp, mpjax.Policy.from_level(level, "bfloat16"), cast_outputs=False)
    ours = memory.residual_bytes(lambda p: loss(ours_fn(p, x)), p)
    theirs = memory.residual_bytes(
        lambda p: loss(mlp(memory.half_tree(p, jnp.bfloat16), x.astype(jnp.bfloat16))), p
    )
    assert "bool" not in ours
    assert sum(ours.values()) <= sum(theirs.values()), (ours, theirs)


@pytest.mark.parametrize("half", HALVES, ids=lambda d: jnp.dtype(d).name)
def test_activation_that_overflows_half_becomes_inf(half):
    """As in torch.amp and hand-written code: an overflow is inf, never a clamped 65504, so
    loss scaling and find_nonfinite see it."""
    # Beyond the half's range, in float32's: a clamp to the half's maximum would halve to a
    # finite number.
    x = jnp.array(
        [1.0, 4.0 * 65504.0 if half == jnp.float16 else float(jnp.finfo(jnp.float32).max)]
    )
    policy = mpjax.Policy.from_level("O2", half).with_output_dtype(half)
    y = jax.jit(mpjax.autocast(lambda x: x * 0.5, policy))(x)
    assert y.dtype == half
    assert float(y[0]) == 0.5 and np.isinf(float(y[1]))
