"""Mixed-precision inference: train the digits CNN in float32, convert it for half inference,
export it with jax.export, and run it in a fresh process that has none of the model's code.

Prints, for O2 float16 and O2 bfloat16, the params' size on disk against the float32 export,
and the test accuracy against the float32 model's.

    python examples/export_digits.py --epochs 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import CNN, cross_entropy, load_data  # noqa: E402

import mpjax  # noqa: E402
import mpjax.export  # noqa: E402

# What the fresh process runs: numpy and mpjax.export, no model code.
PREDICT = """
import sys, numpy as np, mpjax.export
predict = mpjax.export.load(sys.argv[1])
np.save(sys.argv[3], np.asarray(predict(np.load(sys.argv[2])), np.float32))
"""


def train_f32(epochs: int, data, seed: int = 0):
    x_train, _, y_train, _ = data
    model = CNN()
    variables = model.init(jax.random.key(seed), x_train[:1])
    params, stats = variables["params"], variables["batch_stats"]
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, stats, opt_state, x, y):
        def loss_fn(p):
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return cross_entropy(logits, y), new["batch_stats"]

        grads, stats = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state

    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for s in range(len(x_train) // 64):
            idx = order[s * 64 : (s + 1) * 64]
            params, stats, opt_state = step(params, stats, opt_state, x_train[idx], y_train[idx])
    return model, {"params": params, "batch_stats": stats}


def predict_in_fresh_process(directory: str, x: np.ndarray) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        x_path, out_path = os.path.join(tmp, "x.npy"), os.path.join(tmp, "out.npy")
        np.save(x_path, x)
        subprocess.run([sys.executable, "-c", PREDICT, directory, x_path, out_path], check=True)
        return np.load(out_path)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default=None, help="where to write the exports (default: temp)")
    args = parser.parse_args(argv)
    data = load_data()
    _, x_test, _, y_test = data
    model, variables = train_f32(args.epochs, data)
    reference = np.asarray(model.apply(variables, x_test))
    out = args.out or tempfile.mkdtemp()
    results = []
    for level, half in [("O0", "float32"), ("O2", "float16"), ("O2", "bfloat16")]:
        policy = mpjax.Policy.from_level(level, None if half == "float32" else half)
        converted = mpjax.export.convert(model.apply, variables, policy, x_test)
        path = os.path.join(out, f"digits_{level}_{half}")
        summary = mpjax.export.save(path, model.apply, converted, x_test, policy=policy)
        logits = predict_in_fresh_process(path, np.asarray(x_test))
        rel = float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))
        acc = float(np.mean(np.argmax(logits, -1) == y_test))
        results.append(
            {"export": f"{level} {half}", "params_bytes": summary["params_bytes"],
             "dtypes": summary["dtypes"], "rel_error": rel, "test_accuracy": acc}
        )  # fmt: skip
    base = results[0]
    f32_acc = float(np.mean(np.argmax(reference, -1) == y_test))
    print(f"float32 model: test accuracy {100 * f32_acc:.2f}%\n")
    print("| export | params on disk | vs float32 | logits rel. error | test accuracy | change |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['export']} | {r['params_bytes'] / 1024:.1f} KiB | "
            f"{r['params_bytes'] / base['params_bytes']:.2f} | {r['rel_error']:.2e} | "
            f"{100 * r['test_accuracy']:.2f}% | "
            f"{100 * (r['test_accuracy'] - base['test_accuracy']):+.2f} pt |"
        )
    return results


if __name__ == "__main__":
    main()
