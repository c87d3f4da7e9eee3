"""Writes the GPU's HLO for the steps RESULTS.md's GPU notes compare, to read them off the GPU.

    python benchmarks/gpu_dump.py --out gpu_out     # on the GPU machine: gpu_out/hlo.tar.gz

For the Transformer LM and the ResNet (``models.py --size gpu``) it compiles the mpjax O2
bfloat16 step, the hand-written ``dtype=`` step and the FP8 step, and stores each one's HLO
before XLA's passes (``lower().as_text()``) and after them (``compile().as_text()``), plus
SimpleNet's O2 bfloat16 and hand-written steps, so the differences in fusions, reductions
and gemm custom-calls can be counted on any machine.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def steps(size: str, simplenet_size: str):
    import jax
    import models
    import simplenet

    import mpjax

    o2 = mpjax.Policy.from_level("O2", "bfloat16")
    for kind in ("transformer", "resnet"):
        module, x, y, _ = models.build(kind, size)
        for name, variant in (("o2_bf16", o2), ("hand_bf16", models.HAND_BF16),
                              ("fp8", models.FP8)):  # fmt: skip
            yield f"{kind}_{name}", models.make_step(kind, module, variant, x, y)
    width, batch = simplenet.SIZES[simplenet_size]
    params = simplenet.init(jax.random.key(0), width)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    y = jax.random.normal(jax.random.key(2), (batch, width))
    yield "simplenet_o2_bf16", simplenet.mpjax_step(o2, params, x, y)
    yield "simplenet_hand_bf16", simplenet.astype_step(params, x, y)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_out")
    parser.add_argument("--size", default="gpu", help="Transformer/ResNet size")
    parser.add_argument("--simplenet-size", default="paper")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with tarfile.open(os.path.join(args.out, "hlo.tar.gz"), "w:gz") as tar:
        for name, (step, state) in steps(args.size, args.simplenet_size):
            lowered = step.lower(*state)
            for suffix, text in (("before", lowered.as_text()),
                                 ("after", lowered.compile().as_text())):  # fmt: skip
                data = text.encode()
                info = tarfile.TarInfo(f"{name}.{suffix}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            print(name, "written", flush=True)


if __name__ == "__main__":
    main()
