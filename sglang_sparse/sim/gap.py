"""Where a policy's hits fall short of the ``offline`` reference: a state ledger and a decomposition.

:class:`StateLedger` is a :func:`.simulate` observer (read-only): every state a policy captures, when
it was captured and evicted (request indices: evicted at ``e`` = gone before request ``e + 1``),
every request that resumed from it, and the states held after each request.

State kinds, for a state at depth ``p`` captured by request ``k`` whose sequence (input + output) is
``F`` (:meth:`StateCatalog.kind`):

* ``finish``: ``p == len(F)``, the last-token state;
* ``branch``: a depth where another request's input leaves ``F`` or ends (a branch point of the
  trace's tree), or fewer than ``grid`` tokens above one (a grid-floored branch point, Marconi's);
* ``mid``: any other depth inside a sequence (planned grid points, fit states, prompt ends).

Two policies' states are *the same state* when they sit at the same depth of the same prefix
(:meth:`StateCatalog.key`). :func:`compare` then splits, request by request, the hit tokens the
reference gets and the policy does not, by the kind of the reference's state and by why the policy
did not resume there: ``evicted`` (it had captured that state, or one fewer than ``grid`` tokens
above it on the same prefix when ``catalog`` is given, and evicted it before the request),
``first divergence`` (it never held it and no earlier request diverged there: only future
knowledge, a prior or a hint could have placed it; needs ``catalog``), ``not captured`` (it never
held it although an earlier request had diverged there), ``grid`` (it resumed fewer than ``grid``
tokens shallower).

Run ``python -m sglang_sparse.sim.gap --trace agent --fracs 0.2 0.3 0.5`` (tables on stdout,
``--out FILE`` for JSON; ``--ablations`` adds :mod:`.ablation`'s offline with part of the future
hidden).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sglang_sparse.tree import Freed, InsertResult, MatchResult, RadixTree

from .common import SimResult, prepare_requests
from .future import FutureIndex
from .trace import SimRequest

KINDS = ("finish", "branch", "mid")


class StateCatalog:
    """Kind and identity of a state from the trace alone (module docstring); shared by ledgers. ``grid``
    (tokens): how far below a branch point a state still counts as that branch point."""

    def __init__(self, requests: Sequence[SimRequest], grid: int = 64) -> None:
        self.requests = requests
        self.grid = int(grid)
        self.prepared = prepare_requests(requests)
        self.future = FutureIndex(requests)
        inf = RadixTree(0, 1)
        for _, full in self.prepared:
            if len(full):
                inf.insert(full)
        #: every sequence of the trace, whole: ``inf.kv_tokens`` is the infinite-cache footprint
        self.inf = inf
        self._branches: dict[int, np.ndarray] = {}
        self._keys: dict[tuple[int, int], tuple[int, int]] = {}

    def branch_depths(self, k: int) -> np.ndarray:
        """Sorted depths ``< len(F_k)`` where another request's input leaves request ``k``'s
        sequence ``F_k`` or ends on it (tokens)."""
        got = self._branches.get(k)
        if got is None:
            full = self.prepared[k][1]
            others = ~(1 << k)
            got = np.array(
                sorted(
                    d.depth for d in self.future.demands(full) if d.leaving & others and d.depth < len(full)
                ),
                dtype=np.int64,
            )
            self._branches[k] = got
        return got

    def kind(self, k: int, p: int) -> str:
        """``finish`` / ``branch`` / ``mid`` of a state at depth ``p`` captured by request ``k``."""
        if p == len(self.prepared[k][1]):
            return "finish"
        b = self.branch_depths(k)
        i = int(np.searchsorted(b, p))  # the first branch depth >= p
        return "branch" if i < len(b) and b[i] < p + self.grid else "mid"

    def divergence_depths(self) -> np.ndarray:
        """Per request ``j``: the longest prefix its input shares with any earlier request's
        sequence (input + output), i.e. where it diverges from everything seen before (tokens)."""
        got = getattr(self, "_divergence", None)
        if got is None:
            seen = RadixTree(0, 1)
            got = np.zeros(len(self.prepared), dtype=np.int64)
            for j, (inp, full) in enumerate(self.prepared):
                got[j] = seen.match(inp).kv_depth if len(inp) else 0
                if len(full):
                    seen.insert(full)
            self._divergence = got
        return got

    def seen_before(self, j: int, key: tuple[int, int]) -> bool:
        """Whether a request before ``j`` diverged within one grid step below the state ``key``
        (same prefix, depth in ``[p, p + grid)``), so an online policy could have planned it;
        otherwise ``j`` is a *first divergence* there (module docstring)."""
        p = key[1]
        div = self.divergence_depths()
        for i in range(j):
            d = int(div[i])
            if p <= d < p + self.grid and self.key(i, p) == key:
                return True
        return False

    def key(self, k: int, p: int) -> tuple[int, int]:
        """Identity of the state at depth ``p`` of request ``k``'s sequence: ``(uid of the node of
        the trace's whole tree holding depth p, p)``; equal for equal prefixes."""
        got = self._keys.get((k, p))
        if got is None:
            got = (self.inf.match(self.prepared[k][1][:p]).node.uid, p)
            self._keys[(k, p)] = got
        return got


@dataclass
class StateRecord:
    """One captured state: who captured it where (tokens), what it is, its lifetime and uses."""

    request: int
    pos: int
    kind: str
    key: tuple[int, int]
    captured: int
    evicted: int | None = None
    resumes: list[int] = field(default_factory=list)


class StateLedger:
    """Observer of :func:`.simulate` (or ``simulate_offline``) recording every state's life."""

    def __init__(self, catalog: StateCatalog) -> None:
        self.catalog = catalog
        self.states: dict[int, StateRecord] = {}
        #: per request: the handle it resumed from (``None``: it resumed at depth 0)
        self.resumed: list[int | None] = []
        #: per request: states held after its eviction, by kind
        self.held: list[Counter] = []
        self._alive: Counter = Counter()

    def __call__(
        self, i: int, m: MatchResult, handles: dict[int, int], res: InsertResult, freed: Freed
    ) -> None:
        if i != len(self.resumed):
            raise ValueError(f"request {i} observed out of order (expected {len(self.resumed)})")
        h = m.ckpt_handle if m.resume_depth > 0 else None
        self.resumed.append(h)
        if h is not None:
            self.states[h].resumes.append(i)
        unused = set(res.unused_states)
        cat = self.catalog
        for p, hh in handles.items():
            if hh in unused:
                continue
            kind = cat.kind(i, p)
            self.states[hh] = StateRecord(i, p, kind, cat.key(i, p), i)
            self._alive[kind] += 1
        for hh in freed.states:
            st = self.states[hh]
            st.evicted = i
            self._alive[st.kind] -= 1
        self.held.append(Counter(self._alive))

    def resume_state(self, j: int) -> StateRecord | None:
        h = self.resumed[j]
        return None if h is None else self.states[h]

    def residency(self) -> dict[str, dict[str, float]]:
        """Per kind: ``held`` = mean states held after a request; ``dead`` = the share of that
        holding after the state's last resume (or all of it when never resumed): bytes spent on a
        state nobody resumes from again; ``captured`` / ``resumed`` = states captured / resumed
        from at least once."""
        n = max(len(self.resumed), 1)
        tot: dict[str, float] = defaultdict(float)
        dead: dict[str, float] = defaultdict(float)
        cap: Counter = Counter()
        used: Counter = Counter()
        for st in self.states.values():
            end = st.evicted if st.evicted is not None else len(self.resumed)  # held after c..end-1
            tot[st.kind] += end - st.captured
            last = st.resumes[-1] if st.resumes else st.captured
            dead[st.kind] += max(end - last, 0)
            cap[st.kind] += 1
            used[st.kind] += bool(st.resumes)
        out: dict[str, dict[str, float]] = {}
        for k in KINDS:
            out[k] = {
                "held": sum(h[k] for h in self.held) / n,
                "dead": dead[k] / tot[k] if tot[k] else 0.0,
                "captured": cap[k],
                "resumed": used[k],
            }
        return out

    def session_residency(self) -> dict[str, float]:
        """Mean states held after a request, by where the capturing request's session stands:
        ``newest`` (no later request of the session served yet), ``superseded`` (a later request
        of the session has been served: a multi-turn session's older turn states), ``ended`` (the
        session has no later request at all: its final turn's states)."""
        reqs = self.catalog.requests
        n = len(self.resumed)
        nxt: dict[int, int | None] = {}
        seen: dict[str, int] = {}
        for i in range(len(reqs) - 1, -1, -1):
            nxt[i] = seen.get(reqs[i].session_id)
            seen[reqs[i].session_id] = i
        out = {"newest": 0.0, "superseded": 0.0, "ended": 0.0}
        for st in self.states.values():
            end = st.evicted if st.evicted is not None else n
            c, later = st.captured, nxt[st.captured]
            if later is None:
                out["ended"] += end - c
            else:
                out["newest"] += max(min(later, end) - c, 0)
                out["superseded"] += max(end - max(later, c), 0)
        return {k: v / max(n, 1) for k, v in out.items()}


def compare(
    requests: Sequence[SimRequest],
    ref: tuple[SimResult, StateLedger],
    pol: tuple[SimResult, StateLedger],
    grid: int = 64,
    catalog: StateCatalog | None = None,
) -> dict:
    """Request by request, the hit tokens of ``ref`` (e.g. offline) vs ``pol`` (e.g. sparse), both
    replayed with records and a :class:`StateLedger` (module docstring). Returns a JSON-able dict:
    ``lost`` (tokens ``ref`` hit and ``pol`` did not) by ``kind`` of ref's state and ``reason``,
    ``gained`` (the reverse) by kind of ``pol``'s state, per-``session`` hit tokens, each
    ledger's :meth:`~StateLedger.residency`, and ``hit_by_kind`` (hit tokens per kind of the
    resumed state)."""
    (rr, rl), (pr, pl) = ref, pol
    by_key: dict[tuple[int, int], list[StateRecord]] = defaultdict(list)
    by_pos: dict[int, list[StateRecord]] = defaultdict(list)
    for st in pl.states.values():
        by_key[st.key].append(st)
        by_pos[st.pos].append(st)
    lost: dict[str, Counter] = {k: Counter() for k in KINDS}
    lost_requests: dict[str, Counter] = {k: Counter() for k in KINDS}
    gained: Counter = Counter()
    sessions: dict[str, dict[str, int]] = {}
    hit_by_kind = {"ref": Counter(), "pol": Counter()}
    for j, req in enumerate(requests):
        a, b = rr.records[j].resume_depth, pr.records[j].resume_depth
        s = sessions.setdefault(req.session_id, {"turns": 0, "input": 0, "ref": 0, "pol": 0})
        s["turns"] += 1
        s["input"] += len(req.input_tokens)
        s["ref"] += a
        s["pol"] += b
        rs, ps = rl.resume_state(j), pl.resume_state(j)
        if rs is not None:
            hit_by_kind["ref"][rs.kind] += a
        if ps is not None:
            hit_by_kind["pol"][ps.kind] += b
        if a > b:
            assert rs is not None
            if b > 0 and a - b < grid:
                reason = "grid"
            else:
                # the policy's states at this state or fewer than ``grid`` tokens above it on the
                # same prefix (a grid-floored copy of it)
                earlier = [st for st in by_key.get(rs.key, ()) if st.captured < j]
                if catalog is not None:
                    for q in range(max(1, a - grid + 1), a):
                        earlier += [
                            st for st in by_pos.get(q, ()) if st.captured < j and st.key == catalog.key(j, q)
                        ]
                if any(st.evicted is None or st.evicted >= j for st in earlier):
                    reason = "held"  # cannot happen: a held state and its KV would serve j
                else:
                    if earlier:
                        reason = "evicted"
                    elif catalog is not None and not catalog.seen_before(j, rs.key):
                        reason = "first divergence"
                    else:
                        reason = "not captured"
            lost[rs.kind][reason] += a - b
            lost_requests[rs.kind][reason] += 1
        elif b > a:
            assert ps is not None
            gained[ps.kind] += b - a
    return {
        "ref_hit_tokens": rr.hit_tokens,
        "pol_hit_tokens": pr.hit_tokens,
        "input_tokens": rr.input_tokens,
        "lost": {k: dict(v) for k, v in lost.items()},
        "lost_requests": {k: dict(v) for k, v in lost_requests.items()},
        "gained": dict(gained),
        "hit_by_kind": {k: dict(v) for k, v in hit_by_kind.items()},
        "residency": {"ref": rl.residency(), "pol": pl.residency()},
        "session_residency": {"ref": rl.session_residency(), "pol": pl.session_residency()},
        "sessions": sessions,
    }


def _print(name: str, frac: float, g: dict, ref: str, pol: str) -> None:
    n_in = g["input_tokens"]
    print(
        f"\n== {name} at {frac:.0%}: {ref} {g['ref_hit_tokens'] / n_in:.3f}, {pol} "
        f"{g['pol_hit_tokens'] / n_in:.3f} (token hit rate)"
    )
    print(
        f"{'kind':>7} {'hit ' + ref:>14} {'hit ' + pol:>14} {'lost: evicted':>14} "
        f"{'first div.':>11} {'not captured':>13} {'grid':>8} {'gained':>8}"
    )
    for k in KINDS:
        lo = g["lost"][k]
        cells = (
            g["hit_by_kind"]["ref"].get(k, 0),
            g["hit_by_kind"]["pol"].get(k, 0),
            lo.get("evicted", 0),
            lo.get("first divergence", 0),
            lo.get("not captured", 0),
            lo.get("grid", 0),
            g["gained"].get(k, 0),
        )
        print(
            f"{k:>7} "
            + " ".join(f"{c / n_in:>{w}.3f}" for c, w in zip(cells, (14, 14, 14, 11, 13, 8, 8), strict=True))
        )
    print("(fractions of all input tokens; lost = tokens the reference hits and the policy does not,")
    print(" by the kind of the reference's state; gained = the reverse, by the policy's state)")
    print(f"{'kind':>7} {'held ' + ref:>14} {'dead ' + ref:>10} {'held ' + pol:>14} {'dead ' + pol:>10}")
    for k in KINDS:
        a, b = g["residency"]["ref"][k], g["residency"]["pol"][k]
        print(f"{k:>7} {a['held']:14.2f} {a['dead']:10.0%} {b['held']:14.2f} {b['dead']:10.0%}")
    print("(held = mean states held after a request; dead = share of that after the state's last use)")
    a, b = g["session_residency"]["ref"], g["session_residency"]["pol"]
    print(
        "states held by session status (newest / superseded / ended): "
        + f"{ref} {a['newest']:.2f} / {a['superseded']:.2f} / {a['ended']:.2f}, "
        + f"{pol} {b['newest']:.2f} / {b['superseded']:.2f} / {b['ended']:.2f}"
    )
    print(f"{'session':>32} {'turns':>5} {'input':>9} {ref:>8} {pol:>8}")
    for sid, s in sorted(g["sessions"].items(), key=lambda kv: kv[1]["pol"] - kv[1]["ref"]):
        print(
            f"{sid:>32} {s['turns']:5d} {s['input']:9d} {s['ref'] / s['input']:8.3f} "
            f"{s['pol'] / s['input']:8.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    from .models import cost_model
    from .simulator import simulate
    from .trace import load_trace

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="agent", help="built trace name (traces/build/NAME.jsonl) or a file")
    ap.add_argument("--fracs", nargs="+", type=float, default=[0.2, 0.3, 0.5])
    ap.add_argument("--policy", default="sparse")
    ap.add_argument("--reference", default="offline")
    ap.add_argument("--model", default="qwen3-next-80b-a3b")
    ap.add_argument("--out", default=None, help="JSON output file")
    ap.add_argument(
        "--ablations", action="store_true", help="also the knowledge ablations of offline (.ablation)"
    )
    args = ap.parse_args(argv)
    path = Path(args.trace)
    if not path.exists():
        path = Path(__file__).resolve().parents[2] / "traces" / "build" / f"{args.trace}.jsonl"
    reqs = load_trace(path)
    cm = cost_model(args.model)
    cat = StateCatalog(reqs)
    footprint = cat.inf.kv_tokens * cm.kv_bytes_per_token
    out = {"trace": str(path), "model": args.model, "footprint_bytes": footprint, "points": []}
    for frac in args.fracs:
        size = int(footprint * frac)
        runs = []
        for pol in (args.reference, args.policy):
            led = StateLedger(cat)
            res = simulate(reqs, pol, size, cm, observer=led)
            runs.append((res, led))
        g = compare(reqs, runs[0], runs[1], cat.grid, catalog=cat)
        _print(path.stem, frac, g, args.reference, args.policy)
        out["points"].append({"frac": frac, "cache_bytes": size, **g})
    if args.ablations:
        from .ablation import knowledge_table

        sizes = [int(footprint * f) for f in args.fracs]
        table = knowledge_table(reqs, sizes, cm)
        hits = {
            p: [simulate(reqs, p, b, cm, keep_records=False).token_hit_rate for b in sizes]
            for p in (args.policy,)
        }
        print(
            f"\n== {path.stem}: offline with part of the future hidden (admission/knowledge; token hit rate)"
        )
        print(f"{'variant':>20} " + " ".join(f"{f:>7.0%}" for f in args.fracs))
        for name, row in {**table, **hits}.items():
            print(f"{name:>20} " + " ".join(f"{x:7.3f}" for x in row))
        out["ablations"] = {"fracs": list(args.fracs), "hit_rate": {**table, **hits}}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
