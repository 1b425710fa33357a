"""The data on each TCP connection of the student's network, and when it crossed, captured by the
grader: a timeline no rank writes.

``wire.snapshot`` counts what each connection carried over a whole run; the order of the
messages (who sends before receiving, a pipeline schedule's order, a collective's rounds)
needs their times too.  A rank's trace has them, but the rank writes it.  This program opens
a packet socket (``AF_PACKET``, ``CAP_NET_RAW``: the grader, root) on the loopback interface
of the network namespace it is started in (the sandbox has no other interface) and writes,
for every TCP segment that carries data, the time the kernel saw it leave (its own stamp,
``SO_TIMESTAMPNS``, put on ``time.monotonic``'s clock: a reader the scheduler kept waiting reads a
packet late but never times it late), the two addresses and the payload's length.  Each segment is
seen once, leaving (``PACKET_OUTGOING``);
bytes sent again count once: a segment TCP sent again (a retransmission: whole, or from the middle
of one already seen, which a loaded host makes) is kept only for the bytes past the furthest one
this connection has carried (by sequence number), else dropped.  Its socket filter passes the kernel
only the packets leaving (loopback shows each one leaving and arriving), and it runs at a higher
priority (nice -10) than the ranks it watches, which may keep every core busy: a starved reader lets
the kernel's queue fill and drop packets, and a capture that dropped one is refused.  Only the headers
are read (IP and TCP, bounds checked); the payload, the student's bytes, is never parsed.

The grader runs it as a program (standard library only, no import of the package):
``nsenter --net=/proc/P/ns/net python -I -S capture.py``; it prints ``ready`` once the socket is
bound and the kernel stamps packets as they pass (``_wait_for_live_stamps``), captures until SIGINT
(and what was queued by then: at most ``DRAIN_S`` more where other traffic never lets the queue run dry),
then prints one line per segment, ``t local peer seq bytes``
(times in seconds, ``time.monotonic``), and a last line ``end DROPPED CUT``: the kernel's count
of packets it dropped because the socket's queue was full, and of segments whose data it could
not keep.  Given a file's path (``capture.py PATH``, the grader's own file, for a test that reads
what the data carried) it also keeps each segment's payload, whole, and writes them there, one
after the other in the order of the lines (``wiretimeline.Timeline.carries`` looks for a message's bytes in
them); the payload is still never parsed, only copied.  Past ``MAX_CONNECTION_BYTES`` on one
connection or ``MAX_PAYLOAD_BYTES`` in all (the host's own loopback, where the tests capture, carries
other work's traffic too) a segment's data is not kept and its line ends in ``cut``: what that
connection carried is then unobserved (the data kept for it is let go, its every line marked ``cut``),
and a test that reads it fails.  Keeping payloads costs the
program time per segment; its times are the kernel's all the same.
``Capture`` in this module does that and reads the answer; a capture that could not start, or
that dropped a packet, is refused (``RuntimeError``): a test that needs the timeline
then fails, never the ranks' own clocks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET, PACKET_STATISTICS = 263, 6
SO_RCVBUFFORCE, SO_ATTACH_FILTER = 33, 26  # (linux/asm-generic/socket.h)
SO_TIMESTAMPNS = 35  # ... and SCM_TIMESTAMPNS: each packet's time as the kernel saw it, a struct timespec
STAMP = struct.Struct("qq")  # struct timespec: seconds, nanoseconds (64-bit Linux)
HEADERS = 14 + 60 + 60  # loopback's Ethernet header, the longest IPv4 and TCP headers
WHOLE = 1 << 18  # a whole loopback frame (its MTU is 64 KiB, a segment's payload below it)
QUEUE_BYTES = 256 << 20  # what the kernel may queue for this socket before it drops a packet
SKF_AD_PKTTYPE = 0xFFFFF000 + 4  # SKF_AD_OFF + SKF_AD_PKTTYPE: a filter's load of the packet's type (linux/filter.h)
DRAIN_S = 2.0  # once asked to stop, how long it reads on while packets keep coming
PRIORITY = -10  # the capture's nice value: the kernel drops what a starved reader leaves in the queue
STAMPS_LIVE_S = 10.0  # how long a capture waits for the kernel to stamp packets as they pass, before it refuses
MAX_PAYLOAD_BYTES = 512 << 20  # payloads kept at most in all: past it a segment's data is not kept (marked)
MAX_CONNECTION_BYTES = 64 << 20  # ... and on one connection (the host's own loopback carries other traffic)


def _address(family: int, raw: bytes, port: int) -> str:
    """As ``ss`` writes an IPv4 address (an IPv4-mapped IPv6 one too: it travels as IPv4)."""
    if family == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw)}:{port}"
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return f"{socket.inet_ntop(socket.AF_INET, raw[12:])}:{port}"
    return f"[{socket.inet_ntop(socket.AF_INET6, raw)}]:{port}"


def segment(frame: bytes) -> tuple[str, str, int, int] | None:
    """(source, destination, sequence number, payload bytes) of a loopback frame holding a TCP
    segment with data, else None.  Reads the headers only, each length checked."""
    found = _segment(frame)
    return found[:4] if found is not None else None


def payload(frame: bytes) -> bytes | None:
    """The data a loopback frame's TCP segment carries (None: no data, or the frame was cut short)."""
    found = _segment(frame)
    if found is None:
        return None
    start, size = found[4], found[3]
    return frame[start : start + size] if len(frame) >= start + size else None


def _segment(frame: bytes) -> tuple[str, str, int, int, int] | None:
    """``segment``'s fields and where in ``frame`` the payload starts."""
    if len(frame) < 14:
        return None
    ethertype, ip = struct.unpack("!H", frame[12:14])[0], frame[14:]
    if ethertype == 0x0800 and len(ip) >= 20 and ip[0] >> 4 == 4:
        ihl, total, proto = (ip[0] & 0x0F) * 4, struct.unpack("!H", ip[2:4])[0], ip[9]
        family, src, dst, payload_start, length = 4, ip[12:16], ip[16:20], ihl, total - ihl
    elif ethertype == 0x86DD and len(ip) >= 40 and ip[0] >> 4 == 6:
        proto, length = ip[6], struct.unpack("!H", ip[4:6])[0]
        family, src, dst, payload_start = 6, ip[8:24], ip[24:40], 40
    else:
        return None
    tcp = ip[payload_start:]
    if proto != 6 or len(tcp) < 20 or payload_start < 20:
        return None
    sport, dport, seq = struct.unpack("!HHI", tcp[:8])
    data = length - (tcp[12] >> 4) * 4
    if data <= 0:
        return None
    start = 14 + payload_start + (tcp[12] >> 4) * 4
    return _address(family, src, sport), _address(family, dst, dport), seq, data, start


class Carried:
    """How far each connection's data has reached, by sequence number: ``new(src, dst, seq, size)``
    says how many of a segment's first bytes were carried before (a segment sent again from the
    middle of one already seen), or None where all were (it adds nothing)."""

    def __init__(self):
        self.first: dict[tuple[str, str], int] = {}  # each connection's first sequence number seen
        self.furthest: dict[tuple[str, str], int] = {}  # ... and how far past it its data has reached

    def new(self, src: str, dst: str, seq: int, size: int) -> int | None:
        key = (src, dst)
        offset = (seq - self.first.setdefault(key, seq)) & 0xFFFFFFFF  # (TCP's numbers wrap at 2**32)
        reached = self.furthest.get(key, 0)
        if offset >= 1 << 31 or offset + size <= reached:
            return None
        self.furthest[key] = offset + size
        return max(0, reached - offset)


def _clocks_apart(tries: int = 20) -> float:
    """The wall clock less ``time.monotonic``'s, read once: of ``tries`` readings of the wall clock between two
    of the monotonic one, the one read closest together (a reader preempted between two clock reads, as a
    loaded host does, would be off by as long as it waited: once 3 ms, which put a message's forwarding before
    its arrival)."""
    best = None
    for _ in range(tries):
        before = time.monotonic()
        wall = time.time()
        after = time.monotonic()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) / 2)
    return best[1]


def _monotonic(notes: list[tuple[int, int, bytes]], apart: float) -> float:
    """When the kernel saw a packet (``SCM_TIMESTAMPNS``, taken as it left: ``dev_queue_xmit_nit``), on
    ``time.monotonic``'s clock: a reader the scheduler kept waiting reads the packet late, never stamps it
    late.  The kernel's stamp is on the wall clock; ``apart`` (``_clocks_apart``, read once as the capture
    starts) puts it on the monotonic one, the same for every packet, so their order and spacing are the
    kernel's (a step of the wall clock during a run would move the later ones)."""
    for level, kind, data in notes:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= STAMP.size:
            seconds, nanoseconds = STAMP.unpack_from(data)
            return seconds + nanoseconds / 1e9 - apart
    raise RuntimeError("the kernel gave a packet no time (SO_TIMESTAMPNS)")


def _wait_for_live_stamps(apart: float, within: float = STAMPS_LIVE_S) -> None:
    """Return once the kernel stamps packets as they pass, not when they are read.  Its switch for stamping
    (``netstamp_needed_key``, global) is turned on by a work item that the first socket asking for stamps schedules
    (``net_enable_timestamp``); until it runs, a packet is stamped when its reader reads it.  On a loaded host that
    work item ran late once: two segments were timed 0.3 s and 0.2 s after they were sent, when a reader kept
    waiting read them.  So a datagram on the loopback, read 5 ms after it was sent, must carry a stamp from before
    then; after ``within`` seconds without one the capture refuses (``RuntimeError``)."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receiver.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        receiver.bind(("127.0.0.1", 0))
        receiver.settimeout(1.0)
        end = time.monotonic() + within
        while time.monotonic() < end:
            sent = time.monotonic()
            sender.sendto(b"t", receiver.getsockname())
            time.sleep(0.005)
            try:
                _, notes, _, _ = receiver.recvmsg(16, socket.CMSG_SPACE(STAMP.size))
            except TimeoutError:
                continue
            if _monotonic(notes, apart) < sent + 0.004:  # (stamped on its way, not 5 ms later when read)
                return
    finally:
        receiver.close()
        sender.close()
    raise RuntimeError(f"the kernel did not stamp packets as they passed within {within:g} s (its timestamping off)")


def _capture(payload_path: str | None = None) -> None:
    """The program: capture on ``lo`` until SIGINT, then print the segments (module docstring);
    with ``payload_path``, write their payloads there."""
    stop = []
    keep = HEADERS if payload_path is None else WHOLE
    signal.signal(signal.SIGINT, lambda *_: stop.append(time.monotonic()))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, QUEUE_BYTES)  # (past net.core.rmem_max: root may)
    try:  # ahead of the processes it watches, which may keep every core busy (root may)
        os.setpriority(os.PRIO_PROCESS, 0, PRIORITY)
    except OSError:
        pass
    # a socket filter: "a packet leaving (its type PACKET_OUTGOING), its first `keep` bytes; else
    # nothing", so the kernel queues each segment once (loopback shows it leaving and arriving), and
    # headers only where no payload is kept (struct sock_filter's code, jt, jf, k; struct sock_fprog
    # is their count and a pointer to them)
    program = ctypes.create_string_buffer(
        struct.pack("HBBI", 0x30, 0, 0, SKF_AD_PKTTYPE)  # BPF_LD | BPF_B | BPF_ABS: the packet's type
        + struct.pack("HBBI", 0x15, 0, 1, PACKET_OUTGOING)  # BPF_JMP | BPF_JEQ | BPF_K
        + struct.pack("HBBI", 0x06, 0, 0, keep)  # BPF_RET | BPF_K: accept `keep` bytes
        + struct.pack("HBBI", 0x06, 0, 0, 0)  # ... or none
    )
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HxxxxxxQ", 4, ctypes.addressof(program)))
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # the kernel's time of each packet, not this reader's
    sock.bind(("lo", 0))
    sock.settimeout(0.01)  # how soon it sees SIGINT once the data stops
    apart = _clocks_apart()
    _wait_for_live_stamps(apart)  # (the packet socket above asked for stamps: the switch is on its way)
    print("ready", flush=True)
    carried = Carried()
    lines, payloads, kept, cut = [], [], 0, 0  # (payloads: one per line, None where its data is not kept)
    per_connection: dict[tuple[str, str], int] = {}
    held: dict[tuple[str, str], list[int]] = {}  # each connection's lines whose data is kept
    given_up: set[tuple[str, str]] = set()  # connections a segment of which was not kept
    while True:
        if stop and time.monotonic() > stop[0] + DRAIN_S:
            break  # (asked to stop, and other traffic keeps the queue from running dry)
        try:
            frame, notes, _, address = sock.recvmsg(keep, socket.CMSG_SPACE(STAMP.size))
        except BlockingIOError:
            break  # (asked to stop, and what was queued is read)
        except (TimeoutError, InterruptedError):
            if stop:  # what is queued is read without waiting, then it ends (a timeout here can be a reader the
                sock.setblocking(False)  # scheduler kept waiting past it with packets queued: its wait, not theirs)
            continue
        if address[2] != PACKET_OUTGOING:
            continue
        found = segment(frame)
        if found is None:
            continue
        src, dst, seq, size = found
        skip = carried.new(src, dst, seq, size)
        if skip is None:
            continue  # bytes this connection carried already (sent again)
        line = f"{_monotonic(notes, apart):.6f} {src} {dst} {(seq + skip) & 0xFFFFFFFF} {size - skip}"
        if payload_path is not None:
            data, connection = payload(frame), (src, dst)
            on_connection = per_connection.get(connection, 0)
            if connection not in given_up and (
                data is None or kept + size > MAX_PAYLOAD_BYTES or on_connection + size > MAX_CONNECTION_BYTES
            ):
                # what this connection carried is unknown from now on: the data kept for it is let go (room for
                # the others': on the host's own loopback, other work's connections would crowd the ranks' out)
                given_up.add(connection)
                for i in held.pop(connection, []):
                    kept -= len(payloads[i])
                    payloads[i], lines[i], cut = None, lines[i] + " cut", cut + 1
            if connection in given_up:
                cut += 1
                line += " cut"  # (its data not kept)
                payloads.append(None)
            else:
                held.setdefault(connection, []).append(len(lines))
                payloads.append(data[skip:])
                kept += size - skip
                per_connection[connection] = on_connection + size - skip
        lines.append(line)
    dropped = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]
    if payload_path is not None:
        with open(payload_path, "wb") as f:
            f.write(b"".join(data for data in payloads if data is not None))
    print("\n".join([*lines, f"end {dropped} {cut}"]), flush=True)


class Capture:
    """The grader's side: ``with Capture(netns_pid) as c: ...run...``, then ``c.segments``: a list
    of (time, source, destination, bytes) in the order seen, and ``c.payloads`` each one's TCP
    sequence number and data, (seq, bytes), in the same order (bytes sent again are kept once:
    the program's loop).  ``netns_pid`` None: this process's own namespace.  Raises RuntimeError
    where the capture cannot start, lost a packet or could not keep a payload."""

    def __init__(self, netns_pid: int | None = None, timeout: float = 10.0, payloads: bool = False):
        self.netns_pid, self.keep_payloads = netns_pid, payloads
        self.timeout = timeout if not payloads else max(timeout, 60.0)  # (copying payloads may lag behind)
        self.segments: list[tuple[float, str, str, int]] = []
        self.payloads: list[tuple[int, bytes | None]] = []  # (seq, data), or (seq, None): not kept ("cut")
        self._process: subprocess.Popen | None = None
        self._payload_file: str | None = None

    def __enter__(self) -> Capture:
        return self.start()

    def start(self) -> Capture:
        """Start the capture; returns once its socket is bound (``stop`` ends it)."""
        cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__)]  # (the standard library only: no site)
        if self.keep_payloads:
            fd, self._payload_file = tempfile.mkstemp(prefix="capture-")  # (the grader's, 0600)
            os.close(fd)
            cmd.append(self._payload_file)
        if self.netns_pid is not None:
            cmd = ["nsenter", f"--net=/proc/{self.netns_pid}/ns/net", *cmd]
        self._process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ready = self._process.stdout.readline()
        if ready != b"ready\n":
            self._process.kill()
            self._forget_file()
            why = self._process.communicate(timeout=self.timeout)[1].decode("ascii", "replace").strip()
            raise RuntimeError(f"the packet capture could not start: {why.splitlines()[-1:] or ['no reason given']}")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[tuple[float, str, str, int]]:
        """End the capture and read its segments and their payloads (once)."""
        process, self._process = self._process, None
        if process is None:
            return self.segments
        try:
            process.send_signal(signal.SIGINT)
            try:
                out, err = process.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise RuntimeError("the packet capture did not end when asked") from None
            lines = out.decode("ascii", "replace").splitlines()
            end = lines[-1].split() if lines else []
            if len(end) != 3 or end[0] != "end":
                why = err.decode("ascii", "replace")[-300:]
                raise RuntimeError(f"the packet capture ended without its count: {why}")
            if int(end[1]):
                raise RuntimeError(f"the packet capture lost {end[1]} packets (its queue was full)")
            data = b""
            if self._payload_file is not None:
                with open(self._payload_file, "rb") as f:
                    data = f.read()
        finally:
            self._forget_file()
        at = 0
        for line in lines[:-1]:
            t, src, dst, seq, size, *cut = line.split()
            self.segments.append((float(t), src, dst, int(size)))
            if self.keep_payloads:
                self.payloads.append((int(seq), None if cut else data[at : at + int(size)]))
                at += 0 if cut else int(size)
        if at != len(data):
            raise RuntimeError(f"the packet capture's payloads hold {len(data)} bytes, its segments {at}")
        # in the order they left: the kernel's stamps, taken on whichever core sent each, may be read a little
        # out of it (stable: a connection's own segments keep theirs)
        order = sorted(range(len(self.segments)), key=lambda i: self.segments[i][0])
        self.segments = [self.segments[i] for i in order]
        self.payloads = [self.payloads[i] for i in order] if self.keep_payloads else self.payloads
        return self.segments

    def _forget_file(self) -> None:
        if self._payload_file is not None:
            try:
                os.unlink(self._payload_file)
            except FileNotFoundError:
                pass
            self._payload_file = None


if __name__ == "__main__":
    _capture(sys.argv[1] if len(sys.argv) > 1 else None)
