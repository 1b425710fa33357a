"""``disttrain-lab bench launch``: what a student waits for when a cell runs ranks.

This launcher cold (a fresh pool) and warm, ``torch.multiprocessing.spawn`` and
``torchrun --standalone``, each running the same trivial function (join a gloo process
group, return ``rank * 10``).

Where a warm launch's time goes (the rows ``warm, phases timed`` and ``in ranks: ...``), read on one
clock (``time.perf_counter`` is the system's monotonic clock, the same in every process): from the
call to the last rank's
function starting (the job to each rank, and the fresh gloo group each launch makes), and from the
last rank's function ending to the results in the kernel; inside the ranks, what a fresh gloo group
costs alone (``dist.new_group``) and one barrier.  The fresh group is the launcher's floor: a cell's
ranks get a group of their own, so nothing a run left unmatched (a send nobody received, one
collective more on one rank) reaches the next cell's run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from ..launcher import launch, shutdown
from .command import Measured, add_world_size_argument, progress
from .tables import chart


def _trivial():
    return dist.get_rank() * 10


def _stamped():
    return time.perf_counter()  # (the system's monotonic clock: comparable with the kernel's)


def _group_and_barrier():
    start = time.perf_counter()
    group = dist.new_group(backend="gloo")
    made = time.perf_counter()
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    dist.barrier()
    before = time.perf_counter()
    dist.barrier()
    return made - start, time.perf_counter() - before


def time_phases(world_size: int) -> tuple[float, float, float]:
    """Seconds of one warm launch, and of its phases: to the last rank's function starting, and from it
    to the results in the kernel."""
    start = time.perf_counter()
    starts = launch(_stamped, world_size)
    back = time.perf_counter()
    return back - start, max(starts) - start, back - max(starts)


def time_group(world_size: int) -> tuple[float, float]:
    """Seconds, inside the ranks (the slowest), of a fresh gloo group and of one barrier.  (Measured after
    the launches: the launches after a run that made groups of its own are slower for a while.)"""
    group, barrier = zip(*launch(_group_and_barrier, world_size))
    return max(group), max(barrier)


TRIES = 3  # launches of mp.spawn or torchrun before a row is reported not measured
RETRY_PAUSE_S = 1.0


def _spawn_target(rank: int, world_size: int, rendezvous: str) -> None:
    # what torch.multiprocessing.spawn users write: join a group, work, leave
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    _trivial()
    dist.destroy_process_group()


def time_spawn(world_size: int, tries: int = TRIES) -> float:
    """Seconds of one ``torch.multiprocessing.spawn`` of ``world_size`` trivial ranks.  A launch whose gloo
    group fails to connect (its mesh on a loaded host) is tried again, as torchrun's is."""
    # a file of its own to meet at: a free port can be taken by a job beside this one between its choice and its
    # use, and two jobs then meet in one store.  Even so, gloo's mesh itself failed in fresh-clone CI runs
    # ("Gloo connectFullMesh failed ... Connection closed by peer", 2026-12-05 and -06: mp.spawn's and then
    # torchrun's, twice, within 25 s; the suite's other tests run beside it; not seen in 15 torchrun launches
    # beside two CPU-bound processes)
    for attempt in range(tries):
        with tempfile.TemporaryDirectory(prefix="disttrain-spawn-") as folder:
            start = time.perf_counter()
            try:
                mp.spawn(_spawn_target, args=(world_size, os.path.join(folder, "rendezvous")), nprocs=world_size)
            except mp.ProcessRaisedException as failed:
                if attempt == tries - 1 or "connectFullMesh" not in str(failed):
                    raise RuntimeError(f"mp.spawn failed ({attempt + 1} tries): {_gist(str(failed))}") from None
                time.sleep(RETRY_PAUSE_S)
                continue
            return time.perf_counter() - start
    raise AssertionError("unreachable")


def time_torchrun(world_size: int, tries: int = TRIES) -> float:
    """Seconds of one torchrun launch of ``world_size`` trivial ranks.  A launch that fails (its
    rendezvous or gloo's mesh on a loaded host) is tried again; the last failure says what the ranks said."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
    cmd += ["-m", "disttrain_lab.bench.launch", "--torchrun-child"]
    for attempt in range(tries):
        # torchrun's own logs go to a folder removed afterwards (without --log-dir it leaves a
        # torchelastic_* folder in the temp folder on every launch)
        with tempfile.TemporaryDirectory(prefix="disttrain-torchrun-") as logs:
            start = time.perf_counter()
            done = subprocess.run(
                [*cmd[:5], f"--log-dir={logs}", *cmd[5:]],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            elapsed = time.perf_counter() - start
        if done.returncode == 0:
            return elapsed
        if attempt == tries - 1:
            raise RuntimeError(
                f"torchrun exited with {done.returncode} ({tries} tries): {_gist(done.stderr + done.stdout)}"
            )
        time.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable")


def _gist(said: str) -> str:
    """The lines of a failed launch's output that name an error (the ranks' own, not the launcher's summary),
    at most three, else its last line."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "failed" in line]
    return " | ".join((errors or lines[-1:] or ["(no output)"])[:3])[:600]


def time_launch(world_size: int, warm: bool) -> float:
    if not warm:
        shutdown()
    start = time.perf_counter()
    out = launch(_trivial, world_size)
    elapsed = time.perf_counter() - start
    assert out == [10 * r for r in range(world_size)], out
    return elapsed


IDLE = 0.6  # seconds: more than a rank waits idle before destroying old groups (worker.py's 0.25 s)


def bench_launch(world_sizes=(2, 4), repeats: int = 5, slow_repeats: int = 3) -> list[dict]:
    """Median seconds per call of each way to start ranks; one row per (method, world size)."""
    rows = []
    bar = progress(
        total=len(world_sizes) * (3 * max(repeats, 20) + repeats + 2 * slow_repeats), desc="bench launch", unit="launch"
    )

    def timed(measure, n, times, **kwargs):
        # idle first, as ranks are between a notebook's cells: a rank destroys the groups of launches
        # before (~40 ms each) only while idle, or once 32 pile up (worker.py)
        time.sleep(IDLE)
        out = []
        for _ in range(times):
            out.append(measure(n, **kwargs))
            bar.update()
        return out

    for n in world_sizes:
        launch(_trivial, n)  # warm the pool once
        warm = timed(time_launch, n, max(repeats, 20), warm=True)
        phases = list(zip(*timed(time_phases, n, max(repeats, 20))))
        cold = timed(time_launch, n, repeats, warm=False)
        phases += list(zip(*timed(time_group, n, max(repeats, 20))))
        shutdown()
        spawn = _or_why(timed, time_spawn, n, slow_repeats)
        torchrun = _or_why(timed, time_torchrun, n, slow_repeats)
        for name, xs in (
            ("dl.launch warm", warm),
            ("warm, phases timed", phases[0]),
            ("  to the functions", phases[1]),
            ("  back to the kernel", phases[2]),
            ("in ranks: a new group", phases[3]),
            ("in ranks: a barrier", phases[4]),
            ("dl.launch cold", cold),
            ("mp.spawn", spawn),
            ("torchrun --standalone", torchrun),
        ):
            if isinstance(xs, str):
                rows.append({"method": name, "world_size": n, "error": xs})
                continue
            rows.append(
                {
                    "method": name,
                    "world_size": n,
                    "median_s": statistics.median(xs),
                    "mean_s": statistics.fmean(xs),
                    "repeats": len(xs),
                }
            )
    return rows


def _or_why(timed, measure, n, times) -> list[float] | str:
    """``timed(measure, n, times)``, or why it failed (a launcher other than the kit's that failed every try on
    this host: the row says so, and the other rows stand)."""
    try:
        return timed(measure, n, times)
    except RuntimeError as failed:
        return f"{failed}"


def format_launch_table(rows: list[dict]) -> str:
    lines = [f"{'method':<22} {'ranks':>5} {'median':>10} {'mean':>10} {'n':>3}  vs warm launch"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['method']:<22} {row['world_size']:>5} not measured: {row['error']}")
            continue
        warm = next(
            r["median_s"] for r in rows if r["method"] == "dl.launch warm" and r["world_size"] == row["world_size"]
        )
        lines.append(
            f"{row['method']:<22} {row['world_size']:>5} {row['median_s'] * 1e3:>8.1f}ms "
            f"{row['mean_s'] * 1e3:>8.1f}ms {row['repeats']:>3}  {row['median_s'] / warm:>8.1f}x"
        )
    median = {(r["method"], r["world_size"]): r["median_s"] * 1e3 for r in rows if "error" not in r}
    for n in sorted({r["world_size"] for r in rows}):
        if ("in ranks: a new group", n) in median:
            lines.append(
                f"{n} ranks: of a warm launch's {median['warm, phases timed', n]:.1f} ms, "
                f"{median['  to the functions', n]:.1f} until the last rank's function starts, of which about "
                f"{median['in ranks: a new group', n]:.1f} the fresh gloo group each launch makes (so that nothing one "
                "cell's ranks left unmatched reaches the next cell's run), and "
                f"{median['  back to the kernel', n]:.1f} from there to the results in the kernel"
            )
    return "\n".join(lines)


NAME = "launch"
HELP = "starting ranks: dl.launch cold and warm, mp.spawn, torchrun"


def add_arguments(parser) -> None:
    add_world_size_argument(parser, (2, 4))
    parser.add_argument(
        "--slow-repeats",
        type=int,
        default=3,
        help="starts of mp.spawn and of torchrun per "
        "number of ranks, each taking seconds (default 3; dl.launch: --repeats, warm at least 20)",
    )


QUICK = ["--world-size", "2", "--slow-repeats", "1"]  # bench all --quick: a look, not a measurement


def measure(args) -> Measured:
    rows = bench_launch(world_sizes=args.world_size, repeats=args.repeats, slow_repeats=args.slow_repeats)
    pictures = [
        chart(
            rows,
            "Starting ranks",
            "median_s",
            "median (ms)",
            x="method",
            series="world_size",
            named="{} ranks",
            scale=1e3,
            log_y=True,
        )
    ]
    return Measured(rows, format_launch_table(rows), pictures)


if __name__ == "__main__" and "--torchrun-child" in sys.argv:
    dist.init_process_group("gloo")
    _trivial()
    dist.destroy_process_group()
