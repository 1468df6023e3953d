"""Named cache policies, all built from one registry (simulator and SGLang adapter share it).

=============  =====================================  ==============================================
name           admission (what is captured)           eviction
=============  =====================================  ==============================================
lru            Marconi: branch point + last token     LRU over leaves / single-child node states
               (SGLang+ in the Marconi paper)
block32        a state every 32 tokens (vLLM+; off    LRU over leaves
               the 64 grid on purpose)
marconi        Marconi                                recency + alpha * FLOPs/byte, alpha tuned
sglang_native  Marconi (chunk-aligned branch + last)  per-component LRU: leaves by KV recency,
                                                      every state by its own recency (SGLang 0.5.23)
sparse_dp      DP plan + last token                   LRU (leaves, node states, interior checkpoints
                                                      by their own recency)
sparse         DP plan on the path + Marconi branch   per component (leaves whole, every state by its
               point + learned tail prior on the new  own recency as a resume point), decayed
               leaf; a fit state when the sequence    recency + ln(1 + alpha * FLOPs/byte), alpha
               does not fit; up to 2 first-sight      tuned by warm replay; unservable states
               states + an unplanned last token on    first, then probation ones; online sessions
               probation (:mod:`.choose`)             by their predicted return (:mod:`.evict`)
oracle         as sparse, per-edge law = the whole    as sparse (simulator only: needs a law
               trace's true overlap depths            provider)
=============  =====================================  ==============================================

Published baselines (simulator only; :data:`PUBLISHED_POLICIES`) are implemented, each class
documenting its admission and eviction, in :mod:`sglang_sparse.sim.published_caches`, line by line
after github.com/ruipeterpan/marconi (the Marconi paper's simulator). They keep the reference's own
tree (a state at every node end, eviction before insertion by an estimate, no locks), so they are
not :class:`PolicySpec` entries and never reach the SGLang adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .evict import EvictionConfig


@dataclass(frozen=True)
class PolicySpec:
    """A named policy: admission kind (see :mod:`.choose`), eviction config, whether alpha is tuned."""

    name: str
    admission: str
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    flop_aware: bool = False
    block: int = 32
    needs_law_provider: bool = False
    description: str = ""


_MARCONI_EVICT = EvictionConfig(node_states=True, ckpt_scope="none", ckpt_recency="node")
# sparse: per component (every state by its own recency as a resume point, leaves whole, as SGLang's
# MambaComponent) + Marconi's FLOP term, decayed recency. Figures: docs/sparse_backend.md "Eviction score"
#: decayed-recency time scale of ``sparse`` (logical ticks; the simulator ticks twice per request,
#: at match and at insert: 20 ticks = 10 requests)
SPARSE_RECENCY_SCALE = 20.0
#: ticks a superseded state of an online session is set back (:func:`.evict.effective_recency`):
#: two recency scales
SPARSE_SUPERSEDED_DEMOTION = 2 * SPARSE_RECENCY_SCALE
_SPARSE_EVICT = EvictionConfig(
    node_states=False,
    ckpt_scope="all",
    ckpt_recency="own",
    drop_unservable=True,
    recency_scale=SPARSE_RECENCY_SCALE,
    chain_recency=True,
    superseded_demotion=SPARSE_SUPERSEDED_DEMOTION,
)

POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("lru", "marconi", _MARCONI_EVICT, description="SGLang+: Marconi admission, LRU"),
        PolicySpec(
            "block32",
            "block",
            EvictionConfig(node_states=False, ckpt_scope="none"),
            block=32,
            description="vLLM+: state every 32 tokens, LRU",
        ),
        PolicySpec("marconi", "marconi", _MARCONI_EVICT, flop_aware=True, description="Marconi"),
        PolicySpec(
            "sglang_native",
            "marconi",
            EvictionConfig(node_states=False, ckpt_scope="all", ckpt_recency="own"),
            description="SGLang 0.5.23 MambaComponent: per-component LRU",
        ),
        PolicySpec(
            "sparse_dp",
            "dp",
            EvictionConfig(node_states=True, ckpt_scope="interior", ckpt_recency="own"),
            description="DP placement, LRU",
        ),
        PolicySpec(
            "sparse",
            "sparse",
            _SPARSE_EVICT,
            flop_aware=True,
            description="product default",
        ),
        PolicySpec(
            "oracle",
            "sparse",
            _SPARSE_EVICT,
            flop_aware=True,
            needs_law_provider=True,
            description="sparse with the whole-trace law (simulator only)",
        ),
    )
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def get_policy(name: str | PolicySpec) -> PolicySpec:
    """The spec named ``name``; ``ValueError`` listing the valid names otherwise."""
    if isinstance(name, PolicySpec):
        return name
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        if isinstance(name, str) and name in PUBLISHED_POLICIES:
            raise ValueError(
                f"policy {name!r} is a published baseline (simulator only: sglang_sparse.sim.simulate); "
                f"cache policies: {', '.join(POLICY_NAMES)}"
            ) from None
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None


@dataclass(frozen=True)
class PublishedSpec:
    """A published baseline of the Marconi paper (see :mod:`.published`).

    ``kind``: ``"hybrid"`` (``radix_cache_hybrid.py``, ``version`` = its ``evict_policy_version``:
    1 SGLang+, 2 Marconi) or ``"block"`` (``radix_cache_vllm.py``, ``block`` tokens per state);
    ``flop_aware``: alpha is tuned (or fixed by the caller); ``reference``: the file / functions of
    github.com/ruipeterpan/marconi it follows.
    """

    name: str
    kind: str
    version: int = 0
    block: int = 32
    flop_aware: bool = False
    reference: str = ""
    description: str = ""


PUBLISHED_POLICIES: dict[str, PublishedSpec] = {
    p.name: p
    for p in (
        PublishedSpec(
            "sglang_plus_published",
            "hybrid",
            version=1,
            reference="radix_cache_hybrid.py: RadixCache, evict_policy_version=1 (evict_v1)",
            description="SGLang+ as published: leaf-only LRU, exact-split branch states",
        ),
        PublishedSpec(
            "marconi_published",
            "hybrid",
            version=2,
            flop_aware=True,
            reference="radix_cache_hybrid.py: RadixCache, evict_policy_version=2 (evict_v2); config_tuner.py",
            description="Marconi as published: deepest-node recency, alpha tuned once from an empty tree",
        ),
        PublishedSpec(
            "vllm_plus_published",
            "block",
            block=32,
            reference="radix_cache_vllm.py: RadixCache, block_size=32",
            description="vLLM+ as published (block32): soft cap, tail-block LRU, partial-block reuse",
        ),
    )
}

PUBLISHED_NAMES: tuple[str, ...] = tuple(PUBLISHED_POLICIES)
#: every name :func:`sglang_sparse.sim.simulate` accepts
SIM_POLICY_NAMES: tuple[str, ...] = POLICY_NAMES + PUBLISHED_NAMES


def get_published(name: str) -> PublishedSpec:
    """The published baseline named ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return PUBLISHED_POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown published policy {name!r}; valid: {', '.join(PUBLISHED_NAMES)}") from None
