"""Admission: which recurrent-state positions a request captures (during prefill or after decode).

All positions are absolute token depths. A request resuming at ``resume_depth`` can only capture
positions it computes, i.e. ``resume_depth < p <= total_len`` where ``total_len`` counts input +
output tokens; positions ``<= len(input)`` are captured during prefill, deeper ones during decode.

* ``marconi`` (Marconi speculative insertion, arXiv 2411.19379 sec. 4.1): the branch point
  ``floor(kv_depth / branch_grid) * branch_grid`` (``branch_grid``: the chunk grid by default, the
  page size where the engine captures states inside an extend) when the request would create a
  new branch (its input continues past the KV match and the match does not end at a leaf's end), plus
  the state after the last token (``total_len``).
* ``block``: every multiple of ``block`` tokens (vLLM-style, independent of the tree).
* ``dp``: the DP plans of the edges on the matched path
  (:meth:`~.plan_table.PlanTable.planned_captures`), plus the last-token state.
* ``dp_marconi``: union of ``dp`` and ``marconi``.
* ``sparse`` (the product): ``dp`` on the matched path + the Marconi branch point + the positions a
  learned :class:`~sglang_sparse.policy.tail_prior.TailPrior` chooses on the new leaf
  ``(kv_depth, total_len]`` (which includes the last-token state only when requests do continue
  leaves at their end). Until the prior has ``warmup`` observations it admits the last token as
  Marconi does. Planned positions shallower than one grid step are not captured: such a state
  saves fewer than ``grid`` tokens per hit (e.g. a short chat-template header every request shares)
  for the bytes of a whole state, and being used by every request it would never age out.
  *Fit state*: when the sequence is longer than the cache can hold (``total_len > fit``, ``fit`` =
  the most KV tokens that fit with one state), every state past ``fit`` is unservable and would be
  evicted with its whole leaf; ``sparse`` then captures instead the deepest grid position at which
  the prefix fits next to this state and the branch point, if any (``state_tokens`` KV tokens of
  room per state), and drops its other planned positions up to ``fit`` (they could not all stay
  next to it), so eviction can cut the leaf back to that state and keep the longest prefix that
  does fit (a document longer than a small cache, a long agent session). States already on the
  matched path are left to eviction (counting them as well was measured worse on doc_qa at 5% and
  10% of the footprint: 0.094 / 0.191 vs 0.124 / 0.214 token hit rate; better on agent at 5%:
  0.111 vs 0.096; both with the min-max eviction score used before decayed recency).
"""

from __future__ import annotations

from sglang_sparse.placement import DEFAULT_GRID
from sglang_sparse.tree import CheckpointTree, MatchResult

from .plan_table import PlanTable
from .tail_prior import TailPrior

ADMISSIONS = ("marconi", "block", "dp", "dp_marconi", "sparse")
#: observations the tail prior needs before it plans (until then ``sparse`` admits the last token)
TAIL_WARMUP = 2


def extends_leaf(match: MatchResult) -> bool:
    """Does the KV match end exactly at a leaf's end (the request continues a sequence: a new
    turn of a session), so it creates no branch?"""
    node = match.node
    return match.kv_depth > 0 and match.kv_depth == node.end and not node.children


def marconi_branch_point(match: MatchResult, input_len: int, grid: int = DEFAULT_GRID) -> int | None:
    """Chunk-aligned depth where this request would split the tree, or ``None`` if it creates no branch."""
    d = match.kv_depth
    if d == 0 or d >= input_len or extends_leaf(match):
        return None
    p = (d // grid) * grid
    return p if p > 0 else None


def capture_positions(
    kind: str,
    tree: CheckpointTree,
    plans: PlanTable,
    match: MatchResult,
    input_len: int,
    total_len: int,
    *,
    grid: int = DEFAULT_GRID,
    block: int = 32,
    tail: TailPrior | None = None,
    tail_budget: int = 2,
    warmup: int = TAIL_WARMUP,
    fit: int | None = None,
    state_tokens: int = 0,
    branch_grid: int | None = None,
    tail_out: set[int] | None = None,
) -> list[int]:
    """Sorted positions in ``(match.resume_depth, total_len]`` to capture for this request.

    ``branch_grid`` (tokens, default ``grid``): the grid the Marconi branch point is aligned down
    to. An engine that captures a state at any page-aligned depth inside a prefill (the in-forward
    list capture) passes its page size, so the next request on that branch resumes exactly where
    the two diverged instead of up to ``grid - 1`` tokens above it. ``tail_out``, if given,
    receives the positions only the tail prior chose (no edge plan or branch point; a subset of
    the result unless the fit state displaced them)."""
    if kind not in ADMISSIONS:
        raise ValueError(f"unknown admission {kind!r}; valid: {', '.join(ADMISSIONS)}")
    if total_len < input_len:
        raise ValueError(f"total_len ({total_len}) < input_len ({input_len})")
    lo = match.resume_depth
    bgrid = grid if branch_grid is None else branch_grid
    pos: set[int] = set()
    if kind == "block":
        pos.update(range((lo // block + 1) * block, total_len + 1, block))
    elif kind == "sparse":
        if tail is None:
            raise ValueError("the sparse admission needs a TailPrior")
        b = marconi_branch_point(match, input_len, bgrid)
        if b is not None and b >= grid:  # a branch in a shared header saves too little per state
            pos.add(b)
        learned = set(plans.planned_captures(tree, match))
        if tail.observations < warmup:
            pos.add(total_len)
        else:
            from_tail = set(tail.positions(match.kv_depth, total_len, tail_budget))
            if tail_out is not None:
                tail_out.update(from_tail - learned - pos)
            learned.update(from_tail)
        pos.update(p for p in learned if p >= grid or p == total_len)
        if fit is not None and total_len > fit:
            # Room for the fit state: the prefix, this state and the branch point's. The learned
            # positions below it give way: they could not all stay next to it.
            keep = [b] if b is not None and lo < b <= fit else []
            p = ((fit - len(keep) * state_tokens) // grid) * grid
            if p >= grid and p > lo:
                pos.difference_update([q for q in pos if lo < q <= fit and q not in keep])
                pos.add(p)
    else:
        if total_len > 0:
            pos.add(total_len)
        if kind in ("marconi", "dp_marconi"):
            b = marconi_branch_point(match, input_len, bgrid)
            if b is not None:
                pos.add(b)
        if kind in ("dp", "dp_marconi"):
            pos.update(plans.planned_captures(tree, match))
    return sorted(p for p in pos if lo < p <= total_len)
