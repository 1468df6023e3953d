"""Every ``sparse`` backend option is documented once, in ``docs/sparse_backend.md``'s *Options*
table (``sglang_adapter/config.py`` points there instead of repeating it)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from sglang_sparse.sglang_adapter.config import CONFIG_ENV, ENV_PREFIX, SparseConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "sparse_backend.md"


def test_every_option_is_a_row_of_the_docs_table_and_every_row_an_option() -> None:
    text = DOC.read_text()
    options = text[text.index("## Options") :]
    rows = set(re.findall(r"^\| `(SGLANG_SPARSE_[A-Z_]+)` \|", options, re.M))
    fields = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(SparseConfig)}
    assert fields - rows == set(), "options missing from the docs table"
    assert rows - fields - {CONFIG_ENV} == set(), "docs rows that are no option"
