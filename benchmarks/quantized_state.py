"""The optimizer update with 8-bit moments against bfloat16 and float32 state, side by side.

    python benchmarks/quantized_state.py [--params 16777216] [--rounds 20]
    python benchmarks/quantized_state.py --h100 --params 268435456   # no GPU needed

Each variant is one jitted Adam update of bfloat16 params (float32 for the masters' row) on
the same gradients, its state donated, run in turn round by round; the table gives the
median time, the median paired ratio to the bfloat16-state update, the bytes per parameter
of params + state (counted from the pytrees), and the kernels XLA compiled the update into
(fusions and library calls of the optimized HLO's entry computation).

With ``--h100`` nothing runs: each update is compiled for an NVIDIA H100 on this machine
(JAX's CUDA plugin, as ``gpu_program.py``; abstract arrays, so 256M parameters need no
memory) and the table gives its kernels and the bytes they move per parameter, against the
bfloat16-state update's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import mpjax  # noqa: E402

BASE = "bf16 params, bf16 moments (half_updates state_dtype)"


def variants(lr: float = 1e-3):
    adam = optax.adam(lr)
    return {
        "f32 params, f32 moments (optax.adam)": (jnp.float32, adam),
        BASE: (jnp.bfloat16, mpjax.half_updates(adam, state_dtype=jnp.bfloat16)),
        "bf16 params, 8-bit moments (quantize_moments default)": (
            jnp.bfloat16,
            mpjax.half_updates(mpjax.quantize_moments(adam)),
        ),
        "bf16 params, 8-bit moments, recompute=True": (
            jnp.bfloat16,
            mpjax.half_updates(mpjax.quantize_moments(adam, recompute=True)),
        ),
        "bf16 params, 8-bit moments, recompute=False": (
            jnp.bfloat16,
            mpjax.half_updates(mpjax.quantize_moments(adam, recompute=False)),
        ),
    }


def state_bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def kernels(text: str) -> int:
    entry = text[text.index("\nENTRY") :].split("\n}\n")[0]
    return len(re.findall(r" (?:fusion|custom-call)\(", entry))


def h100_program(n: int) -> str:
    """Kernels and bytes moved per parameter of each update in its H100 program."""
    from mpjax._src.tools import gpu_program

    shapes = [(n // 4 // 1024, 1024)] * 4
    table, moved = [], {}
    for name, (dtype, tx) in variants().items():
        params = {f"w{i}": jax.ShapeDtypeStruct(s, dtype) for i, s in enumerate(shapes)}
        state = jax.eval_shape(tx.init, params)

        def step(params, state, grads, tx=tx):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        args = gpu_program.on_target((params, state, params))
        lowered = jax.jit(step, donate_argnums=(0, 1)).trace(*args).lower()
        found = gpu_program.read_kernels(gpu_program.compile_lowered(lowered).as_text())
        moved[name] = sum(k.bytes for k in found) / n
        table.append([name, str(len(found)), f"{moved[name]:.2f}"])
    for row in table:
        row.append(f"{moved[row[0]] / moved[BASE]:.3f}")
    return f"### Adam update, {n / 2**20:g}M parameters, H100 program (counted)\n\n" + (
        harness.table(["state", "kernels", "bytes moved/param", "ratio to bf16 state"], table)
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=2**24, help="parameters in the tree")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--h100", action="store_true", help="count the H100 program instead")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    n = args.params
    if args.h100:
        md = h100_program(n)
        print(md)
        return {"markdown": md}
    shapes = [(n // 4 // 1024, 1024)] * 4  # four weight matrices
    key = jax.random.key(0)
    grads32 = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), s) * 1e-2
               for i, s in enumerate(shapes)}  # fmt: skip
    runs, rows, memory = {}, {}, {}
    for name, (dtype, tx) in variants().items():
        params = {k: jnp.ones(s, dtype) for k, s in zip(grads32, shapes, strict=True)}
        grads = jax.tree_util.tree_map(lambda g, dtype=dtype: g.astype(dtype), grads32)
        state = tx.init(params)

        def step(params, state, grads, tx=tx):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        jitted = jax.jit(step, donate_argnums=(0, 1))
        compiled = jitted.lower(params, state, grads).compile()
        memory[name] = (state_bytes(params) + state_bytes(state)) / n
        rows[name] = kernels(compiled.as_text())
        box = [params, state]
        box[:] = compiled(*box, grads)
        harness.block(box)

        def run(box=box, compiled=compiled, grads=grads):
            box[:] = compiled(*box, grads)
            return box

        runs[name] = run
    times = harness.interleave(runs, args.rounds)
    table = []
    for name in runs:
        table.append([name, f"{1e3 * statistics.median(times[name]):.2f}",
                      f"{harness.paired_ratio(times, name, BASE):.3f}",
                      f"{memory[name]:.2f}", str(rows[name])])  # fmt: skip
    info = harness.machine()
    md = (
        f"### Adam update, {n / 2**20:g}M parameters ({info['device']}, jax {info['jax']})\n\n"
        + harness.table(
            ["state", "median update (ms)", "ratio to bf16 state", "bytes/param", "kernels"],
            table,
        )
    )
    print(md)
    result = {"machine": info, "config": vars(args), "times": times, "markdown": md}
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
