"""Lab 5's timing checks: a step's idle fraction on the simulated accelerator against the bubble
(p − 1)/(m + p − 1), in a graded cell of its own per exercise.

Under grading the step's length comes from the wire, not from the ranks' clocks: from gloo's
handshake as the launch opens the ranks' connections (the only segments under 48 bytes; the ranks
then set up and call the step function, a few milliseconds that count as idle) to the last
gradient reaching stage 0, plus stage 0's last backward, which follows it.  The run's bytes must be
the schedule's messages (``checks.assert_messages``), so no other traffic moves either end.  Every
stage computes 3 · BUBBLE_COST per micro-batch (a forward, a backward twice as long: the grader's
own setting), so the idle fraction is 1 − m · 3 · BUBBLE_COST / that length, the same on every
stage.  A stage that holds its work back past the last gradient only hides its own slowness, and
never beats the schedule's dependencies.  In a student's own notebook the ranks' F/B boxes give it.

That busy time is the ranks' to spend (the notebook's ``Stage`` sleeps ``stage.cost`` per row, and the
step function can change ``stage.cost``), so under grading the wire must also show it spent
(``_assert_computed``): a stage that sent a message sooner after its input than the compute between
them takes fails, whatever idle fraction its step's length gives.  Stage 0's backwards send nothing:
in GPipe the wire bounds only its forwards, from its connections' handshake to each activation it
sends; in 1F1B each forward after the warm-up follows a backward, so the window from a gradient's
arrival to a later activation's send holds both, on stage 0 as on every stage before the last."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ... import checks, viz, wire
from ...exercise import ExerciseRun
from .order import _messages, _payloads
from .stages import _DRIVERS, _launch, _schedule

BUBBLE_COST = 0.03  # bubble tests: 30 ms of simulated forward per micro-batch (60 ms backward)
BUBBLE_BELOW, BUBBLE_ABOVE = 0.08, 0.15  # measured idle within −0.08 … +0.15 of (p − 1)/(m + p − 1):
# messages and Python between the boxes only add idle time
BUBBLE_TRIES = 5  # a run over the range runs again, 5 runs in all; the least idle counts (3 were too few
# for the solution once, in a suite beside other test runs at load 10 on 2 cores: a launch's set-up counts as idle)
BUBBLE_SLACK = 0.002  # s by which a window on the wire may fall short of the compute it must hold: the capture's
# times are rounded to the microsecond and put on time.monotonic's clock once; the byte bounds themselves only
# ever err towards more time (the solution, every graded case 4 times at load 5 on 2 cores: its least window
# held 1.008× its compute, 60.45 ms seen for a middle stage's 60 ms backward)


def _idle(run: ExerciseRun, case: str, p: int, m: int, rows: int, name: str) -> list[float]:
    """Each stage's idle fraction of the step: from the wire under grading (never the ranks' boxes: where
    the wire was not captured, reading it raises ``wire.Unobserved``), after the wire has shown the stages'
    compute spent (``_assert_computed``); from the boxes in a student's own notebook."""
    if run.timeline.source == "trace":
        return viz.pipeline_idle(_schedule(run), step=0)
    checks.assert_messages(
        run, _messages(p, rows * m, m, 1), case, "The timed step sends the same messages as the graded one."
    )
    segments = run.timeline.segments or []
    data = [t for t, _, _, n in segments if n >= wire.GLOO_PREAMBLE]
    handshake = [t for t, _, _, n in segments if n < wire.GLOO_PREAMBLE and data and t <= data[0]]
    back = [t for t, a, b, n in segments if (a, b) == (1, 0) and n > wire.GLOO_PREAMBLE]
    if not handshake or not back:
        raise wire.Unobserved(
            "the step's start (gloo's handshake as the launch opens the connections) or its last gradient was "
            "not seen on the wire, so its idle time cannot be measured from outside the ranks"
        )
    _assert_computed(run, case, p, m, rows, name)
    length = back[-1] - handshake[-1] + 2 * BUBBLE_COST
    return [1.0 - m * 3 * BUBBLE_COST / length] * p


def _windows(run: ExerciseRun, p: int, m: int, rows: int, name: str) -> list[tuple[str, int, int, int, float, float]]:
    """What the wire says each stage computed, as windows ``(kind, stage, j, k, seen, need)``: between two times
    of the grader's capture, ``seen`` seconds apart, the stage must have run work the simulated accelerator
    charges ``need`` seconds for (F: BUBBLE_COST a micro-batch, B: twice that), one piece after the other (a
    stage is one device: the step function calls stage.forward and stage.backward in turn).

    A window opens when the stage's j-th input message had surely all crossed (it can start no work on it
    before) and closes when its k-th output message had surely begun to (an honest stage posts a send only
    once it has computed what it sends, and TCP keeps a direction's bytes in order, so every byte from that
    message's first on was written after).  By then it has computed k + 1 outputs, of which at least
    k − j + 1 used inputs from the j-th on: those ran inside the window.  Kinds: "F" on a middle stage
    (activations in, activations out), "B" there (gradients in, gradients out), "FB" on the last stage
    (activations in, gradients out: each micro-batch's F, the loss and its B), and "start" on stage 0 (its
    connections' handshake, before its step began, to each activation: k + 1 forwards).  Stage 0's backwards
    send nothing, so in GPipe the wire cannot time them (the step's length already adds its last one).  In 1F1B
    (``name``), stage s runs p − s − 1 warm-up forwards, then F(i), B(i − p + s + 1) in turn: its forward of
    micro-batch j + p − s follows its backward of j, so "BF" on every stage before the last (stage 0
    included) is the window from gradient j's arrival to activation k's send, k ≥ j + p − s: the backwards
    of j … k − p + s and the forwards of j + p − s … k, k − j − p + s + 1 of each (``order.py`` checks that
    activation j + p − s leaves only after gradient j has come).

    Byte positions bound each message (as in ``order.py``; no payload is read): a direction carries gloo's
    handshake (8 bytes, one way), 96 bytes before each message's payload (a note as its send is posted, then
    its preamble) and a 48-byte note for each receive its sender posts for the other end's messages (at most
    m in a step).  A message has surely ended once the bytes passed its own and every earlier message's, and
    the notes that surely went before it: a gradient's sender has received j + 1 activations by the time it
    sends its j-th gradient, and gloo sends a message only after its receiver's note.  It has surely begun
    once they passed the most that can stand before it (the handshake, the earlier messages, all m notes).
    Both bounds err towards more time in a window, never less, so an honest run is never failed; the
    capture's times are the kernel's stamps as each segment left (before its receiver could read it)."""
    timeline, note = run.timeline, wire.GLOO_PREAMBLE
    segments = timeline.segments or []
    sent = [t for t, a, _, n in segments if a == 0 and n >= note]
    opened = [t for t, a, b, n in segments if n < note and 0 in (a, b) and sent and t <= sent[0]]
    if not opened:
        raise wire.Unobserved(
            "stage 0's connections opening (gloo's handshake as the launch begins) was not seen on the wire, so "
            "its forwards cannot be timed from outside the ranks"
        )

    def ended(src: int, dst: int, sizes: list[int], j: int, notes: int) -> float:
        at = sum(sizes[: j + 1]) + 2 * note * (j + 1) + note * notes
        return _at(timeline.passed(src, dst, at - 1), src, dst)

    def begun(src: int, dst: int, sizes: list[int], k: int) -> float:
        at = wire.HANDSHAKE_BYTES + sum(sizes[:k]) + 2 * note * k + note * m
        return _at(timeline.passed(src, dst, at), src, dst)

    forward, found = BUBBLE_COST, []
    for s in range(p):
        if s == 0:
            acts = _payloads(p, 0, rows * m, m, 1)
            found += [("start", 0, 0, k, begun(0, 1, acts, k) - opened[-1], (k + 1) * forward) for k in range(m)]
            continue
        before = _payloads(p, s - 1, rows * m, m, 1)  # what stage s receives from s − 1, and sends it back
        arrived = [ended(s - 1, s, before, j, 0) for j in range(m)]
        if s == p - 1:
            out = [begun(s, s - 1, before, k) for k in range(m)]
            found += _spans("FB", s, arrived, out, 3 * forward)
            continue
        after = _payloads(p, s, rows * m, m, 1)
        found += _spans("F", s, arrived, [begun(s, s + 1, after, k) for k in range(m)], forward)
        back = [ended(s + 1, s, after, j, j + 1) for j in range(m)]
        found += _spans("B", s, back, [begun(s, s - 1, before, k) for k in range(m)], 2 * forward)
    if name == "one_f_one_b_step":
        for s in range(p - 1):
            after = _payloads(p, s, rows * m, m, 1)
            back = [ended(s + 1, s, after, j, j + 1) for j in range(m)]
            out = [begun(s, s + 1, after, k) for k in range(m)]
            found += [
                ("BF", s, j, k, out[k] - back[j], (k - j - p + s + 1) * 3 * forward)
                for j in range(m)
                for k in range(j + p - s, m)
            ]
    return found


def _at(when: float | None, src: int, dst: int) -> float:
    """A time ``Timeline.passed`` found; where the data never reached that byte, the wire is unobserved."""
    if when is None:  # (assert_messages counted every byte these positions need)
        raise wire.Unobserved(f"the capture's times do not cover what rank {src} sent rank {dst}")
    return when


def _spans(kind: str, s: int, arrived: list[float], out: list[float], each: float) -> list:
    """Windows from each input j to each output k ≥ j: k − j + 1 pieces of ``each`` seconds."""
    n = len(out)
    return [(kind, s, j, k, out[k] - arrived[j], (k - j + 1) * each) for k in range(n) for j in range(k + 1)]


def _assert_computed(run: ExerciseRun, case: str, p: int, m: int, rows: int, name: str = "gpipe_step") -> float:
    """Under grading: every stage spent the simulated accelerator's time, as far as the wire can show it
    (``_windows``), within BUBBLE_SLACK.  Fails where a window holds less, naming the stage, the micro-batches,
    the time seen and the compute required (a single micro-batch's window first, else the shortest one);
    returns the least ratio of time seen to compute required (the margin an honest run leaves)."""
    windows = _windows(run, p, m, rows, name)
    short = [w for w in windows if w[4] < w[5] - BUBBLE_SLACK]
    if short:
        raise AssertionError(_too_short(case, m, *min(short, key=lambda w: (w[2] != w[3], w[4] / w[5]))))
    return min(seen / need for *_, seen, need in windows)


def _too_short(case: str, m: int, kind: str, s: int, j: int, k: int, seen: float, need: float) -> str:
    """What a window that held too little compute says (``_windows``' kinds)."""
    sent = _gradient(k, m) if kind in ("B", "FB") else f"micro-batch {k}'s activations"
    came = "micro-batch 0's gradient" if m == 1 else f"gradient {j}"  # (named in full as what it sent)
    since = {
        "start": "its connections opened (gloo's handshake as the launch began; its step starts after)",
        "B": f"{came} from stage {s + 1} had reached it",
        "BF": f"{came} from stage {s + 1} had reached it",
    }.get(kind, f"micro-batch {j}'s activations had reached it")
    if kind == "BF":  # (k ≥ j + 1: 1F1B's backward of j, then the forward it lets in, in turn)
        pairs = round(need / (3 * BUBBLE_COST))  # backwards j … j + pairs − 1, forwards k − pairs + 1 … k
        ran = (
            f"gradient {j}'s backward, then micro-batch {k}'s forward"
            if pairs == 1
            else f"the backwards of gradients {j} … {j + pairs - 1} and the forwards of micro-batches "
            f"{k - pairs + 1} … {k} in turn"
        )
        held = (
            f"1F1B runs {ran} in between (after the warm-up each forward follows a backward), and they take "
            f"{need * 1e3:.0f} ms"
        )
    elif j == k:
        one = {
            "F": "forward takes",
            "start": "forward takes",
            "B": "backward takes",
            "FB": "forward, loss and backward take",
        }
        held = f"{'micro-batch 0' if kind == 'start' else 'a micro-batch'}'s {one[kind]} {need * 1e3:.0f} ms"
    else:
        works = {"F": "forwards", "start": "forwards", "B": "backwards", "FB": "forwards, losses and backwards"}[kind]
        ran = f"gradients {j} … {k}" if kind == "B" else f"micro-batches {j} … {k}"
        held = (
            f"the {works} of {ran}, which it ran {'before' if kind == 'start' else 'in between'} one after the "
            f"other, take {need * 1e3:.0f} ms"
        )
    return (
        f"{case}: stage {s}{' (the last)' if kind == 'FB' else ''} began sending {sent} {seen * 1e3:.1f} ms after "
        f"{since}, as the grader's capture timed the bytes, but {held} on the simulated accelerator "
        f"({BUBBLE_COST * 1e3:.0f} ms of forward per micro-batch, twice that of backward): at least "
        f"{(need - BUBBLE_SLACK) * 1e3:.0f} ms must lie between them ({BUBBLE_SLACK * 1e3:.0f} ms allowed for the "
        f"capture's clock). The bubble is measured against that compute, so every stage must spend it: call "
        f"stage.forward and stage.backward as given, and leave stage.cost and time.sleep alone."
    )


def _gradient(k: int, m: int) -> str:
    """The k-th gradient a stage sends back, named by its micro-batch (GPipe may run the backwards in reverse)."""
    if m == 1 or 2 * k == m - 1:
        return f"micro-batch {k}'s gradient"
    return f"gradient {k} (micro-batch {k}'s, or {m - 1 - k}'s with the backwards in reverse)"


def _check_bubble(
    name: str, p: int, micro_batches: Sequence[int | None], rows: int = 4, driver: Callable | None = None
) -> list[float]:
    """Measured idle of one step (F: BUBBLE_COST per micro-batch), after an untimed step that warms the ranks up,
    against the formula.  A run idle more than BUBBLE_ABOVE over the formula runs again, BUBBLE_TRIES runs in all,
    and the least idle one counts: a busy machine only adds idle time (a schedule that serialises the stages is as
    idle in every run).  A run whose wire shows less compute than the stages must spend fails at once
    (``_assert_computed``: a busy machine only adds time there too)."""
    measured = []
    for m in micro_batches:
        kwargs = {} if m is None else {"micro_batches": m}  # None: naive_step, one micro-batch
        m = m or 1
        case = f"{name} on {p} stages, {m} micro-batches of {rows} rows"
        formula, runs = (p - 1) / (m + p - 1), []
        _launch(case, p, driver or _DRIVERS[name], rows * m, 1, kwargs, 0.0, timeline=False)  # warm-up: untimed
        while len(runs) < BUBBLE_TRIES and (not runs or min(runs)[0] - formula > BUBBLE_ABOVE):
            run = _launch(case, p, driver or _DRIVERS[name], rows * m, 1, kwargs, BUBBLE_COST / rows)
            idle = _idle(run, case, p, m, rows, name)
            runs.append((sum(idle) / p, idle))
        mean, idle = min(runs)
        measured.append(mean)
        assert -BUBBLE_BELOW <= mean - formula <= BUBBLE_ABOVE, (
            f"{case}: the stages were idle {mean:.0%} of the step (per rank {', '.join(f'{i:.0%}' for i in idle)}"
            f"{f'; the least idle of {len(runs)} runs' if len(runs) > 1 else ''}); the schedule's bubble is "
            f"(p − 1)/(m + p − 1) = {formula:.0%}, accepted {formula - BUBBLE_BELOW:.0%} … "
            f"{formula + BUBBLE_ABOVE:.0%}. "
            f"Does every stage start micro-batch i + 1 as soon as it has sent micro-batch i (isend, not a blocking "
            f"send)?"
        )
    assert all(a > b for a, b in zip(measured, measured[1:])), (
        f"{name} on {p} stages: idle fraction {[f'{v:.0%}' for v in measured]} for m = {list(micro_batches)} "
        f"should fall as m grows"
    )
    return measured


def check_naive_bubble(p: int) -> list[float]:
    """Exercise 2's timing: naive_step on p stages idles (p − 1)/p of a step on the simulated accelerator,
    within −BUBBLE_BELOW … +BUBBLE_ABOVE (the least idle of up to BUBBLE_TRIES runs).  Returns the idle
    fraction measured."""
    return _check_bubble("naive_step", p, [None])


def check_gpipe_bubble(p: int, micro_batches: Sequence[int]) -> list[float]:
    """Exercise 3's timing: gpipe_step on p stages idles (p − 1)/(m + p − 1) of a step for each m of
    ``micro_batches``, within −BUBBLE_BELOW … +BUBBLE_ABOVE, falling as m grows.  Returns the idle fractions."""
    return _check_bubble("gpipe_step", p, micro_batches)


def check_1f1b_bubble(p: int, micro_batches: Sequence[int], driver: Callable | None = None) -> list[float]:
    """Exercise 4's timing, as :func:`check_gpipe_bubble` (1F1B's bubble is GPipe's).  ``driver``:
    :func:`driver_for_1f1b`'s."""
    return _check_bubble("one_f_one_b_step", p, micro_batches, driver=driver)
