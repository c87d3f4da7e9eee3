#!/usr/bin/env bash
# The oldest supported JAX (.ci/oldest.txt), then the JAX in between (.ci/middle.txt): .ci/run
# starts this in the background at its beginning, beside the newest JAX's phases, and waits
# for it before it ends. Each line prints the minutes since this script started.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "== oldest job: $1 (at $((SECONDS / 60)) min $((SECONDS % 60)) s)"; }
trap 'phase "end"' EXIT
phase "oldest"
# -- oldest supported ---------------------------------------------------------------------------
python3 -m venv .venv-ci-oldest
. .venv-ci-oldest/bin/activate
python3 -m pip install -q --upgrade pip
python3 -m pip install -q -c .ci/oldest.txt -e ".[test,examples]"
python3 -c "import jax, flax, optax; print('oldest:', 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__)"
# no pytest cache: the newest phases run pytest in the same checkout at the same time
python3 -m pytest -p no:cacheprovider
# The slow checks whose outcome can depend on the JAX version: autocast on the corpus of real
# programs (their jaxprs differ by release), two processes and the NNX examples (Flax's API by
# release). GSPMD partitioning (Shardy above) is checked here by the test command's
# multidevice suite. The rest of the slow set (the agreement guard against its baseline,
# optax-only fault and half-params runs, the sharding benchmark, benchmark and example smoke
# runs) runs on the newest above, and so does the corpus under FP8 (FP8's fast tests run here
# in the test command).
python3 -m pytest -p no:cacheprovider -m slow tests/test_corpus_models.py tests/test_corpus_solvers.py \
  --deselect tests/test_corpus_models.py::test_fp8_runs_the_corpus_as_float32_does \
  tests/test_distributed.py tests/test_autocast.py \
  tests/test_compare.py::test_corpus_models_at_o2_compare_leaf_by_leaf_and_need_no_rules \
  tests/test_examples.py::test_nnx_and_autocast_examples_train

phase "middle"
# -- a JAX in between ---------------------------------------------------------------------------
# jax_compat branches by JAX version; a branch neither end takes (jax.shard_map exists from
# 0.6.1, its equation's manual_axes became newly_manual_axes in 0.10.2) runs only here: the
# tests that rebuild shard_map bodies (of the 8-device suite, only its shard_map tests).
# Every other branch 0.6.2 takes, 0.6.0 takes too.
# Only these tests here: the whole suite runs on the oldest and the newest, and a third
# full run would take CI past its 45 minutes. The oldest environment is moved to 0.6.2's jax
# and jaxlib (its other pins are the same) rather than built again.
python3 -m pip install -q -c .ci/middle.txt jax jaxlib
python3 -c "import jax, flax; print('middle:', 'jax', jax.__version__, 'flax', flax.__version__)"
MPJAX_MULTIDEVICE_SELECT="shard_map or all_reduce_axis_name" python3 -m pytest -p no:cacheprovider \
  tests/test_multidevice.py \
  tests/test_autocast.py::test_recurses_into_shard_map_and_keeps_collectives_in_their_traced_dtype
deactivate
