"""Runs every benchmark and writes benchmarks/RESULTS.md (and results.json beside it) with the
machine, versions and command that produced the numbers.

    python benchmarks/results.py                 # CPU-sized runs
    python benchmarks/results.py --size paper    # SimpleNet at the tutorial's size

On a GPU, `benchmarks/gpu.py` measures the GPU targets; its section of RESULTS.md is kept here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compile_overhead  # noqa: E402
import gpu  # noqa: E402
import harness  # noqa: E402
import loss_scale_overhead  # noqa: E402
import memory  # noqa: E402
import models  # noqa: E402
import quantized_state  # noqa: E402
import simplenet  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", help="SimpleNet size: small|medium|paper")
    parser.add_argument("--model-size", default="small", help="ResNet/Transformer: small|medium")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args(argv)
    command = "python benchmarks/results.py " + " ".join(argv if argv is not None else sys.argv[1:])
    sections, raw = [], {}

    r = simplenet.main(["--size", args.size, "--rounds", str(args.rounds)])
    raw["simplenet"] = r
    sections.append(r["markdown"])
    for kind in ("resnet", "transformer"):
        r = models.main(["--model", kind, "--size", args.model_size, "--rounds", str(args.rounds)])
        raw[kind] = r
        sections.append(r["markdown"])
    r = memory.main(["--rounds", str(2 * args.rounds)])
    raw["memory"] = r
    sections += [m["markdown"] for m in r["results"]]
    r = loss_scale_overhead.main(["--rounds", str(3 * args.rounds)])
    raw["loss_scale_overhead"] = r
    rows = [[k, f"{r['median_step_ms'][k]:.3f}", f"{v:.3f}"] for k, v in r["ratio_to_noop"].items()]
    sections.append(
        "### Loss-scaling overhead (4x512 MLP, O2 float16, batch 256)\n\n"
        + harness.table(["loss scale", "median step (ms)", "paired ratio to NoOp"], rows)
    )
    r = compile_overhead.main(["--rounds", str(max(3, args.rounds // 2))])
    raw["compile_overhead"] = r
    sections.append(f"### Trace + lower time of a train step ({r['policy']})\n\n" + r["markdown"])
    r = quantized_state.main(["--params", str(2**22), "--rounds", str(args.rounds)])
    raw["quantized_state"] = r
    sections.append(r["markdown"])
    info = harness.machine()
    header = [
        "# Benchmark results",
        "",
        f"- Machine: {info['device']} ({info['backend']}), {info['device_count']} device(s); "
        f"{info['host']}; CPU {info.get('cpu', '?')}",
        f"- Versions: jax {info['jax']}, jaxlib {info.get('jaxlib', '?')}, "
        f"torch {info.get('torch', 'not installed')}",
        f"- Command: `{command.strip()}`",
        f"- Date: {datetime.date.today().isoformat()}",
        "- Method: every variant in one process, interleaved round by round; ratios are medians "
        "of per-round paired ratios.",
        "",
    ]
    if info["backend"] == "cpu":
        sections.append(
            "### Notes\n\n"
            "- XLA on CPU runs float16/bfloat16 matmuls in float32 (the audit's 'backend runs "
            "matmuls as' line shows it), so on a CPU mixed precision saves memory at O3 but "
            "cannot beat float32; mpjax warns once with a HardwareWarning. torch's oneDNN "
            "kernels do use a CPU's bfloat16 instructions where it has them (see the CPU flags "
            "above), which is why torch.amp bfloat16 can beat every XLA variant here.\n"
            "- The GPU targets (>= 75% of the bf16 matmul peak, >= 8x over O0 'highest', "
            ">= 1.5x over O0 TF32, loss-scale overhead <= 1%, faster than torch.amp on the same "
            "GPU) are measured on a GPU by `python benchmarks/gpu.py`: see the GPU section "
            "below."
        )
    text = "\n".join(header) + "\n" + "\n\n".join(sections) + "\n"
    try:  # the GPU section (benchmarks/gpu.py --merge) stays until a GPU run replaces it
        with open(args.out) as f:
            old = f.read()
        if gpu.BEGIN in old:
            text += (
                "\n" + gpu.BEGIN + old.split(gpu.BEGIN, 1)[1].split(gpu.END, 1)[0] + gpu.END + "\n"
            )
    except OSError:
        pass
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0].lower() + ".json", "w") as f:
        json.dump(raw, f, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
