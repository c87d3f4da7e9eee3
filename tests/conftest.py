"""Shared test helpers."""

import jax
import numpy as np
import pytest


@pytest.fixture
def rng():
    """A fresh, unseeded NumPy generator: each run draws new inputs (never zeros)."""
    return np.random.default_rng()


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
