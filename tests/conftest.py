"""Shared test helpers."""

import os

import jax
import jax.extend
import numpy as np
import pytest

_SEED_KEY = pytest.StashKey[int]()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one process per core this process may run on, at most 4.

    The suite is mostly XLA compilation, one thread per process, so processes scale it to the
    cores (on 2 cores: 7.3 instead of 10.3 minutes). The cap keeps a many-core machine from
    starting a JAX runtime, with its memory, per core.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


def slow_except(keep, grid):
    """`grid`'s cases as pytest params, those not in `keep` marked slow (CI runs both sets)."""
    return [
        pytest.param(
            *(case if isinstance(case, tuple) else (case,)),
            marks=() if case in keep else pytest.mark.slow,
        )
        for case in grid
    ]


@pytest.fixture
def rng(request):
    """A freshly seeded NumPy generator: each run draws new inputs (never zeros).

    The seed is reported with a failure; ``MPJAX_TEST_SEED=<seed>`` replays that draw.
    """
    env = os.environ.get("MPJAX_TEST_SEED")
    seed = int(env) if env else int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
    request.node.stash[_SEED_KEY] = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(_SEED_KEY, None)
    if seed is not None and report.failed:
        report.sections.append(("rng seed", f"replay with MPJAX_TEST_SEED={seed}"))


def bits(x):
    """The raw bits of an array, so that equality means bit-identical (-0.0 != 0.0, nan == nan)."""
    x = np.asarray(x)
    return (
        x.view(np.dtype(f"u{x.dtype.itemsize}"))
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16"
        else x
    )


def assert_trees_bit_identical(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ: {ta} vs {tb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        assert np.asarray(x).dtype == np.asarray(y).dtype, f"leaf {i}: dtype {x.dtype} vs {y.dtype}"
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=f"leaf {i} differs bitwise")


def sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def eqns(jaxpr, name=None):
    """Every equation (recursively) whose primitive is `name`."""
    for eqn in jaxpr.eqns:
        if name is None or eqn.primitive.name == name:
            yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from eqns(sub, name)


def rel_err(a, b):
    """||a - b|| / ||b||, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def exact_jit(f, **kwargs):
    """``jax.jit`` that keeps every rounding the program asks for. XLA otherwise skips some
    half-precision roundings inside a fusion ("excess precision"), so one function compiled
    into other fusions (under ``jax.checkpoint`` or ``vmap``, or through another caller)
    differs from itself at a few roundings, which a later FP8 cast can turn into a whole FP8
    step. Tests that compare two compilations of one computation closely compile both so."""
    return jax.jit(f, compiler_options={"xla_allow_excess_precision": False}, **kwargs)
