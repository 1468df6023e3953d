"""The CPU pieces SGLang's HiCache needs (``sgl_kernel_cpu/hicache.py``): host<->device copy ops
checked against plain indexing, and, in a fresh SGLang process, the plugin's routes (host
allocation, the ops on the pool modules, ``--hicache-io-backend`` resolved to ``direct``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from sglang_sparse_kernels.sgl_kernel_cpu import hicache  # noqa: E402

pytestmark = pytest.mark.kernel

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="sglang is not installed"
)


def _device_layers(layers: int, tokens: int, *shape: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, *shape, generator=g) for _ in range(layers)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_backup_then_load_back_round_trips_page_first(page_size):
    """KV layout: K and V groups of L layers on the device, host ``[pages, L, page_size, heads,
    dim]`` per group. Back up whole pages from device slots, load them into other device slots:
    every layer equals the source rows."""
    layers, tokens, heads, dim = 3, 96, 2, 8
    k = _device_layers(layers, tokens, heads, dim, seed=1)
    v = _device_layers(layers, tokens, heads, dim, seed=2)
    host_pages = 10
    host_k = torch.zeros(host_pages, layers, page_size, heads, dim)
    host_v = torch.zeros_like(host_k)
    n_pages = 3
    dev_pages = torch.tensor([5, 1, 3])[:n_pages]
    src = (dev_pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    hpages = torch.tensor([7, 2, 9])[:n_pages]
    dst = (hpages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    hicache.transfer_kv_all_layer_direct_lf_pf(k + v, [host_k, host_v], src, dst, page_size)
    for i, p in enumerate(hpages.tolist()):
        for layer in range(layers):
            rows = src[i * page_size : (i + 1) * page_size]
            assert torch.equal(host_k[p, layer], k[layer][rows])
            assert torch.equal(host_v[p, layer], v[layer][rows])
    untouched = [p for p in range(host_pages) if p not in hpages.tolist()]
    assert not host_k[untouched].any() and not host_v[untouched].any()
    back = torch.randperm(tokens, generator=torch.Generator().manual_seed(3))[: src.numel()]
    for layer in range(layers):
        new_k, new_v = torch.zeros(tokens, heads, dim), torch.zeros(tokens, heads, dim)
        hicache.transfer_kv_per_layer_direct_pf_lf(
            [host_k, host_v], [new_k, new_v], dst, back, layer, page_size
        )
        assert torch.equal(new_k[back], k[layer][src]) and torch.equal(new_v[back], v[layer][src])
        others = torch.ones(tokens, dtype=torch.bool)
        others[back] = False
        assert not new_k[others].any()


def test_mamba_state_layout_round_trips():
    """Mamba states: per-layer device ``[slots, ...]``, host ``[slots, L, 1, ...]``, page size 1."""
    layers, slots = 4, 12
    conv = _device_layers(layers, slots, 6, 3, seed=4)
    host = torch.zeros(20, layers, 1, 6, 3)
    src, dst = torch.tensor([2, 9, 0]), torch.tensor([17, 4, 11])
    hicache.transfer_kv_all_layer_direct_lf_pf(conv, [host], src, dst, 1)
    for layer in range(layers):
        out = torch.zeros(slots, 6, 3)
        back = torch.tensor([1, 5, 7])
        hicache.transfer_kv_per_layer_direct_pf_lf([host], [out], dst, back, layer, 1)
        assert torch.equal(out[back], conv[layer][src])


def test_layer_first_direct_copy_and_bad_inputs():
    src = _device_layers(2, 10, 4, seed=5)
    dst = [torch.zeros(16, 4) for _ in range(2)]
    hicache.transfer_kv_direct(src, dst, torch.tensor([3, 0]), torch.tensor([15, 8]), 1)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[15], s[3]) and torch.equal(d[8], s[0]) and d[:8].abs().sum() == 0
    hicache.transfer_kv_direct(
        src, dst, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 1
    )
    with pytest.raises(ValueError, match="layers"):
        hicache.transfer_kv_direct(src, dst[:1], torch.tensor([0]), torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="groups"):
        hicache.transfer_kv_all_layer_direct_lf_pf(
            src + src[:1], [torch.zeros(4, 1, 1, 4)] * 2, torch.tensor([0]), torch.tensor([0]), 1
        )


def test_host_allocation_is_plain_memory():
    t = hicache.alloc_host((3, 4), torch.float32, "cpu", True, None)
    assert t.shape == (3, 4) and t.device.type == "cpu" and t.dtype == torch.float32


@needs_sglang
def test_plugin_routes_in_a_fresh_sglang_process(tmp_path):
    """After SGLang loads its plugins on the CPU: host pools allocate without CUDA, the pool modules
    have the copy ops, and a HiCache server's io backend resolves to direct (layout
    page_first_direct) while an explicit one is kept."""
    from sglang_sparse.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    script = f"""
        import json
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.mem_cache.pool_host import common, mamba, mha
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.arg_groups.model_override_base import resolved_view
        from sglang_sparse_kernels.sgl_kernel_cpu import hicache
        base = ["--model-path", {str(model)!r}, "--device", "cpu", "--skip-tokenizer-init",
                "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
        def resolve(extra):
            a = prepare_server_args(base + extra)
            a.resolve_once()
            v = resolved_view(a)
            return [v.hicache_io_backend, v.hicache_mem_layout]
        print(json.dumps({{
            "alloc": common.ALLOC_MEMORY_FUNCS["cpu"] is hicache.alloc_host,
            "ops": [getattr(m, n, None) is f for m in (mha, mamba) for n, f in hicache.TRANSFER_OPS.items()],
            "hicache": resolve(["--enable-hierarchical-cache"]),
            "explicit": resolve(["--enable-hierarchical-cache", "--hicache-mem-layout", "layer_first",
                                 "--hicache-io-backend", "direct"]),
            "off": resolve([]),
        }}))
    """
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLATFORM"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["alloc"] and all(out["ops"]), out
    assert out["hicache"] == ["direct", "page_first_direct"]
    assert out["explicit"] == ["direct", "layer_first"]
    assert out["off"][0] == "kernel"  # no HiCache: nothing resolved
