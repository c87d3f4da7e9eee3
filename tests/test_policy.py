"""Tests of Policy, the O0-O3 levels, jmp's policy grammar and the cast helpers."""

import pathlib
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpjax

F32, F16, BF16 = np.dtype("float32"), np.dtype("float16"), np.dtype(jnp.bfloat16)
HALVES = {"float16": F16, "bfloat16": BF16}


def test_import_mpjax_pulls_in_no_flax_torch_or_jmp():
    code = (
        "import sys, mpjax; print(sorted(m for m in ('flax', 'torch', 'jmp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- Policy ------------------------------------------------------------------------------------


def test_policy_is_frozen_hashable_and_a_static_jit_argument():
    policy = mpjax.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert policy == mpjax.Policy("float32", "f16", np.float32)
    assert hash(policy) == hash(mpjax.Policy("float32", "f16", np.float32))
    with pytest.raises(AttributeError):
        policy.param_dtype = jnp.float16  # type: ignore[misc]
    assert jax.tree_util.tree_leaves(policy) == [policy]  # not a pytree: a single leaf

    traces = []

    def inner(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    f = jax.jit(inner, static_argnums=1)
    assert f(jnp.ones(3), policy).dtype == F16
    assert f(jnp.ones(3), mpjax.Policy(jnp.float32, jnp.float16, jnp.float32)).dtype == F16
    assert len(traces) == 1, "an equal policy must not retrace"
    assert f(jnp.ones(3), policy.with_compute_dtype(jnp.bfloat16)).dtype == BF16
    assert len(traces) == 2


def test_cast_helpers_cast_only_floating_array_leaves(rng):
    policy = mpjax.Policy(jnp.float32, jnp.bfloat16, jnp.float16)
    key = jax.random.key(0)
    tree = {
        "w": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
        "np": rng.normal(size=3).astype(np.float64),
        "i": jnp.arange(3),
        "b": jnp.array([True, False]),
        "none": None,
        "py": 1.5,
        "key": key,
        "s": "name",
    }
    for cast, dtype in [
        (policy.cast_to_param, F32),
        (policy.cast_to_compute, BF16),
        (policy.cast_to_output, F16),
    ]:
        out = cast(tree)
        assert out["w"].dtype == dtype and out["np"].dtype == dtype
        assert out["i"].dtype == tree["i"].dtype
        assert out["b"].dtype == np.bool_
        assert out["none"] is None and out["py"] == 1.5 and out["s"] == "name"
        assert out["key"] is key
        np.testing.assert_allclose(
            np.asarray(out["w"], np.float64), np.asarray(tree["w"]), rtol=2**-7
        )


def test_with_dtype_methods_replace_one_field():
    base = mpjax.Policy.from_level("O2", "float16")
    assert base.with_param_dtype(jnp.bfloat16).param_dtype == BF16
    assert base.with_compute_dtype(jnp.bfloat16).compute_dtype == BF16
    out = base.with_output_dtype(jnp.float16)
    assert out.output_dtype == F16
    assert (out.param_dtype, out.compute_dtype, out.level) == (F32, F16, "O2")


@pytest.mark.parametrize("bad", ["int8", jnp.int32, np.bool_, "fp12", object()])
def test_policy_rejects_non_float_dtypes(bad):
    with pytest.raises(ValueError, match="dtype"):
        mpjax.Policy(bad, jnp.float32, jnp.float32)


# -- levels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("half_name", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "level, param, compute, output, keep_norm",
    [
        ("O0", "f32", "f32", "f32", True),
        ("O1", "f32", "half", "f32", True),
        ("O2", "f32", "half", "f32", True),
        ("O3", "half", "half", "half", False),
    ],
)
def test_level_table(level, param, compute, output, keep_norm, half_name):
    half = HALVES[half_name]
    resolve = {"f32": F32, "half": half}
    policy = mpjax.Policy.from_level(level, half_name)
    assert policy.level == level
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        resolve[param],
        resolve[compute],
        resolve[output],
    )
    assert policy.keep_norm_fp32 is keep_norm
    if level in ("O1", "O2"):
        assert policy.f32_ops == mpjax.F32_OPS
        assert policy.lower_ops == mpjax.LOWER_OPS
        assert {"exp", "log", "reduce_sum", "rsqrt"} <= policy.f32_ops
        assert {"dot_general", "conv_general_dilated"} <= policy.lower_ops
    elif level == "O3":
        assert policy.f32_ops == frozenset()
    else:
        assert policy.f32_ops == policy.lower_ops == frozenset()
    scale = policy.loss_scale()
    dynamic = level in ("O1", "O2") and half == F16
    assert isinstance(scale, mpjax.DynamicLossScale if dynamic else mpjax.NoOpLossScale)
    if dynamic:
        assert float(scale.loss_scale) == 2.0**15


def test_level_half_dtype_defaults_to_backend_rule():
    assert mpjax.Policy.from_level("O2").compute_dtype == mpjax.half_dtype()
    assert mpjax.half_dtype() == np.dtype(jmp.half_dtype())
    # jmp returns the scalar type, and its README calls it: half_dtype()(2 ** 15)
    assert mpjax.half_dtype() is jmp.half_dtype()
    assert mpjax.half_dtype()(2**15).dtype == jmp.half_dtype()(2**15).dtype


def test_level_names_are_forgiving_about_case_and_say_letter_o():
    assert mpjax.Policy.from_level("o2", "bfloat16") == mpjax.Policy.from_level("O2", "bfloat16")
    with pytest.raises(ValueError, match="the letter O"):
        mpjax.Policy.from_level("01")
    with pytest.raises(ValueError, match="Unknown level 'O4'.*'O0', 'O1', 'O2', 'O3'"):
        mpjax.Policy.from_level("O4")
    with pytest.raises(TypeError, match="level must be a string"):
        mpjax.Policy.from_level(1)


# Every accepted spelling of a peer's level name -> the mpjax level it means.
PEER_LEVEL_NAMES = {
    # apex opt_level (exact case), Paddle level (upper-cased by Paddle), MindSpore amp_level.
    **{name: name for name in ("O0", "O1", "O2", "O3")},
    **{name.lower(): name for name in ("O0", "O1", "O2", "O3")},  # Paddle's "o2"
    "auto": "O1",  # MindSpore auto_mixed_precision(net, "auto")
    "AUTO": "O1",
    "Auto": "O1",
    " auto ": "O1",
}


@pytest.mark.parametrize("half_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("name, level", PEER_LEVEL_NAMES.items(), ids=repr)
def test_peer_level_names(name, level, half_name):
    policy = mpjax.Policy.from_level(name, half_name)
    assert policy.level == level
    assert policy == mpjax.Policy.from_level(level, half_name)
    assert mpjax.Policy(F32, F32, F32, level=name).level == level
    if half_name == "float16":
        assert mpjax.get_policy(name) == mpjax.Policy.from_level(level)


def test_level_names_table_is_complete():
    from mpjax._src import levels

    assert levels.LEVEL_NAMES == {"O0": "O0", "O1": "O1", "O2": "O2", "O3": "O3", "auto": "O1"}
    assert {key.strip().upper() for key in PEER_LEVEL_NAMES} == {
        name.upper() for name in levels.LEVEL_NAMES
    }


@pytest.mark.parametrize(
    "name, words",
    [
        ("OD", "Paddle's 'OD'.*no such level.*closest is 'O1'"),
        ("od", "Paddle's 'OD'"),
        ("autocast", "torch has no level names, but torch.autocast's rule is mpjax's 'O1'"),
        ("O4", "Unknown level 'O4'"),
        ("auto-O1", "Unknown level 'auto-O1'"),
        ("", "Unknown level ''"),
        ("02", "Did you mean 'O2'"),
    ],
)
def test_wrong_level_names_list_the_accepted_ones(name, words):
    with pytest.raises(ValueError, match=words) as info:
        mpjax.Policy.from_level(name)
    assert "'O0', 'O1', 'O2', 'O3', 'auto'" in str(info.value)


@pytest.mark.parametrize("name", ["OD", "autocast"])
def test_get_policy_refuses_unmapped_level_names_with_the_reason(name):
    with pytest.raises(ValueError, match="is not accepted.*'O0', 'O1', 'O2', 'O3', 'auto'"):
        mpjax.get_policy(name)


def test_get_policy_unknown_name_keeps_jmps_words_and_lists_levels():
    with pytest.raises(ValueError, match="^Unknown dtype 'fp16' must be full.*'auto'"):
        mpjax.get_policy("fp16")


def test_levels_guide_name_table_matches_from_level():
    from mpjax._src import levels

    root = pathlib.Path(__file__).resolve().parent.parent
    guide = (root / "docs" / "guides" / "levels.md").read_text()
    rows = re.findall(r'^\| `"([^"]+)"` \| ([^|]+) \|', guide, flags=re.M)
    assert {name for name, _ in rows} == set(levels.LEVEL_NAMES) | {"OD"}
    for name, level in rows:
        if level.strip() == "not accepted":
            with pytest.raises(ValueError, match="is not accepted"):
                mpjax.Policy.from_level(name)
        else:
            assert mpjax.Policy.from_level(name).level == level.strip(), name


@pytest.mark.parametrize("bad", ["float32", "int8", "f8"])
def test_level_rejects_a_half_dtype_that_is_not_half(bad):
    with pytest.raises(ValueError, match="half_dtype|Unknown dtype|dtype"):
        mpjax.Policy.from_level("O1", bad)


def test_custom_op_lists_move_ops_between_lists():
    policy = mpjax.Policy.from_level(
        "O1", "bfloat16", lower_ops={"reduce_sum"}, f32_ops={"conv_general_dilated", "tanh"}
    )
    assert "reduce_sum" in policy.lower_ops and "reduce_sum" not in policy.f32_ops
    assert "conv_general_dilated" in policy.f32_ops
    assert "conv_general_dilated" not in policy.lower_ops
    assert "tanh" in policy.f32_ops
    # O2 lower_ops take an op off the float32 list (Paddle's custom white list).
    o2 = mpjax.Policy.from_level("O2", "float16", lower_ops={"exp"})
    assert "exp" not in o2.f32_ops


def test_custom_op_lists_reject_unknown_names_listing_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown op name\(s\) \['matmul'\].*dot_general"):
        mpjax.Policy.from_level("O1", lower_ops={"matmul"})
    with pytest.raises(TypeError, match="collection of primitive names"):
        mpjax.Policy.from_level("O1", f32_ops="exp")
    with pytest.raises(ValueError, match="both lower_ops and f32_ops"):
        mpjax.Policy.from_level("O1", lower_ops={"exp"}, f32_ops={"exp"})


@pytest.mark.parametrize(
    "level, overrides, why",
    [
        ("O0", {"lower_ops": {"exp"}}, "O0 runs everything in float32"),
        ("O0", {"f32_ops": {"tanh"}}, "O0 runs everything in float32"),
        ("O0", {"master_weights": True}, "O0 runs everything in float32"),
        ("O0", {"keep_norm_fp32": False}, "O0 runs everything in float32"),
        ("O1", {"master_weights": True}, "use O2"),
        ("O1", {"master_weights": False}, "use O2"),
        ("O3", {"lower_ops": {"exp"}}, "already runs every op in half"),
    ],
)
def test_overrides_that_make_no_sense_for_the_level_raise(level, overrides, why):
    with pytest.raises(ValueError, match=f"makes no sense at {level}.*{why}"):
        mpjax.Policy.from_level(level, "float16", **overrides)


def test_overrides_that_make_sense():
    o2 = mpjax.Policy.from_level("O2", "float16", master_weights=False)
    assert o2.param_dtype == F16
    assert isinstance(o2.loss_scale(), mpjax.NoOpLossScale)  # no float32 copy to protect
    o3 = mpjax.Policy.from_level("O3", "float16", master_weights=True, keep_norm_fp32=True)
    assert (o3.param_dtype, o3.compute_dtype, o3.keep_norm_fp32) == (F32, F16, True)
    with pytest.warns(UserWarning, match="bfloat16 has float32's exponent range"):
        bf = mpjax.Policy.from_level("O1", "bfloat16", loss_scaling="dynamic")
    assert isinstance(bf.loss_scale(), mpjax.DynamicLossScale)
    static = mpjax.Policy.from_level("O2", "float16", loss_scaling=1024.0).loss_scale()
    assert isinstance(static, mpjax.StaticLossScale) and static.loss_scale == 1024.0
    # An int is accepted, as jmp's StaticLossScale accepts one, and kept as a float.
    from_int = mpjax.Policy.from_level("O2", "float16", loss_scaling=1024)
    assert from_int == mpjax.Policy.from_level("O2", "float16", loss_scaling=1024.0)
    assert from_int.loss_scaling == 1024.0 and isinstance(from_int.loss_scaling, float)
    none = mpjax.Policy.from_level("O2", "float16", loss_scaling="none").loss_scale()
    assert isinstance(none, mpjax.NoOpLossScale)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (True, TypeError, "must be a float, got bool"),
        (0, ValueError, "positive finite"),
        (float("inf"), ValueError, "positive finite"),
        (float("nan"), ValueError, "positive finite"),
        (-2.0, ValueError, "positive finite"),
        ("dynamc", ValueError, "Unknown loss_scaling 'dynamc'"),
    ],
)
def test_bad_loss_scale_override(bad, error, match):
    with pytest.raises(error, match=match):
        mpjax.Policy.from_level("O2", "float16", loss_scaling=bad)


def test_plain_policy_derives_its_loss_scale():
    assert isinstance(mpjax.get_policy("f16").loss_scale(), mpjax.NoOpLossScale)  # f16 params
    assert isinstance(mpjax.get_policy("p=f32,c=f16").loss_scale(), mpjax.DynamicLossScale)
    assert isinstance(mpjax.get_policy("p=f32,c=bf16").loss_scale(), mpjax.NoOpLossScale)


# -- jmp's grammar -----------------------------------------------------------------------------

JMP_SPECS = [
    "f32",
    "full",
    "float32",
    "half",
    "f16",
    "float16",
    "bf16",
    "bfloat16",
    "f64",
    "c=f16",
    "c=bf16",
    "p=f16,c=f16",
    "p=f16,c=bf16",
    "p=f32,c=bf16,o=f32",
    "params=float32,compute=bfloat16,output=float16",
    "o=f16",
    "c=half,o=full",
    "p=half",
    "compute=bf16,params=f32",
]


@pytest.mark.parametrize("spec", JMP_SPECS)
def test_get_policy_matches_jmp(spec):
    ours, theirs = mpjax.get_policy(spec), jmp.get_policy(spec)
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
        assert getattr(ours, field) == np.dtype(getattr(theirs, field)), field
    assert str(ours) == str(theirs)


@pytest.mark.parametrize("spec", ["f33", "p=f32,c=float8", "c=int8", "p=quarter", "O1x"])
def test_get_policy_bad_dtype_errors_like_jmp(spec):
    with pytest.raises(ValueError, match="^Unknown dtype") as ours:
        mpjax.get_policy(spec)
    with pytest.raises(ValueError, match="^Unknown dtype") as theirs:
        jmp.get_policy(spec)
    assert str(ours.value).split(" must")[0] == str(theirs.value).split(" must")[0]


@pytest.mark.parametrize("spec", ["x=f16", "p=f32,q=bf16"])
def test_get_policy_bad_key(spec):
    with pytest.raises(ValueError, match="^Unknown key"):
        mpjax.get_policy(spec)
    with pytest.raises(ValueError, match="^Unknown key"):
        jmp.get_policy(spec)


@pytest.mark.parametrize(
    "spaced, plain",
    [
        (" p = f32 , c = bf16 ", "p=f32,c=bf16"),
        ("c= f16,o =f32", "c=f16,o=f32"),
        (" half ", "half"),
    ],
)
def test_get_policy_accepts_spaces_that_jmp_rejects(spaced, plain):
    assert mpjax.get_policy(spaced) == mpjax.get_policy(plain)
    with pytest.raises(ValueError):
        jmp.get_policy(spaced)


def test_get_policy_other_errors_are_clear():
    with pytest.raises(ValueError, match="each part is key=dtype"):
        mpjax.get_policy("p=f32,c")
    with pytest.raises(ValueError, match="each part is key=dtype"):
        mpjax.get_policy("p=f32=f16")
    with pytest.raises(TypeError, match="takes a string"):
        mpjax.get_policy(jnp.float16)
    assert mpjax.get_policy("O2") == mpjax.Policy.from_level("O2")


def test_cast_to_full_and_half_match_jmp(rng):
    tree = {
        "a": jnp.asarray(rng.normal(size=4), jnp.bfloat16),
        "b": rng.normal(size=(2, 2)).astype(np.float32),
        "i": np.arange(3),
        "f": 2.5,
    }
    for ours, theirs in [
        (mpjax.cast_to_full, jmp.cast_to_full),
        (mpjax.cast_to_half, jmp.cast_to_half),
    ]:
        a, b = ours(tree), theirs(tree)
        assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_get_policy_maps_keras_mixed_precision_names():
    for name, half in [("mixed_float16", "float16"), ("Mixed_BFloat16", "bfloat16")]:
        assert mpjax.get_policy(name) == mpjax.Policy.from_level("O2", half)


def test_loss_scaling_asked_for_with_bfloat16_warns_once(monkeypatch):
    from mpjax._src import policy as policy_lib

    monkeypatch.setattr(policy_lib, "_warned_bfloat16_scaling", False)
    with pytest.warns(UserWarning, match="bfloat16 has float32's exponent range") as record:
        mpjax.Policy.from_level("O2", "bfloat16", loss_scaling="dynamic")
        mpjax.Policy.from_level("O1", "bfloat16", loss_scaling=1024.0)
    assert len([w for w in record if "exponent range" in str(w.message)]) == 1
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpjax.Policy.from_level("O2", "float16", loss_scaling="dynamic")
        mpjax.Policy.from_level("O2", "bfloat16")


def test_reduce_dtype_defaults_to_compute_and_round_trips_through_the_grammar():
    o2 = mpjax.Policy.from_level("O2", "float16")
    assert o2.reduce_dtype is None and o2.gradient_dtype == jnp.float16
    assert o2.gather_dtype == jnp.float16
    wide = mpjax.Policy.from_level("O2", "float16", reduce_dtype="f32")
    assert wide.reduce_dtype == jnp.float32 and wide.gradient_dtype == jnp.float32
    assert str(wide) == "p=full,c=f16,o=full,r=full,level=O2"
    assert mpjax.get_policy(str(wide)) == wide
    assert mpjax.get_policy("p=full,c=f16,o=full,r=full") == mpjax.Policy(
        jnp.float32, jnp.float16, jnp.float32, reduce_dtype=jnp.float32
    )
    assert str(o2) == "p=full,c=f16,o=full,level=O2"
    assert mpjax.Policy.from_level("O0").gradient_dtype == jnp.float32


@pytest.mark.parametrize(
    "level, half, reduce, words",
    [
        ("O2", "bfloat16", jnp.int32, "must be a floating dtype"),
        ("O2", "bfloat16", jnp.float64, "jax_enable_x64"),
        ("O2", "bfloat16", jnp.float16, "reduce_dtype=bfloat16"),
        ("O0", None, jnp.bfloat16, "level that computes in half"),
        ("O1", "float16", "f17", "Unknown dtype"),
    ],
)
def test_a_reduce_dtype_that_makes_no_sense_names_the_fix(level, half, reduce, words):
    with pytest.raises(ValueError, match=words):
        mpjax.Policy.from_level(level, half, reduce_dtype=reduce)


def test_a_level_policy_and_a_jmp_policy_of_the_same_dtypes_print_differently():
    """O2 float16 runs exp in float32 (its f32 list); jmp's grammar's policy of the same
    dtypes casts only, and runs exp in float16: their strings differ, and each parses back
    to itself (the level's str names it as mpjax's `level` key)."""
    level = mpjax.Policy.from_level("O2", "float16")
    plain = mpjax.get_policy("params=float32,compute=float16,output=float32")
    assert str(plain) == "p=full,c=f16,o=full"  # jmp's own string
    assert str(level) != str(plain)
    for policy in (
        level,
        plain,
        mpjax.Policy.from_level("O1", "bfloat16"),
        mpjax.Policy.from_level("O3", "bfloat16"),
        mpjax.Policy.from_level("O0"),
        mpjax.Policy.from_level("O2", "bfloat16", master_weights=False),
        mpjax.get_policy("mixed_bfloat16"),
    ):
        assert mpjax.get_policy(str(policy)) == policy, str(policy)
