"""The jaxpr interpreter core: rule lookup, layouts of higher-order primitives, the loops."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from mpjax._src.interpreter import autocast, first_order, interpret, ops


def _eqn(fn, *args, name):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return next(e for e in interpret.eqns_within(jaxpr) if e.primitive.name == name)


def test_a_rule_is_found_by_primitive_then_higher_order_then_default():
    rules = interpret.Registry(default=lambda e: "default", higher_order=lambda e: "higher")
    rules.register("exp")(lambda e: "exp")
    exp = _eqn(jnp.exp, 1.0, name="exp")
    sin = _eqn(jnp.sin, 1.0, name="sin")
    cond = _eqn(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0, name="cond")
    assert rules(exp)(exp) == "exp"
    assert rules(sin)(sin) == "default"
    assert rules(cond)(cond) == "higher"
    # A scatter's combiner is a jaxpr param but no body: first order.
    scatter = _eqn(lambda x: x.at[0].add(1.0), jnp.zeros(3), name="scatter-add")
    assert not interpret.is_higher_order(scatter)
    assert rules(scatter)(scatter) == "default"


def test_an_extension_overrides_and_inherits_without_touching_its_parent():
    base = interpret.Registry(default=lambda e: "base default")
    base.register("exp")(lambda e: "base exp")
    child = base.extend()
    child.register("exp")(lambda e: ("child", child.inherited(e)(e)))
    exp = _eqn(jnp.exp, 1.0, name="exp")
    sin = _eqn(jnp.sin, 1.0, name="sin")
    assert child(exp)(exp) == ("child", "base exp")
    assert child(sin)(sin) == "base default"
    assert base(exp)(exp) == "base exp"
    with pytest.raises(KeyError, match="no rule"):
        interpret.Registry()(sin)


def test_fp8_extends_autocasts_rules_and_leaves_them_as_they_are():
    from mpjax._src.float8 import fp8

    sites = fp8._Sites(None, None, fp8.policy("O2"))
    rules = sites.rules()
    dot = _eqn(jnp.dot, jnp.ones((16, 16)), jnp.ones((16, 16)), name="dot_general")
    assert rules(dot) is not autocast.RULES(dot)
    assert autocast.RULES(dot) is first_order._dot_rule


def test_layouts_split_operands_as_the_bodies_take_them():
    def scan(c, xs):
        return lax.scan(lambda c, x: (c * w + x, c), c, xs)

    w = jnp.float32(2.0)
    eqn = _eqn(scan, 1.0, jnp.ones(4), name="scan")
    consts, carry, xs = interpret.scan_parts(eqn, eqn.invars)
    body = eqn.params["jaxpr"].jaxpr
    assert [v.aval for v in consts + carry + xs] != []
    assert len(consts) + len(carry) + len(xs) == len(body.invars)
    assert [v.aval.shape for v in carry] == [()] and [v.aval.shape for v in xs] == [(4,)]

    def loop(x, bound):
        return lax.while_loop(lambda c: c[0] < bound, lambda c: (c[0] + 1, c[1] * w), (0, x))

    eqn = _eqn(loop, 1.0, 5, name="while")
    cconsts, bconsts, carry = interpret.while_parts(eqn, eqn.invars)
    cond_body = eqn.params["cond_jaxpr"].jaxpr
    body = eqn.params["body_jaxpr"].jaxpr
    assert len(cconsts) + len(carry) == len(cond_body.invars)
    assert len(bconsts) + len(carry) == len(body.invars)
    assert len(carry) == 2

    eqn = _eqn(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0, name="cond")
    index, operands = interpret.cond_parts(eqn, eqn.invars)
    assert index.aval.dtype != jnp.float32 and len(operands) == 1


def test_every_body_holding_primitive_autocast_rebuilds_has_a_rule():
    for name in [n for layout in interpret.LAYOUTS for n in layout.names]:
        assert autocast.RULES.own(name) is not None, name


def test_the_op_table_refuses_a_primitive_listed_twice():
    with pytest.raises(AssertionError, match="listed as"):
        ops._table(
            [("iota", ops.Op(ops.Kind.FOLLOW, "")), ("iota", ops.Op(ops.Kind.UNTOUCHED, "ints"))]
        )
    assert "iota" in ops.FOLLOW_OPS and "iota" not in ops.UNTOUCHED_OPS
    assert ops.PRIMITIVES["iota"].kind is ops.Kind.FOLLOW


def test_forward_walks_and_eqns_within_reach_nested_bodies():
    def f(x):
        return jax.jit(lambda y: jnp.exp(y) + lax.cond(y[0] > 0, jnp.sin, jnp.cos, y))(x)

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    names = [e.primitive.name for e in interpret.eqns_within(closed.jaxpr)]
    assert {"exp", "sin", "cos", "cond"} <= set(names)
    seen = []

    def step(eqn, invals):
        seen.append(eqn.primitive.name)
        return [None] * len(eqn.outvars)

    outs = interpret.forward(closed.jaxpr, interpret.Env(closed.jaxpr, closed.consts, [1]), step)
    assert seen == [e.primitive.name for e in closed.jaxpr.eqns] and outs == [None]
