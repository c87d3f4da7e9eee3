"""GPU probes behind RESULTS.md's GPU notes: does half precision's overflow stay visible when
XLA may keep excess precision, and which FP8 formulation reaches cuBLAS's FP8 gemm.

    python benchmarks/gpu_probe.py --out DIR                 # runs both XLA settings
    python benchmarks/gpu_probe.py --out DIR --child         # one setting (this process)

For each setting of ``--xla_allow_excess_precision`` (XLA's default, true, and false) it
prints: whether ``x.astype(bfloat16).astype(float32)`` rounds; whether a float16 product that
overflows shows as inf, written by hand and under mpjax O3 float16, and whether
``mpjax.all_finite`` sees it; and, for an 8192^3 matmul, the time and the gemm custom-calls of
a bfloat16 dot, of mpjax's quantize-dequantize FP8 dot, and of a dot taking the FP8 operands
directly (the dequantizing scales applied to its float32 output). It also writes the optimized
HLO of SimpleNet's O2 bfloat16 step and of the hand-written bfloat16 step to DIR.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _time(fn, *args, repeats=20):
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def _gemms(fn, *args):
    text = fn.lower(*args).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]*(?:gemm|matmul)[^"]*)"', text)
    f8 = len(re.findall(r"f8e4m3fn\[|f8e5m2\[", text))
    return sorted(set(targets)), f8


def child(out: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mpjax
    import mpjax.fp8

    flags = os.environ.get("XLA_FLAGS", "(default)")
    print(f"\n#### XLA_FLAGS={flags}")
    v = jax.random.normal(jax.random.key(3), (2**20,), jnp.float32) * 1.001
    pair = jax.jit(lambda v: v.astype(jnp.bfloat16).astype(jnp.float32) * 3.0)(v)
    want = np.asarray(v.astype(jnp.bfloat16)).astype(np.float32) * np.float32(3.0)
    print("cast pair rounds:", bool(np.array_equal(np.asarray(pair), want)))

    x = jnp.full((1024,), 300.0, jnp.float32)

    def prog(x):
        return jnp.sum((x * x) / 1000.0)

    hand = jax.jit(lambda x: prog(x.astype(jnp.float16)).astype(jnp.float32))(x)
    o3 = jax.jit(mpjax.autocast(prog, mpjax.Policy.from_level("O3", "float16")))(x)
    fin = jax.jit(lambda x: mpjax.all_finite(x.astype(jnp.float16) * x.astype(jnp.float16)))(x)
    print(f"f16 overflow (300*300) by hand: {float(hand)}; mpjax O3: {float(o3)}; "
          f"all_finite sees it: {not bool(fin)}")  # fmt: skip

    n = 8192 if jax.default_backend() == "gpu" else 256
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    scale = jnp.ones(3, jnp.float32)
    bf16 = jax.jit(lambda a, b: a @ b)

    def qdq_dot(a, b):
        return mpjax.fp8.fp8_dot_general(dims, None, None, a, b, scale, jnp.zeros(3))

    def direct(a, b):
        sa, sb = jnp.float32(1.0), jnp.float32(1.0)
        qa = jnp.clip(a.astype(jnp.float32) * sa, -448, 448).astype(jnp.float8_e4m3fn)
        qb = jnp.clip(b.astype(jnp.float32) * sb, -448, 448).astype(jnp.float8_e4m3fn)
        out = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
        return (out / (sa * sb)).astype(jnp.bfloat16)

    base = _time(bf16, a, b)
    print(f"bf16 dot: {1e3 * base:.3f} ms ({2 * n**3 / base / 1e12:.0f} TFLOP/s); "
          f"gemms {_gemms(bf16, a, b)}")  # fmt: skip
    for name, f in (("mpjax qdq FP8 dot", qdq_dot), ("direct FP8 dot", direct)):
        jf = jax.jit(f)
        t = _time(jf, a, b)
        err = float(jnp.linalg.norm((jf(a, b) - bf16(a, b)).astype(jnp.float32)) /
                    jnp.linalg.norm(bf16(a, b).astype(jnp.float32)))  # fmt: skip
        print(f"{name}: {1e3 * t:.3f} ms, {base / t:.2f}x bf16; rel err vs bf16 {err:.3g}; "
              f"gemms {_gemms(jf, a, b)}")  # fmt: skip
        g = jax.jit(jax.grad(lambda a, b, f=f: f(a, b).astype(jnp.float32).sum(), (0, 1)))
        tg = _time(g, a, b, repeats=10)
        gb = jax.jit(jax.grad(lambda a, b: (a @ b).astype(jnp.float32).sum(), (0, 1)))
        print(f"  forward+backward: {1e3 * tg:.3f} ms, {_time(gb, a, b, repeats=10) / tg:.2f}x "
              f"bf16; gemms {_gemms(g, a, b)}")  # fmt: skip

    if out and "false" not in flags:
        import simplenet

        width, batch = simplenet.SIZES["paper"]
        params = simplenet.init(jax.random.key(0), width)
        xs = jax.random.normal(jax.random.key(1), (batch, width))
        ys = jax.random.normal(jax.random.key(2), (batch, width))
        pol = mpjax.Policy.from_level("O2", "bfloat16")
        for name, (step, state) in {
            "simplenet_o2_bf16": simplenet.mpjax_step(pol, params, xs, ys),
            "simplenet_hand_bf16": simplenet.astype_step(params, xs, ys),
        }.items():
            with open(os.path.join(out, name + ".hlo.txt"), "w") as f:
                f.write(step.lower(*state).compile().as_text())


def fp8_candidates() -> None:
    """Forward + backward of one 8192^3 dot in FP8, four ways: which reach the FP8 gemm."""
    import functools

    import jax
    import jax.numpy as jnp

    import mpjax.fp8

    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    n = 8192 if jax.default_backend() == "gpu" else 256
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / 64
    dims = (((1,), (0,)), ((), ()))
    one = jnp.float32(1.0)

    def quant(x, dt, s):
        lim = float(jnp.finfo(dt).max)
        return jnp.clip(x.astype(jnp.float32) * s, -lim, lim).astype(dt)

    def dq(q, s):
        return q.astype(jnp.bfloat16) * (1 / s).astype(jnp.bfloat16)

    def make(barrier, direct):
        @jax.custom_vjp
        def f(a, b):
            return fwd(a, b)[0]

        def mm(x, y, sx, sy):  # x @ y from FP8 operands
            if direct:
                out = jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)
                return (out / (sx * sy)).astype(jnp.bfloat16)
            return dq(x, sx) @ dq(y, sy)

        def fwd(a, b):
            qa, qb = quant(a, e4, one), quant(b, e4, one)
            return mm(qa, qb, one, one), (qa, qb)

        def bwd(res, g):
            qa, qb = jax.lax.optimization_barrier(res) if barrier else res
            qg = quant(g, e5, one)
            return mm(qg, qb.T, one, one), mm(qa.T, qg, one, one)

        f.defvjp(fwd, bwd)
        return f

    def mpjax_dot(a, b):
        return mpjax.fp8.fp8_dot_general(dims, None, None, a, b, jnp.ones(3), jnp.zeros(3))

    def loss(f, a, b):
        return (f(a, b).astype(jnp.float32) * jnp.linspace(-1, 1, n)).sum()

    ref = jax.jit(jax.grad(functools.partial(loss, lambda a, b: a.astype(jnp.float32) @
                                             b.astype(jnp.float32)), (0, 1)))(a, b)  # fmt: skip
    gb = jax.jit(jax.grad(functools.partial(loss, lambda a, b: a @ b), (0, 1)))
    tb = _time(gb, a, b, repeats=10)
    print(f"\nbf16 forward+backward: {1e3 * tb:.3f} ms; gemms {_gemms(gb, a, b)}")
    for name, f in (("mpjax today", mpjax_dot), ("f8 residuals", make(False, False)),
                    ("f8 residuals + barrier", make(True, False))):  # fmt: skip
        # make(False, True), dots taking the FP8 operands directly, ran past 100 s on an H200
        # (JAX 0.11.2) in this program; its forward alone ran at 0.39x bf16 (child() above).
        g = jax.jit(jax.grad(functools.partial(loss, f), (0, 1)))
        try:
            t = _time(g, a, b, repeats=10)
            da, db = g(a, b)
            err = max(float(jnp.linalg.norm(x.astype(jnp.float32) - r) / jnp.linalg.norm(r))
                      for x, r in zip((da, db), ref))  # fmt: skip
            print(f"{name}: {1e3 * t:.3f} ms, {tb / t:.2f}x bf16; grad rel err {err:.3g}; "
                  f"gemms {_gemms(g, a, b)}")  # fmt: skip
        except Exception as e:  # noqa: BLE001
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}")


def fp8_why() -> None:
    """Which dots reach XLA's FP8 gemm: 2-D or 3-D operands, constant or run-time scales.

    Each case prints the gemm custom-call targets and the count of FP8-typed values left in
    the optimized HLO. (``TF_CPP_VMODULE=gemm_rewriter=1`` printed nothing from JAX 0.11's
    CUDA plugin on an H200, so the HLO is what says it.)
    """
    import jax
    import jax.numpy as jnp

    import mpjax.fp8

    gpu = jax.default_backend() == "gpu"
    b_, t, d, f = (8, 1024, 2048, 8192) if gpu else (2, 32, 64, 128)
    key = jax.random.key(0)
    x3 = jax.random.normal(key, (b_, t, d), jnp.bfloat16)
    x2 = x3.reshape(b_ * t, d)
    w2 = jax.random.normal(key, (d, f), jnp.bfloat16) / 64
    w3 = w2.reshape(d, 16, f // 16)
    cases = {
        "2-D x 2-D, constant scales": (x2, w2, (((1,), (0,)), ((), ())), True),
        "2-D x 2-D, run-time scales": (x2, w2, (((1,), (0,)), ((), ())), False),
        "3-D x 2-D (Dense), run-time scales": (x3, w2, (((2,), (0,)), ((), ())), False),
        "3-D x 3-D (DenseGeneral), run-time scales": (x3, w3, (((2,), (0,)), ((), ())), False),
    }
    for name, (a, b, dims, const) in cases.items():

        def loss(a, b, scale, dims=dims, const=const):
            s = jnp.ones(3) if const else scale
            y = mpjax.fp8.fp8_dot_general(dims, None, None, a, b, s, jnp.zeros(3))
            return y.astype(jnp.float32).sum()

        g = jax.jit(jax.grad(loss, (0, 1)))
        print(f"== {name}", flush=True)
        print(f"{name}: gemms {_gemms(g, a, b, jnp.ones(3))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="only the FP8 candidates")
    parser.add_argument("--fp8-why", action="store_true", help="which dots reach FP8 gemms")
    args = parser.parse_args()
    if args.fp8_why:
        fp8_why()
        return
    if args.fp8:
        fp8_candidates()
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(args.out)
        return
    for flags in (None, "--xla_allow_excess_precision=false"):
        env = dict(os.environ)
        if flags:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", args.out]
        subprocess.run(cmd, env=env, check=False)


if __name__ == "__main__":
    main()
