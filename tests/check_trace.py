#!/usr/bin/env python3
"""Checks Chrome trace files the demos wrote: each parses as JSON and holds,
per rank, the caller's calls for every unit, the gather stream's all-gathers
and the comm stream's reductions with unit names and bytes, and memory
counters.

Usage: check_trace.py PREFIX WORLD UNITS          (train_mlp: PREFIX.rankR.json, units layer0..)
       check_trace.py --merged FILE WORLD NAME...  (train_gpt: one file, pid = rank, units by name)"""
import json
import sys


def check(path, events, rank, unit_names):
    assert events, f"{path}: no events of rank {rank}"
    names = {(e["name"], e["ph"], e.get("tid")) for e in events}
    # Gathers on a stream of their own (gather_stream=1) have a track of
    # their own (3); else they share the comm stream's (1). Never both.
    gather_track = 3 if any(e.get("tid") == 3 and e["ph"] != "M" for e in events) else 1
    stray = [n for n, ph, t in names if n.startswith("all_gather") and t != gather_track]
    assert not stray, f"{path}: rank {rank}: all-gathers off track {gather_track}: {stray[:3]}"
    for u in unit_names:
        for call in ("forward_begin", "forward_end", "backward_begin", "backward_end"):
            for ph in "BE":
                assert (f"{call} {u}", ph, 0) in names, f"{path}: rank {rank}: no {call} {u} {ph}"
        for coll, track, where in (("all_gather", gather_track, "gathers'"), ("reduce_scatter", 1, "comm")):
            assert any(n.startswith(f"{coll} of unit '{u}'") and n.endswith(" B") and t == track
                       for n, ph, t in names), f"{path}: rank {rank}: no {coll} of {u} on the {where} track"
    assert ("step", "B", 0) in names, f"{path}: rank {rank}: no step"
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all("gathered_params" in e["args"] for e in counters), f"{path}: no memory counters"
    begins = sum(1 for e in events if e["ph"] == "B")
    ends = sum(1 for e in events if e["ph"] == "E")
    assert begins == ends, f"{path}: rank {rank}: {begins} begins but {ends} ends"


if sys.argv[1] == "--merged":
    path, world, unit_names = sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    with open(path) as f:
        events = json.load(f)["traceEvents"]  # raises on invalid JSON
    assert {e.get("pid") for e in events} == set(range(world)), f"{path}: not the ranks 0..{world - 1}"
    for rank in range(world):
        check(path, [e for e in events if e.get("pid") == rank], rank, unit_names)
    print(f"{path}: {world} ranks OK")
else:
    prefix, world, units = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for rank in range(world):
        path = f"{prefix}.rank{rank}.json"
        with open(path) as f:
            events = json.load(f)["traceEvents"]  # raises on invalid JSON
        assert all(e.get("pid") == rank for e in events), f"{path}: an event of another rank"
        check(path, events, rank, [f"layer{u}" for u in range(units)])
    print(f"{world} trace files OK")
