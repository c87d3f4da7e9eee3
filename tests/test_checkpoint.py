"""Checkpoint save and restore mid-run: the resumed run is bit-identical; a policy change is
refused with a clear error."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import assert_trees_bit_identical
from test_faults import init, mlp, regression_data

import mpjax
import mpjax.checkpoint


def make(policy):
    scale = mpjax.DynamicLossScale(2.0**10, period=5, hysteresis=2, backoff_factor=0.5)
    # eps=1e-4: O3 float16 keeps Adam's moments in float16, where the default 1e-8 is zero.
    tx = mpjax.loss_scale(optax.adam(1e-2, eps=1e-4), scale=scale, track_nonfinite=True)
    model = mpjax.autocast(mlp, policy)
    x, y = regression_data(jax.random.key(0))

    @jax.jit
    def step(params, opt_state, inject):
        ls = mpjax.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: ls.scale(jnp.mean((model(p, x).astype(jnp.float32) - y) ** 2)))(
            params
        )
        grads[0]["w"] = grads[0]["w"] * inject.astype(grads[0]["w"].dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = policy.cast_to_param(init(jax.random.key(1)))
    return step, {"params": params, "opt_state": tx.init(params), "step": jnp.array(0)}


def run(step, state, start, stop):
    for i in range(start, stop):
        inject = jnp.float32(jnp.inf if i % 7 == 3 else 1.0)  # overflows mid-run too
        params, opt_state = step(state["params"], state["opt_state"], inject)
        state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
    return state


@pytest.mark.parametrize("level, half", [("O2", "float16"), ("O3", "bfloat16"), ("O1", "float16")])
def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path, level, half):
    policy = mpjax.Policy.from_level(level, half)
    step, state = make(policy)
    reference = run(step, state, 0, 40)

    midway = run(step, state, 0, 17)
    mpjax.checkpoint.save(tmp_path / "ckpt", midway, policy)
    _, fresh = make(policy)  # a new process would start from a fresh init like this
    restored = mpjax.checkpoint.restore(tmp_path / "ckpt", fresh, policy)
    assert_trees_bit_identical(restored, midway)
    restored_scale = mpjax.get_loss_scale(restored["opt_state"])
    assert restored_scale.hysteresis == 2 and restored_scale.period == 5
    resumed = run(step, restored, 17, 40)
    assert_trees_bit_identical(resumed, reference)
    assert int(mpjax.loss_scale_metrics(resumed["opt_state"])["skipped_steps"]) > 0


@pytest.mark.parametrize(
    "other", [("O1", "float16"), ("O2", "bfloat16"), ("O3", "float16")], ids=lambda o: "-".join(o)
)
def test_restoring_into_another_level_or_dtype_is_refused(tmp_path, other):
    saved = mpjax.Policy.from_level("O2", "float16")
    _, state = make(saved)
    mpjax.checkpoint.save(tmp_path / "ckpt", state, saved)
    target = mpjax.Policy.from_level(*other)
    _, fresh = make(target)
    with pytest.raises(
        ValueError, match=r"saved under O2 \(params float32, compute float16.*restore it under"
    ):
        mpjax.checkpoint.restore(tmp_path / "ckpt", fresh, target)


def test_checkpoint_errors(tmp_path):
    policy = mpjax.Policy.from_level("O1")
    with pytest.raises(FileNotFoundError, match="No mpjax checkpoint"):
        mpjax.checkpoint.restore(tmp_path / "nothing", {"w": jnp.ones(2)}, policy)
    mpjax.checkpoint.save(tmp_path / "a", {"w": jnp.ones(2)}, policy)
    with pytest.raises(ValueError, match="already exists"):
        mpjax.checkpoint.save(tmp_path / "a", {"w": jnp.ones(2)}, policy)
    with pytest.raises(TypeError, match="needs the mpjax.Policy"):
        mpjax.checkpoint.save(tmp_path / "b", {"w": jnp.ones(2)}, "O1")


@pytest.mark.parametrize("saved_scaled", [True, False])
def test_restoring_without_the_loss_scale_state_says_so(tmp_path, saved_scaled):
    # orbax's own message suggested `partial_restore=True`, an option restore does not take.
    policy = mpjax.Policy.from_level("O2", "float16")
    params = {"w": jnp.ones(3)}
    scaled, plain = mpjax.loss_scale(optax.adam(1e-3)), optax.adam(1e-3)
    saved, target = (scaled, plain) if saved_scaled else (plain, scaled)
    mpjax.checkpoint.save(tmp_path / "c", {"params": params, "opt": saved.init(params)}, policy)
    words = "holds a loss-scale state" if saved_scaled else "the checkpoint does not"
    with pytest.raises(ValueError, match=words) as info:
        mpjax.checkpoint.restore(
            tmp_path / "c", {"params": params, "opt": target.init(params)}, policy
        )
    assert "partial_restore" not in str(info.value)
    # Another structure: the paths that differ are named.
    with pytest.raises(ValueError, match=r"only in the target: \['params/b'\]"):
        mpjax.checkpoint.restore(
            tmp_path / "c",
            {"params": {**params, "b": jnp.ones(1)}, "opt": saved.init(params)},
            policy,
        )
