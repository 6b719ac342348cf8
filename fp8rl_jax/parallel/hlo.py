"""Collectives in a compiled XLA program, read from its HLO text: what a program moves between devices.

``jax.jit(f).lower(...).compile().as_text()`` is the optimized, partitioned module that runs: every cross-device
transfer is one of ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``collective-permute`` or ``all-to-all``
(or the ``-start`` half of its asynchronous form). Counting them there, with their element types and bytes,
tells without a GPU whether a decode loop gathers weights at every token, or in which dtype FSDP gathers them.

The compiled text names operands without their types (``all-gather(%bitcast.10)``), so a collective's element
type and bytes are read from its result: an all-gather's result is the gathered array (the bytes each device
receives, its own shard included), an all-reduce's the reduced one; both keep the operand's element type.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY )?%(?P<name>[\w.\-]+) \(")
# "%all-gather.3 = f32[64,32]{1,0} all-gather(%x), ..." or a tuple result "(f32[..], bf16[..]) all-reduce(...)"
_OP = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (?P<type>\(.*?\)|\S+) (?P<op>[\w\-]+)\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|called_computations|branch_computations)="
                     r"(?:\{(?P<many>[^}]*)\}|%(?P<one>[\w.\-]+))")
_BODY = re.compile(r"\bwhile\(.*\bbody=%(?P<body>[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    dtype: str  # HLO element type of the moved data: f32, bf16, f8e4m3fn, ...
    shape: tuple[tuple[int, ...], ...]  # result array shapes (several for a combined all-reduce)
    bytes: int  # result bytes per device
    computation: str  # the HLO computation it sits in


def _itemsize(dtype: str) -> int:
    if dtype.startswith("f8"):
        return 1
    if dtype not in _BYTES:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return _BYTES[dtype]


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header["name"]
            out[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            out[current].append(line)
    return out


def _collective(line: str, computation: str) -> Collective | None:
    m = _OP.match(line)
    if not m:
        return None
    op = m["op"]
    kind = op.removesuffix("-start")
    if kind not in KINDS or op.endswith("-done"):
        return None
    arrays = [(a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d)) for a in _ARRAY.finditer(m["type"])]
    if op.endswith("-start") and kind != "all-reduce":
        # an async start returns (operands, results[, u32[] contexts]): the results are the moved data
        arrays = [a for a in arrays if a[1]] or arrays
        arrays = arrays[len(arrays) // 2:]
    dtypes = {d for d, _ in arrays}
    nbytes = sum(_itemsize(d) * _prod(s) for d, s in arrays)
    return Collective(kind, ",".join(sorted(dtypes)), tuple(s for _, s in arrays), nbytes, computation)


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled HLO module, in text order."""
    found = []
    for name, lines in _computations(hlo).items():
        for line in lines:
            c = _collective(line, name)
            if c is not None:
                found.append(c)
    return found


def loop_computations(hlo: str) -> set[str]:
    """The computations that run once per iteration of some ``while`` loop: every loop body and whatever it calls
    (fusions, reductions, nested loops, conditionals), transitively."""
    comps = _computations(hlo)
    calls = {name: set() for name in comps}
    bodies: set[str] = set()
    for name, lines in comps.items():
        for line in lines:
            for m in _CALLED.finditer(line):
                targets = m["one"] and [m["one"]] or [t.strip().lstrip("%") for t in m["many"].split(",")]
                calls[name].update(t for t in targets if t)
            body = _BODY.search(line)
            if body:
                bodies.add(body["body"])
    seen, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(calls.get(name, ()))
    return seen


def loop_collectives(hlo: str) -> list[Collective]:
    """The collectives that run inside a ``while`` loop (e.g. at every decode step of a generate loop)."""
    inside = loop_computations(hlo)
    return [c for c in collectives(hlo) if c.computation in inside]


def summary(found: Iterable[Collective]) -> dict:
    """``{"count", "bytes", "by_kind": {kind: {"count", "bytes", "dtypes"}}}`` of a list of collectives."""
    found = list(found)
    by_kind: dict[str, dict] = {}
    for c in found:
        k = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0, "dtypes": set()})
        k["count"] += 1
        k["bytes"] += c.bytes
        k["dtypes"].update(c.dtype.split(","))
    for k in by_kind.values():
        k["dtypes"] = sorted(k["dtypes"])
    return {"count": len(found), "bytes": sum(c.bytes for c in found), "by_kind": by_kind}


_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_ENTRY = re.compile(r"^ENTRY %(?P<name>[\w.\-]+) \(", re.M)


def executions(hlo: str) -> dict[str, int]:
    """How many times each computation runs per call of the module: a ``while`` body its loop's
    ``known_trip_count`` times its caller's count (a loop without a known count counts once), anything else
    called (fusions, conditionals' branches, async wrappers) as often as its callers, summed over call sites."""
    comps = _computations(hlo)
    entry = _ENTRY.search(hlo)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    # caller -> [(callee, times per run of the caller)]
    calls: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    for name, lines in comps.items():
        for line in lines:
            body = _BODY.search(line)
            trip = _TRIP.search(line)
            for m in _CALLED.finditer(line):
                targets = m["one"] and [m["one"]] or [t.strip().lstrip("%") for t in m["many"].split(",")]
                for t in targets:
                    if t:
                        times = int(trip["n"]) if body and trip and t == body["body"] else 1
                        calls[name].append((t, times))
    callers: dict[str, list[tuple[str, int]]] = {}
    for caller, callees in calls.items():
        for callee, n in callees:
            callers.setdefault(callee, []).append((caller, n))
    counts: dict[str, int] = {entry["name"]: 1}

    def count(name: str, path: frozenset = frozenset()) -> int:  # memoized over the (acyclic) call graph
        if name not in counts:
            if name in path:
                raise ValueError(f"HLO call graph has a cycle through {name!r}")
            counts[name] = sum(count(c, path | {name}) * n for c, n in callers.get(name, ()))
        return counts[name]

    for name in comps:
        count(name)
    return counts


def executed(hlo: str) -> list[tuple[Collective, int]]:
    """Every collective with the number of times it runs per call of the module (``executions``)."""
    counts = executions(hlo)
    return [(c, counts.get(c.computation, 0)) for c in collectives(hlo)]
