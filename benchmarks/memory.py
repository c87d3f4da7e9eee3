"""What mixed precision saves, measured exactly: residual bytes, compiled temp memory, bytes
moved by fusions and FLOPs of a full train step, for float32, the hand-written half steps and
mpjax's levels, on four models: a GPT-style Transformer LM, an encoder-decoder Transformer (as
Flax's WMT example), a ResNet with BatchNorm and an LSTM tagger (``nn.RNN``, a scan).

    python benchmarks/memory.py --rounds 0          # all four models (~15 min on 2 CPU cores)
    python benchmarks/memory.py --model lstm --size tiny --rounds 0

(The LSTM needs an ``nn.RNN`` that runs on the installed JAX: Flax 0.11.0's fails on JAX 0.6.0,
with or without mpjax.)

Four counts per variant, none of them a timing:

- residuals: the bytes reverse-mode AD saves for the backward pass of the loss (from the
  jaxpr, by dtype; arguments themselves not counted);
- temp: ``compiled.memory_analysis().temp_size_in_bytes`` of the jitted train step;
- fusion bytes: for every fusion, dot, convolution and other kernel in the optimized HLO, the
  bytes of its operands and results (what the kernels read and write);
- FLOPs: XLA's count for the compiled step (``compiled.cost_analysis()``), which shows what
  recomputing autocast's float32 islands in the backward pass costs.

Two yardsticks, the hand-written half steps Flax users write: ``.astype`` (params and float
inputs cast by hand, logits cast to float32 for the loss) and ``dtype=`` (the model built with
``dtype=half`` and float32 params, as Flax's examples do), each with Flax's ``DynamicScale`` for
float16 and plain adam for bfloat16. mpjax's rows wrap the float32 model with
``mpjax.flax.wrap`` and use ``mpjax.loss_scale(adam, scale=policy.loss_scale())``; two more rows
put mpjax.loss_scale's two forms on the ``dtype=`` float16 model in place of DynamicScale. The
targets compare each level with the better of the two hand-written steps. With ``--rounds N``
the CPU step time of mpjax O2 is also compared with the ``dtype=`` step, interleaved in one
process (median of N paired ratios).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import sys
import warnings
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

# transformer, encdec: (width, depth, heads, seq, batch); resnet, cnn: (widths, batch, side);
# lstm: (width, seq, batch); gpt: (vocab, width, depth, heads, seq, batch)
SIZES = {
    "transformer": {"tiny": (32, 2, 2, 16, 4), "small": (256, 8, 4, 128, 16)},
    "encdec": {"tiny": (32, 1, 2, 16, 4), "small": (256, 4, 4, 64, 16)},
    "resnet": {"tiny": ((8, 16), 4, 8), "small": ((32, 64, 128), 32, 32)},
    "lstm": {"tiny": (32, 16, 4), "small": (256, 64, 32)},
    # The GPU-cost issue's models, which no benchmark tunes for: a GPT-style LM with a large
    # vocabulary (d_model 4096 on a GPU, d_model 1024 on a TPU) and a CNN with BatchNorm in
    # training mode (100 classes, 64x64 images).
    "gpt": {"tiny": (512, 32, 1, 2, 16, 4), "tpu": (4096, 1024, 4, 16, 512, 8),
            "large": (32768, 4096, 2, 32, 2048, 2),
            # the fused-attention issue's: 16 heads of 128 over 4096 tokens
            "attention": (8192, 2048, 2, 16, 4096, 1)},
    "cnn": {"tiny": ((8, 16), 4, 8), "small": ((64, 128, 256), 64, 64)},
}  # fmt: skip
# The models "--model all" measures (the cost issue's two run in the GPU and TPU programs).
MEASURED = ("transformer", "encdec", "resnet", "lstm")


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


def flops(compiled: Any) -> float:
    """XLA's count of the floating-point operations of a compiled step (0 if it has none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    return float((cost or {}).get("flops", 0.0))


# -- the train steps ----------------------------------------------------------------------------

VOCAB, TAGS = 1024, 32


def build(kind: str, size: str) -> tuple[Any, Any, Any]:
    """(float32 Flax module with a ``dtype`` field, inputs, integer labels) for one model."""
    key_x, key_y = jax.random.key(1), jax.random.key(2)
    if kind in ("resnet", "cnn"):
        widths, batch, side = SIZES[kind][size]
        x = jax.random.normal(key_x, (batch, side, side, 3))
        if kind == "cnn":
            return models.BNCNN(widths), x, jax.random.randint(key_y, (batch,), 0, 100)
        return models.ResNet(widths), x, jax.random.randint(key_y, (batch,), 0, 10)
    if kind == "gpt":
        vocab, width, depth, heads, seq, batch = SIZES[kind][size]
        tokens = jax.random.randint(key_x, (batch, seq), 0, vocab)
        return models.TransformerLM(vocab, width, depth, heads), tokens, jnp.roll(tokens, -1, 1)
    if kind == "lstm":
        width, seq, batch = SIZES[kind][size]
        tokens = jax.random.randint(key_x, (batch, seq), 0, VOCAB)
        tags = jax.random.randint(key_y, (batch, seq), 0, TAGS)
        return models.LSTMTagger(VOCAB, width, TAGS), tokens, tags
    width, depth, heads, seq, batch = SIZES[kind][size]
    if kind == "transformer":
        tokens = jax.random.randint(key_x, (batch, seq), 0, VOCAB)
        return models.TransformerLM(VOCAB, width, depth, heads), tokens, jnp.roll(tokens, -1, 1)
    pairs = jax.random.randint(key_x, (batch, 2, seq), 0, VOCAB)  # (source, target) pairs
    return models.EncoderDecoder(VOCAB, width, depth, heads), pairs, pairs[:, 1]


def lookup_elements(module: Any, x: Any) -> int:
    """How many elements `module`'s embedding tables hold: mpjax sums a lookup's gradient in
    float32 where the hand-written step sums it in half, 8 bytes per element as the programs
    count it (float32 zeros, the scatter's operand and result, the update's read)."""
    params = jax.eval_shape(module.init, jax.random.key(0), x)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return sum(a.size for path, a in leaves if "embedding" in jax.tree_util.keystr(path))


def half_tree(tree: Any, dtype: Any) -> Any:
    """`tree` with its float leaves cast with ``.astype(dtype)``, as a hand-written step does."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the step. `form`: "policy" (mpjax.flax.wrap of the float32 module),
    "astype" (params and inputs cast by hand) or "dtype" (the module built with ``dtype=half``,
    ``param_dtype`` float32, as Flax's examples do). `scaling`: "flax" (Flax's DynamicScale,
    the examples' float16 recipe), "wrap" / "chain" (the two forms of mpjax.loss_scale),
    "apply_if_finite" (optax's exact skip around adam) or "none" (plain adam)."""

    form: str
    half: Any = None
    policy: Any = None
    scaling: str = "none"


HALVES = ("bfloat16", "float16")


def variants() -> list[tuple[str, Variant]]:
    """(name, variant) for every variant measured."""
    out = [("float32", Variant("policy", policy=mpjax.Policy.from_level("O0")))]
    for h in HALVES:
        scaling = "flax" if h == "float16" else "none"
        out.append((f"hand-written {h} (.astype)", Variant("astype", jnp.dtype(h), None, scaling)))
        out.append((f"hand-written {h} (dtype=)", Variant("dtype", jnp.dtype(h), None, scaling)))
    for level in ("O1", "O2", "O3"):
        for h in HALVES:
            policy = mpjax.Policy.from_level(level, h)
            out.append((f"mpjax {level} {h}", Variant("policy", jnp.dtype(h), policy, "wrap")))
    # Loss scaling alone, like for like: the dtype= float16 model, mpjax.loss_scale in place of
    # Flax's DynamicScale.
    for scaling in ("wrap", "chain"):
        out.append(
            (f"dtype= float16, loss_scale {scaling} form",
             Variant("dtype", jnp.dtype("float16"), None, scaling))
        )  # fmt: skip
    return out


def make(module: Any, v: Variant, x: Any, y: Any) -> tuple[Any, Any, Any]:
    """(loss of params, jitted train step, its arguments) for one variant."""
    if v.form == "policy":
        model = mpjax.flax.wrap(module, v.policy)
    elif v.form == "dtype":
        model = module.clone(dtype=v.half)
    else:
        model = module
    variables = model.init(jax.random.key(0), x)
    params = variables["params"]
    stats = variables.get("batch_stats")

    def loss_fn(p: Any, stats: Any, x: Any) -> Any:
        if v.form == "astype":  # what a JAX expert writes: params and float inputs cast
            p, x = half_tree(p, v.half), half_tree(x, v.half)
        if stats is None:
            logits, new_stats = model.apply({"params": p}, x), None
        else:
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, x, mutable=["batch_stats"]
            )
            new_stats = new["batch_stats"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss.mean(), new_stats

    def loss_of_params(p: Any) -> Any:
        return loss_fn(p, stats, x)[0]

    # float16 params (O3) keep Adam's moments in float16, where the default eps=1e-8 is 0.
    half16 = v.policy is not None and v.policy.param_dtype == jnp.float16
    adam = optax.adam(1e-3, eps=1e-4 if half16 else 1e-8)
    if v.scaling == "flax":  # Flax's examples (ImageNet, WMT) with half_precision on a GPU
        from flax.training import dynamic_scale

        def flax_step(params: Any, stats: Any, opt_state: Any, ds: Any, x: Any) -> Any:
            grad_fn = ds.value_and_grad(lambda p: loss_fn(p, stats, x), has_aux=True)
            ds, is_fin, (_, new_stats), grads = grad_fn(params)
            updates, new_opt = adam.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            keep = lambda new, old: jax.tree.map(functools.partial(jnp.where, is_fin), new, old)
            return keep(new_params, params), new_stats, keep(new_opt, opt_state), ds

        ds = dynamic_scale.DynamicScale()
        return loss_of_params, jax.jit(flax_step), (params, stats, adam.init(params), ds, x)

    if v.scaling == "none":
        tx = adam
    elif v.scaling == "apply_if_finite":  # optax's exact skip, no loss scale: the yardstick
        tx = optax.apply_if_finite(adam, max_consecutive_errors=2**30)
    else:
        scale = v.policy.loss_scale() if v.policy is not None else mpjax.DynamicLossScale(2.0**15)
        if v.scaling == "wrap":
            tx = mpjax.loss_scale(adam, scale=scale)
        else:  # adam after loss_scale() in a chain: warned about (inexact skips), same memory
            tx = optax.chain(mpjax.loss_scale(scale=scale), adam)

    def step(params: Any, stats: Any, opt_state: Any, x: Any) -> Any:
        if v.scaling in ("none", "apply_if_finite"):
            grads, new_stats = jax.grad(lambda p: loss_fn(p, stats, x), has_aux=True)(params)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mpjax.InexactSkipWarning)
                s = mpjax.get_loss_scale(opt_state)
            scaled = lambda p: (lambda out: (s.scale(out[0]), out[1]))(loss_fn(p, stats, x))
            grads, new_stats = jax.grad(scaled, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state

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
            "flops": flops(compiled),
        }
        if rounds and name in ("hand-written bfloat16 (dtype=)", "mpjax O2 bfloat16"):
            harness.block(step(*args))
            runs[name] = lambda step=step, args=args: step(*args)
    result: dict[str, Any] = {"model": kind, "size": size, "rows": rows}
    if runs:
        times = harness.interleave(runs, rounds)
        result["o2_time_over_hand_bf16"] = harness.paired_ratio(
            times, "mpjax O2 bfloat16", "hand-written bfloat16 (dtype=)"
        )
        result["rounds"] = rounds
    return result


METRICS = ("residual_bytes", "temp_bytes", "fusion_bytes")
# (level, metric) -> the most it may be of the better hand-written step in the same half
LIMITS = {
    **{("O2", m): x for m, x in zip(METRICS, (1.00, 1.03, 1.05))},
    **{("O1", m): x for m, x in zip(METRICS, (1.10, 1.10, 1.15))},
}


def hand_written(rows: dict[str, Any], half: str, metric: str) -> tuple[str, float]:
    """The hand-written form (.astype or dtype=) that does better on `metric`, and its value."""
    forms = [f"hand-written {half} (.astype)", f"hand-written {half} (dtype=)"]
    best = min(forms, key=lambda f: rows[f][metric])
    return best, rows[best][metric]


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = result["rows"]
    out = []
    for (level, metric), limit in LIMITS.items():
        for half in HALVES:
            base, value = hand_written(rows, half, metric)
            ratio = rows[f"mpjax {level} {half}"][metric] / max(value, 1)
            out.append(
                {
                    "target": f"mpjax {level} {half} {metric.replace('_', ' ')} <= {limit:.2f}x "
                    f"the better hand-written ({base[len('hand-written ') :]})",
                    "ratio": ratio,
                    "met": ratio <= limit + 5e-4,
                }
            )
    for form in ("wrap", "chain"):
        ratio = (
            rows[f"dtype= float16, loss_scale {form} form"]["temp_bytes"]
            / rows["hand-written float16 (dtype=)"]["temp_bytes"]
        )
        out.append(
            {
                "target": f"loss_scale {form} form temp <= 1.00x Flax's DynamicScale "
                "(dtype= float16 model)",
                "ratio": ratio,
                "met": ratio <= 1.0 + 5e-4,
            }
        )
    return out


def _ratios(row: dict[str, Any], bases: tuple[dict[str, Any], ...], metric: str) -> list[str]:
    """`row`'s `metric` over each base row's, as table cells."""
    return [f"{row[metric] / base[metric]:.2f}" for base in bases]


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    f32 = rows["float32"]
    cells = []
    for name, r in rows.items():
        half = "float16" if "float16" in name and "bfloat16" not in name else "bfloat16"
        astype = rows[f"hand-written {half} (.astype)"]
        dtype_ = rows[f"hand-written {half} (dtype=)"]
        by = ", ".join(f"{k} {v / MB:.1f}" for k, v in sorted(r["residual_bytes_by_dtype"].items()))
        ratios = functools.partial(_ratios, r, (astype, dtype_))
        cells.append(
            [
                name,
                f"{r['residual_bytes'] / MB:.1f}",
                by or "-",
                f"{r['residual_bytes'] / f32['residual_bytes']:.2f}",
                *ratios("residual_bytes"),
                f"{r['temp_bytes'] / MIB:.1f}",
                *ratios("temp_bytes"),
                f"{r['fusion_bytes'] / MIB:.0f}",
                *ratios("fusion_bytes"),
                f"{r['flops'] / 1e9:.2f}",
                f"{r['flops'] / max(dtype_['flops'], 1):.2f}",
            ]
        )
    headers = [
        "variant",
        "residuals (MB)",
        "by dtype (MB)",
        "/ float32",
        "/ .astype",
        "/ dtype=",
        "temp (MiB)",
        "/ .astype",
        "/ dtype=",
        "fusion bytes (MiB)",
        "/ .astype",
        "/ dtype=",
        "GFLOP",
        "/ dtype=",
    ]
    text = f"#### {result['model']} ({result['size']}: {_config(result)})\n\n"
    text += harness.table(headers, cells)
    text += (
        "\n\n'/ .astype' and '/ dtype=' compare with the two hand-written steps in the same half "
        "dtype (float32 rows: with bfloat16's).\n\n"
    )
    t = targets(result)
    if "o2_time_over_hand_bf16" in result:
        r = result["o2_time_over_hand_bf16"]
        t.append(
            {
                "target": "mpjax O2 bfloat16 step time <= 1.03x hand-written (dtype=) "
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
    names = {
        "resnet": ("widths", "batch", "side"),
        "cnn": ("widths", "batch", "side"),
        "lstm": ("width", "seq", "batch"),
        "gpt": ("vocab", "d_model", "layers", "heads", "seq", "batch"),
    }.get(result["model"], ("d_model", "layers", "heads", "seq", "batch"))
    return ", ".join(f"{n} {v}" for n, v in zip(names, spec))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*SIZES, "all"], default="all")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--rounds", type=int, default=20, help="paired timing rounds (0: none)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    kinds = list(MEASURED) if args.model == "all" else [args.model]
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
