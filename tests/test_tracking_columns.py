"""W&B tables: every column of one plain type (Shown cells beside empty ones crashed a real run)."""
from __future__ import annotations

from memorization.experiments.reporting import Shown
from memorization.tracking import uniform_columns


def test_shown_cells_become_plain_text_and_mixed_columns_text():
    rows = uniform_columns([[Shown("1.55 (24/24)", 1.55), 1, None], ["", "-", 2.0]])
    assert [type(r[0]) for r in rows] == [str, str] and rows[0][0] == "1.55 (24/24)"
    assert rows[0][1] == "1" and rows[1][1] == "-" and rows[0][2] is None and rows[1][2] == 2.0
