"""One trace of a whole launched run, for Perfetto: each rank's ``torch.profiler`` trace, merged.

``dl.launch(dl.profiled(step, folder), 4)`` runs ``step`` in every rank under
``torch.profiler.profile`` and writes torch's own Chrome trace of each rank to
``folder/ranks/rank<r>.json``, with the rank's clock offset to rank 0, measured just before
(Cristian's algorithm: the fastest of eight round trips, its error at most half that trip).
``dl.merge_traces(folder)`` writes ``folder/trace.json``:

- one process per rank, named ``rank <r>`` and sorted by rank, its threads as torch named them
  (the main thread, gloo's ``pt_gloo_runloop`` that runs asynchronous collectives);
- every time on rank 0's clock (each rank's ``baseTimeNanoseconds + ts``, plus its offset),
  counted from the first event of the run;
- each point-to-point message (``send``/``isend`` to the ``recv``/``irecv`` that took it: the
  k-th from rank a to rank b with a tag is the k-th that b took from a with that tag) drawn as a
  flow from the send to the end of the receive, with its bytes;
- ``dl.region`` blocks, and any ``torch.profiler.record_function`` range, as named slices.

Open the file at https://ui.perfetto.dev ("Open trace file": the file is read in the browser,
nothing is uploaded) or at chrome://tracing.  The rank files are torch's unchanged but for one
added key, so Holistic Trace Analysis reads ``folder/ranks`` as it reads any PyTorch trace.

Flows are matched on the world group's ranks: torch's trace names a message's peer by its rank
in the message's group, and does not name the group, so a message sent on a subgroup is drawn
only where its group ranks are the world's (a group of ranks 0..k-1).  The same code runs under
``torchrun``; on several hosts the offsets are what makes one timeline of the clocks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import trace

PINGS = 8  # round trips per rank; the fastest is kept
PING_TAG = 7_919_001  # the pings' tag, apart from any a lab uses
KEY = "disttrain_lab"  # the key each rank's file gains: rank, world size, clock offset and its error
SENDS = ("c10d::send",)
RECEIVES = ("c10d::recv_", "c10d::recv_any_source_")
ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
}


def clock_offset(pings: int = PINGS) -> tuple[int, int]:
    """This rank's clock offset to rank 0's (ns to add to a local ``time.time_ns()``) and its error.

    Every rank calls it (a collective of point-to-point pings on the world group): rank 0 answers
    each other rank's ``pings`` requests with its own time; a rank keeps the round trip that took
    least, whose midpoint is off by at most half of it.  Rank 0 returns ``(0, 0)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(1, dtype=torch.int64)
    with trace.unrecorded():
        if rank == 0:
            for peer in range(1, world):
                for _ in range(pings):
                    dist.recv(out, src=peer, tag=PING_TAG)
                    out[0] = time.time_ns()
                    dist.send(out, dst=peer, tag=PING_TAG)
            return 0, 0
        best = None
        for _ in range(pings):
            sent = time.time_ns()
            dist.send(out, dst=0, tag=PING_TAG)
            dist.recv(out, src=0, tag=PING_TAG)
            back = time.time_ns()
            trip = back - sent
            if best is None or trip < best[1]:
                best = (int(out[0]) - (sent + back) // 2, trip)
    return best[0], best[1] // 2


def profiled(fn: Callable, folder: str | Path, *, activities: list | None = None, **profile_args: Any) -> Callable:
    """``fn`` for ``dl.launch`` (or ``torchrun``), profiled in every rank: see the module's text.

    ``activities``: ``torch.profiler.ProfilerActivity`` values (the CPU, and CUDA where a GPU is
    there, by default); other keywords go to ``torch.profiler.profile`` (``record_shapes`` is on,
    which the message flows need).  Returns what ``fn`` returns."""
    folder = Path(folder)

    @functools.wraps(fn)
    def run_profiled(*args, **kwargs):
        rank = dist.get_rank()
        offset, error = clock_offset()
        acts = activities
        if acts is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
        options = {"record_shapes": True, **profile_args}
        prof = torch.profiler.profile(activities=acts, **options)
        with _quiet_stderr():
            prof.start()
        try:
            result = fn(*args, **kwargs)
        finally:
            with _quiet_stderr():
                prof.stop()
        path = folder / "ranks" / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
        data[KEY] = {
            "rank": rank,
            "world_size": dist.get_world_size(),
            "clock_offset_ns": offset,
            "clock_error_ns": error,
        }
        path.write_text(json.dumps(data))
        return result

    return run_profiled


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null while the profiler starts or stops: Kineto writes a line there
    each time (``USDT: ... profiler_start``) whatever ``KINETO_LOG_LEVEL`` says, which would print as
    the rank's output in every cell that profiles."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _rank_files(folder: Path) -> list[dict]:
    files = sorted((folder / "ranks").glob("rank*.json"))
    if not files:
        raise FileNotFoundError(
            f"no rank traces in {folder / 'ranks'}: run the function dl.profiled(fn, {str(folder)!r}) returned"
        )
    traces = [json.loads(f.read_text()) for f in files]
    for f, data in zip(files, traces):
        if KEY not in data:
            raise ValueError(f"{f} has no {KEY!r} key: it was not written by dl.profiled")
    traces.sort(key=lambda d: d[KEY]["rank"])
    ranks = [d[KEY]["rank"] for d in traces]
    world = traces[0][KEY]["world_size"]
    if ranks != list(range(world)):
        raise ValueError(
            f"{folder / 'ranks'} holds the traces of ranks {ranks}, expected 0..{world - 1}: one run's files only"
        )
    return traces


def _peer_and_tag(event: dict) -> tuple[int, int] | None:
    concrete = event.get("args", {}).get("Concrete Inputs", [])
    try:
        return int(concrete[2]), int(concrete[3])
    except (IndexError, ValueError):
        return None


def _payload_bytes(op: dict, annotation: dict | None) -> int | None:
    dims = op.get("args", {}).get("Input Dims", [[]])
    kind = (annotation or {}).get("args", {}).get("Input type", [None])[0]
    if not dims or not dims[0] or kind not in ELEMENT_BYTES:
        return None
    return sum(ELEMENT_BYTES[kind] * _numel(shape) for shape in dims[0])


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _messages(rank: int, events: list[dict]) -> tuple[list[tuple], list[tuple]]:
    """A rank's sends and receives, in its order: (peer, tag, op event, gloo's slice or None).

    gloo's ``gloo:send`` / ``gloo:recv`` slice (from the call to its work's end) follows each
    call's ``c10d::`` op, one for one and in order; NCCL has none, and the op itself is used."""
    ops = sorted((e for e in events if e.get("ph") == "X" and e["name"] in SENDS + RECEIVES), key=lambda e: e["ts"])
    slices = {
        kind: sorted((e for e in events if e.get("ph") == "X" and e["name"] == f"gloo:{kind}"), key=lambda e: e["ts"])
        for kind in ("send", "recv")
    }
    used = {"send": 0, "recv": 0}
    sends, receives = [], []
    for op in ops:
        kind = "send" if op["name"] in SENDS else "recv"
        found = None
        while used[kind] < len(slices[kind]):
            candidate = slices[kind][used[kind]]
            used[kind] += 1
            if candidate["ts"] >= op["ts"]:
                found = candidate
                break
        peer_tag = _peer_and_tag(op) if op["name"] != "c10d::recv_any_source_" else None  # its peer is unnamed
        if peer_tag is not None:
            (sends if kind == "send" else receives).append((*peer_tag, op, found))
    return sends, receives


def _received(events: list[dict], end: dict) -> float:
    """When a receive's data was the program's: its slice's end, or, where the kit's wrapper
    (``dl:recv``, ``dl:wait(irecv)``) holds that moment on the same thread, the wrapper's end,
    which counts the emulated network's time."""
    at = end["ts"] + end.get("dur", 0)
    later = [
        e["ts"] + e["dur"]
        for e in events
        if e.get("ph") == "X"
        and e["tid"] == end["tid"]
        and e["name"].startswith("dl:")
        and e["ts"] <= at <= e["ts"] + e["dur"] + 0.001
    ]
    return round(max([at, *later]), 3)


def _flows(per_rank: list[list[dict]]) -> list[dict]:
    """The flow events linking each send to the receive that took it (see the module's text)."""
    queues: dict[tuple[int, int, int], list[tuple]] = defaultdict(list)  # (src, dst, tag) -> sends in order
    receives: list[tuple[int, tuple]] = []
    for rank, events in enumerate(per_rank):
        sends, recvs = _messages(rank, events)
        for peer, tag, op, found in sends:
            if tag != PING_TAG:
                queues[(rank, peer, tag)].append((op, found))
        receives += [(rank, r) for r in recvs if r[1] != PING_TAG]
    taken: dict[tuple[int, int, int], int] = defaultdict(int)
    flows = []
    for rank, (peer, tag, op, found) in sorted(receives, key=lambda item: item[1][2]["ts"]):
        key = (peer, rank, tag)
        k = taken[key]
        if k >= len(queues[key]):
            continue  # a receive no send of the world group matches (a subgroup's message)
        taken[key] += 1
        send_op, send_slice = queues[key][k]
        end = found or op
        received = _received(per_rank[rank], end)
        flow = {"cat": "message", "name": f"rank {peer} → rank {rank}", "id": len(flows) + 1}
        args = {
            "bytes": _payload_bytes(send_op, send_slice),
            "tag": tag,
            "sent": send_op["ts"],
            "received": received,
        }
        # each end at the middle of its slice, which it binds to
        middle = round(send_op["ts"] + send_op.get("dur", 0) / 2, 3)
        flows.append({**flow, "ph": "s", "pid": peer, "tid": send_op["tid"], "ts": middle, "args": args})
        flows.append(
            {
                **flow,
                "ph": "f",
                "bp": "e",
                "pid": rank,
                "tid": end["tid"],
                "ts": round(end["ts"] + end.get("dur", 0) / 2, 3),
            }
        )
    return flows


def merge_traces(folder: str | Path, out: str | Path | None = None) -> Path:
    """Merge ``folder/ranks/rank*.json`` (written by :func:`profiled`) into one trace: see the module's text.

    Returns the merged file's path (``folder/trace.json`` unless ``out`` is given)."""
    folder = Path(folder)
    traces = _rank_files(folder)
    per_rank: list[list[dict]] = []
    for rank, data in enumerate(traces):
        shift_ns = int(data.get("baseTimeNanoseconds", 0)) + int(data[KEY]["clock_offset_ns"])
        events = []
        for e in data.get("traceEvents", []):
            if not isinstance(e.get("pid"), int):
                continue  # the profiler's own "Spans" and "Traces" rows
            e = {**e, "pid": rank}
            if "ts" in e:
                e["ts"] = e["ts"] + shift_ns / 1000  # µs on rank 0's clock since the epoch
            if e.get("ph") in ("s", "f", "t") and "id" in e:
                e["id"] = f"{rank}:{e['id']}"  # the profiler's own flows, told apart between ranks
            if e.get("ph") == "M" and e["name"] == "process_name":
                e["args"] = {"name": f"rank {rank}"}
            if e.get("ph") == "M" and e["name"] == "process_sort_index":
                e["args"] = {"sort_index": rank}
            events.append(e)
        per_rank.append(events)
    starts = [e["ts"] for events in per_rank for e in events if e.get("ph") == "X"]
    if not starts:
        raise ValueError(f"the traces in {folder / 'ranks'} hold no events: was anything run under dl.profiled?")
    first = min(starts)
    for events in per_rank:
        for e in events:
            e["ts"] = 0 if e.get("ph") == "M" else round(e["ts"] - first, 3)  # µs since the run's first event
    merged = [e for events in per_rank for e in events] + _flows(per_rank)
    result = {
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": int(first * 1000),
        "traceEvents": merged,
        KEY: {
            "world_size": len(traces),
            "clock_offset_ns": [d[KEY]["clock_offset_ns"] for d in traces],
            "clock_error_ns": [d[KEY]["clock_error_ns"] for d in traces],
            "distributedInfo": [d.get("distributedInfo", {}) for d in traces],
        },
    }
    target = Path(out) if out is not None else folder / "trace.json"
    target.write_text(json.dumps(result))
    return target


def messages(merged: dict) -> list[dict]:
    """The messages of a merged trace, one dict each: ``src``, ``dst``, ``tag``, ``bytes``,
    ``sent`` and ``received`` (µs on the merged clock: the send's call, the receive's end)."""
    starts = {e["id"]: e for e in merged["traceEvents"] if e.get("ph") == "s" and e.get("cat") == "message"}
    out = []
    for e in merged["traceEvents"]:
        if e.get("ph") == "f" and e.get("cat") == "message" and e["id"] in starts:
            s = starts[e["id"]]
            out.append({"src": s["pid"], "dst": e["pid"], **s["args"]})
    return out
