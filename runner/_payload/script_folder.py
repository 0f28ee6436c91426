"""The script's folder travels with a script run, so ``import model`` in ``train.py`` finds ``model.py`` on every rank.

Driver: ``collect`` walks the script's folder once and zips what ``python train.py`` could import from it
(modules and packages) plus the small config files the folder and its packages hold, and refuses a folder
above the bounds (``FolderLimits``) before anything launches. The zip travels inside the run's payload, in
the HMAC-verified FETCH frame.

Rank: ``shipped`` unpacks it into a private temporary folder, puts that first on ``sys.path`` and removes it
when the script ends (``remove_unpacked``: also when the rank is stopped). Modules load from the copy (their
``__file__`` is there, so files they open beside themselves are found) but are compiled under their path on
the driver, as the script is, so tracebacks name the user's files and quote their lines.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.machinery import EXTENSION_SUFFIXES, SOURCE_SUFFIXES, ExtensionFileLoader, FileFinder, SourceFileLoader
from importlib.util import decode_source

from ..._common import settings

ENTRIES_PER_FILE = 100  # the walk looks at no more than max_files * this many files and folders
MAX_CONFIG_BYTES = 1_000_000  # a larger config-like file is data: it stays behind
CONFIG_SUFFIXES = (".json", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".txt")
SKIPPED_FOLDERS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})


@dataclass(frozen=True)
class FolderLimits:
    """How much of the script's folder ships (docs/cli.md); ``from_env`` reads the environment variables."""

    ship: bool = settings.SHIP_SCRIPT_FOLDER.default
    max_bytes: int = settings.SCRIPT_FOLDER_MAX_BYTES.default  # the files' total size
    max_files: int = settings.SCRIPT_FOLDER_MAX_FILES.default

    @classmethod
    def from_env(cls, environ=None) -> FolderLimits:
        return cls(ship=settings.SHIP_SCRIPT_FOLDER.get(environ),
                   max_bytes=settings.SCRIPT_FOLDER_MAX_BYTES.get(environ),
                   max_files=settings.SCRIPT_FOLDER_MAX_FILES.get(environ))


@dataclass(frozen=True)
class ShippedFolder:
    """The files of the script's folder that travel to the ranks."""

    driver_folder: str  # where they are on the driver (tracebacks name them there)
    zip: bytes
    files: int
    size: int  # bytes before compression


# --- the driver ---------------------------------------------------------------------------------------------------

def collect(folder: str, limits: FolderLimits) -> ShippedFolder:
    """The modules and config files of ``folder``, zipped; ValueError, with the ways out, above the bounds."""
    if os.path.dirname(folder) == folder:
        raise ValueError(f"the script's folder is {folder}, the filesystem's root, whose files are not a project to "
                         f"ship to the ranks; {_ways_out(None)}.")
    found, complete = _walk(folder, limits.max_files * ENTRIES_PER_FILE)
    size = sum(s for _, _, s in found)
    where = f"the script's folder {folder} holds"
    max_files, max_bytes = settings.SCRIPT_FOLDER_MAX_FILES.name, settings.SCRIPT_FOLDER_MAX_BYTES.name
    if len(found) > limits.max_files:
        count = f"{'' if complete else 'more than '}{len(found):,}"
        raise ValueError(f"{where} {count} Python and config files to ship to the ranks, over the bound of "
                         f"{limits.max_files:,} ({max_files}){_most(found)}; {_ways_out(max_files)}.")
    if not complete:
        raise ValueError(f"{where} more than {limits.max_files * ENTRIES_PER_FILE:,} files and folders (the bound is "
                         f"{ENTRIES_PER_FILE} times {max_files}), too many to look through for the modules to ship "
                         f"to the ranks; {_ways_out(max_files)}.")
    if size > limits.max_bytes:
        name, _, largest = max(found, key=lambda f: f[2])
        raise ValueError(f"{where} {_size(size)} of Python and config files to ship to the ranks, over the bound of "
                         f"{_size(limits.max_bytes)} ({max_bytes}), the largest being {name} ({_size(largest)}); "
                         f"{_ways_out(max_bytes)}.")
    with io.BytesIO() as buffer:
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, path, _ in found:
                try:
                    archive.write(path, name)
                except OSError as exc:  # gone or changed since the walk
                    raise ValueError(f"the script's folder {folder} holds {name}, which cannot be read to ship it "
                                     f"to the ranks ({exc.strerror}); make it readable, or "
                                     f"{_ways_out(None)}.") from None
        blob = buffer.getvalue()
    return ShippedFolder(driver_folder=folder, zip=blob, files=len(found), size=size)


def _ways_out(setting: str | None) -> str:
    return (f"move the script into a folder of its own with the modules it imports, install your code as a package "
            f"on every host, or ship it with --py-files or sc.addPyFile and set "
            f"{settings.SHIP_SCRIPT_FOLDER.name}=0 to ship the script alone"
            + (f"; or raise {setting}" if setting else ""))


def _walk(root: str, max_entries: int) -> tuple[list, bool]:
    """``(name, path, size)`` of each file that ships, in name order, and whether the walk finished (False: it
    stopped after looking at ``max_entries`` files and folders).

    Ships: Python modules (``.py``, extension modules) in folders Python could import them from (names that
    are identifiers), and config files of up to ``MAX_CONFIG_BYTES`` in the folder itself and inside packages
    (folders with ``__init__.py``). Skips: dot files and folders, ``__pycache__``, virtual environments,
    site-packages, node_modules, symlinks leading out of the folder, a folder with no module and no package in
    it (``data/`` of a million images: neither looked through nor counted), files this user cannot read, names
    a zip cannot carry as they are (``_plain``), and everything else (data).
    """
    real_root = os.path.realpath(root)
    found: list = []
    scanned = 0
    followed = {real_root}  # folders reached through a symlink: a link back up is not followed again
    stack = [(root, "", None)]  # (path, name in the zip, whether it is inside a package; None: the root)
    while stack:
        path, prefix, in_package = stack.pop()
        entries = _entries(path)
        if entries is None:
            continue  # unreadable: nothing to ship from it
        names = {e.name for e in entries}
        if in_package is not None and (_is_environment(path, names) or not _holds_code(path, entries)):
            continue
        scanned += len(entries)
        if scanned > max_entries:
            return found, False
        in_package = bool(in_package) or "__init__.py" in names
        configs = prefix == "" or in_package
        folders = []
        for entry in entries:
            if entry.name.startswith(".") or not _plain(entry.name):
                continue
            if entry.is_dir():
                if _follows(entry, real_root, followed):
                    folders.append((entry.path, f"{prefix}{entry.name}/", in_package))
            elif entry.is_file():
                size = _shipped_size(entry, configs, real_root)
                if size is not None:
                    found.append((prefix + entry.name, entry.path, size))
        stack += reversed(folders)
    return found, True


def _entries(path: str) -> list | None:
    """The folder's entries in name order; None where it cannot be read."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return None


def _follows(entry: os.DirEntry, real_root: str, followed: set) -> bool:
    """Whether the walk goes into the folder ``entry``: one Python could import from, not skipped, and, for a
    symlink, one inside the script's folder (``real_root``) not reached before (``followed``, which it joins)."""
    if entry.name in SKIPPED_FOLDERS or not entry.name.isidentifier():
        return False
    if entry.is_symlink():
        real = os.path.realpath(entry.path)
        if not _inside(real, real_root) or real in followed:
            return False
        followed.add(real)
    return True


def _shipped_size(entry: os.DirEntry, configs: bool, real_root: str) -> int | None:
    """The size of the file ``entry`` if it ships (a module; a config file where ``configs`` says they ship and
    it is small enough), else None; a symlink leading out of the script's folder (``real_root``) stays behind."""
    name = entry.name
    if not (_is_module(name) or configs and name.endswith(CONFIG_SUFFIXES)):
        return None
    if entry.is_symlink() and not _inside(os.path.realpath(entry.path), real_root):
        return None
    if not os.access(entry.path, os.R_OK):  # not this user's to read: a fresh rank could not either
        return None
    size = entry.stat().st_size
    return size if _is_module(name) or size <= MAX_CONFIG_BYTES else None


# Extension modules by their Python-specific suffixes only: a bare ``.so`` is far more often a native library.
_EXTENSION_SUFFIXES = tuple(s for s in EXTENSION_SUFFIXES if s != ".so")


def _is_module(name: str) -> bool:
    if name.endswith(".py"):
        return True
    return any(name.endswith(s) and name[:-len(s)].isidentifier() for s in _EXTENSION_SUFFIXES)


def _plain(name: str) -> bool:
    """A file or folder name that travels in the zip and unpacks as it is (``unpack`` refuses the others)."""
    if "\\" in name or "\0" in name or name in (".", ".."):
        return False
    try:
        name.encode("utf-8")  # an undecodable name arrives here with surrogates
    except UnicodeEncodeError:
        return False
    return True


def _holds_code(path: str, entries: list) -> bool:
    """Whether a folder below the script's holds a module, or a package (a folder with ``__init__.py``)."""
    for entry in entries:
        if _is_module(entry.name) or (entry.name.isidentifier() and entry.is_dir()
                                      and os.path.isfile(os.path.join(entry.path, "__init__.py"))):
            return True
    return False


def _is_environment(path: str, names: set) -> bool:
    """A virtual environment or conda environment, not code of the user's."""
    return ("pyvenv.cfg" in names or "conda-meta" in names
            or "bin" in names and os.path.lexists(os.path.join(path, "bin", "python")))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _most(found: list) -> str:
    """Where most of the files are, when one top-level folder holds most of them."""
    counts: dict = {}
    for name, _, _ in found:
        top = name.split("/", 1)[0] + "/" if "/" in name else None
        counts[top] = counts.get(top, 0) + 1
    top, n = max(counts.items(), key=lambda kv: kv[1])
    return f", {n:,} of them under {top}" if top is not None and n * 2 > len(found) else ""


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"


# --- the rank -----------------------------------------------------------------------------------------------------

_unpacked: dict = {}  # the unpacked folders of this process -> their folder on the driver


@contextlib.contextmanager
def shipped(folder: ShippedFolder):
    """On a rank: the shipped files in a new private (0700) folder under ``$TMPDIR``, first on ``sys.path`` and
    imported through ``_Loader``; the folder is removed at the end."""
    tmp = settings.TMPDIR.get()
    root = tempfile.mkdtemp(prefix="sparkhvd-script-", dir=tmp if tmp and os.path.isdir(tmp) else None)
    _unpacked[root] = folder.driver_folder
    try:
        unpack(folder.zip, root)
        sys.path_hooks.insert(0, _path_hook)
        sys.path.insert(0, root)
        try:
            yield root
        finally:
            sys.path[:] = [p for p in sys.path if p != root]
            with contextlib.suppress(ValueError):  # the script may have taken it out itself
                sys.path_hooks.remove(_path_hook)
            for path in [p for p in sys.path_importer_cache if _inside(p, root)]:
                del sys.path_importer_cache[path]
    finally:
        _remove(root)


def remove_unpacked() -> None:
    """Remove this process's unpacked folders now: for a rank about to ``os._exit`` (runner/_rank/worker.py)."""
    for root in list(_unpacked):
        _remove(root)


def _remove(root: str) -> None:
    _unpacked.pop(root, None)
    shutil.rmtree(root, ignore_errors=True)


def unpack(blob: bytes, into: str) -> None:
    """Write the zip's files under the folder ``into``; ValueError for a member whose name would leave it."""
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        for info in archive.infolist():
            name = info.filename
            parts = name.rstrip("/").split("/")
            if name.startswith("/") or not all(_plain(p) for p in parts) or any(p == "" for p in parts):
                raise ValueError(f"the shipped script folder holds a file named {name!r}, which would be written "
                                 f"outside the folder it is unpacked into ({into}); only relative names without "
                                 "'..' are unpacked, so this payload was not built by sparkhvd's collect.")
            if info.is_dir():
                continue
            target = os.path.join(into, *parts)
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            with archive.open(info) as src, open(target, "xb") as dst:
                shutil.copyfileobj(src, dst)


def _path_hook(path: str) -> FileFinder:
    """The finder for an unpacked folder and the packages in it (``sys.path_hooks``)."""
    if not any(_inside(path, root) for root in _unpacked):
        raise ImportError("not an unpacked script folder")
    return FileFinder(path, (_Loader, SOURCE_SUFFIXES), (ExtensionFileLoader, EXTENSION_SUFFIXES))


class _Loader(SourceFileLoader):
    """A shipped module, run from its unpacked copy (its ``__file__``) but compiled under its path on the driver,
    whose lines go to ``linecache``: tracebacks and ``inspect.getsource`` work after the copy is gone and name
    the user's file, as for the script. No bytecode is written or read (a cached one would carry the copy's path).
    """

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        source = self.get_data(path)
        shown = _driver_path(path)
        code = compile(source, shown, "exec", dont_inherit=True)
        linecache.cache[shown] = (len(source), None, decode_source(source).splitlines(True), shown)
        return code


def _driver_path(path: str) -> str:
    for root, driver_folder in _unpacked.items():
        if _inside(path, root):
            return os.path.join(driver_folder, os.path.relpath(path, root))
    return path
