"""``disttrain-lab bench trace``: what tracing costs per ping-pong round trip, against torch's own
``send``/``recv`` and the launcher's always-on status wrappers."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import trace
from ..events import format_bytes
from ..launcher import launch
from .command import Measured, progress
from .tables import chart


def _pingpong_modes(trips: int, nbytes: int) -> dict:
    """Seconds per round trip on rank 0 for: torch's own functions, the launcher's
    status-only wrappers (always on in a launched rank), and full tracing."""
    rank = dist.get_rank()
    t = torch.zeros(max(1, nbytes // 4))
    genuine = (trace.genuine_of(dist.send), trace.genuine_of(dist.recv))
    wrapped = (dist.send, dist.recv)
    out = {}
    for mode, (send, recv), record in (
        ("torch", genuine, False),
        ("status only", wrapped, False),
        ("traced", wrapped, True),
        ("torch again", genuine, False),
    ):
        trace.set_recording(record)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(trips):
            if rank == 0:
                send(t, 1)
                recv(t, 1)
            else:
                recv(t, 0)
                send(t, 0)
        out[mode] = (time.perf_counter() - start) / trips
        trace.set_recording(False)  # the round trips' events are not wanted, only their time
    return out


def bench_trace(trips: int = 2000, sizes=(4, 1 << 20), repeats: int = 5) -> list[dict]:
    """Tracing overhead per ping-pong round trip, medians of ``repeats`` runs."""
    rows = []
    for nbytes in sizes:
        runs = [
            launch(_pingpong_modes, 2, trips if nbytes < 1024 else max(1, trips // 20), nbytes)[0]
            for _ in progress(range(repeats), desc=f"bench trace, {nbytes} B", unit="run")
        ]
        base = statistics.median([min(r["torch"], r["torch again"]) for r in runs])
        for mode in ("torch", "status only", "traced"):
            med = statistics.median([min(r["torch"], r["torch again"]) if mode == "torch" else r[mode] for r in runs])
            rows.append({"bytes": nbytes, "mode": mode, "us_per_trip": med * 1e6, "ratio": med / base})
    return rows


def format_trace_table(rows: list[dict]) -> str:
    """Each mode's round trip and its time over torch's own (above 1: what the kit's wrappers cost)."""
    lines = [
        "a ping-pong's round trip on 2 ranks; time / torch's: above 1.00x, what the kit's wrappers cost "
        "(torch's own send/recv timed twice, around the others, the better of the two each repeat)",
        f"{'message':>9} {'mode':<12} {'us/round trip':>14} {'time / torch':>13}",
    ]
    for row in rows:
        lines.append(
            f"{format_bytes(row['bytes']):>9} {row['mode']:<12} {row['us_per_trip']:>14.1f} {row['ratio']:>12.2f}x"
        )
    faster = [r for r in rows if r["mode"] != "torch" and r["ratio"] < 1.0]
    if faster:
        named = ", ".join(f"{r['mode']} at {format_bytes(r['bytes'])}" for r in faster)
        lines.append(
            f"({named} below 1.00x: faster than "
            "torch's own calls, which a wrapper around them cannot be: the machine's noise between runs)"
        )
    return "\n".join(lines)


NAME = "trace"
HELP = "what tracing costs per ping-pong round trip"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--trips",
        type=int,
        default=2000,
        help="round trips per run of each mode with a 4 B message (default 2000; with 1 MiB, a twentieth of them)",
    )


QUICK = ["--trips", "100"]  # bench all --quick


def measure(args) -> Measured:
    rows = bench_trace(trips=args.trips, repeats=args.repeats)
    pictures = [
        chart(
            rows,
            "What tracing costs a ping-pong",
            "us_per_trip",
            "µs per round trip",
            x="mode",
            series="bytes",
            named=format_bytes,
        )
    ]
    return Measured(rows, format_trace_table(rows), pictures)
