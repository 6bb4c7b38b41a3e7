"""The large values of a compiled XLA program, read from its optimized HLO text: where a step
program's temporaries come from when memory_analysis() says they are large (issue 38 item 6:
a pool-sized temporary means the KV pool is copied, not updated in place).

  large_values(compiled.as_text(), min_bytes) -> [{"name", "opcode", "shape", "bytes", "gib", "op_name"}]
  copies(values)                              -> the copies among them
  moves(values)                               -> {copy|concatenate|transpose: [count, GiB]}

Only the entry computation and the computations it reaches through while, conditional and
call are read; a fusion counts as one value, its output (what XLA allocates), never its
inner instructions. `copies` picks copy and copy-done: XLA's copy insertion adds
one where a buffer cannot be updated in place (a donated pool read again after its update, an
alias it cannot prove safe).
"""

from __future__ import annotations

import re

import numpy as np

# "  %name = bf16[32,2048,16,8,128]{4,3,2,1,0} opcode(...": the name, then the shape (an array
# or a tuple of them, read by _split_shape), the opcode and its operands and attributes.
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([\w\-]+)\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# "ENTRY %main.12 (p: f32[4]) -> (f32[4], /*index=5*/f32[]) {": a name, then its parameters.
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")
# An asynchronous copy is counted once, by its copy-done (the destination array).
COPIES = ("copy", "copy-done")
# Ops that allocate nothing of their own (views, tuples of other values, a loop's state, which
# is its operand's buffer; copy-start's tuple holds the copy-done's).
_NO_BUFFER = frozenset({"tuple", "get-tuple-element", "bitcast", "while", "copy-start"})
# Bytes per element of XLA's primitive types (pred is a byte; f8* and f4*/s4/u4/s2/u2 by width).
_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5, "s8": 1, "u8": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (an array "bf16[2,3]{1,0}" or a tuple of them)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape.replace("<=", "")):  # (a dynamic dim: its bound)
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return int(total)


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines; the entry's under the key "ENTRY"."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m:
            name = "ENTRY" if m.group(1) else m.group(2)
            comps[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def _split_shape(rest: str) -> tuple[str, str, str] | None:
    """(shape, opcode, the text from the opcode on) of an instruction's text after "name = ";
    None if it is not one."""
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, tail = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, tail = rest.partition(" ")
    m = _OPCODE.match(tail)
    return (shape, m.group(1), tail) if m else None


def large_values(hlo: str, min_bytes: int) -> list[dict]:
    """The instructions of at least `min_bytes` (their output's size) in the entry computation
    and the computations it reaches through while/conditional/call, largest first, less those
    that allocate nothing (_NO_BUFFER): name, opcode, shape (without layout), bytes, GiB and
    the jax op_name of their metadata ("" if none)."""
    comps = _computations(hlo)
    seen, todo, out = set(), ["ENTRY"], []
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        for line in comps[comp]:
            m = _NAME.match(line)
            parts = _split_shape(m.group(2)) if m else None
            if parts is None:
                continue
            shape, opcode, tail = parts
            if opcode in ("while", "conditional", "call"):
                for one, many in _CALLED.findall(tail):
                    todo += [one] if one else [c.strip().lstrip("%") for c in many.split(",")]
            size = shape_bytes(shape)
            if size >= min_bytes and opcode not in _NO_BUFFER:
                op = _OP_NAME.search(tail)
                out.append({"name": m.group(1), "opcode": opcode, "shape": re.sub(r"\{[^}]*\}", "", shape),
                            "bytes": size, "gib": round(size / 2**30, 3), "op_name": op.group(1) if op else ""})
    return sorted(out, key=lambda v: -v["bytes"])


def copies(values: list[dict]) -> list[dict]:
    """The copies among `large_values`' values (COPIES): a pool-sized one is the pool copied."""
    return [v for v in values if v["opcode"] in COPIES]


# A value that only moves data: a copy, a concatenation, a transpose or a dynamic slice (a
# layer's weights taken out of a stack: scan_layers), as an op or as the fusion XLA names after
# its root (copy_fusion, loop_concatenate_fusion, input_transpose_fusion,
# dynamic-slice_bitcast_fusion; not XLA:GPU's address computations, which copy nothing).
_MOVE = re.compile(r"copy|concatenate|transpose|dynamic[-_]slice")


def moves(values: list[dict]) -> dict[str, list]:
    """{kind: [count, GiB]} of `large_values`' values that only move data (copy, concatenate,
    transpose, dynamic-slice: the op, or a fusion named after one), e.g. weights concatenated
    into a buffer of their own on every step (XLA:GPU fused the dot merger's concatenation into
    its gemm on 2026-12-04: none there), or a scan copying each layer's slice of its stacked
    weights out; {} when none."""
    total: dict[str, list] = {}
    for v in values:
        m = _MOVE.search(v["opcode"]) or (v["opcode"] == "fusion" and "address" not in v["name"]
                                          and _MOVE.search(v["name"]))
        if m:
            kind = m.group(0).replace("_", "-")
            count, size = total.get(kind, (0, 0))
            total[kind] = [count + 1, size + v["bytes"]]
    return {kind: [count, round(size / 2**30, 4)] for kind, (count, size) in total.items()}
