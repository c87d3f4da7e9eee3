"""SimpleNet, the PaddlePaddle AMP tutorial's model (nine Linear layers, MSE loss, SGD), at
every level, side by side with a hand-written jmp O2 step and torch.amp (when installed).

All variants run in one process, interleaved round by round; the table reports the median
step time, the paired ratio to O0 (JAX's default matmul precision), achieved TFLOP/s, the
share of a measured matmul peak (bfloat16 on a GPU, float32 on a CPU), compiled memory, and
the targets, each met or not with its number.

    python benchmarks/simplenet.py                      # CPU-sized default
    python benchmarks/simplenet.py --size paper         # 8192 wide, batch 2048 (the tutorial)
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import mpjax  # noqa: E402

SIZES = {"tiny": (64, 32), "small": (512, 256), "medium": (2048, 512), "paper": (8192, 2048)}
DEPTH = 9
LR = 1e-4
HAND_BF16 = "hand-written bfloat16 (.astype)"


def init(key, width: int):
    keys = jax.random.split(key, DEPTH)
    return [
        {"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)}
        for k in keys
    ]


def simplenet(params, x):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def mse(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def mpjax_step(policy_or_precision, params, x, y):
    """The design card's step: autocast model, chain(loss_scale, sgd), jitted."""
    if isinstance(policy_or_precision, str):  # O0 at a matmul precision
        policy = mpjax.Policy.from_level("O0")
        precision = policy_or_precision
    else:
        policy, precision = policy_or_precision, "default"
    model = mpjax.autocast(simplenet, policy)
    tx = optax.chain(mpjax.loss_scale(scale=policy.loss_scale()), optax.sgd(LR))
    params = jax.tree_util.tree_map(jnp.copy, policy.cast_to_param(params))  # donated below

    def step(params, opt_state, x, y):
        scale = mpjax.get_loss_scale(opt_state)
        with jax.default_matmul_precision(precision):
            grads = jax.grad(lambda p: scale.scale(mse(model(p, x), y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, x, y

    return jax.jit(step, donate_argnums=(0, 1)), (params, tx.init(params), x, y)


def astype_step(params, x, y, dtype=jnp.bfloat16):
    """The hand-written half step a JAX expert writes: float32 params, the params and inputs
    cast with ``.astype`` inside the loss, plain SGD (bfloat16 needs no loss scale)."""

    def step(params, x, y):
        def loss_fn(p):
            half = jax.tree_util.tree_map(lambda a: a.astype(dtype), p)
            return mse(simplenet(half, x.astype(dtype)), y)

        grads = jax.grad(loss_fn)(params)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads), x, y

    params = jax.tree_util.tree_map(jnp.copy, params)  # donated below
    return jax.jit(step, donate_argnums=(0,)), (params, x, y)


def jmp_step(params, x, y):
    """The peer: O2 written by hand with jmp (policy casts, DynamicLossScale, select_tree)."""
    import jmp

    policy = jmp.get_policy("p=f32,c=f16,o=f32")
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15))

    def step(params, loss_scale, x, y):
        def loss_fn(p):
            out = policy.cast_to_output(
                simplenet(policy.cast_to_compute(p), policy.cast_to_compute(x))
            )
            return loss_scale.scale(mse(out, y))

        grads = loss_scale.unscale(jax.grad(loss_fn)(params))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        new = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
        return jmp.select_tree(finite, new, params), loss_scale, x, y

    params = jax.tree_util.tree_map(jnp.copy, params)  # donated below
    return jax.jit(step, donate_argnums=(0,)), (params, loss_scale, x, y)


def torch_steps(width: int, batch: int, seed: int):
    """torch.amp autocast + GradScaler on the same device (float16 and bfloat16), and float32,
    each warmed up; with the peak device memory each one's model, optimizer and first steps
    allocated (MiB, on a GPU)."""
    try:
        import torch
    except ImportError:
        return {}, None, {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    x = torch.randn(batch, width, device=device)
    y = torch.randn(batch, width, device=device)

    def make(dtype):
        layers = []
        for i in range(DEPTH):
            layers.append(torch.nn.Linear(width, width))
            if i < DEPTH - 1:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)

        def step():
            with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    def sync(_):
        if device == "cuda":
            torch.cuda.synchronize()

    steps, memory = {}, {}
    dtypes = {"torch float32": torch.float32, "torch.amp float16": torch.float16}
    for name, dtype in {**dtypes, "torch.amp bfloat16": torch.bfloat16}.items():
        base = torch.cuda.memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps[name] = make(dtype)
        for _ in range(2):  # warm up (the second step has the optimizer's state)
            steps[name]()
        if device == "cuda":
            sync(None)
            memory[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return steps, sync, memory


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="small")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed call")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    width, batch = SIZES[args.size]
    key = jax.random.key(0)
    params = init(key, width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    y = jax.random.normal(jax.random.key(2), (batch, width))
    flops = 2 * batch * width * width * (3 * DEPTH - 1)  # forward, weight and input grads

    variants, states, memory = {}, {}, {}
    builders = [
        (name, lambda p=p: mpjax_step(p, params, x, y)) for name, p in harness.level_variants()
    ]
    builders.append((HAND_BF16, lambda: astype_step(params, x, y)))
    try:
        import jmp  # noqa: F401

        builders.append(("jmp O2 float16 (hand-written)", lambda: jmp_step(params, x, y)))
    except ImportError:
        print("jmp not installed: its variant is left out")
    for name, build in builders:
        step, state = build()
        step, memory[name] = harness.compile_once(step, *state)
        state = step(*state)  # compile, and warm up
        harness.block(state)
        states[name] = state

        def run(name=name, step=step):
            for _ in range(args.steps):
                states[name] = step(*states[name])
            return states[name]

        variants[name] = run
    torch_names: list[str] = []
    torch_memory: dict[str, float] = {}
    sync = harness.block
    if not args.no_torch:
        torch_runs, torch_sync, torch_memory = torch_steps(width, batch, 0)
        for name, run in torch_runs.items():
            variants[name] = lambda r=run: [r() for _ in range(args.steps)]
            torch_names.append(name)
        if torch_runs:

            def sync(out):  # noqa: F811 - JAX and torch variants in the same rounds
                harness.block(out)
                torch_sync(out)

    times = harness.interleave(variants, args.rounds, sync)
    times = {k: [t / args.steps for t in v] for k, v in times.items()}
    torch_times = {k: times.pop(k) for k in torch_names}
    if torch_times:
        torch_times = {**torch_times, "O0 default": times["O0 default"]}

    gpu = jax.default_backend() == "gpu"
    peak_dtype = jnp.bfloat16 if gpu else jnp.float32
    peak = harness.matmul_peak_tflops(peak_dtype, 8192 if gpu else 1024)
    peak_label = f"measured {'bf16' if gpu else 'f32'} matmul peak ({peak:.2f} TFLOP/s)"
    rows, text = harness.report(
        f"SimpleNet {width} wide, batch {batch}, {DEPTH} Linear layers",
        times, flops, memory, "O0 default", peak, peak_label,
    )  # fmt: skip
    torch_rows, torch_text = [], ""
    if torch_times:
        # torch runs in the same rounds as JAX, so its ratios to JAX's O0 are paired too.
        torch_rows, torch_text = harness.report(
            "torch on the same device (interleaved with the JAX variants)",
            torch_times, flops, torch_memory, "O0 default", peak, peak_label,
        )  # fmt: skip

    def ratio(a, b):
        return harness.paired_ratio(times, a, b)

    overhead = ratio("O2 float16", "O2 float16 no scaling") - 1
    targets = [
        (
            f"loss-scale overhead <= {'1' if gpu else '3'}% of step time",
            overhead <= (0.01 if gpu else 0.03),
            f"{100 * overhead:+.1f}% (O2 float16 dynamic vs no scaling)",
        )
    ]
    if "jmp O2 float16 (hand-written)" in times:
        r = ratio("O2 float16", "jmp O2 float16 (hand-written)")
        targets.append(
            ("mpjax O2 no slower than hand-written jmp (ratio <= 1.0)", r <= 1.0, f"{r:.3f}")
        )
    r = ratio("O2 bfloat16", HAND_BF16)
    targets.append(("mpjax O2 bf16 within 1.03x of the hand-written bf16 step", r <= 1.03,
                    f"{r:.3f}"))  # fmt: skip
    o2bf = next(row for row in rows if row["variant"] == "O2 bfloat16")
    if gpu:
        targets.append(("O2 bf16 >= 75% of measured bf16 peak", o2bf["share_of_peak"] >= 0.75,
                        f"{100 * o2bf['share_of_peak']:.1f}%"))  # fmt: skip
        s_high = 1 / ratio("O2 bfloat16", "O0 highest")
        targets.append(("O2 bf16 >= 8x faster than O0 highest", s_high >= 8, f"{s_high:.2f}x"))
        s_def = 1 / ratio("O2 bfloat16", "O0 default")
        targets.append(
            ("O2 bf16 >= 1.5x faster than O0 default (TF32)", s_def >= 1.5, f"{s_def:.2f}x")
        )
    if torch_times:
        both = {**times, **torch_times}
        amps = ("torch.amp bfloat16", "torch.amp float16")
        best_amp = min(amps, key=lambda k: np.median(both[k]))
        best_ours = min(("O2 bfloat16", "O2 float16"), key=lambda k: np.median(both[k]))
        r = harness.paired_ratio(both, best_ours, best_amp)
        targets.append(
            (f"mpjax {best_ours} faster than {best_amp} (paired ratio < 1)", r < 1, f"{r:.3f}")
        )
        if gpu:
            r = harness.paired_ratio(both, "O2 bfloat16", "torch.amp float16")
            targets.append(("mpjax O2 bf16 <= 0.8x torch.amp float16 + GradScaler", r <= 0.8,
                            f"{r:.3f}"))  # fmt: skip
            r = harness.paired_ratio(both, "O2 bfloat16", "torch.amp bfloat16")
            targets.append(("mpjax O2 bf16 no slower than torch bfloat16 autocast", r <= 1.0,
                            f"{r:.3f}"))  # fmt: skip
    target_text = harness.table(
        ["target", "met", "measured"], [[t, "yes" if ok else "NO", m] for t, ok, m in targets]
    )
    info = harness.machine()
    print(f"{info['device']} ({info['backend']}), jax {info['jax']}; ", end="")
    print(f"{args.rounds} rounds of {args.steps} steps\n")
    print(text)
    if torch_text:
        print("\n" + torch_text)
    print("\n### Targets\n\n" + target_text)
    result = {
        "benchmark": "simplenet",
        "machine": info,
        "config": vars(args) | {"width": width, "batch": batch, "depth": DEPTH},
        "flops_per_step": flops,
        "peak_tflops": peak,
        "rows": rows,
        "torch_rows": torch_rows,
        "targets": [{"target": t, "met": ok, "measured": m} for t, ok, m in targets],
        "markdown": text + ("\n\n" + torch_text if torch_text else "") + "\n\n" + target_text,
    }
    harness.write(args.json, result)
    return result


if __name__ == "__main__":
    main()
