"""What a command may write and what `--overwrite` removes: one rule for every command.

`--overwrite` removes only the entries the command itself writes (named, inside OUT), never anything
else in OUT, never a symlink's target (a symlinked entry loses its link, its target stays), and never
the command's own input: an OUT that is, contains or lies inside an input is refused before any work
(`check_inputs`). `check_writable` finds an OUT that cannot be written before any work starts.
Every command that takes --overwrite (train, run, demo, eval, export) goes through this module.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from memorize_core import fail


def check_name(field: str, name: object) -> str:
    """`name` as a plain file name (it becomes a folder under OUT); ConfigError otherwise."""
    text = name if isinstance(name, str) else str(name)
    bad = (not isinstance(name, str) or not text or text.startswith(".") or "/" in text or "\\" in text
           or "\0" in text or text != text.strip())
    if bad:
        raise fail(field, name, "must be a plain file name (not empty, no '/', no leading '.', no "
                   "surrounding spaces): it names a folder under OUT; rename it, e.g. 'arm-1'")
    return text


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def check_writable(field: str, out: str | Path) -> None:
    """ConfigError unless `out` (made if missing) can take files: the nearest existing folder on its
    path is a folder this process may write, on a read-write file system with space left."""
    path = Path(out)
    if os.path.lexists(path) and not path.is_dir():
        raise fail(field, str(out), "exists and is not a directory; choose another path")
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise fail(field, str(out), f"cannot be created: {base} is not a directory; choose another path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise fail(field, str(out), f"cannot be written: permission denied on {base}; choose a folder "
                   "you can write")
    st = os.statvfs(base)
    if st.f_flag & os.ST_RDONLY:
        raise fail(field, str(out), f"cannot be written: {base} is on a read-only file system; choose "
                   "another folder")
    if st.f_bavail == 0:
        raise fail(field, str(out), f"cannot be written: no space left on the file system of {base}; "
                   "free some space or choose another folder")


def _resolve(field: str, path: str | Path) -> Path:
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise fail(field, str(path), f"cannot be resolved ({type(e).__name__}: {e}); a symlink loop? "
                   "point it at a real file or folder") from None


def _overlap(out: Path, src: Path) -> str | None:
    if out == src:
        return "is"
    if out in src.parents:
        return "contains"
    if src in out.parents:
        return "lies inside"
    return None


def check_inputs(field: str, out: str | Path, inputs: Mapping[str, str | Path | None], *,
                 entries: Iterable[str] | None = None) -> None:
    """ConfigError when OUT overlaps an input of the command (`inputs`: option name -> path; None
    and paths that do not exist are skipped). `entries`: the names the command writes in OUT; then an
    input is only refused inside one of them (or when OUT is or lies inside it). Without `entries`
    the whole of OUT is the command's (export) and any overlap is refused."""
    dest = _resolve(field, out)
    targets = [dest / e for e in entries] if entries is not None else [dest]
    for name, value in inputs.items():
        if value is None or not os.path.lexists(value):
            continue
        src = _resolve(name, value)
        how = _overlap(dest, src)
        if how == "contains" and entries is not None:
            how = "contains" if any(t == src or t in src.parents for t in targets) else None
        if how:
            raise fail(field, str(out), f"{how} the input {name}={str(value)!r}; the command would write "
                       "over what it reads: choose an output path outside it")


def existing_entries(out: str | Path, names: Iterable[str]) -> list[str]:
    """The entries of `names` present in OUT (a dangling symlink counts: writing would follow it)."""
    path = Path(out)
    return [n for n in names if os.path.lexists(path / n)]


def remove_entries(out: str | Path, names: Iterable[str]) -> list[str]:
    """Remove the entries `names` of OUT (the command's own outputs) and nothing else; return them.

    A symlinked entry is unlinked (its target is never touched; rmtree itself never follows links
    inside a folder). Names are checked first, so no name can reach outside OUT."""
    path = Path(out)
    removed = []
    for name in names:
        check_name("output entry", name)
        target = path / name
        if target.is_symlink() or (os.path.lexists(target) and not target.is_dir()):
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        else:
            continue
        removed.append(name)
    return removed


# The ledger of what a command wrote into a folder it shares with other files (export): what a later
# `--overwrite` may remove beyond the names it writes itself. Never a name pattern: a user's file that
# merely looks like ours (model-00001-of-00002.safetensors) is not in the ledger and stays.
LEDGER = ".memorize-written.json"


def recorded_entries(out: str | Path) -> list[str]:
    """The entry names the ledger in OUT says this tool wrote there ([] without a readable ledger)."""
    try:
        names = json.loads((Path(out) / LEDGER).read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str) and n and "/" not in n and not n.startswith(".")]


def record_entries(out: str | Path, command: str, names: Iterable[str]) -> None:
    """Write the ledger: `command` wrote `names` into OUT (replacing an earlier ledger)."""
    tmp = Path(out) / (LEDGER + ".tmp")
    tmp.write_text(json.dumps({"command": command, "entries": sorted(names)}, indent=1) + "\n")
    tmp.replace(Path(out) / LEDGER)


__all__ = ["LEDGER", "check_inputs", "check_name", "check_writable", "existing_entries", "record_entries",
           "recorded_entries", "remove_entries"]


def write_files(out: Path, files: Mapping[str, str | bytes], *, replace: Iterable[str]) -> None:
    """Write every file (text or bytes) into a scratch folder inside `out` first, then move them in,
    dropping the `replace` files the call does not write (stale results of an earlier call).

    A failure while writing leaves `out` as it was; the moves are renames within one folder.
    """
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".write-", dir=out))
    try:
        for name, data in files.items():
            if isinstance(data, bytes):
                (tmp / name).write_bytes(data)
            else:
                (tmp / name).write_text(data, encoding="utf-8")
        for name in replace:  # an old extraction.jsonl must not sit beside a report without extraction
            if name not in files and (out / name).exists():
                (out / name).unlink()
        for name in files:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
