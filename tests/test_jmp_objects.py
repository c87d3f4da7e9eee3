"""jmp's objects where jmp's names are used: a policy made through jmp's API holds JAX's scalar
types (``policy.compute_dtype is jnp.bfloat16``), and reprs, compares, hashes and introspects
(``dataclasses``) as jmp's own policy does; a jmp client's real code runs on it."""

import dataclasses

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpjax

SPECS = ["p=f32,c=bf16,o=f32", "c=f16", "p=f16,c=bf16", "full", "bf16", "f32", "p=bf16,c=f32"]


@pytest.mark.parametrize("spec", SPECS)
def test_get_policy_holds_jmps_dtype_objects(spec):
    ours, theirs = mpjax.get_policy(spec), jmp.get_policy(spec)
    for name in ("param_dtype", "compute_dtype", "output_dtype"):
        mine, jmps = getattr(ours, name), getattr(theirs, name)
        assert mine is jmps  # jnp.float32, jnp.bfloat16, ...: the same objects
        assert str(mine) == str(jmps)  # "<class 'jax.numpy.bfloat16'>"
        assert {jmps: "found"}[mine] == "found"  # a dict keyed by jnp's types finds them
        assert mine(2.0).dtype == np.dtype(jmps)  # callable, as a scalar type
    assert repr(ours) == repr(theirs)
    assert str(ours) == str(theirs)
    assert [f.name for f in dataclasses.fields(ours)] == [
        f.name for f in dataclasses.fields(theirs)
    ]
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    assert dataclasses.astuple(ours) == dataclasses.astuple(theirs)
    assert ours == mpjax.Policy(*dataclasses.astuple(theirs))
    assert hash(ours) == hash(mpjax.Policy(*dataclasses.astuple(theirs)))
    changed = dataclasses.replace(ours, compute_dtype=jnp.float16)
    assert changed.compute_dtype is jnp.float16 and changed.param_dtype is ours.param_dtype


def test_a_float32_policy_takes_the_no_op_branch_of_a_jmp_script():
    """Public training scripts choose the loss scale with ``compute_dtype is jnp.float32``."""

    def choose(policy):
        if policy.compute_dtype is jnp.float32:
            return jmp.NoOpLossScale()
        return jmp.DynamicLossScale(jnp.float32(2**15))

    for spec in ("p=f32,c=f32,o=f32", "p=f32,c=f16,o=f32"):
        ours, theirs = choose(mpjax.get_policy(spec)), choose(jmp.get_policy(spec))
        assert type(ours) is type(theirs), spec
    assert isinstance(choose(mpjax.Policy(np.float32, "float32", jnp.float32)), jmp.NoOpLossScale)
    assert mpjax.parse_dtype("bf16") is jnp.bfloat16 and mpjax.half_dtype() is jmp.half_dtype()


def test_mpjax_fields_show_where_they_are_set():
    """A policy with mpjax's own fields set (a level) shows them; its dtypes are still jnp's."""
    level = mpjax.Policy.from_level("O2", "bfloat16")
    names = [f.name for f in dataclasses.fields(level)]
    assert names[:3] == ["param_dtype", "compute_dtype", "output_dtype"] and "level" in names
    assert "level='O2'" in repr(level) and level.compute_dtype is jnp.bfloat16
    assert not level.is_plain() and mpjax.get_policy("c=bf16").is_plain()
    # replace keeps what it does not change, on either kind of policy
    assert dataclasses.replace(level, output_dtype=jnp.bfloat16).level == "O2"
    assert [f.name for f in dataclasses.fields(mpjax.Policy)][3] == "level"  # the class: all


def test_haiku_mixed_precision_runs_mpjax_policies():
    """dm-haiku's ``hk.mixed_precision.set_policy``, a jmp client, with mpjax's policies:
    params float32, the Linear's matmul in bfloat16, the output float32, as with jmp's."""
    hk = pytest.importorskip("haiku")
    x = jnp.ones((2, 8))

    def dots_and_out(policy):
        hk.mixed_precision.set_policy(hk.Linear, policy)
        try:
            model = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(4)(x)))
            params = model.init(jax.random.key(0), x)
            jaxpr = jax.make_jaxpr(model.apply)(params, x)
            out = model.apply(params, x)
        finally:
            hk.mixed_precision.clear_policy(hk.Linear)
        dots = [
            str(e.outvars[0].aval.dtype)
            for e in jaxpr.jaxpr.eqns
            if e.primitive.name in ("dot_general", "pjit", "closed_call")
        ]
        leaves = jax.tree_util.tree_leaves(params)
        return dots, out.dtype, {str(p.dtype) for p in leaves}

    spec = "p=f32,c=bf16,o=f32"
    ours = dots_and_out(mpjax.get_policy(spec))
    assert ours == dots_and_out(jmp.get_policy(spec))
    assert "bfloat16" in ours[0] and ours[1] == jnp.float32 and ours[2] == {"float32"}
