"""The ``sparse`` tree core's hinted insert (a checkpoint's walk resumed at the request's locked
node, :meth:`~sglang_sparse.sglang_adapter.cache.SparseTreeCore.begin_insert`) leaves SGLang's tree
exactly as SGLang's own walk from the root does: the same nodes, edges, LRU clocks, priorities, hit
counts, locks and pool values, and the same hits, after a request stream with chunked prefills,
repeats, turns and eviction (the scheduler-cache harness's tiny pools). Each mode runs in its own
subprocess (its own published ``ServerArgs``, fresh node ids and clocks), ~1 min."""

from __future__ import annotations

import pytest
from sparse_testing.child import run_tagged_child
from sparse_testing.stack import require_serving_stack

pytestmark = pytest.mark.serving

require_serving_stack(("torch", "sglang", "transformers"))


#: the child: run the stream with the hint on or off (argv[1]), print one JSON line
CHILD = r"""
import hashlib, json, os, sys, warnings
from array import array
import numpy as np
os.environ.update({"SGLANG_SPARSE_POLICY": "sparse", "SGLANG_SPARSE_CAPTURE": "cut",
                   "SGLANG_SPARSE_CHECK_INVARIANTS": "1"})
from benchmarks import scheduler_cache as sc
from sglang_sparse.sglang_adapter import cache as C
if sys.argv[1] == "off":
    C.SparseTreeCore._known_path = lambda self, hint, params: None
from sglang.srt.mem_cache.unified_cache.components import ComponentType
h = sc.small_harness("sparse", sc.make_model_dir(context_len=4096))
tc = h.b.cache.tree_core
rng = np.random.default_rng(3)
def rand(n):
    return array("q", rng.integers(4, 2**30, size=n, dtype=np.int64).tobytes())
def values(v):
    if v is None:
        return None
    return repr([t.tolist() if hasattr(t, "tolist") else t for t in (v if isinstance(v, list) else [v])])
def dump():
    out = []
    for n in [tc.root_node, *tc.iter_nodes()]:
        cd = n.component_data
        out.append((n.id, n.parent.id if n.parent else None, len(n.key), n.last_access_time, n.priority,
                    n.hit_count, cd[ComponentType.FULL].lock_ref, cd[ComponentType.MAMBA].lock_ref,
                    values(cd[ComponentType.FULL].value), values(cd[ComponentType.MAMBA].value)))
    return sorted(out)
docs = [rand(260) for _ in range(4)]
prompts, hits, digest = [], [], hashlib.sha256()
for i in range(40):
    u = rng.random()
    if u < 0.5 or not prompts:
        p = docs[int(rng.integers(len(docs)))] + rand(int(rng.integers(20, 200)))
    elif u < 0.8:
        p = prompts[int(rng.integers(len(prompts)))] + sc.output_ids(i, 4) + rand(30)
    else:
        p = prompts[int(rng.integers(len(prompts)))]
    p = p[:900]
    prompts.append(p)
    hits.append(h.run(f"r{i}", p, sc.output_ids(100 + i, 4)))
    digest.update(repr(dump()).encode())
st = h.b.cache.sparse_stats()
print("HINT " + json.dumps({"hits": hits, "digest": digest.hexdigest(), "hinted": st["inserts_hinted"],
      "unhinted": st["inserts_unhinted"], "violations": st["invariant_violations"],
      "mirror_errors": st["mirror_errors"], "evicted": st["states_evicted"] + st["kv_leaves_evicted"]}))
"""


def _run(mode: str) -> dict:
    return run_tagged_child(["-c", CHILD, mode], "HINT", drop_env=("SGLANG_SPARSE_",), timeout=900)


def test_hinted_insert_equals_sglang_walk() -> None:
    on, off = _run("on"), _run("off")
    assert on["hinted"] > 40 and on["unhinted"] == 0, on  # chunk ends and finishes resume the walk
    assert off["hinted"] == 0, off
    assert on["evicted"] > 0, on  # the tiny pools evicted: hints met splits and removed leaves
    assert on["violations"] == 0 and on["mirror_errors"] == 0, on
    assert on["hits"] == off["hits"]
    assert on["digest"] == off["digest"]  # the whole tree, after every request
