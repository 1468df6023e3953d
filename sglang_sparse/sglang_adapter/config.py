"""Options of the ``sparse`` radix-cache backend: one validated source, environment and/or JSON.

Sources, later wins: built-in defaults < ``SGLANG_SPARSE_CONFIG=/path.json`` (an object whose keys
are the option names, lower case, without the prefix) < individual ``SGLANG_SPARSE_*``
variables. Every value is validated when the scheduler builds the cache (the backend factory), so
a bad value aborts server start-up with a :class:`SparseConfigError` naming the variable.

The options, their defaults, units and meaning are one table, ``docs/sparse_backend.md`` (*Options*);
:class:`SparseConfig`'s fields are those options, named as their JSON keys.

This module has no SGLang import (it is unit-testable without the serving stack).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from sglang_sparse.placement import DEFAULT_GRID

ENV_PREFIX = "SGLANG_SPARSE_"
#: default ``min_cut_gain`` on the chunk-cut capture path (tokens; an extra forward costs ~50-80)
CUT_MIN_GAIN = 32
CONFIG_ENV = "SGLANG_SPARSE_CONFIG"
#: the project's variables under :data:`ENV_PREFIX` that are not backend options, so the strict
#: option check lets them through: the traces' data directory (``sglang_sparse.traces.data``) and
#: the CPU platform's device-activity switch (``sgl_kernel_cpu/sglang_platform.py``)
NON_OPTION_ENV = frozenset({"SGLANG_SPARSE_DATA", "SGLANG_SPARSE_CPU_NO_DEVICE_ACTIVITY"})


class SparseConfigError(ValueError):
    """A ``sparse`` backend option is invalid; the message names the variable."""


@dataclass(frozen=True)
class SparseConfig:
    """Validated options (see the module docstring)."""

    policy: str = "sparse"
    edge_budget: int = 4
    gamma: float = 0.99
    refresh: int = 10
    alpha: float | None = None  # None = "auto"
    grid: int | None = None  # None: the engine's state grid (resolved by the backend factory)
    min_cut_gain: int | None = None  # None: 0 with capture=forward, CUT_MIN_GAIN with cut
    branch_grid: int | None = None  # None: grid
    tail_grid: int | None = None  # None: grid
    tune_window: int = 200
    retune: bool = False
    log_every: int = 100
    probation: int = 2
    check_invariants: bool = False
    capture: str | None = None  # None: auto (resolve_capture)
    host_bandwidth: float | None = None  # bytes/s; None: measured at start-up (HiCache only)
    device_flops: float | None = None  # FLOP/s; None: measured at start-up (HiCache only)
    host_cost: bool = True
    demote: str = "lru"

    @property
    def alpha_auto(self) -> bool:
        return self.alpha is None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["alpha"] = "auto" if self.alpha is None else self.alpha
        return d

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SparseConfig:
        """Read ``SGLANG_SPARSE_CONFIG`` (JSON) then the ``SGLANG_SPARSE_*`` variables; validate."""
        env = os.environ if environ is None else environ
        raw: dict[str, tuple[str, Any]] = {}  # field -> (source name for messages, raw value)
        path = env.get(CONFIG_ENV)
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as e:
                raise SparseConfigError(f"{CONFIG_ENV}={path!r}: cannot read ({e.strerror})") from None
            except json.JSONDecodeError as e:
                raise SparseConfigError(f"{CONFIG_ENV}={path!r}: invalid JSON ({e})") from None
            if not isinstance(data, dict):
                raise SparseConfigError(f"{CONFIG_ENV}={path!r}: expected a JSON object")
            for k, v in data.items():
                if k not in _FIELDS:
                    raise SparseConfigError(
                        f"{CONFIG_ENV}={path!r}: unknown key {k!r}; valid: {', '.join(_FIELDS)}"
                    )
                raw[k] = (f"{CONFIG_ENV}[{k!r}]", v)
        for k in _FIELDS:
            var = ENV_PREFIX + k.upper()
            if var in env and env[var] != "":
                raw[k] = (var, env[var])
        unknown = sorted(
            v
            for v in env
            if v.startswith(ENV_PREFIX)
            and v != CONFIG_ENV
            and v not in NON_OPTION_ENV
            and v[len(ENV_PREFIX) :].lower() not in _FIELDS
        )
        if unknown:
            raise SparseConfigError(
                f"unknown variable {unknown[0]}; valid: {CONFIG_ENV}, "
                + ", ".join(ENV_PREFIX + k.upper() for k in _FIELDS)
            )
        return cls.from_values(raw)

    @classmethod
    def from_values(cls, raw: Mapping[str, tuple[str, Any]]) -> SparseConfig:
        kw: dict[str, Any] = {}
        for k, (src, v) in raw.items():
            kw[k] = _PARSERS[k](src, v)
        cfg = cls(**kw)
        cfg._check_policy_alpha(raw)
        return cfg

    def _check_policy_alpha(self, raw: Mapping[str, tuple[str, Any]]) -> None:
        from sglang_sparse.policy import get_policy

        spec = get_policy(self.policy)
        if not spec.flop_aware and self.alpha not in (None, 0.0):
            src = raw.get("alpha", (ENV_PREFIX + "ALPHA", None))[0]
            raise SparseConfigError(
                f"{src}={self.alpha}: policy {self.policy!r} is not FLOP-aware, alpha must be 0 or 'auto'"
            )


def _int(src: str, v: Any, lo: int) -> int:
    if isinstance(v, bool):
        raise SparseConfigError(f"{src}={v!r}: expected an integer >= {lo}")
    try:
        x = int(str(v).strip()) if not isinstance(v, int) else v
    except ValueError:
        raise SparseConfigError(f"{src}={v!r}: expected an integer >= {lo}") from None
    if x < lo:
        raise SparseConfigError(f"{src}={v!r}: must be >= {lo}")
    return x


def _float(src: str, v: Any) -> float:
    if isinstance(v, bool):
        raise SparseConfigError(f"{src}={v!r}: expected a number")
    try:
        x = float(str(v).strip()) if not isinstance(v, (int, float)) else float(v)
    except ValueError:
        raise SparseConfigError(f"{src}={v!r}: expected a number") from None
    if not math.isfinite(x):
        raise SparseConfigError(f"{src}={v!r}: must be finite")
    return x


def _policy(src: str, v: Any) -> str:
    from sglang_sparse.policy import POLICY_NAMES, get_policy

    name = str(v).strip()
    if name not in POLICY_NAMES:
        serving = [n for n in POLICY_NAMES if not get_policy(n).needs_law_provider]
        raise SparseConfigError(f"{src}={v!r}: unknown policy; valid: {', '.join(serving)}")
    if get_policy(name).needs_law_provider:
        raise SparseConfigError(f"{src}={v!r}: policy {name!r} needs the whole trace (simulator only)")
    return name


def _bool(src: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    t = str(v).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise SparseConfigError(f"{src}={v!r}: expected 0 or 1")


CAPTURE_MODES = ("cut", "forward")
DEMOTE_ORDERS = ("lru", "policy")


def _demote(src: str, v: Any) -> str:
    t = str(v).strip().lower()
    if t not in DEMOTE_ORDERS:
        raise SparseConfigError(f"{src}={v!r}: unknown demotion order; valid: {', '.join(DEMOTE_ORDERS)}")
    return t


def _capture(src: str, v: Any) -> str:
    t = str(v).strip().lower()
    if t not in CAPTURE_MODES:
        raise SparseConfigError(f"{src}={v!r}: unknown capture mode; valid: {', '.join(CAPTURE_MODES)}")
    return t


def resolve_capture(
    capture: str | None, *, interior_states: bool, hicache_write_policy: str | None = None
) -> tuple[str, str]:
    """The capture mode a server runs, and why: ``(mode, reason)``.

    ``capture``: the option (None = auto). ``interior_states``: the prefill kernel returns states
    inside an extend (every GDN kernel but CuTe DSL's, Mamba2's scan). ``hicache_write_policy``:
    SGLang's HiCache write policy, None without HiCache. Auto is ``forward`` except where the chunk
    cuts are the only way (no interior states) or measured better (HiCache write-back: *Host tier*
    in docs/sparse_backend.md).

    Raises:
        SparseConfigError: ``forward`` asked for where the kernel has no interior states.
    """
    if capture == "cut":
        return "cut", "SGLANG_SPARSE_CAPTURE=cut"
    if not interior_states:
        why = "the GDN prefill kernel returns no per-chunk states (CuTe DSL)"
        if capture == "forward":
            raise SparseConfigError(f"SGLANG_SPARSE_CAPTURE=forward: {why}; use cut or another kernel")
        return "cut", why
    if capture == "forward":
        return "forward", "SGLANG_SPARSE_CAPTURE=forward"
    if hicache_write_policy is not None and hicache_write_policy != "write_through":
        return "cut", f"HiCache {hicache_write_policy} (the chunk cuts keep more there)"
    return "forward", "default"


def _gamma(src: str, v: Any) -> float:
    x = _float(src, v)
    if not 0.0 < x <= 1.0:
        raise SparseConfigError(f"{src}={v!r}: must be in (0, 1]")
    return x


def _alpha(src: str, v: Any) -> float | None:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return None
    x = _float(src, v)
    if x < 0:
        raise SparseConfigError(f"{src}={v!r}: must be >= 0 or 'auto'")
    return x


def _positive(src: str, v: Any, unit: str) -> float:
    x = _float(src, v)
    if not x > 0:
        raise SparseConfigError(f"{src}={v!r}: must be > 0 ({unit})")
    return x


_PARSERS = {
    "policy": _policy,
    "edge_budget": lambda s, v: _int(s, v, 0),
    "gamma": _gamma,
    "refresh": lambda s, v: _int(s, v, 1),
    "alpha": _alpha,
    "grid": lambda s, v: _int(s, v, 1),
    "min_cut_gain": lambda s, v: _int(s, v, 0),
    "branch_grid": lambda s, v: _int(s, v, 1),
    "tail_grid": lambda s, v: _int(s, v, 1),
    "tune_window": lambda s, v: _int(s, v, 1),
    "retune": _bool,
    "log_every": lambda s, v: _int(s, v, 0),
    "probation": lambda s, v: _int(s, v, 0),
    "check_invariants": _bool,
    "capture": _capture,
    "host_bandwidth": lambda s, v: _positive(s, v, "bytes per second"),
    "device_flops": lambda s, v: _positive(s, v, "FLOP per second"),
    "host_cost": _bool,
    "demote": _demote,
}
_FIELDS = tuple(_PARSERS)


def resolve_defaults(
    config: SparseConfig, *, capture: str, page: int, state_grid: int, extra_buffer: bool
) -> SparseConfig:
    """``config`` with every auto option settled for a server: ``capture`` (the resolved mode,
    :func:`resolve_capture`), ``page`` (``--page-size``, tokens), ``state_grid`` (SGLang's
    ``mamba_checkpoint_grid``: lcm of the recurrent kernel's chunk and the page, tokens) and the
    state strategy.

    * ``min_cut_gain``: 0 with in-forward capture (a capture costs one state's copies), else
      :data:`CUT_MIN_GAIN` (each capture inside a prefill costs an extra forward).
    * ``grid``: where plans may place states. Off SGLang's state grid a state needs a capture at any
      page-aligned depth (in-forward capture: GDN's h row + the tail kernel, Mamba2's exact
      recompute inside its SSM chunk; or no_buffer, whose cut chunk ends are exact), so there
      ``lcm(64, page)`` whatever the state grid (Mamba2's SSM chunk is 128-256 tokens); on
      extra_buffer with ``cut`` the state grid (SGLang snapshots states only there).
    * ``branch_grid``: the grid; ``tail_grid``: the page with in-forward capture, else the grid.

    Raises:
        SparseConfigError: an explicit grid off the state grid where states exist only on it.
    """
    off_grid = capture == "forward" or not extra_buffer
    for name in ("grid", "branch_grid", "tail_grid"):
        value = getattr(config, name)
        if value is not None and not off_grid and value % state_grid:
            raise SparseConfigError(
                f"{ENV_PREFIX}{name.upper()}={value} must be a multiple of the state grid {state_grid} "
                "with extra_buffer and capture=cut (SGLang snapshots states only there)"
            )
    if config.grid is not None:
        grid = config.grid
    elif off_grid:
        grid = math.lcm(DEFAULT_GRID, page)
    else:
        grid = max(state_grid, DEFAULT_GRID)
    return replace(
        config,
        capture=capture,
        grid=grid,
        min_cut_gain=(0 if capture == "forward" else CUT_MIN_GAIN)
        if config.min_cut_gain is None
        else config.min_cut_gain,
        branch_grid=grid if config.branch_grid is None else config.branch_grid,
        tail_grid=(page if capture == "forward" else grid) if config.tail_grid is None else config.tail_grid,
    )


#: option -> (the default shown where the field's is None, unit, one-line meaning): the README's
#: options table (:func:`options_table`); the full meanings are ``docs/sparse_backend.md``, *Options*
OPTION_HELP: dict[str, tuple[str, str, str]] = {
    "policy": ("", "name", "the cache policy: {serving_policies}"),
    "edge_budget": ("", "states", "per-edge checkpoint budget `M` of the DP plan"),
    "gamma": ("", "", "decay of the per-edge depth histogram, in (0, 1]"),
    "refresh": ("", "observations", "re-plan an edge every N observed depths"),
    "alpha": ("auto", "", "FLOP-aware eviction weight, or `auto`: tuned by replaying the first window"),
    "grid": (
        "auto",
        "tokens",
        "candidate-position grid; auto: `lcm(64, page)` (the state grid with `cut` on extra_buffer)",
    ),
    "min_cut_gain": (
        "auto",
        "tokens",
        "skip a capture this close to the previous one; auto: 0 (forward), 32 (cut)",
    ),
    "branch_grid": ("auto", "tokens", "grid of the branch point a request creates; auto: `grid`"),
    "tail_grid": (
        "auto",
        "tokens",
        "grid of the tail prior's positions; auto: the page size with forward capture",
    ),
    "tune_window": ("", "requests", "requests per alpha-tuning window"),
    "retune": ("", "0/1", "re-tune alpha when a window's hit rate drifts by > 5 points"),
    "log_every": ("", "requests", "a statistics log line every N finished requests; 0: off"),
    "probation": ("", "states", "first-sight states per new leaf, evicted first; 0: off"),
    "check_invariants": ("", "0/1", "check the policy's mirror against SGLang's tree after every change"),
    "capture": ("auto", "mode", "`forward` (states written in the forward) or `cut` (chunks end there)"),
    "host_bandwidth": ("measured", "bytes/s", "HiCache: host-to-device load bandwidth"),
    "device_flops": ("measured", "FLOP/s", "HiCache: the device's prefill FLOP/s"),
    "host_cost": ("", "0/1", "HiCache: value a state net of its expected load"),
    "demote": ("", "name", "HiCache: device eviction order, `lru` (SGLang's) or `policy`"),
}


def _shown_default(name: str) -> str:
    value = getattr(SparseConfig(), name)
    if value is None:
        return OPTION_HELP[name][0]
    if isinstance(value, bool):
        return str(int(value))
    return f"`{value}`" if isinstance(value, str) else str(value)


def options_table() -> str:
    """The options as a markdown table (variable, default, unit, meaning), in field order."""
    from sglang_sparse.policy import POLICY_NAMES, get_policy

    serving = ", ".join(f"`{n}`" for n in POLICY_NAMES if not get_policy(n).needs_law_provider)
    rows = ["| variable | default | unit | meaning |", "| --- | --- | --- | --- |"]
    for name in _FIELDS:
        _, unit, meaning = OPTION_HELP[name]
        meaning = meaning.format(serving_policies=serving)
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {_shown_default(name)} | {unit} | {meaning} |")
    return "\n".join(rows)
