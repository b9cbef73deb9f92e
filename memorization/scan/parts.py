"""What `memorize scan` writes and how it resumes: row parts, the state file, the --out rules.

OUT/parts/part-00000.parquet (or .jsonl with `--format jsonl`) holds rows 0 .. part_rows - 1, the next
part the next part_rows rows, and so on. A part is written to a hidden temporary name and renamed into
place (atomic on one file system); then OUT/scan-state.json, rewritten the same way, records how many
parts are complete, with the command's fingerprint (every option that decides the rows). The state
file is the truth: a part the state does not count (killed between the rename and the state write)
is removed on resume, as is any temporary file, and the scan continues at row parts * part_rows.
So a scan killed with SIGKILL at any point and started again with the same command ends with exactly
the rows of an uninterrupted run, no duplicates and no gaps. A different command refuses in one line
naming the first option that differs. `--overwrite` removes only SCAN_FILES (memorization/outputs.py).

Every row also holds `logpz_greedy` (0 on an exact match) and one `logpz/<scheme>` per --sampling
scheme: log P(the scheme emits exactly the suffix), float64 (with --near-verbatim also `near_score`,
the near-verbatim search's ranking: evals/scan.py). A scheme that can never emit the suffix (top-k /
top-p removed a suffix token; greedy off an exact match) gives -inf: stored as -inf in Parquet, and as
null in JSON lines (JSON has no infinity); read_parts gives None there, and `logpz_values` turns
either back into -inf. With --near-verbatim, OUT/near_verbatim.jsonl holds the windows searched after
the last part (memorization/scan/near.py), written whole or not at all.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from memorization.outputs import check_writable, existing_entries
from memorize_core import fail

STATE = "scan-state.json"
PARTS = "parts"
PNGS = ("scan-scores.png", "scan-position.png", "scan-duplicates.png", "scan-np.png", "scan-near.png")
NEAR_ROWS = "near_verbatim.jsonl"  # --near-verbatim: the searched windows (memorization/scan/near.py)
NEAR_SCORE = "near_score"  # --near-verbatim: each row's rank for the search (evals/scan.py)
SCAN_FILES = (PARTS, STATE, "report.json", "report.md", NEAR_ROWS, *PNGS, "wandb")
# results of other commands: a scan must not land beside them without --overwrite
OTHER_RESULTS = ("metrics.jsonl", "run.json", "extraction.jsonl", "model", "checkpoints")
FLAGS = {"model_files": "--model", "data_files": "--data"}  # fingerprint keys not named as their flag


def logpz_columns(schemes: Sequence[str]) -> list[str]:
    """The log p_z columns of a scan with these sampling schemes (their names); greedy's always."""
    return ["logpz_greedy", *(f"logpz/{name}" for name in schemes)]


def schema(generate: bool, schemes: Sequence[str] = (), near: bool = False) -> pa.Schema:
    """The columns of a part: where each window came from, its tokens and every score (`near`: with
    --near-verbatim's near_score)."""
    ids = pa.list_(pa.int32())
    fields = [("row", pa.int64()), ("sequence", pa.int64()), ("offset", pa.int64()), ("doc", pa.int64()),
              ("doc_id", pa.string()), ("doc_offset", pa.int64()), ("count", pa.int64()),
              ("exact_match", pa.bool_()), ("lead", pa.int32()), ("token_accuracy", pa.float64()),
              ("suffix_loss", pa.float64()), ("zlib_ratio", pa.float64()), ("min_k", pa.float64())]
    if generate:
        fields += [("memorization_score", pa.float64()), ("rougeL", pa.float64()), ("continuation_ids", ids)]
    fields += [(name, pa.float64()) for name in logpz_columns(schemes)]
    fields += [(NEAR_SCORE, pa.float64())] if near else []
    fields += [("prefix_ids", ids), ("suffix_ids", ids)]
    return pa.schema(fields)


def part_name(index: int, fmt: str) -> str:
    """File name of part `index`."""
    return f"part-{index:05d}.{fmt}"


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:  # on disk before the rename makes it visible
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part(out: Path, index: int, cols: dict[str, list], fmt: str, generate: bool,
               schemes: Sequence[str] = (), near: bool = False) -> Path:
    """Write one part (columns: name -> values) atomically (temporary name, then rename); its path."""
    folder = out / PARTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / part_name(index, fmt)
    if fmt == "parquet":
        table = pa.Table.from_pydict(cols, schema=schema(generate, schemes, near))
        _atomic_write(path, lambda p: pq.write_table(table, p))
    else:
        cols = {k: [_json_float(x) for x in v] if k.startswith("logpz") or k == NEAR_SCORE else v
                for k, v in cols.items()}
        names = list(cols)
        text = "".join(json.dumps(dict(zip(names, r))) + "\n" for r in zip(*cols.values()))
        _atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    return path


def _json_float(x: float) -> float | None:
    """A log p_z for a JSON line: -inf (never emitted) as null; json.dumps would write -Infinity."""
    return x if math.isfinite(x) else None


def logpz_values(values: Sequence[float | None]) -> list[float]:
    """A log p_z column as read from either format: JSON's null back to -inf."""
    return [-math.inf if v is None else v for v in values]


def read_state(out: Path) -> dict[str, Any] | None:
    """The state file of a scan in OUT (None: none there)."""
    path = out / STATE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("fingerprint"), dict):
            raise ValueError("no fingerprint")
        return state
    except (ValueError, OSError):
        raise fail("--out", str(out), f"holds a {STATE} this scan cannot read; pass --overwrite to start "
                   "over, or a new --out") from None


def write_state(out: Path, state: dict[str, Any]) -> None:
    """Rewrite the state file atomically."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(state, indent=1) + "\n"
    _atomic_write(out / STATE, lambda p: p.write_text(text, encoding="utf-8"))


def check_scan_out(out: str | Path, fingerprint: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """Raise unless OUT can take this scan; the state to resume from (None: start fresh). Writes nothing."""
    check_writable("--out", out)
    path = Path(out)
    if overwrite:
        return None
    state = read_state(path)
    if state is None:
        taken = existing_entries(path, SCAN_FILES + OTHER_RESULTS)
        if taken:
            raise fail("--out", str(out), f"already holds results ({', '.join(taken)}); choose a new folder "
                       "or pass --overwrite")
        return None
    old = state["fingerprint"]
    for key in dict.fromkeys([*fingerprint, *old]):
        if old.get(key) != fingerprint.get(key):
            flag = FLAGS.get(key, "--" + key.replace("_", "-"))
            raise fail(flag, fingerprint.get(key, "(not given)"), f"differs from the scan being resumed in "
                       f"{out} (made with {old.get(key, '(not given)')!r}); rerun its command to resume it, "
                       "or pass --overwrite or a new --out")
    if state.get("complete"):
        raise fail("--out", str(out), "already holds a finished scan of this command; pass --overwrite to "
                   "run it again, or a new --out")
    return state


def clean_for_resume(out: Path, parts: int, fmt: str) -> None:
    """Remove temporary files and any part the state does not count (the main rank, before writing)."""
    folder = out / PARTS
    if not folder.is_dir():
        return
    keep = {part_name(i, fmt) for i in range(parts)}
    for p in folder.iterdir():
        if p.name not in keep and (p.name.startswith(".part-") or p.name.startswith("part-")):
            p.unlink()


def read_parts(out: Path, fmt: str, columns: Sequence[str] | None = None) -> Iterator[dict[str, list]]:
    """Each part's columns (name -> list), in row order."""
    folder = out / PARTS
    for path in sorted(folder.glob(f"part-*.{fmt}")):
        if fmt == "parquet":
            yield pq.read_table(path, columns=list(columns) if columns else None).to_pydict()
        else:
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
            names = columns or (list(rows[0]) if rows else [])
            yield {c: [r.get(c) for r in rows] for c in names}


__all__ = ["NEAR_ROWS", "NEAR_SCORE", "PARTS", "SCAN_FILES", "STATE", "check_scan_out", "clean_for_resume",
           "logpz_columns", "logpz_values", "read_parts", "read_state", "schema", "write_part", "write_state"]
