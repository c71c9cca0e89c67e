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
  ``.NAME.partial*`` and is removed by the next run (:func:`remove_stale_partials`); the partial
  of a run still writing (its process alive on this host) is left alone;
* a run without ``--force`` never replaces an output that appeared while it was writing (another
  run's): its commit refuses (:class:`OutputTaken`), the other output stays;
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
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

#: The partials this process named for writing (:func:`partial_path`), for :func:`remove_own_partials`.
_OWN: set[Path] = set()


def partial_path(out: str | os.PathLike) -> Path:
    """A fresh hidden sibling name for writing ``out``: ``.NAME.partial-<pid>-<random>`` (not created)."""
    partial = _sibling(out)
    _OWN.add(partial)
    return partial


def _sibling(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"


def remove_own_partials() -> None:
    """Remove what this process was writing and never committed: it is ending without its job's clean-up.

    For a rank whose launcher was killed (the command line registers it with
    :func:`~vime_gemma4_bridge.runtime.launch.at_launcher_gone`): its
    ``.partial-<pid>`` name would otherwise wait, its writer gone, for the next run to remove it.
    A committed partial is at its output by now, and an old output set aside by a commit in progress
    is not among these (it may be the only copy).
    """
    for partial in list(_OWN):
        _remove(partial)


class OutputTaken(ValueError):
    """The output appeared while this run was writing it (another run's), and replacing was not asked for."""


def _writer_alive(partial: Path) -> bool:
    """Whether the process that named ``partial`` (:func:`partial_path`) still runs on this host."""
    match = re.search(r"\.partial-(\d+)-", partial.name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_partials(out: str | os.PathLike, *, keep: Path | None = None) -> None:
    """Remove the ``.NAME.partial*`` siblings of ``out`` that runs killed while writing left.

    ``keep`` and the partials of runs still writing (a concurrent run to the same output) stay.
    """
    out = Path(out)
    for stale in out.parent.glob(f".{glob.escape(out.name)}.partial*"):
        if stale != keep and not _writer_alive(stale):
            _remove(stale)


def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """``(device, inode)`` of what is at ``path`` now, or ``None``: a commit puts another one there."""
    try:
        stat = os.lstat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def committed_since(path: str | os.PathLike, before: tuple[int, int] | None) -> bool:
    """Whether a directory was committed at ``path`` since :func:`identity` returned ``before``.

    A commit renames the new directory (created while any old one still existed, so with another
    inode) into place: an output that is there with a new identity is a complete one.
    """
    now = identity(path)
    return now is not None and now != before


def commit_directory(partial: str | os.PathLike, out: str | os.PathLike, *, replace: bool = True) -> Path:
    """Put the complete directory ``partial`` at ``out``; an existing ``out`` goes only once it is replaced.

    Without ``replace`` an ``out`` that is not empty now (it appeared while the caller was
    writing: the command checked before) is kept and :class:`OutputTaken` raised.
    """
    partial, out = Path(partial), Path(out)
    if not replace and out.is_dir() and any(out.iterdir()):
        raise OutputTaken(
            f"{out} appeared while this run was writing it (another run?); it was kept and this run's output "
            "discarded: pass --force to replace it"
        )
    _apply_umask(partial)
    aside = None
    if out.exists() or out.is_symlink():
        aside = _sibling(out)
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
def atomic_directory(out: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield a fresh partial directory for ``out``; committed when the body completes, removed if it raises.

    Stale partials of killed runs are removed first; ``out``'s parent is created if missing;
    ``replace`` as for :func:`commit_directory`.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    partial = partial_path(out)
    partial.mkdir()
    try:
        yield partial
        commit_directory(partial, out, replace=replace)
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
