"""Captures of one extend forward as entries of SGLang's own prefill track lists (index arithmetic).

SGLang's ``extra_buffer`` strategy copies the recurrent state of a tracked request out of an extend
forward with plain index copies, each written for index lists of any length:

* conv: ``conv_states[conv_states_mask_indices] = x[track_conv_indices]`` before the conv kernel
  (``W - 1`` pre-conv input rows per entry: ``gdn_backend.py`` ``forward_extend``, Mamba2's
  ``MambaMixer2.forward``);
* SSM (``MambaAttnBackendBase._track_mamba_state_extend``): ``ssm[h_dst] = h[h_src]`` from the
  per-chunk states ``h`` the extend kernel returns, ``ssm[final_dst] = ssm[final_src]`` from the
  final state the kernel wrote in place into the working slot, and (Mamba2)
  ``ssm[recompute_dst] = track_states`` from the scan's exact states at ``track_end_locs``.

:func:`track_additions` turns a capture list (batch row, offset into the row's extend, slot) into
extra entries of those lists, so SGLang's own copy code writes several states per sequence per
forward on every device. What it adds per capture at offset ``r`` of row ``n`` (``0 < r <= len_n``):

* conv: ``starts[n] + r - (W - 1) + arange(W - 1)``; for ``r < W - 1`` the window reaches into the
  state before the extend: its first ``W - 1 - r`` columns are then a *conv fix* (``conv_fix_*``),
  columns ``r ..`` of the row's initial conv window, copied after SGLang's gather (the gathered
  rows before ``starts[n]`` are another row's tokens; indices below 0 are clamped to 0, in bounds);
* SSM, by the layout of ``h`` (:class:`Layout`):

  - ``r == len_n``: the final state (``final``, any layout);
  - ``r`` on the layout's grid: an ``h`` row;
  - otherwise (GDN only) a **tail**: the state at the grid point below ``r`` (an ``h`` row, or for
    FlashInfer below its first checkpoint the initial state, copied before the kernel: ``pre``)
    advanced by the ``r % grid`` remaining tokens with the recurrent kernel in place
    (``tail_tokens`` / ``tail_cu``, CSR over the tails);
  - Mamba2 (:attr:`Layout.FLAT`): an ``h`` row when ``starts[n] + r`` is on the chunk grid, else
    an exact recompute (SGLang's own rule, ``prefill_track_metadata.build_prefill_track_plan``).

Units: offsets, starts and lengths in tokens; ``h`` rows, slots and batch rows are indices. Slots are
passed through unchanged (virtual or physical: the caller translates). Every returned list is in
capture order within its kind. Pure Python (no SGLang, no torch): unit-tested without either.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import accumulate


class Layout(enum.Enum):
    """Where the per-chunk states ``h`` of an extend kernel live (``grid`` below is its step).

    * ``CHUNKS``: SGLang's Triton GDN kernel (and the project's CPU stand-in): sequence ``n`` owns
      ``ceil(len_n / grid)`` rows from ``sum_{m<n} ceil(len_m / grid)``; its row ``c`` is the state
      after ``c * grid`` tokens of its extend (row 0 = the initial state). ``grid`` = 64.
    * ``CHECKPOINTS``: FlashInfer's GDN prefill with ``state_checkpoints``: sequence ``n`` owns
      ``len_n // grid`` rows from ``sum_{m<n} len_m // grid``; row ``j`` is the state after
      ``(j + 1) * grid`` tokens (no initial state). ``grid`` = ``mamba_cache_chunk_size()``.
    * ``FLAT``: Mamba2's SSD scan: one grid over the flattened batch; row ``i`` is the state at
      token ``i * grid`` of the batch. ``grid`` = the model's ``mamba_chunk_size``.
    * ``NONE``: the kernel returns no per-chunk states (CuTe DSL GDN prefill): only the final
      state can be captured.
    """

    CHUNKS = "chunks"
    CHECKPOINTS = "checkpoints"
    FLAT = "flat"
    NONE = "none"


@dataclass
class TrackAdditions:
    """Entries to append to SGLang's track lists for one forward (see the module docstring).

    ``final_rows`` / ``pre_rows`` are batch rows: the caller maps them to the rows' working slots.
    ``tail_base`` is ``("h", row)`` or ``("pre", j)`` per tail: where the tail's start state comes
    from (an ``h`` row, or the ``j``-th ``pre`` copy, already in the tail's slot).
    ``conv_fix_*``: the captures whose conv window starts before their extend (``r < W - 1``):
    batch row, offset, slot. ``checkpoint_counts``: per batch row, the FlashInfer checkpoints the
    forward must request (``len_n // grid``), or ``None`` when no capture reads one."""

    conv_idx: list[list[int]] = field(default_factory=list)
    conv_dst: list[int] = field(default_factory=list)
    h_src: list[int] = field(default_factory=list)
    h_dst: list[int] = field(default_factory=list)
    final_rows: list[int] = field(default_factory=list)
    final_dst: list[int] = field(default_factory=list)
    recompute_rows: list[int] = field(default_factory=list)
    recompute_end_locs: list[int] = field(default_factory=list)
    recompute_dst: list[int] = field(default_factory=list)
    pre_rows: list[int] = field(default_factory=list)
    pre_dst: list[int] = field(default_factory=list)
    tail_src: list[int] = field(default_factory=list)
    tail_dst: list[int] = field(default_factory=list)
    tail_tokens: list[int] = field(default_factory=list)
    tail_cu: list[int] = field(default_factory=lambda: [0])
    conv_fix_rows: list[int] = field(default_factory=list)
    conv_fix_offsets: list[int] = field(default_factory=list)
    conv_fix_dst: list[int] = field(default_factory=list)
    checkpoint_counts: list[int] | None = None

    @property
    def n_tails(self) -> int:
        return len(self.tail_dst)

    @property
    def n_ssm(self) -> int:
        """Captures whose SSM state this forward writes (every capture has exactly one source)."""
        return len(self.h_dst) + len(self.final_dst) + len(self.recompute_dst) + self.n_tails


def conv_window_fits(offset: int, conv_len: int) -> bool:
    """Whether the conv state after ``offset`` tokens of an extend (its last ``conv_len`` pre-conv
    inputs) lies inside the extend, where SGLang's conv-track copy gathers it from."""
    return offset >= conv_len


def interior_capturable(layout: Layout) -> bool:
    """Whether states strictly inside an extend can be captured with this kernel's outputs."""
    return layout is not Layout.NONE


def track_additions(
    rows: list[int],
    offsets: list[int],
    slots: list[int],
    starts: list[int],
    lens: list[int],
    *,
    conv_len: int,
    layout: Layout,
    grid: int,
) -> TrackAdditions:
    """The track-list entries that capture ``(rows[j], offsets[j])`` into ``slots[j]``.

    Args:
        rows, offsets, slots: the captures (same length); ``0 < offsets[j] <= lens[rows[j]]``.
        starts: token index of each batch row's first extend token (``query_start_loc[:-1]``).
        lens: extend length of each batch row (tokens).
        conv_len: conv state width ``W - 1`` (0: the layer keeps no conv state).
        layout, grid: where the kernel's per-chunk states are (:class:`Layout`).

    Raises:
        ValueError: mismatched lengths, an offset outside ``(0, len]``, an interior capture with
        :attr:`Layout.NONE`, a grid < 1.
    """
    if not len(rows) == len(offsets) == len(slots):
        raise ValueError(f"{len(rows)} rows, {len(offsets)} offsets, {len(slots)} slots")
    if len(starts) != len(lens):
        raise ValueError(f"{len(starts)} row starts for {len(lens)} row lengths")
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    out = TrackAdditions()
    h_row0 = _row_offsets(lens, layout, grid)
    for n, r, d in zip(rows, offsets, slots, strict=True):
        if not 0 <= n < len(lens):
            raise ValueError(f"capture row {n} outside the batch of {len(lens)} rows")
        if not 0 < r <= lens[n]:
            raise ValueError(f"capture offset {r} outside (0, {lens[n]}] of row {n}")
        if conv_len > 0:
            first = starts[n] + r - conv_len  # < starts[n]: columns the conv fix replaces
            out.conv_idx.append([max(i, 0) for i in range(first, first + conv_len)])
            out.conv_dst.append(d)
            if not conv_window_fits(r, conv_len):
                out.conv_fix_rows.append(n)
                out.conv_fix_offsets.append(r)
                out.conv_fix_dst.append(d)
        if r == lens[n]:
            out.final_rows.append(n)
            out.final_dst.append(d)
            continue
        if layout is Layout.NONE:
            raise ValueError(f"interior capture at offset {r} of row {n}: the kernel returns no h")
        if layout is Layout.FLAT:
            end = starts[n] + r
            if end % grid == 0:
                out.h_src.append(end // grid)
                out.h_dst.append(d)
            else:
                out.recompute_rows.append(n)
                out.recompute_end_locs.append(end)
                out.recompute_dst.append(d)
            continue
        c, t = divmod(r, grid)
        if t == 0:
            out.h_src.append(_h_row(layout, h_row0[n], c))
            out.h_dst.append(d)
            continue
        if layout is Layout.CHECKPOINTS and c == 0:
            out.tail_src.append(-1)  # the start state is the pre-copied initial state
            out.pre_rows.append(n)
            out.pre_dst.append(d)
        else:
            out.tail_src.append(_h_row(layout, h_row0[n], c))
        out.tail_dst.append(d)
        base = starts[n] + c * grid
        out.tail_tokens.extend(range(base, base + t))
        out.tail_cu.append(len(out.tail_tokens))
    if layout is Layout.CHECKPOINTS and any(s >= 0 for s in (*out.h_src, *out.tail_src)):
        out.checkpoint_counts = [n // grid for n in lens]
    return out


def _row_offsets(lens: list[int], layout: Layout, grid: int) -> list[int]:
    """First ``h`` row of each batch row (CHUNKS / CHECKPOINTS; zeros otherwise)."""
    if layout is Layout.CHUNKS:
        return list(accumulate((-(-n // grid) for n in lens[:-1]), initial=0))
    if layout is Layout.CHECKPOINTS:
        return list(accumulate((n // grid for n in lens[:-1]), initial=0))
    return [0] * len(lens)


def _h_row(layout: Layout, row0: int, c: int) -> int:
    """The ``h`` row of the state after ``c`` grid steps (``c >= 1`` for CHECKPOINTS)."""
    return row0 + c if layout is Layout.CHUNKS else row0 + c - 1


def checkpoint_cu_starts(counts: list[int]) -> list[int]:
    """FlashInfer's ``state_checkpoint_cu_starts``: ``[0, c_0, c_0 + c_1, ...]``."""
    return list(accumulate(counts, initial=0))
