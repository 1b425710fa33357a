"""What runs on the student's ranks in lab 2's checks: the drivers (each one's source is sent to the student's
kernel and defined there among the notebook's names, where it calls the notebook's functions by name), and
the grader's stand-ins for the ring's halves, which a driver imports there."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _held_at_receives(x, name, rounds, *rest):
    """Driver (runs in your kernel): your ``name(x, *rest)`` on this rank; under grading the grader holds
    it at each of its first ``rounds`` receives (``rounds_gate``), and in your own notebook nothing changes."""
    from disttrain_lab.labtests.rounds_gate import held_at_receives

    # (each named where it is called: the ranks get the names a driver's code mentions, not the whole notebook)
    if name == "ring_reduce_scatter":
        fn = ring_reduce_scatter  # noqa: F821  (the notebook's)
    elif name == "ring_all_gather":
        fn = ring_all_gather  # noqa: F821
    elif name == "ring_all_reduce":
        fn = ring_all_reduce  # noqa: F821
    else:
        fn = halving_doubling_all_reduce  # noqa: F821
    with held_at_receives(fn.__globals__, rounds):
        return fn(x, *rest)


def direct_reduce_scatter(flat: torch.Tensor) -> torch.Tensor:
    """The grader's stand-in for ``ring_reduce_scatter`` (public: a driver imports it in the ranks):
    the same result, chunk ``rank`` of ``flat`` summed over all ranks and returned, but **not a ring**:
    each rank sends chunk c straight to rank c.  ``ring_all_reduce`` is graded on it where the
    student's reduce-scatter did not pass its graded test; handed in as ``ring_reduce_scatter`` it
    fails that test (messages to ranks other than the right neighbour)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    incoming = {peer: torch.empty_like(chunks[rank]) for peer in range(n) if peer != rank}
    if chunks[rank].numel():
        requests = [dist.irecv(buffer, src=peer) for peer, buffer in incoming.items()]
    else:
        requests = []
    requests += [dist.isend(chunks[peer], dst=peer) for peer in range(n) if peer != rank and chunks[peer].numel()]
    for request in requests:
        request.wait()
    for buffer in incoming.values():
        chunks[rank].add_(buffer)
    return chunks[rank]


def direct_all_gather(flat: torch.Tensor) -> torch.Tensor:
    """The grader's stand-in for ``ring_all_gather`` (as ``direct_reduce_scatter``): every rank sends
    its chunk straight to every other rank; not a ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = flat.tensor_split(n)
    requests = [dist.irecv(chunks[peer], src=peer) for peer in range(n) if peer != rank and chunks[peer].numel()]
    if chunks[rank].numel():
        requests += [dist.isend(chunks[rank], dst=peer) for peer in range(n) if peer != rank]
    for request in requests:
        request.wait()
    return flat


def _ring_all_reduce_standing_in(x, replace):
    """Driver (runs in your kernel): your ring_all_reduce, with the grader's stand-ins
    (``direct_reduce_scatter``, ``direct_all_gather``) in the place of the halves named in ``replace``."""
    from disttrain_lab.labtests.common import standing_in
    from disttrain_lab.labtests.lab02.ranks import direct_all_gather, direct_reduce_scatter

    graders = {"ring_reduce_scatter": direct_reduce_scatter, "ring_all_gather": direct_all_gather}
    with standing_in({name: graders[name] for name in replace}, [ring_all_reduce.__globals__]):  # noqa: F821
        return ring_all_reduce(x)  # noqa: F821  (the notebook's)
