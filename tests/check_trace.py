#!/usr/bin/env python3
"""Checks the Chrome trace files the demo wrote: each parses as JSON and holds,
per rank, the caller's calls for every unit, the comm stream's collectives with
unit names and bytes, and memory counters.

Usage: check_trace.py PREFIX WORLD UNITS"""
import json
import sys

prefix, world, units = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for rank in range(world):
    path = f"{prefix}.rank{rank}.json"
    with open(path) as f:
        events = json.load(f)["traceEvents"]  # raises on invalid JSON
    assert all(e.get("pid") == rank for e in events), f"{path}: an event of another rank"
    names = {(e["name"], e["ph"], e.get("tid")) for e in events}
    for u in range(units):
        for call in ("forward_begin", "forward_end", "backward_begin", "backward_end"):
            for ph in "BE":
                assert (f"{call} layer{u}", ph, 0) in names, f"{path}: no {call} layer{u} {ph}"
        for coll in ("all_gather", "reduce_scatter"):
            assert any(n.startswith(f"{coll} of unit 'layer{u}'") and n.endswith(" B") and t == 1
                       for n, ph, t in names), f"{path}: no {coll} of layer{u} on the comm track"
    assert ("step", "B", 0) in names, f"{path}: no step"
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all("gathered_params" in e["args"] for e in counters), f"{path}: no memory counters"
    begins = sum(1 for e in events if e["ph"] == "B")
    ends = sum(1 for e in events if e["ph"] == "E")
    assert begins == ends, f"{path}: {begins} begins but {ends} ends"
print(f"{world} trace files OK")
