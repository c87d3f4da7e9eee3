"""What mixed precision saves, measured exactly: residual bytes, compiled temp memory and bytes
moved by fusions of a full train step, for float32, a hand-written half step and mpjax's levels.

    python benchmarks/memory.py                     # GPT-style Transformer and ResNet-style CNN
    python benchmarks/memory.py --size tiny --rounds 0

Three counts per variant, none of them a timing:

- residuals: the bytes reverse-mode AD saves for the backward pass of the loss (from the
  jaxpr, by dtype; arguments themselves not counted);
- temp: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted train step;
- fusion bytes: for every fusion, dot, convolution and other kernel in the optimized HLO, the
  bytes of its operands and results (what the kernels read and write).

The yardstick is the hand-written step a JAX expert writes: params and float inputs cast with
``.astype``, logits cast to float32 for the loss. With ``--rounds N`` the CPU step time of mpjax
O2 is also compared with it, interleaved in one process (median of N paired ratios).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import mpjax  # noqa: E402
import mpjax.flax  # noqa: E402
from mpjax._src import jax_compat  # noqa: E402

MB = 1e6
MIB = 2**20

# (width, depth, heads, seq, batch) and (widths, batch, side)
SIZES = {
    "transformer": {"tiny": (32, 2, 2, 16, 4), "small": (256, 8, 4, 128, 16)},
    "resnet": {"tiny": ((8, 16), 4, 8), "small": ((32, 64, 128), 32, 32)},
}


# -- the three counts ---------------------------------------------------------------------------


def residual_bytes(f: Any, *args: Any) -> dict[str, int]:
    """Bytes saved for the backward pass of `f` at `args`, by dtype name (arguments excluded)."""
    out: dict[str, int] = collections.Counter()
    for aval, is_argument in jax_compat.saved_residuals(f, *args):
        if not is_argument:
            dtype = np.dtype(aval.dtype)
            out[dtype.name] += int(np.prod(aval.shape)) * dtype.itemsize
    return dict(out)


_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}
_NOT_KERNELS = frozenset(
    {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional",
     "call", "after-all", "partition-id", "replica-id", "opt-barrier"}
)  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _bytes_of(shape: str) -> int:
    total = 0
    for kind, dims in _SHAPE.findall(shape):
        bits = _BITS.get(kind) or int(re.sub(r"\D", "", kind.split("e")[0]) or 8)
        total += int(np.prod([int(d) for d in dims.split(",") if d])) * max(bits, 8) // 8
    return total


def _close(text: str, start: int) -> int:
    """The index of the parenthesis closing the one opened just before `start`."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _split_instruction(rest: str) -> tuple[str, str, str]:
    """'SHAPE opcode(operands), attrs' -> (shape, opcode, operands)."""
    if rest.startswith("("):  # a tuple shape
        end = _close(rest, 1)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    return shape, opcode.strip(), rest[: _close(rest, 0)]


def fusion_bytes(hlo_text: str) -> int:
    """Bytes read and written by the kernels of an optimized HLO module: every instruction of
    the entry computation and of loop and branch bodies (fusions, dots, convolutions, copies,
    ...), operands plus results. Computations inside fusions and reducers are not kernels."""
    computations: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)  # not indented
        if header and not line.startswith("HloModule"):
            name = header.group(2)
            computations[name] = []
            if header.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None and _INSTRUCTION.match(line):
            computations[name].append(line)
    control, todo = set(), [entry]
    while todo:
        comp = todo.pop()
        if comp is None or comp in control:
            continue
        control.add(comp)
        for line in computations.get(comp, []):
            for key in ("body", "condition", "true_computation", "false_computation"):
                todo += re.findall(rf"\b{key}=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [c.strip().lstrip("%") for c in group.split(",")]
            if re.search(r"=\s*\S+\s+call\(", line) or " call(" in line:
                todo += re.findall(r"\bto_apply=%?([\w.\-]+)", line)
    total = 0
    for comp in control:
        shapes: dict[str, str] = {}
        for line in computations.get(comp, []):
            m = _INSTRUCTION.match(line)
            assert m is not None
            shape, opcode, operands = _split_instruction(m.group(2))
            shapes[m.group(1)] = shape
            if opcode in _NOT_KERNELS:
                continue
            names = re.findall(r"%([\w.\-]+)", operands) or [
                o.strip() for o in operands.split(",") if o.strip()
            ]
            total += _bytes_of(shape) + sum(_bytes_of(shapes.get(n, "")) for n in names)
    return total


# -- the train steps ----------------------------------------------------------------------------


def build(kind: str, size: str) -> tuple[Any, Any, Any]:
    if kind == "transformer":
        width, depth, heads, seq, batch = SIZES[kind][size]
        vocab = 1024
        tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
        return models.TransformerLM(vocab, width, depth, heads), tokens, jnp.roll(tokens, -1, 1)
    widths, batch, side = SIZES[kind][size]
    x = jax.random.normal(jax.random.key(1), (batch, side, side, 3))
    y = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    return models.ResNet(widths), x, y


def half_tree(tree: Any, dtype: Any) -> Any:
    """`tree` with its float leaves cast with ``.astype(dtype)``, as a hand-written step does."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def variants() -> list[tuple[str, Any]]:
    """(name, policy or ('hand', half dtype)) for every variant measured."""
    out: list[tuple[str, Any]] = [("float32", mpjax.Policy.from_level("O0"))]
    for half in ("bfloat16", "float16"):
        out.append((f"hand-written {half}", ("hand", jnp.dtype(half))))
    for level in ("O1", "O2", "O3"):
        for half in ("bfloat16", "float16"):
            out.append((f"mpjax {level} {half}", mpjax.Policy.from_level(level, half)))
    return out


def make(module: Any, variant: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
    """(loss of params, jitted train step, its arguments) for one variant."""
    hand = isinstance(variant, tuple)
    half = variant[1] if hand else None
    policy = mpjax.Policy.from_level("O0") if hand else variant
    model = module if hand else mpjax.flax.wrap(module, policy)
    if hand:
        scale = mpjax.DynamicLossScale(2.0**15) if half == jnp.float16 else mpjax.NoOpLossScale()
    else:
        scale = policy.loss_scale()
    variables = model.init(jax.random.key(0), x)
    params = variables["params"]
    stats = variables.get("batch_stats")

    def loss_fn(p: Any, stats: Any, x: Any) -> Any:
        if hand:  # what a JAX expert writes: params and float inputs cast with .astype
            p, x = half_tree(p, half), half_tree(x, half)
        if stats is None:
            logits, new_stats = model.apply({"params": p}, x), None
        else:
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, x, mutable=["batch_stats"]
            )
            new_stats = new["batch_stats"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss.mean(), new_stats

    tx = mpjax.loss_scale(optax.adam(1e-3), scale=scale)

    def step(params: Any, stats: Any, opt_state: Any, x: Any) -> Any:
        s = mpjax.get_loss_scale(opt_state)
        scaled = lambda p: (lambda out: (s.scale(out[0]), out[1]))(loss_fn(p, stats, x))
        grads, new_stats = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state

    def loss_of_params(p: Any) -> Any:
        return loss_fn(p, stats, x)[0]

    return loss_of_params, jax.jit(step), (params, stats, tx.init(params), x)


def measure(kind: str, size: str, rounds: int) -> dict[str, Any]:
    module, x, y = build(kind, size)
    rows: dict[str, dict[str, Any]] = {}
    runs = {}
    for name, variant in variants():
        loss, step, args = make(module, variant, x, y)
        compiled = step.lower(*args).compile()
        res = residual_bytes(loss, args[0])
        rows[name] = {
            "residual_bytes": sum(res.values()),
            "residual_bytes_by_dtype": res,
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "fusion_bytes": fusion_bytes(compiled.as_text()),
        }
        if rounds and name in ("hand-written bfloat16", "mpjax O2 bfloat16"):
            harness.block(step(*args))
            runs[name] = lambda step=step, args=args: step(*args)
    result: dict[str, Any] = {"model": kind, "size": size, "rows": rows}
    if runs:
        times = harness.interleave(runs, rounds)
        result["o2_time_over_hand_bf16"] = harness.paired_ratio(
            times, "mpjax O2 bfloat16", "hand-written bfloat16"
        )
        result["rounds"] = rounds
    return result


TARGETS = (
    # (variant, baseline, metric, limit)
    *[(f"mpjax O2 {h}", f"hand-written {h}", m, 1.05)
      for h in ("bfloat16", "float16") for m in ("residual_bytes", "temp_bytes", "fusion_bytes")],
    *[(f"mpjax O2 {h}", "float32", "residual_bytes", 0.65) for h in ("bfloat16", "float16")],
    *[(f"mpjax O1 {h}", f"hand-written {h}", m, 1.15)
      for h in ("bfloat16", "float16") for m in ("residual_bytes", "temp_bytes", "fusion_bytes")],
)  # fmt: skip


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = result["rows"]
    out = []
    for variant, baseline, metric, limit in TARGETS:
        ratio = rows[variant][metric] / max(rows[baseline][metric], 1)
        out.append(
            {
                "target": f"{variant} {metric.replace('_', ' ')} <= {limit}x {baseline}",
                "ratio": ratio,
                "met": ratio <= limit,
            }
        )
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    f32, hand = rows["float32"], rows["hand-written bfloat16"]
    cells = []
    for name, r in rows.items():
        half = "float16" if "float16" in name and "bfloat16" not in name else "bfloat16"
        hw = rows[f"hand-written {half}"] if name != "float32" else hand
        by = ", ".join(f"{k} {v / MB:.1f}" for k, v in sorted(r["residual_bytes_by_dtype"].items()))
        cells.append(
            [
                name,
                f"{r['residual_bytes'] / MB:.1f}",
                by or "-",
                f"{r['residual_bytes'] / f32['residual_bytes']:.2f}",
                f"{r['residual_bytes'] / hw['residual_bytes']:.2f}",
                f"{r['temp_bytes'] / MIB:.1f}",
                f"{r['temp_bytes'] / hw['temp_bytes']:.2f}",
                f"{r['fusion_bytes'] / MIB:.0f}",
                f"{r['fusion_bytes'] / hw['fusion_bytes']:.2f}",
            ]
        )
    headers = [
        "variant",
        "residuals (MB)",
        "by dtype (MB)",
        "/ float32",
        "/ hand-written",
        "temp (MiB)",
        "/ hand-written",
        "fusion bytes (MiB)",
        "/ hand-written",
    ]
    text = f"### Memory: {result['model']} ({result['size']}: {_config(result)})\n\n"
    text += harness.table(headers, cells)
    text += "\n\n'/ hand-written' compares with the hand-written step in the same half dtype.\n\n"
    t = targets(result)
    if "o2_time_over_hand_bf16" in result:
        r = result["o2_time_over_hand_bf16"]
        t.append(
            {
                "target": "mpjax O2 bfloat16 step time <= 1.03x hand-written "
                f"(median of {result['rounds']} paired rounds)",
                "ratio": r,
                "met": r <= 1.03,
            }
        )
    text += harness.table(
        ["target", "met", "measured"],
        [[x["target"], "yes" if x["met"] else "NO", f"{x['ratio']:.3f}"] for x in t],
    )
    return text


def _config(result: dict[str, Any]) -> str:
    spec = SIZES[result["model"]][result["size"]]
    if result["model"] == "transformer":
        names = ("d_model", "layers", "heads", "seq", "batch")
    else:
        names = ("widths", "batch", "side")
    return ", ".join(f"{n} {v}" for n, v in zip(names, spec))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*SIZES, "all"], default="all")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--rounds", type=int, default=20, help="paired timing rounds (0: none)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    kinds = list(SIZES) if args.model == "all" else [args.model]
    results = [measure(kind, args.size, args.rounds) for kind in kinds]
    for r in results:
        r["targets"] = targets(r)
        r["markdown"] = markdown(r)
        print(r["markdown"] + "\n")
    out = {"machine": harness.machine(), "results": results}
    harness.write(args.json, out)
    return out


if __name__ == "__main__":
    main()
