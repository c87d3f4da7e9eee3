"""Reading XLA's optimized HLO text (a GPU's or a TPU's): its computations, instructions,
their shapes and the bytes of those shapes. :mod:`gpu_program` and :mod:`gpu_flops` read
programs through these."""

from __future__ import annotations

import dataclasses
import math
import re

_BITS = {"pred": 8, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_CALLS = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations)=(\{[^}]*\}|%?[^\s,}]+)"
)
# Instructions that launch nothing.
_FREE = {
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier",
    "after-all", "add-dependency", "domain", "partition-id", "replica-id",
}  # fmt: skip
_CONTROL = {"call", "while", "conditional", "async-start"}
# A TPU's DMAs between its memory (HBM) and a core's: they move what they write on chip.
_DMA = {"copy-start", "slice-start", "dynamic-slice-start"}
_COLLECTIVES = {
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all",
}  # fmt: skip
_FLOATS = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}


def _element_bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    m = re.match(r"[a-z]+?(\d+)", dtype)  # f8e4m3fn -> 8, s4 -> 4, bf16 -> 16
    return int(m.group(1)) if m else 0


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


# An array with its layout: a TPU layout names the memory space, S(1) being the core's own
# memory (VMEM), whose traffic is not the HBM's.
_PLACED = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


def _bytes(shape: str, library: bool = False, on_chip: bool = False) -> int:
    """The bytes of `shape`'s arrays in device memory (HBM), or with `on_chip` those in a
    TPU core's own memory (the destinations of its DMAs)."""
    arrays = [
        (t, tuple(int(d) for d in dims.split(",") if d), "S(1)" in layout)
        for t, dims, layout in _PLACED.findall(shape)
    ]
    if library and shape.startswith("(") and len(arrays) > 1 and arrays[-1][0] == "s8":
        arrays = arrays[:-1]  # a cuBLAS or cuDNN call's scratch workspace
    return sum(math.prod(d) * _element_bits(t) // 8 for t, d, vmem in arrays if vmem == on_chip)


def _close(s: str, i: int) -> int:
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return len(s) - 1


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class _Computation:
    entry: bool
    instrs: list[_Instr] = dataclasses.field(default_factory=list)
    shapes: dict[str, str] = dataclasses.field(default_factory=dict)


def _parse(text: str) -> dict[str, _Computation]:
    comps: dict[str, _Computation] = {}
    cur: _Computation | None = None
    for line in text.splitlines():
        if cur is None:
            h = _HEADER.match(line)
            if h:
                cur = comps[h.group(2)] = _Computation(bool(h.group(1)))
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.group(2), m.group(3)
        if rest.startswith("("):
            j = _close(rest, 0)
            shape, rest = rest[: j + 1], rest[j + 1 :].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        op = re.match(r"([\w\-$.]+)\(", rest)
        if not op:
            continue
        j = _close(rest, op.end() - 1)
        operands = _operand_names(rest[op.end() : j])
        cur.shapes[name] = shape
        cur.instrs.append(_Instr(name, shape, op.group(1), operands, rest[j + 1 :]))
    return comps


def _operand_names(inside: str) -> list[str]:
    """The operand names of an instruction's parenthesis: ``f32[8]{0} %a, %b`` (optimized
    text) or ``a, b`` (a lowering's text). XLA marks every fifth operand of a long list with
    a comment (``/*index=5*/%f``), which is not part of the name."""
    inside = re.sub(r"/\*.*?\*/", "", inside)
    names, depth, start = [], 0, 0
    for i, c in enumerate(inside + ","):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            piece = inside[start:i].strip()
            if piece:
                names.append(piece.split()[-1].lstrip("%"))
            start = i + 1
    return names


def _called(attrs: str) -> list[str]:
    return [
        n.strip().lstrip("%")
        for group in _CALLS.findall(attrs)
        for n in group.strip("{}").split(",")
        if n.strip()
    ]


def _find_all(comps: dict[str, _Computation], names: list[str], opcode: str) -> list[_Instr]:
    """The `opcode` instructions in computations `names` and those they call."""
    seen: set[str] = set()
    todo, found = list(names), []
    while todo:
        n = todo.pop()
        if n in seen or n not in comps:
            continue
        seen.add(n)
        for ins in comps[n].instrs:
            if ins.opcode == opcode:
                found.append(ins)
            todo += _called(ins.attrs)
    return found


def _find(comps: dict[str, _Computation], names: list[str], opcode: str) -> _Instr | None:
    """The first `opcode` instruction in computations `names` or those they call."""
    return next(iter(_find_all(comps, names, opcode)), None)


def _dtype_of(comps: dict[str, _Computation], names: list[str], operand: str) -> str:
    for n in names:
        if n in comps and operand in comps[n].shapes:
            arrays = _arrays(comps[n].shapes[operand])
            if arrays:
                return arrays[0][0]
    return "?"
