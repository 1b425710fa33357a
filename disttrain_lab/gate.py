"""A gate the grader holds inside a graded run's backward pass: evidence that communication overlapped it.

Whether a data-parallel wrapper's all-reduces overlap the backward pass is a matter of *when*: an
all-reduce posted from a gradient hook crosses the wire while the layers below are still computing.
The ranks' own trace says so, but the ranks write it (a submission can rewrite its timestamps).  Under
grading the grader makes the moment observable instead:

- the test's driver puts a *gate* at one layer's input (``Gate.at(module)``; or its output, ``after``), tells
  the grader when the graded step begins (``start()``) and arms the gate before that step's last forward
  (``arm()``): in its backward, where that input gets its gradient, the rank stops and asks the grader to go on;
- the grader (``grading/gatekeeper.py``, outside the student's processes) answers only once every
  rank has asked and it has seen from the OS what the ranks sent each other by then (``ss``, polled
  until it settles, or a few seconds at most); its answer is needed to finish the backward: a tensor,
  drawn at grading time, added to the gradient that rank's activations receive there.  So no gradient
  of a layer below the gate is right before the answer arrives;
- the grader's packet capture sees the answer leave, among the ranks' own segments (``capture.py``):
  what crossed between the ranks before it, and after the step began (the grader's first answer,
  one byte, once every rank reached the step), crossed while the backward was held.  The test reads
  those messages (``wiretimeline.Timeline.sends_between``) and holds them to the gradients of the layers
  above the gate, which it recomputes.  A wrapper that communicates only after ``backward()``
  returns has sent nothing there; junk sent in their place is not the gradients.

The same gate also *marks* a run's steps where nothing is held: the driver calls ``start()`` at the start
of every micro-step, and once more after the last, and the grader answers each round once every rank has
asked (``Seen.marks``: when each round's first answer left).  A rank's messages of a micro-step are done
before it asks for the next round, so the capture's segments between two marks are that micro-step's
(``Seen.windows``): how many all-reduces each step made, of which sizes, and none under ``no_sync()``, read
off the wire rather than the ranks' trace.

The rank's end is this module: a TCP connection to the grader's port in the rank's own network
namespace (a graded rank may open TCP sockets alone; ``confine.py``), given to each rank of a run as
:data:`PORT` by the kit (``serving._call``).  In the student's own notebook no grader holds a gate:
``connect()`` returns None, the driver runs without one, and the test reads the ranks' trace instead.
The rank's main thread waits for each answer itself: the grader checks from ``/proc`` that, when a rank
says it is held, its main thread is blocked reading its gate connection (a thread that said "held" for
it while the rank's own work went on elsewhere is not the rank held: the gate is then unobserved).

A hold can also be a moment to read a rank's memory from the OS (lab 9: ``labtests/lab09/kept.py``): the
grader asked to (``Request.memory``) reads each held rank's private memory while its main thread waits there
(``Seen.memory_at``), and a rank may first tell it values it recomputes (``Gate.say``, a loss: ``Seen.said``), so
that what made them had run before the reading; ``Gate.hold()`` holds a rank outside any backward.

A rank's emulated host link (lab 9's ``OffloadAdam``: ``hostlink.HostLink(gate=...)``) sends the grader each copy's
bytes on the same connection as the copy is asked for (``Gate.link``); the grader keeps them with the hold they came
before (``Seen.link``), so what crossed the link and whether a held backward was still running are its own reading.

:class:`Seen` is what the grader observed, its evidence (``protocol.Evidence.gate``).
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass

import torch
from torch import nn

from . import osmemory
from .wire import Unobserved

__all__ = ["PORT", "Behind", "Gate", "Seen", "connect"]

PORT: list[int | None] = [None]  # the grader's gate in this run (set in each rank by serving._call), or None
WAIT_S = 120.0  # a rank waits at most this long for the grader's answer (the run's own timeout ends it sooner)
MAX_ELEMENTS = 1 << 20  # the most a gate's answer may hold (4 MiB of float32)
HELLO, START, HOLD = b"H", b"S", b"B"  # a rank's messages: who it is, at the step's start, held in backward,
VALUE = b"V"  # and a value for the grader to check before its next hold (a float32: evidence of what ran before it)
MAX_VALUES = 16  # the most values a rank may say before one hold
GO = b"g"  # the grader's answer at the step's start
# what crossed an emulated host link (lab 9's OffloadAdam: ``hostlink.HostLink(gate=...)``), sent as each copy begins:
# the kind, its payload's length ("<I") and the payload (the grader keeps it, with the hold it came before)
DOWN, UP = b"D", b"U"  # device -> host (gradients), host -> device (parameters)
MAX_LINK_BYTES = 32 << 20  # the most a run's link messages may carry in all


def connect(rank: int) -> Gate | None:
    """This rank's gate in a run the grader holds one for, else None (the student's own notebook)."""
    port = PORT[0]
    return None if port is None else Gate(port, rank)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError(f"the grader's gate closed after {len(data)} of {n} bytes")
        data += part
    return bytes(data)


class _Held(torch.autograd.Function):
    """Identity forward; backward waits at the gate and adds the grader's answer to the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: Gate) -> torch.Tensor:
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        added = ctx.gate.wait(grad.shape)
        return grad + added.to(grad.device, grad.dtype), None


class Gate:
    """One rank's connection to the grader's gate (see the module docstring)."""

    def __init__(self, port: int, rank: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # waits that time out in the kernel (SO_RCVTIMEO), not in Python's poll(): a rank waiting for the
        # grader's answer sits in recvfrom(2) on this socket, and the grader reads from /proc that it is the
        # rank's main thread that waits there (pauses.receiving_on), not a thread that speaks for it
        self.sock.settimeout(None)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("@ll", int(WAIT_S), 0))
        self._sending = threading.Lock()  # (a host link's threads send on it too: whole messages, one at a time)
        self._send(HELLO + struct.pack("<I", rank))
        self.armed = False

    def _send(self, data: bytes) -> None:
        with self._sending:
            self.sock.sendall(data)

    def start(self) -> None:
        """At a (micro-)step's start, every earlier message done: wait until every rank is there (a mark)."""
        self._send(START)
        if _exactly(self.sock, 1) != GO:
            raise ConnectionError("the grader's gate answered the step's start with something else")

    def arm(self) -> None:
        """Hold the next forward's backward (the graded step's last micro-batch: just before its forward)."""
        self.armed = True

    def at(self, module: nn.Module):
        """Hold the backward where ``module``'s first input gets its gradient, in the first forward after
        ``arm()``.  Returns the hook's handle."""

        def hold(_module, args):
            if not self.armed or not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
                return None
            self.armed = False
            return (_Held.apply(args[0], self), *args[1:])

        return module.register_forward_pre_hook(hold)

    def after(self, module: nn.Module):
        """Hold the backward where ``module``'s output gets its gradient, in the first forward after ``arm()`` (a
        place no module's input marks: the tied autoencoder's encoder output, which no submodule takes in).
        Returns the hook's handle."""

        def hold(_module, _args, output):
            if not self.armed or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            self.armed = False
            return _Held.apply(output, self)

        return module.register_forward_hook(hold)

    def held(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, whose backward waits at the gate where ``x`` gets its gradient, adding the grader's answer (every
        backward through it: no ``arm()``)."""
        return _Held.apply(x, self)

    def say(self, *values: float) -> None:
        """Tell the grader ``values`` (float32 each) before the next hold: numbers it recomputes itself (a loss),
        so that what made them had run by the time it holds the rank (lab 9 reads the rank's memory there)."""
        self._send(b"".join(VALUE + struct.pack("<f", float(v)) for v in values))

    def link(self, direction: str, payload: bytes) -> None:
        """Tell the grader what a copy over an emulated host link carries ("down": device -> host, "up"), as it
        begins (``hostlink.HostLink`` calls it from its own threads): the grader keeps it with the hold it came
        before (``Seen.link``), evidence of what crossed and whether a backward it held was still running."""
        self._send((DOWN if direction == "down" else UP) + struct.pack("<I", len(payload)) + payload)

    def hold(self) -> None:
        """Ask the grader to go on, here (outside a backward), and wait for its answer (one value, unused: an answer
        of no bytes would not make the rank wait)."""
        self.wait(torch.Size([1]))

    def wait(self, shape: torch.Size) -> torch.Tensor:
        """Ask the grader to go on; its answer, a float32 tensor of ``shape``."""
        numel = shape.numel()
        osmemory.trim()  # (the grader may read this rank's memory while it waits: what it freed given back first)
        self._send(HOLD + struct.pack("<I", numel))
        data = _exactly(self.sock, 4 * numel)
        return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)

    def close(self) -> None:
        self.sock.close()


class Behind(list):
    """A hold's answers (one per rank, each None: zeros) to give apart: every rank but ``behind`` as soon as all are
    held there, ``behind`` only once each other rank is held at the next hold, or ``gatekeeper.HELD_WAIT`` seconds
    after the others' answers (``Seen.ranks_ahead`` says which got there).  The ranks hold alike at every hold:
    nothing they are given says which hold, or which rank, the grader keeps behind."""

    def __init__(self, answers, behind: int):
        if any(a is not None for a in answers):
            raise ValueError("a hold answered apart answers zeros (each None): it holds, it adds nothing")
        super().__init__(answers)
        self.behind = behind


@dataclass(frozen=True)
class Seen:
    """What the grader observed at a run's gate, on the capture's clock (``wiretimeline.Timeline``'s seconds):
    ``marks``, when the first rank was told to go on in each round of ``Gate.start()`` (one per
    micro-step, and one after the last); ``start``, the round in which the backward was held; ``cut``, when
    the first rank was given the answer it needed to finish that step's backward (None where nothing was
    held); ``settled``, whether the ranks' bytes had stopped growing (as the OS counted them) before the
    grader answered, at every hold with answers, rather than its patience ending; ``held``, for each hold in
    turn, the ranks that were held when it answered (all of them, unless some were not held in time).
    ``source``: ``"wire"``; ``"none"`` where no grader held a gate (the student's own notebook); or
    ``"unobserved"``, with why (reading it raises ``wire.Unobserved``)."""

    start: float | None = None
    cut: float | None = None
    settled: bool = False
    source: str = "wire"
    why: str = ""
    marks: tuple[float, ...] = ()
    held: tuple[tuple[int, ...], ...] = ()  # each hold's ranks held when the grader answered (as each said who)
    cuts: tuple[float | None, ...] = ()  # each hold's first answer on the capture
    # each hold's values, per rank: what the rank said (``Gate.say``) since its previous hold, before this one
    values: tuple[tuple[tuple[float, ...], ...], ...] = ()
    # each hold's private memory of each rank, read from the OS while its main thread waited at the gate (None: not
    # read, or that rank not held then); empty where the grader was not asked to read memory
    memory: tuple[tuple[int | str | None, ...], ...] = ()  # (a str: why that reading was refused)
    # what each copy over a rank's emulated host link carried (``Gate.link``), in the order the grader read them:
    # (rank, "down" or "up", the hold it came before: how many holds the grader had answered then, payload)
    link: tuple[tuple[int, str, int, bytes], ...] = ()
    # each hold answered apart (``Behind``): (the hold, the ranks held at the next one when the rank behind was let go)
    ahead: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @classmethod
    def unobserved(cls, why: str) -> Seen:
        return cls(source="unobserved", why=why)

    @classmethod
    def none(cls) -> Seen:
        return cls(source="none", why="no grader held a gate (the student's own notebook)")

    def window(self) -> tuple[float, float]:
        """(start, cut): the graded step's data that crossed while its backward was held."""
        if self.source != "wire" or self.start is None or self.cut is None:
            raise Unobserved(
                f"the grader could not see when the graded step's backward was held ({self.why}), so a test "
                "that grades what crossed meanwhile fails rather than take the ranks' own clocks"
            )
        return self.start, self.cut

    def windows(self) -> list[tuple[float, float]]:
        """(start, end) of each micro-step between two marks, in order: its data crossed in between."""
        if self.source != "wire" or len(self.marks) < 2:
            raise Unobserved(
                f"the grader could not see when the run's steps began ({self.why or 'no marks'}), so a test that "
                "grades what each step sent fails rather than take the ranks' own clocks"
            )
        return list(zip(self.marks, self.marks[1:]))

    def hold_window(self, hold: int) -> tuple[float, float]:
        """(the last mark before the ``hold``-th hold's first answer, that answer): what crossed while it held."""
        cut = self.cuts[hold] if self.source == "wire" and hold < len(self.cuts) else None
        start = max((t for t in self.marks if cut is not None and t < cut), default=None)
        if cut is None or start is None:
            raise Unobserved(
                f"the grader could not see when it held the ranks ({self.why or 'no answer seen'}), so a test that "
                "grades what crossed meanwhile fails rather than take the ranks' own clocks"
            )
        return start, cut

    def memory_at(self, hold: int, rank: int = 0) -> int:
        """Rank ``rank``'s private memory, in bytes, as the OS counted it while the grader held it at its
        ``hold``-th hold (``/proc/<pid>/smaps_rollup``, its main thread blocked reading the gate before and after
        the reading, the same wait); ``Unobserved`` where it was not read."""
        read = self.memory[hold][rank] if self.source == "wire" and hold < len(self.memory) else None
        if type(read) is not int:
            why = read if isinstance(read, str) else self.why or "no reading at that hold"
            raise Unobserved(
                f"the grader could not read rank {rank}'s memory while it held it at its gate ({why}), so a test "
                "that grades it fails rather than take the rank's own account"
            )
        return read

    def said(self, hold: int, rank: int = 0) -> tuple[float, ...]:
        """What rank ``rank`` said (``Gate.say``) before the grader's ``hold``-th hold, after the one before."""
        if self.source != "wire" or hold >= len(self.values):
            raise Unobserved(
                f"the grader could not see what rank {rank} said at its gate ({self.why or 'no such hold'}), so a "
                "test that grades it fails rather than take the rank's own account"
            )
        return self.values[hold][rank] if rank < len(self.values[hold]) else ()

    def link_data(self, rank: int = 0) -> list[tuple[str, int, bytes]]:
        """What rank ``rank``'s host link carried, as the grader read it at its gate: (direction, the hold it came
        before, payload) of each copy, in order; ``Unobserved`` where the grader held no gate."""
        if self.source != "wire":
            raise Unobserved(
                f"the grader could not see what rank {rank}'s host link carried ({self.why}), so a test that grades it "
                "fails rather than take the rank's own account"
            )
        return [(direction, hold, data) for r, direction, hold, data in self.link if r == rank]

    def ranks_ahead(self, hold: int) -> tuple[int, ...]:
        """The ranks held at hold ``hold`` + 1 while the grader still held the rank behind at hold ``hold`` (a hold
        answered apart: ``Behind``), when it let that rank go."""
        found = dict(self.ahead).get(hold) if self.source == "wire" else None
        if found is None:
            raise Unobserved(
                f"the grader could not see which ranks went on past hold {hold} while it held one there "
                f"({self.why or 'no such hold answered apart'}), so a test that grades it fails rather than take "
                "the ranks' own account"
            )
        return found

    def ranks_held(self, hold: int = 0) -> tuple[int, ...]:
        """The ranks held at the gate when the grader answered its ``hold``-th hold (see ``held``; none where
        the run ended before it)."""
        if self.source != "wire":
            raise Unobserved(
                f"the grader could not see which ranks reached its gate ({self.why}), so a test that grades it "
                "fails rather than take the ranks' own account"
            )
        return self.held[hold] if hold < len(self.held) else ()
