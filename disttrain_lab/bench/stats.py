"""What a benchmark's repeats come to: the slowest rank's median (a step of several ranks ends when its
last rank does), each repeat's slowest time, how much one repeat's time moves in a run (spread), and
which rows fall below their baseline within that noise or beyond it (below_in_noise)."""

from __future__ import annotations

import statistics


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's seconds: a step of several ranks ends
    when its last rank does.  ``per_rank[r][i]`` is rank r's time in repeat i."""
    return statistics.median(max(times) for times in zip(*per_rank))


def slowest_samples(per_rank: list[list[float]]) -> list[float]:
    """Each repeat's time on its slowest rank (``per_rank[r][i]``: rank r's time in repeat i)."""
    return [max(times) for times in zip(*per_rank)]


def spread(samples: list[float]) -> float:
    """How much one repeat's time moves in this run: the samples' median absolute deviation over their
    median (0.05: a repeat is typically 5 % off the median; 0 for a single sample)."""
    middle = statistics.median(samples)
    return statistics.median(abs(s - middle) for s in samples) / middle if middle else 0.0


def below_in_noise(rows: list[dict], baseline_of, label: str = "version") -> list[str]:
    """Lines for the rows whose ``ratio`` is below 1 (slower than their baseline): each with its own and its
    baseline's ``spread`` in this run, and whether the gap is within their sum (the machine's noise: the same
    two rows measured again can swap) or beyond it.  ``baseline_of(row)``: the baseline's row."""
    below = [r for r in rows if r.get("ratio", 1.0) < 1.0 and "spread" in r and "spread" in baseline_of(r)]
    if not below:
        return []
    lines = [
        f"below its baseline in this run (spread: a repeat's typical distance from the median, over "
        f"{below[0].get('repeats', '?')} repeats; a gap within the two rows' spreads is this machine's noise)"
    ]
    for r in below:
        base = baseline_of(r)
        noise = r["spread"] + base["spread"]
        verdict = "within the noise" if 1.0 - r["ratio"] <= noise else "beyond the noise"
        lines.append(
            f"  {r[label]}: {r['ratio']:.2f}x {base[label]}; spreads {100 * r['spread']:.1f} % and "
            f"{100 * base['spread']:.1f} %: {verdict} (±{100 * noise:.1f} %)"
        )
    return lines
