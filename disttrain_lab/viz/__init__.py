"""Pictures drawn from real runs (never drawings of what should have happened).

run = dl.launch(step, 4, trace=True)
dl.viz.timeline(run)            # one row per rank: compute regions above, communication below

One module a kind of picture, each function here as ``dl.viz.NAME``: :mod:`.timelines` (a traced
run per rank), :mod:`.ring` (a ring's steps, replayed), :mod:`.pipeline` (a pipeline's schedule and
idle time), :mod:`.weights` (which slice of each weight a rank holds), :mod:`.comparison` (prediction
against measurement), :mod:`.profiler` (a merged torch.profiler trace); :mod:`.colors` is their palette.
"""

from __future__ import annotations

from .colors import COLORS
from .comparison import predicted_vs_measured
from .pipeline import PIPELINE_COLORS, pipeline_idle, pipeline_regions, pipeline_schedule
from .profiler import PROFILE_LANES, profile, profile_lane
from .ring import RING_PHASES, ring_steps, ring_steps_slider, ring_transfers
from .timelines import timeline
from .weights import weight_slices

__all__ = [
    "COLORS",
    "timeline",
    "RING_PHASES",
    "ring_transfers",
    "ring_steps",
    "ring_steps_slider",
    "PIPELINE_COLORS",
    "pipeline_regions",
    "pipeline_idle",
    "pipeline_schedule",
    "weight_slices",
    "predicted_vs_measured",
    "PROFILE_LANES",
    "profile_lane",
    "profile",
]
