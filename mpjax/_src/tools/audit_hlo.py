"""The audit's reading of the backend's optimized HLO, text being the only form it has: the
kernels matmuls became and the collectives after SPMD partitioning."""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import jax
import numpy as np

from mpjax._src.tools.audit_report import Collective

# -- the backend's optimized HLO: text, the only form it has -------------------------------

# HLO's element type names.
_TYPE_NAMES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
}
_HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s(all-reduce|all-reduce-start|reduce-scatter|"
    r"all-gather|all-gather-start|all-to-all)\("
)


def _dtypes_in(text: str) -> tuple[str, ...]:
    return tuple(_TYPE_NAMES[t] for t in re.findall(r"\b(bf16|f16|f32|f64)\[", text))


# Bytes per element of HLO's element types.
_HLO_BYTES = {
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_HLO_PARTITIONED = re.compile(
    r"=\s*(\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+(all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|collective-permute)(?:-start)?\("
)


def partitioned_collectives(text: str) -> list[Collective]:
    """The collectives of HLO text after SPMD partitioning, with bytes per device."""
    found = []
    for m in _HLO_PARTITIONED.finditer(text):
        arrays = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        shape = tuple(int(d) for d in arrays[0][1].split(",") if d) if arrays else ()
        size = sum(
            int(np.prod([int(d) for d in dims.split(",") if d])) * _HLO_BYTES.get(t, 4)
            for t, dims in arrays
        )
        dtypes = tuple(_TYPE_NAMES.get(t, t) for t, _ in arrays)
        line = text[m.end() : text.find("\n", m.end())]
        op_name = re.search(r'op_name="([^"]*)"', line)
        name = op_name.group(1) if op_name else ""
        found.append(Collective(m.group(2), dtypes, "partitioned", shape, size, name))
    return found


def compile_text(lowered: Any) -> tuple[str | None, str | None]:
    """(the optimized HLO text, the HLO right after SPMD partitioning) of one compile. The
    second is None on one device, which has no such pass; on several, the compile dumps
    that pass to a temporary folder. The text is None where a backend gives none."""
    if len(jax.devices()) == 1:
        return lowered.compile().as_text(), None
    with tempfile.TemporaryDirectory() as folder:
        options = {"xla_dump_to": folder, "xla_dump_hlo_pass_re": "spmd-partitioning"}
        text = lowered.compile(compiler_options=options).as_text()
        names = sorted(n for n in os.listdir(folder) if "after_spmd-partitioning" in n)
        if not names:
            return text, None
        with open(os.path.join(folder, names[-1])) as f:
            return text, f.read()


# An instruction, its result dtype (the first element's for a tuple, which is what a GPU's
# library gemm returns: (bf16[m,n], s8[workspace])), opcode and the rest of the line.
_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(?(\w+)\[[^=]*?\s([\w\-]+)\((.*)$")
_HLO_MATMUL_TARGET = re.compile(r"gemm|conv|matmul", re.I)


def parse_compiled(text: str) -> tuple[list[tuple[str, tuple[str, ...]]], list[Collective]]:
    """(kind, operand dtypes) of each dot/convolution/library matmul in optimized HLO, and
    the collectives the compiler inserted."""
    found = []
    collectives = []
    dtypes: dict[str, str] = {}
    for line in text.splitlines():
        c = _HLO_COLLECTIVE.match(line)
        if c:
            collectives.append(
                Collective(c.group(2).replace("-start", ""), _dtypes_in(c.group(1)), "compiled")
            )
        if line.rstrip().endswith("{") and "=" not in line.split("(", 1)[0]:
            dtypes = {}  # a new computation: names are local to it
            continue
        m = _HLO_INSTR.match(line)
        if not m:
            continue
        name, dtype, opcode, rest = m.groups()
        dtypes[name] = dtype
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            if not target or not _HLO_MATMUL_TARGET.search(target.group(1)):
                continue
            opcode = target.group(1)
        elif opcode not in ("dot", "convolution"):
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        found.append(
            (
                opcode,
                tuple(
                    _TYPE_NAMES.get(dtypes.get(o, "?"), dtypes.get(o, "?")) for o in operands[:2]
                ),
            )
        )
    return found, collectives
