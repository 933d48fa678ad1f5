"""Replacing a whole folder atomically: a reader sees the old folder or the new one, complete, never a mix.

A save writes everything into a temporary folder beside the target (same filesystem, so renames are atomic),
then swaps it in for the target. On Linux the swap is one ``renameat2(RENAME_EXCHANGE)`` call; where that is
not available it is two renames (old aside, new in), which leaves a moment with no target at all but still
never a half-written one. A failed save removes its temporary folder and leaves the target as it was.

Files in the old folder that the save does not own (a tokenizer, a README, the user's own files) are
carried into the new folder (hard links, so nothing is copied), unless the new folder has a file of the same
name. Files the save owns (every weight file in any layout, and config.json) are replaced as a whole: an
old checkpoint's shards never survive next to new weights. A process killed mid-save leaves its hidden
temporary folder (``.NAME.tmp-*``) beside the target; nothing reads it, and it can be deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

Owned = Callable[[str], bool]  # does the save own this top-level name of the target folder?


def owns_everything(name: str) -> bool:
    return True


def temp_folder_beside(target: Path) -> Path:
    """A new, empty folder next to ``target`` (created with its parents), hidden by a leading dot. Made as
    ``mkdir`` makes folders (the umask's mode, as transformers' saved folders have), not ``mkdtemp``'s owner-only
    mode: it becomes the saved folder itself."""
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        folder = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # another writer's name: draw again
            continue


def why_unwritable(path: str | Path) -> str | None:
    """Why ``path`` (a file or folder to be made, with any missing parent folders) could not be written, or None:
    its nearest existing ancestor must be a folder this process may write in."""
    parent = Path(path).absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"no write permission in {parent}"
    return None


def real_target(target: str | Path) -> Path:
    """The folder a save replaces: a symlinked target is followed, so the link keeps pointing at the new
    contents. A path that exists and is not a folder is refused."""
    target = Path(os.path.realpath(target))
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot save into {target}: it exists and is not a folder")
    return target


def swap_in(new: Path, target: Path, *, owned: Owned) -> None:
    """Make ``new`` (complete) become ``target`` in one step, carrying over the old folder's foreign files."""
    if target.is_dir():
        _carry_over(target, new, owned)
        if _exchange(new, target):  # ``new`` now holds the old contents
            shutil.rmtree(new, ignore_errors=True)
            return
        old = temp_folder_beside(target)
        os.replace(target, old)  # onto an empty folder: allowed, and atomic
        try:
            os.replace(new, target)
        except BaseException:
            os.replace(old, target)  # put the old folder back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)


@contextlib.contextmanager
def atomic_folder(target: str | Path, *, owned: Owned = owns_everything) -> Iterator[Path]:
    """Yield an empty temporary folder to write into; when the block ends without an error it replaces
    ``target`` (see ``swap_in``), and on an error it is removed and ``target`` is left untouched."""
    target = real_target(target)
    tmp = temp_folder_beside(target)
    try:
        yield tmp
        cwd = os.getcwd()
        swap_in(tmp, target, owned=owned)
        if Path(cwd).is_relative_to(target):
            # The process stood in the old folder (``save_pretrained(".")``), which is now deleted: stand at the
            # same path again, in the new folder (foreign subfolders are carried over, so the path exists).
            os.chdir(cwd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a swap


def _carry_over(old: Path, new: Path, owned: Owned) -> None:
    for entry in old.iterdir():
        if owned(entry.name) or (new / entry.name).exists() or (new / entry.name).is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def _link_or_copy(src, dst) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2; False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
