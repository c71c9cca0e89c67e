"""The one atomic directory commit: every output directory appears only complete.

Why one: a conversion that is killed, runs out of disk or fails half way must never leave anything
at the output path that looks like a checkpoint, and must not destroy the previous output before
the new one is whole. Every writer of a directory (``import``, ``export``, ``roundtrip``,
``export-live``, the tiny factory) therefore writes into a hidden sibling ``.NAME.partial-<id>`` (same
file system, so the final rename is atomic) and hands it to :func:`commit_directory`:

* the output appears only complete: the partial is renamed into place as the last step;
* an existing output is replaced only once the new one is complete: it is renamed aside (into
  another ``.NAME.partial-…`` name), the partial renamed in, then the old one removed; if the
  second rename fails, the old output is put back;
* a partial left by a run that was killed (SIGKILL: nothing could clean up) matches
  ``.NAME.partial*`` and is removed by the next run (:func:`remove_stale_partials`);
* files get the usual ``0666 & ~umask`` mode (some writers create them 0600, which would hide a
  checkpoint from other users and containers).

:func:`atomic_directory` is the whole protocol for a writer in one process; a job whose partial is
named before its ranks start (``import``: the command removes it when interrupted) uses
:func:`partial_path` and :func:`commit_directory` itself.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


def partial_path(out: str | os.PathLike) -> Path:
    """A fresh hidden sibling name for writing ``out``: ``.NAME.partial-<pid>-<random>`` (not created)."""
    out = Path(out)
    return out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"


def remove_stale_partials(out: str | os.PathLike, *, keep: Path | None = None) -> None:
    """Remove the ``.NAME.partial*`` siblings of ``out`` that runs killed while writing left (except ``keep``)."""
    out = Path(out)
    for stale in out.parent.glob(f".{glob.escape(out.name)}.partial*"):
        if keep is None or stale != keep:
            _remove(stale)


def commit_directory(partial: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Put the complete directory ``partial`` at ``out``; an existing ``out`` goes only once it is replaced."""
    partial, out = Path(partial), Path(out)
    _apply_umask(partial)
    aside = None
    if out.exists() or out.is_symlink():
        aside = partial_path(out)
        os.replace(out, aside)
    try:
        os.replace(partial, out)
    except BaseException:
        if aside is not None:
            os.replace(aside, out)
        raise
    if aside is not None:
        _remove(aside)
    return out


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh partial directory for ``out``; committed when the body completes, removed if it raises.

    Stale partials of killed runs are removed first; ``out``'s parent is created if missing.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    partial = partial_path(out)
    partial.mkdir()
    try:
        yield partial
        commit_directory(partial, out)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


def _remove(path: Path) -> None:
    """Remove a directory tree, or a symbolic link itself (never what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _apply_umask(directory: Path) -> None:
    """Give the files under ``directory`` the usual ``0666 & ~umask`` mode."""
    mask = os.umask(0)
    os.umask(mask)
    for file in directory.rglob("*"):
        if file.is_file() and not file.is_symlink():
            file.chmod(0o666 & ~mask)
