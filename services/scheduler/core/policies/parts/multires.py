"""AccelGen's multi-resource selection (SelectRequests, Algorithm 2), shared with `hybrid`.

Among a window of candidates of similar urgency, repeatedly pick the one whose demand
(D_c compute tokens, D_m KV tokens) is nearest in Euclidean distance to what is still free
(A_c token budget, A_m free KV tokens), until nothing else fits. A prompt longer than the
leftover budget (or the free KV) is chunked to fit, so it fills one resource exactly.
Decodes have only two possible demands, (1, 0) and (1, one block), so they are grouped and the
cost of a pick stays proportional to the number of distinct prompts in the window.

`select_in_order` is the ablation without this method (AccelGen's "/Batch"): the window is
taken in queue order, each candidate chunked to what is left. With `whole=True` (no chunking)
a prompt is only taken when all of it fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from services.scheduler.core.request import RequestStatus

if TYPE_CHECKING:
    from services.scheduler.core.batch import Batch
    from services.scheduler.core.block_manager import BlockManager
    from services.scheduler.core.request import Request

Veto = Callable[["Request"], bool]
RUNNING, WAITING, SWAPPED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED


def demand(
    bm: BlockManager, req: Request, a_c: int, a_m: int, reserve: int, whole: bool = False
) -> tuple[int, int] | None:
    """(tokens, device blocks) `req` would take now, or None when it cannot fit (with `whole`,
    when its whole remaining work does not fit)."""
    rid, bs = req.request_id, bm.block_size
    status, computed, left = req.status, req.num_computed_tokens, req.num_uncomputed_tokens
    if status is RUNNING:
        room = (bm.num_device_blocks_of(rid) + a_m) * bs - computed
    elif status is SWAPPED:  # its kept shared blocks need no room
        room = (a_m - reserve + bm.num_kept_blocks_of(rid)) * bs - computed
        if bm.num_host_blocks_of(rid) > a_m - reserve:
            return None
    else:  # waiting: a cached prefix takes only its evictable blocks from the free count
        room = (a_m - reserve - bm.attach_cost(req)) * bs
    n = min(left, a_c, room)
    if n < 1 or (whole and n < left):
        return None
    if status is SWAPPED:
        blocks = bm.num_swap_in_blocks(req, n)
    else:
        blocks = bm.num_new_blocks(req, n)
    return n, blocks


def select_nearest(
    b: Batch,
    candidates: Sequence[Request],
    reserve_new: int,
    allowed: Veto | None = None,
    max_seqs: int = 1 << 30,
    whole: bool = False,
) -> list[Request]:
    """Schedule candidates into batch `b` nearest-demand first; returns the ones not taken.
    `allowed(req)` may veto a candidate at pick time (exclusive request allocation); `whole`
    takes prompts unchunked (only when all of it fits)."""
    bm, bs = b.bm, b.bm.block_size
    dec0, dec1, general = _split_decodes(bm, candidates)
    rest: list[Request] = []
    while b.tokens_left >= 1 and b.num_seqs < max_seqs:
        a_c, a_m = b.tokens_left, bm.num_free_device_blocks
        best: list[Request] | Request | None = None  # a decode group or a request
        best_d: int | None = None
        best_n = 0
        if dec0:
            best, best_d, best_n = dec0, (a_c - 1) ** 2 + (a_m * bs) ** 2, 1
        if dec1 and a_m >= 1:
            d = (a_c - 1) ** 2 + ((a_m - 1) * bs) ** 2
            if best_d is None or d < best_d:
                best, best_d, best_n = dec1, d, 1
        keep: list[Request] = []
        for req in general:
            if allowed is not None and not allowed(req):
                rest.append(req)
                continue
            reserve = 0 if req.status is RUNNING else reserve_new
            dm = demand(bm, req, a_c, a_m, reserve, whole)
            if dm is None:
                rest.append(req)  # resources only shrink: it will not fit this step
                continue
            keep.append(req)
            d = (a_c - dm[0]) ** 2 + ((a_m - dm[1]) * bs) ** 2
            if best_d is None or d < best_d:
                best, best_d, best_n = req, d, dm[0]
        general = keep
        if best is None:
            break
        if isinstance(best, list):
            req = best.pop()
            if not b.schedule(req, 1):
                rest.append(req)
            continue
        general.remove(best)
        if best.status is SWAPPED and not b.swap_in(best):
            rest.append(best)
            continue
        if not b.schedule(best, best_n):
            rest.append(best)
    return rest + general + dec0[::-1] + dec1[::-1]


def _split_decodes(
    bm: BlockManager, candidates: Sequence[Request]
) -> tuple[list[Request], list[Request], list[Request]]:
    """(decodes that need no new block, decodes that need one, the others); the decode
    lists are reversed, so pop() takes the most urgent first."""
    dec0: list[Request] = []
    dec1: list[Request] = []
    general: list[Request] = []
    for req in candidates:
        if req.status is RUNNING and req.num_uncomputed_tokens == 1:
            (dec0 if bm.num_new_blocks(req, 1) == 0 else dec1).append(req)
        else:
            general.append(req)
    dec0.reverse()
    dec1.reverse()
    return dec0, dec1, general


def select_in_order(
    b: Batch,
    candidates: Sequence[Request],
    reserve_new: int,
    allowed: Veto | None = None,
    max_seqs: int = 1 << 30,
    whole: bool = False,
) -> list[Request]:
    """Schedule candidates into batch `b` in the given order, each chunked to what is left of
    the budget and KV (skipping those that do not fit); returns the ones not taken. Same
    arguments as `select_nearest`: the ablation of nearest-demand selection."""
    bm = b.bm
    rest: list[Request] = []
    for i, req in enumerate(candidates):
        if b.tokens_left < 1 or b.num_seqs >= max_seqs:
            return rest + list(candidates[i:])
        if allowed is not None and not allowed(req):
            rest.append(req)
            continue
        reserve = 0 if req.status is RUNNING else reserve_new
        dm = demand(bm, req, b.tokens_left, bm.num_free_device_blocks, reserve, whole)
        if dm is None or (req.status is SWAPPED and not b.swap_in(req)):
            rest.append(req)
            continue
        if not b.schedule(req, dm[0]):
            rest.append(req)
    return rest
