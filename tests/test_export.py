"""Mixed-precision inference: convert, export, reload in a fresh process, compare."""

import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpjax
import mpjax.export

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3))(x.reshape(x.shape[0], 8, 8, 1))
        x = nn.relu(nn.LayerNorm()(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def setup(rng):
    model = Net()
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
    return model, model.init(jax.random.key(0), x), x


def test_convert_puts_only_matmul_params_in_half(rng):
    model, variables, x = setup(rng)
    o2 = mpjax.Policy.from_level("O2", "bfloat16")
    converted = mpjax.export.convert(model.apply, variables, o2, x)
    dtypes = {
        jax.tree_util.keystr(p): v.dtype for p, v in jax.tree_util.tree_leaves_with_path(converted)
    }
    assert dtypes["['params']['Conv_0']['kernel']"] == jnp.bfloat16
    assert dtypes["['params']['Dense_0']['kernel']"] == jnp.bfloat16
    for name in ("['params']['Conv_0']['bias']", "['params']['LayerNorm_0']['scale']"):
        assert dtypes[name] == jnp.float32, name
    assert (
        mpjax.export.convert(model.apply, variables, mpjax.Policy.from_level("O0"), x) is variables
    )
    o3 = mpjax.export.convert(model.apply, variables, mpjax.Policy.from_level("O3", "float16"), x)
    assert {v.dtype for v in jax.tree_util.tree_leaves(o3)} == {np.dtype("float16")}


def test_a_param_read_outside_matmuls_stays_float32():
    def tied(p, x):
        h = jnp.einsum("bi,ij->bj", x, p["w"])  # inside a jit: still a matmul use
        return h @ p["w"].T + p["w"].sum()  # but also summed: stays float32

    def untied(p, x):
        return jnp.einsum("bi,ij->bj", x, p["w"])

    params, x = {"w": jnp.ones((4, 4))}, jnp.ones((2, 4))
    policy = mpjax.Policy.from_level("O1", "float16")
    assert mpjax.export.half_param_paths(tied, params, policy, x) == []
    assert mpjax.export.half_param_paths(untied, params, policy, x) == ["['w']"]


PREDICT = """
import sys, numpy as np, mpjax.export
predict = mpjax.export.load(sys.argv[1])
np.save(sys.argv[3], np.asarray(predict(np.load(sys.argv[2])), np.float32))
assert "flax" not in sys.modules, "the model's code must not be needed"
"""


@pytest.mark.parametrize("half, rtol", [("float16", 5e-3), ("bfloat16", 3e-2)])
def test_export_reload_in_a_subprocess_and_compare(tmp_path, rng, half, rtol):
    model, variables, x = setup(rng)
    policy = mpjax.Policy.from_level("O2", half)
    f32 = mpjax.export.save(
        tmp_path / "f32", model.apply, variables, x, policy=mpjax.Policy.from_level("O0")
    )
    converted = mpjax.export.convert(model.apply, variables, policy, x)
    summary = mpjax.export.save(tmp_path / "half", model.apply, converted, x, policy=policy)
    assert summary["params_bytes"] < 0.6 * f32["params_bytes"]  # about half on disk
    np.save(tmp_path / "x.npy", np.asarray(x))
    subprocess.run(
        [sys.executable, "-c", PREDICT, str(tmp_path / "half"), str(tmp_path / "x.npy"), str(tmp_path / "out.npy")],
        check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    out = np.load(tmp_path / "out.npy")
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(model.apply(variables, x), np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < rtol
    # In this process too, and with the params given explicitly.
    predict = mpjax.export.load(tmp_path / "half", params=converted)
    np.testing.assert_allclose(np.asarray(predict(x)), out, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_digits_export_example_halves_the_size_and_keeps_accuracy():
    example = pytest.importorskip("export_digits")
    f32, f16, bf16 = example.main(["--epochs", "4"])
    for r in (f16, bf16):
        assert r["params_bytes"] < 0.55 * f32["params_bytes"]
        assert abs(r["test_accuracy"] - f32["test_accuracy"]) <= 0.01


def test_bad_input(tmp_path, rng):
    model, variables, x = setup(rng)
    policy = mpjax.Policy.from_level("O2", "float16")
    converted = mpjax.export.convert(model.apply, variables, policy, x)
    mpjax.export.save(tmp_path / "e", model.apply, converted, x, policy=policy)
    with pytest.raises(ValueError, match="already exists"):
        mpjax.export.save(tmp_path / "e", model.apply, converted, x, policy=policy)
    with pytest.raises(
        ValueError, match=r"\['params'\]\['Conv_0'\]\['kernel'\] is float32.*exported as float16"
    ):
        mpjax.export.load(tmp_path / "e", params=variables)  # the unconverted params
    with pytest.raises(ValueError, match="takes a tree"):
        mpjax.export.load(
            tmp_path / "e", params={"params": {"Conv_0": converted["params"]["Conv_0"]}}
        )
    os.remove(tmp_path / "e" / "params.npz")
    with pytest.raises(FileNotFoundError, match="params.npz is missing"):
        mpjax.export.load(tmp_path / "e")
    with pytest.raises(FileNotFoundError, match="is missing"):
        mpjax.export.load(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="needs an mpjax.Policy"):
        mpjax.export.convert(model.apply, variables, "O2", x)
