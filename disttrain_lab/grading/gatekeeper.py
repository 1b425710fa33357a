"""The grader's end of a gate in a graded run's backward pass (the rank's end and why: ``gate.py``).

``Gatekeeper(netns_pid, answers, sent).start()`` listens on a port of the loopback in the student's
network namespace (the socket is made by a thread that joins that namespace with ``setns``, then the
grader's own threads serve it), and a thread of the grader's serves the run:

1. each rank connects and says which rank it is (its claim: a rank that lies gets another rank's answer,
   and its backward is then wrong);
2. when every rank has reached a (micro-)step (``START``), each is told to go on (``GO``, one byte): the
   capture sees the first of these leave, a mark (a rank told first may send before the others are told:
   every earlier message was done when the last rank said ``START``); rounds repeat, one per micro-step
   and one after the last; ``sent()`` counts the bytes from the latest round;
3. when every rank is held in that step's backward (``HOLD``, with the size of the gradient it holds),
   the grader reads from the OS what each rank has sent the others since step 2 (``sent``: ``ss`` in the
   namespace, as ``wire.snapshot`` reads it), again and again until every rank has sent at least
   ``MIN_SENT`` bytes and the counts stopped growing with no thread of a rank left to run, or ``HOLD_S``
   passed; then it gives each rank its answer (``answers[rank]``, drawn by the test at grading time; zeros
   where a rank asks for another size).  Answers all None: the grader answers zeros, once every rank is
   held and the counts did not grow over ``QUIET_S`` with no thread of a rank left to run (``_quiet``, no
   minimum: what the ranks sent each other while held has crossed; lab 2 holds every rank at each receive;
   lab 10 holds a rank before its ring sends anything, the next one at its first block's computation);
   where some rank is not held ``HELD_WAIT`` seconds after the first, it answers those that are
   (``Seen.held`` names them), and any later one at once.  ``answers`` may also be a list of such rounds,
   one per hold in the order the ranks are held (a rank's k-th ``HOLD`` is round k's): lab 3 holds one
   rank before its backward and the others after theirs, then all in the last step.  A round given as
   ``gate.Behind`` (answers all None) is answered apart: once every rank is held there, every rank but the one
   behind at once; that one once each other rank is held at the next round, or ``HELD_WAIT`` seconds after their
   answers (``Seen.ranks_ahead``): lab 14 holds both ranks at every layer and keeps one a layer behind, told
   nothing of where.
4. a rank's host link (``Gate.link``: a kind, a length, then the payload, at most ``MAX_LINK_BYTES`` a run) is
   kept as data with the number of holds answered when it was read (``Seen.link``); before answering a hold
   the grader reads, without waiting, what each held rank sent by then (its main thread waits at the gate: its
   link's copies alone come), so a copy asked for before the hold is that hold's (lab 9's ``OffloadAdam``).

``stop()`` closes everything; ``seen(segments, origin)`` finds, among the capture's segments, when each
message the grader sent each rank left (by its first byte's position in the connection: TCP keeps a
direction's bytes in order): each round's first ``GO`` and the first answer, ``gate.Seen`` on the
timeline's clock.  Anything that goes
wrong (a rank that never connects, a message that is not the protocol's) leaves the gate unobserved,
with why, and the test that reads it fails.  Nothing a rank sends is evaluated; each read is bounded.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch

from disttrain_lab.gate import (
    DOWN,
    GO,
    HELLO,
    HOLD,
    MAX_ELEMENTS,
    MAX_LINK_BYTES,
    MAX_VALUES,
    START,
    UP,
    VALUE,
    Behind,
    Seen,
)

__all__ = ["Gatekeeper"]

CLONE_NEWNET = 0x40000000
HOLD_S = 5.0  # at most this long the grader holds the ranks, waiting for their bytes to settle
POLL_S = 0.02  # between two reads of the OS's counts while holding
QUIET_S = 0.005  # ranks all held, answers all None: what they sent must not grow over this long
MIN_SENT = 48 + 4 * 4  # each rank has sent at least one message of 4 floats, with gloo's preamble
HELD_WAIT = 10.0  # answers all None: how long after the first rank is held the others may take to be held
_MESSAGE = {HELLO: 4, START: 0, HOLD: 4, VALUE: 4}  # each message's bytes after its first
_LINK = {DOWN: "down", UP: "up"}  # a host link's messages: their length ("<I") after the first byte, then the payload


def _listening(netns_pid: int | None) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 in the network namespace of process ``netns_pid`` (None:
    this process's own), made in a thread of its own that joins that namespace first."""
    made: list = []

    def make():
        try:
            if netns_pid is not None:
                fd = os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into process {netns_pid}'s network namespace")
                finally:
                    os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            made.append(sock)
        except OSError as exc:
            made.append(exc)

    thread = threading.Thread(target=make, name="gate-socket")  # (its namespace ends with it)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def _address(address: tuple) -> str:
    return f"{address[0]}:{address[1]}"


class Gatekeeper:
    """See the module docstring."""

    def __init__(
        self,
        netns_pid: int | None,
        answers: list,
        sent: Callable[[object], list[int]],
        baseline: Callable[[], object],
        timeout: float,
        busy: Callable[[], bool] = lambda: False,
        holding: Callable[[list[tuple[str, str]]], str] = lambda connections: "",
        memory: Callable[[list[tuple[str, str]]], list[int | str | None]] | None = None,
    ):
        self.netns_pid, self.sent, self.baseline = netns_pid, sent, baseline
        self.busy, self.holding, self.memory = busy, holding, memory
        rounds = answers if answers and isinstance(answers[0], (list, tuple)) else [answers]
        self.rounds_of_answers: list[list] = [list(r) for r in rounds]  # each hold round's answers, per rank
        # the hold rounds answered apart (``gate.Behind``): round -> the rank kept behind
        self.behind = {i: r.behind for i, r in enumerate(rounds) if isinstance(r, Behind)}
        self.ahead: list[tuple[int, tuple[int, ...]]] = []  # (such a round, the ranks held at the next when let go)
        self.world_size, self.timeout = len(self.rounds_of_answers[0]), timeout
        self.why: str | None = None
        self.settled = False
        self.connections: list[tuple[str, str]] = []  # (the gate's address, the rank's), as the capture writes them
        # what the grader sent on each connection: (kind, bytes, the hold round an answer is of)
        self.messages: list[list[tuple[bytes, int, int | None]]] = []
        self.rounds = 0  # rounds of GO sent
        # each hold round's kind: answers to compute with, once the ranks' bytes settled (else zeros, at once)
        self.settles = [any(a is not None for a in r) for r in self.rounds_of_answers]
        self.held_ranks: list[tuple[int, ...]] = []  # each round's ranks held when answered (as they said who)
        self.said: list[dict[int, tuple[float, ...]]] = []  # each hold round's values, by rank (Gate.say)
        self.memory_by_round: list[tuple[int | str | None, ...]] = []  # each hold round's memory, by rank (``memory``)
        self.link: list[tuple[int, str, int, bytes]] = []  # what ranks' host links carried (``Seen.link``)
        self._link_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._socks: list[socket.socket] = []
        self._round, self._held = 0, 0  # the hold round now, and how many ranks it holds
        self._settling = 0  # hold rounds with answers so far (``settled``: whether the bytes settled in every one)

    def start(self) -> int:
        """Listen and serve in a thread; returns the port the ranks connect to."""
        self._listener = _listening(self.netns_pid)
        self._thread = threading.Thread(target=self._serve, name="gatekeeper", daemon=True)
        self._thread.start()
        return self._listener.getsockname()[1]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HOLD_S + 5)
        if not self.connections:  # (a run that held its ranks without a round of marks)
            try:
                self.connections = [(_address(s.getsockname()), _address(s.getpeername())) for s in self._socks]
            except OSError:
                pass
        for sock in [*self._socks, *([self._listener] if self._listener else [])]:
            try:
                sock.close()
            except OSError:
                pass
        if self.why is None and len(self.connections) != self.world_size:
            self.why = "the run ended before every rank reached the gate"
        if self.why is None and any(self.settles[self._round :]):
            self.why = f"the run ended with {self._held} of {self.world_size} ranks held at the gate"

    def seen(self, segments: list[tuple[float, str, str, int]], origin: float) -> Seen:
        """When the capture saw the gate's messages leave (see the module docstring), on the clock of a
        timeline whose first segment was at ``origin``."""
        if self.why is not None:
            return Seen.unobserved(self.why)
        marks: list[list[float]] = [[] for _ in range(self.rounds)]
        answered: dict[int, list[float]] = {}  # each hold round's answers: when each left
        crossing = self.settles.index(True) if True in self.settles else None  # the round whose answers count
        for (local, peer), sent in zip(self.connections, self.messages):
            left = _first_bytes(
                [(t, n) for t, src, dst, n in segments if src == local and dst == peer and n > 0],
                [size for _, size, _ in sent],
            )
            if left is None:
                return Seen.unobserved(f"the capture did not see every message the gate sent the rank at {peer}")
            go = [t for (kind, _, _), t in zip(sent, left) if kind == GO]
            for (kind, _, r), t in zip(sent, left):
                if kind != GO:
                    answered.setdefault(r, []).append(t)
            if len(go) != self.rounds:
                return Seen.unobserved(f"the rank at {peer} was sent {len(go)} of the gate's {self.rounds} rounds")
            for i, t in enumerate(go):
                marks[i].append(t)
        firsts = [min(m) for m in marks if m]
        cuts = [min(answered[r]) if r in answered else None for r in range(len(self.settles))]
        cut = cuts[crossing] if crossing is not None and crossing < len(cuts) else None
        start = max((t for t in firsts if cut is None or t < cut), default=None)
        if crossing is not None and (cut is None or start is None):
            return Seen.unobserved("the capture saw a rank's answer leave before any rank was told to begin")
        shift = lambda t: None if t is None else round(t - origin, 6)  # noqa: E731
        return Seen(
            start=shift(start),
            cut=shift(cut),
            settled=self.settled,
            marks=tuple(shift(t) for t in firsts),
            held=tuple(self.held_ranks),
            cuts=tuple(shift(t) for t in cuts),
            values=tuple(tuple(said.get(r, ()) for r in range(self.world_size)) for said in self.said),
            memory=tuple(self.memory_by_round),
            link=tuple(self.link),
            ahead=tuple(self.ahead),
        )

    # ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._run()
        except (OSError, ValueError, TimeoutError, RuntimeError) as exc:  # (RuntimeError: a rank's /proc gone)
            self.why = f"the gate's protocol failed: {type(exc).__name__}: {exc}"[:300]

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        buffers: dict[socket.socket, bytearray] = {}
        rank_of: dict[socket.socket, int] = {}
        started: set[socket.socket] = set()
        held: dict[socket.socket, int] = {}
        sent: dict[socket.socket, list[tuple[bytes, int]]] = {}
        base, first_held = None, None
        early: set[socket.socket] = set()  # at a round answered apart: the ranks answered, all but the one behind
        ahead_held: dict[socket.socket, int] = {}  # those of them held at the next round meanwhile
        early_at = 0.0  # when they were answered
        holds_of: dict[socket.socket, int] = {}  # how many times each rank has been held
        values: dict[socket.socket, list[float]] = {}  # what each rank said since its last hold
        while not self._stop.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run was still at the gate after {self.timeout:g} s")
            for key, _ in selector.select(timeout=0.1):
                if key.fileobj is self._listener:
                    sock, _ = self._listener.accept()
                    if len(self._socks) >= self.world_size:
                        sock.close()  # (only a run's ranks connect)
                        continue
                    sock.setblocking(True)
                    sock.settimeout(5.0)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._socks.append(sock)
                    buffers[sock], sent[sock] = bytearray(), []
                    selector.register(sock, selectors.EVENT_READ)
                    continue
                sock = key.fileobj
                data = sock.recv(1 << 16)
                if not data:
                    selector.unregister(sock)
                    continue
                buffers[sock] += data
                for kind, value in self._messages(buffers[sock]):
                    if kind in _LINK:
                        self._keep_link(rank_of.get(sock), kind, value)
                    elif kind == HELLO:
                        rank_of[sock] = value
                    elif kind == START:
                        started.add(sock)
                    elif kind == VALUE:
                        values.setdefault(sock, []).append(value)
                        if len(values[sock]) > MAX_VALUES:
                            raise ValueError(f"a rank said more than {MAX_VALUES} values before one hold")
                    else:
                        r = holds_of.get(sock, 0)  # (a rank's k-th hold is round k's)
                        holds_of[sock] = r + 1
                        while len(self.said) <= r:
                            self.said.append({})
                        if sock in rank_of:
                            self.said[r][rank_of[sock]] = tuple(values.pop(sock, ()))
                        if r == self._round + 1 and sock in early:  # (let go first at a round answered apart)
                            ahead_held[sock] = value
                            continue
                        if r >= len(self.settles) or r > self._round or (r < self._round and self.settles[r]):
                            raise ValueError(f"a rank asked the gate to hold it a {r + 1}th time, out of turn")
                        if r < self._round:  # (late, where the grader answered the others without it: at once)
                            self._send(sock, self._answer(None, value, r), (HOLD, r), sent)
                        else:
                            held[sock] = value
                            first_held = first_held or time.monotonic()
            if len(started) == self.world_size:  # a round: every rank at the same (micro-)step
                if any(self.settles[self._round :]):
                    base = self.baseline()
                for sock in started:
                    self._send(sock, GO, (GO, None), sent)
                started.clear()
                self.rounds += 1
                if not self.connections:
                    self.connections = [(_address(s.getsockname()), _address(s.getpeername())) for s in self._socks]
            self._held = len(held)
            settles = self._round < len(self.settles) and self.settles[self._round]
            apart = not settles and first_held is not None and time.monotonic() - first_held > HELD_WAIT
            behind = [s for s in held if self._round in self.behind and rank_of.get(s) == self.behind[self._round]]
            if early and (len(ahead_held) == len(early) or time.monotonic() - early_at > HELD_WAIT):
                # a round answered apart, the others answered: the one behind let go, the next round begun
                why = self._not_held([*behind, *ahead_held])
                if why and self.why is None:
                    self.why = why
                self.ahead.append((self._round, tuple(sorted(rank_of.get(s, -1) for s in ahead_held))))
                for sock in behind:
                    answer = self._answer(rank_of.get(sock), held[sock], self._round)
                    self._send(sock, answer, (HOLD, self._round), sent)
                self._round += 1
                held, first_held, early, ahead_held = dict(ahead_held), time.monotonic(), set(), {}
                self.messages = [sent[s] for s in self._socks]
                continue
            if not early and len(behind) == 1 and len(held) == self.world_size and self.world_size > 1:
                # a round answered apart: every rank but the one behind answered now (``gate.Behind``)
                why = self._not_held(list(held))
                if why and self.why is None:
                    self.why = why
                self._quiet()
                if self.memory is not None:
                    self.memory_by_round.append((None,) * self.world_size)
                self.held_ranks.append(tuple(sorted(rank_of.get(sock, -1) for sock in held)))
                for sock, numel in held.items():
                    if sock not in behind:
                        self._drain_links(sock, buffers[sock], rank_of.get(sock))
                        self._send(sock, self._answer(rank_of.get(sock), numel, self._round), (HOLD, self._round), sent)
                        early.add(sock)
                held, early_at = {behind[0]: held[behind[0]]}, time.monotonic()
                self.messages = [sent[s] for s in self._socks]
                continue
            if held and (len(held) == self.world_size or apart) and not early:
                why = self._not_held(list(held))
                if why and self.why is None:  # (answered all the same: the run ends, the test reading the gate fails)
                    self.why = why
                if self.memory is not None:  # each held rank's memory, while it waits here (None: not read)
                    # once no thread of a rank is left to run: what gloo's own threads free after a collective
                    # has completed (its work, and the buffers it holds) is freed before the reading
                    self._quiet()
                    ends = [(_address(s.getsockname()), _address(s.getpeername())) for s in held]
                    by_rank = dict(zip((rank_of.get(s) for s in held), self.memory(ends))) if not why else {}
                    self.memory_by_round.append(tuple(by_rank.get(r) for r in range(self.world_size)))
                if settles:  # (one rank alone sends no one anything: its count settles at 0)
                    settled = self._hold(base, MIN_SENT if self.world_size > 1 else 0)
                    self.settled = settled and (self.settled or not self._settling)  # (every such round's)
                    self._settling += 1
                elif not apart:  # (what the ranks already sent each other crosses before the answers)
                    self._quiet()
                for sock in held:  # what their host links sent before the answers: this hold's
                    self._drain_links(sock, buffers[sock], rank_of.get(sock))
                for sock, numel in held.items():
                    self._send(sock, self._answer(rank_of.get(sock), numel, self._round), (HOLD, self._round), sent)
                self.held_ranks.append(tuple(sorted(rank_of.get(sock, -1) for sock in held)))
                self._round, held, first_held = self._round + 1, {}, None
            self.messages = [sent[s] for s in self._socks]
        # the run has ended (``stop``): what the ranks' host links sent after the last answer and the loop had not read
        # yet (a busy host: the run can end between two of its reads) is still theirs, kept as after the last hold
        for sock in list(buffers):
            self._drain_links(sock, buffers[sock], rank_of.get(sock))

    @staticmethod
    def _send(sock: socket.socket, data: bytes, kind: tuple, sent: dict) -> None:
        """``kind``: (GO, None), or (HOLD, the hold round it answers)."""
        sock.sendall(data)
        if data:
            sent[sock].append((kind[0], len(data), kind[1]))

    @staticmethod
    def _messages(buffer: bytearray, links_only: bool = False):
        """Whole messages off the front of ``buffer``: (kind, value; a host link's: its payload); ``links_only``:
        up to the first that is not a host link's."""
        while buffer:
            kind = bytes(buffer[:1])
            if kind in _LINK:
                if len(buffer) < 5:
                    return
                (size,) = struct.unpack("<I", buffer[1:5])
                if size > MAX_LINK_BYTES:
                    raise ValueError(f"a rank's host link sent the gate {size:,} bytes at once")
                if len(buffer) < 5 + size:
                    return
                value = bytes(buffer[5 : 5 + size])
                del buffer[: 5 + size]
                yield kind, value
                continue
            if links_only:
                return
            if kind not in _MESSAGE:
                raise ValueError(f"a rank sent the gate {kind!r}, not one of its messages")
            size = 1 + _MESSAGE[kind]
            if len(buffer) < size:
                return
            value = struct.unpack("<f" if kind == VALUE else "<I", buffer[1:size])[0] if size > 1 else 0
            del buffer[:size]
            yield kind, value

    def _keep_link(self, rank: int | None, kind: bytes, payload: bytes) -> None:
        """A host link's copy, kept with the hold it came before (how many the grader had answered)."""
        self._link_bytes += len(payload)
        if self._link_bytes > MAX_LINK_BYTES:
            raise ValueError(f"a run's host links sent the gate over {MAX_LINK_BYTES:,} bytes")
        self.link.append((-1 if rank is None else rank, _LINK[kind], self._round, payload))

    def _drain_links(self, sock: socket.socket, buffer: bytearray, rank: int | None) -> None:
        """What ``sock``'s rank has sent by now (its main thread is held: its host link's threads alone send), read
        without waiting: its host link's copies kept as this hold's (the rest stays for the loop)."""
        sock.setblocking(False)
        try:
            while data := sock.recv(1 << 16):
                buffer += data
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            sock.settimeout(5.0)
        for kind, payload in self._messages(buffer, links_only=True):
            self._keep_link(rank, kind, payload)

    def _not_held(self, held: list[socket.socket]) -> str:
        """Why the ranks that said they are held on ``held`` are not all waiting there themselves ('' where each
        one's main thread is blocked reading its gate connection: ``holding``), read again for up to ``HOLD_S``
        (a rank goes from its ``HOLD`` to its read in a moment, later on a loaded host)."""
        connections = [(_address(s.getsockname()), _address(s.getpeername())) for s in held]
        until, why = time.monotonic() + HOLD_S, ""
        while time.monotonic() < until and not self._stop.is_set():
            why = self.holding(connections)
            if not why:
                return ""
            time.sleep(POLL_S)
        return why

    def _hold(self, base, minimum: int) -> bool:
        """Wait until each rank has sent ``minimum`` bytes since ``base`` and the counts stopped growing while
        no thread of a rank was left to run (``busy``: on a loaded host a rank's sending thread may wait for a
        core longer than two reads apart, its bytes unsent); whether they did within ``HOLD_S``."""
        until, last = time.monotonic() + HOLD_S, None
        while time.monotonic() < until and not self._stop.is_set():
            counts = self.sent(base)
            if all(n >= minimum for n in counts) and counts == last and not self.busy():
                return True
            last = counts
            time.sleep(POLL_S)
        return False

    def _quiet(self) -> bool:
        """Wait until nothing the ranks sent each other grew over ``QUIET_S`` and no thread of a rank was left
        to run (the ranks all held: each is waiting, so nothing more crosses until the grader answers); whether
        that came within ``HOLD_S``.  Cheaper than ``_hold``'s (two reads of the OS's counts, ``QUIET_S``
        apart): lab 2 holds every rank at each of its receives, 42 rounds in one graded cell."""
        until = time.monotonic() + HOLD_S
        while time.monotonic() < until and not self._stop.is_set():
            base = self.baseline()
            time.sleep(QUIET_S)
            if not any(self.sent(base)) and not self.busy():
                return True
        return False

    def _answer(self, rank: int | None, numel: int, round_: int) -> bytes:
        if numel > MAX_ELEMENTS:
            raise ValueError(f"a rank asked the gate for {numel:,} values")
        answers = self.rounds_of_answers[round_]
        answer = answers[rank] if rank is not None and 0 <= rank < self.world_size else None
        if answer is None or answer.numel() != numel:
            answer = torch.zeros(numel)
        return answer.detach().to(torch.float32).contiguous().numpy().tobytes()


def _first_bytes(segments: list[tuple[float, int]], sizes: list[int]) -> list[float] | None:
    """When the first byte of each of a connection's messages (``sizes`` bytes each, in order) left: the
    time of the segment that carried it (``segments``: (time, payload bytes), in order).  None where the
    segments carry fewer bytes than the messages."""
    starts = list(itertools.accumulate([0, *sizes[:-1]])) if sizes else []
    times, total, i = [], 0, 0
    for t, n in segments:
        total += n
        while i < len(starts) and starts[i] < total:
            times.append(t)
            i += 1
    return times if len(times) == len(sizes) else None
