"""Writing checkpoints: torch files, safetensors files, DCP and Hugging Face directories.

The rule: a checkpoint is written completely next to its destination, then put in
place by one rename, so a reader never sees half of one; nothing that exists is
replaced without ``force=True``, and with it only what is itself a checkpoint of the
format being written. :func:`output_format` says which format a destination's name
stands for; :func:`write_checkpoint` writes; :class:`HFPlan` says how a Hugging Face
directory is laid out (its shards, their index, the small files copied beside them).

Every error is a :class:`~dsdmerge.CheckpointWriteError` naming the destination.

What a crash (a kill, a power cut) at any point of a write leaves, ``OUT`` being the
destination:

* while the new checkpoint is written: ``OUT`` as it was (absent, or the old checkpoint),
  and the unfinished new one in ``.OUT.<random>.tmp`` beside it (remove it; it is never
  removed for you, as another process may be writing it);
* a file, or a directory that did not exist, is put in place by one rename: before it,
  the above; after it, the new ``OUT``;
* a directory that existed (``force=True``), on Linux: one ``renameat2(RENAME_EXCHANGE)``
  swaps the two; just after it the old checkpoint is in ``.OUT.<random>.tmp``, then it is
  renamed to ``.OUT.<random>.old`` and removed (a ``.old`` left by a crash is removed by
  the next write of ``OUT``);
* elsewhere, two renames: ``OUT`` to ``.OUT.<random>.old``, then the new one to ``OUT``.
  Between them ``OUT`` is missing; the next write of ``OUT`` (:func:`recover_interrupted`)
  renames the old one back first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dsdmerge.errors import CheckpointWriteError
from dsdmerge.integrations._files import plain_name

__all__ = [
    "FORMATS",
    "CheckpointWriteError",
    "HFPlan",
    "HF_FILES",
    "check_destination",
    "hf_plan",
    "hf_small_files",
    "is_hf_file",
    "recover_interrupted",
    "output_format",
    "write_checkpoint",
]


HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
_HF_SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")
"""Shard names as ``save_pretrained`` writes them, and as :func:`hf_plan` names shards."""

HF_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
    }
)
"""The small files of a Hugging Face model directory that ``merge`` copies beside the
weights: the config, the generation config, tokenizer and processor files."""

_HF_CODE = re.compile(
    r"(configuration|modeling|tokenization|processing|image_processing|feature_extraction)"
    r"_[A-Za-z0-9_]+\.py"
)
"""The model's own code (``trust_remote_code``), as the hub names it."""


def is_hf_file(name: str, /) -> bool:
    """Whether dsdmerge writes a file of this name into a Hugging Face directory.

    Exactly: ``model.safetensors``, ``model.safetensors.index.json``, shards
    ``model-0000N-of-0000M.safetensors``, the small files of :data:`HF_FILES` and the
    model's code (``configuration_*.py``, ``modeling_*.py``, ``tokenization_*.py`` ...).
    ``force=True`` replaces a directory holding nothing else.

    Examples:
        >>> from dsdmerge.integrations.writing import is_hf_file
        >>> [is_hf_file(n) for n in ("config.json", "train.py", "adapter_model.safetensors")]
        [True, False, False]
    """
    return (
        name in (HF_SINGLE, HF_INDEX)
        or name in HF_FILES
        or _HF_SHARD.fullmatch(name) is not None
        or _HF_CODE.fullmatch(name) is not None
    )


def _is_small_file(name: str) -> bool:
    return name in HF_FILES or _HF_CODE.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class HFPlan:
    """How a Hugging Face directory is written: shards, their metadata, the index, small files.

    Attributes:
        shard_of: Each key's shard file name (a plain name ending in ``.safetensors``).
        shard_metadata: Each shard's ``__metadata__``.
        index: The index file's name, or ``None`` for one unsharded weights file. The
            index written describes exactly the shards written (``weight_map``,
            ``total_size``).
        index_metadata: The index's ``"metadata"`` (``total_size`` is recomputed).
        extra_files: Small files copied into the directory (``config.json`` ...): the
            name in the directory, and the path of the file to copy. Each must be a
            regular file that resolves inside the directory it is in (checked again
            when copied).

    Raises:
        CheckpointWriteError: A shard, index or small-file name that is not a plain
            file name of the kind it stands for, or several shards without an index.
    """

    shard_of: dict[str, str]
    shard_metadata: dict[str, dict[str, str]]
    index: str | None
    index_metadata: dict[str, Any]
    extra_files: dict[str, str]

    def __post_init__(self) -> None:
        shards = set(self.shard_of.values())
        bad = sorted(
            n for n in shards if not (plain_name(n) and n.endswith(".safetensors"))
        ) + sorted(n for n in self.extra_files if not (plain_name(n) and _is_small_file(n)))
        if self.index is not None and not (
            plain_name(self.index) and self.index.endswith(".safetensors.index.json")
        ):
            bad.append(self.index)
        if bad:
            raise CheckpointWriteError(
                f"cannot write a Hugging Face directory holding {bad[0]!r}: shards are plain "
                "*.safetensors file names, the index a *.safetensors.index.json, small files "
                "those a model directory has (config.json, tokenizer files ...)"
            )
        if self.index is None and len(shards) > 1:
            raise CheckpointWriteError(
                f"cannot write {len(shards)} shards without an index that lists them"
            )


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _roots(directory: str) -> list[str]:
    """Where the files of ``directory`` may resolve: itself, and a hub cache's ``blobs``.

    A hub cache snapshot (``models--org--name/snapshots/<revision>``) links every file
    to the repository's ``blobs``.
    """
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _small_file(directory: str, name: str) -> str:
    """The path of small file ``name`` of ``directory``, checked.

    It must be a regular file that resolves inside the directory (or, in a hub cache
    snapshot, into its blobs).
    """
    path = os.path.join(directory, name)
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            target = os.path.realpath(path)
            if not any(_inside(target, root) for root in _roots(directory)):
                raise CheckpointWriteError(
                    f"{directory}: {name} is a link to {target!r}, outside the directory; "
                    "only the checkpoint's own files are copied (copy the file in, or remove "
                    "the link); nothing was written",
                    path=directory,
                )
        mode = os.stat(path).st_mode
    except OSError as err:
        if isinstance(err, CheckpointWriteError):
            raise
        raise CheckpointWriteError(
            f"{directory}: {name} cannot be read: {' '.join(str(err).split())}", path=directory
        ) from err
    if not stat.S_ISREG(mode):
        raise CheckpointWriteError(
            f"{directory}: {name} is not a regular file; nothing was written", path=directory
        )
    return path


def hf_small_files(directory: str, /) -> dict[str, str]:
    """The small files of a Hugging Face directory that a merge copies: name -> path.

    Only the names :func:`is_hf_file` lists (never the weights or an index: the
    writer writes those from what it writes), each checked to be a regular file that
    resolves inside the directory (or, in a hub cache snapshot, into the repository's
    ``blobs``).

    Raises:
        CheckpointWriteError: One of them is a link out of the directory, or not a
            regular file (named, so nothing from elsewhere is ever copied).
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise CheckpointWriteError(
            f"{directory}: cannot be listed: {' '.join(str(err).split())}", path=directory
        ) from err
    return {name: _small_file(directory, name) for name in names if _is_small_file(name)}


def hf_plan(result: Mapping[str, Any], checkpoint: str, reference: str, ckpt_format: str) -> HFPlan:
    """How to write ``result`` as a Hugging Face directory like the checkpoint's.

    Shards as the checkpoint groups its keys, named as ``save_pretrained`` names them
    (``model-0000N-of-0000M.safetensors``, their index ``model.safetensors.index.json``);
    keys only the reference had go where its index puts them (when the checkpoint has
    that shard), else into the last shard; the small files (:func:`hf_small_files`) come
    from the reference's directory (the model you have now), else the checkpoint's. A
    checkpoint that is not a Hugging Face directory, or one unsharded file, is written as
    one ``model.safetensors`` with no index.

    Raises:
        CheckpointWriteError: A small file to copy is a link out of its directory or
            not a regular file.
    """
    from dsdmerge.integrations._files import detect_format, hf_shards

    ref_shard_of: dict[str, str] = {}
    ref_dir = None
    if detect_format(reference) == "hf":
        ref_layout, ref_shard_of, _ = hf_shards(reference)
        ref_dir = ref_layout.directory
    if ckpt_format != "hf":
        extra = hf_small_files(ref_dir) if ref_dir else {}
        return HFPlan(
            dict.fromkeys(result, HF_SINGLE), {HF_SINGLE: {"format": "pt"}}, None, {}, extra
        )
    layout, shard_of, shard_metadata = hf_shards(checkpoint)
    extra = hf_small_files(ref_dir or layout.directory)
    if layout.index is None:
        [single] = layout.shards
        return HFPlan(
            dict.fromkeys(result, HF_SINGLE),
            {HF_SINGLE: shard_metadata.get(single) or {"format": "pt"}},
            None,
            {},
            extra,
        )
    n = len(layout.shards)
    name_of = {s: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, s in enumerate(layout.shards)}
    last = layout.shards[-1]
    plan = {}
    for key in result:
        shard = shard_of.get(key) or ref_shard_of.get(key)
        plan[key] = name_of[shard if shard in name_of else last]
    metadata = {name_of[s]: m for s, m in shard_metadata.items() if s in name_of}
    return HFPlan(plan, metadata, HF_INDEX, dict(layout.metadata), extra)


FORMATS = ("torch", "safetensors", "dcp", "hf")
"""The formats :func:`write_checkpoint` writes."""

_SUFFIX_FORMAT = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".safetensors": "safetensors"}
_NAMES = {
    "torch": "a .pt, .pth or .bin file name",
    "safetensors": "a .safetensors file name",
    "dcp": "a directory name without a suffix",
    "hf": "a directory name without a suffix",
}


def output_format(out: Path, requested: str | None = None, /, *, directory: str = "dcp") -> str:
    """The format ``out``'s name says, checked against the format asked for.

    ``.pt``/``.pth``/``.bin``: torch; ``.safetensors``: safetensors; no suffix: a
    directory, of the format ``directory`` says (``merge`` passes ``"hf"`` when the
    checkpoint is a Hugging Face directory, so the result keeps its layout), unless
    ``requested`` says DCP or HF. Another suffix says nothing, so ``requested`` must.
    Does not touch the file system.

    Args:
        out: The output path.
        requested: The format asked for (``None``: what the name says).
        directory: The format of a name without a suffix: ``"dcp"`` or ``"hf"``.

    Returns:
        ``"torch"``, ``"safetensors"``, ``"dcp"`` or ``"hf"``.

    Raises:
        CheckpointWriteError: The name and ``requested`` disagree, or neither says a format.

    Examples:
        >>> from pathlib import Path
        >>> from dsdmerge.integrations.writing import output_format
        >>> output_format(Path("resume.pt")), output_format(Path("merged"))
        ('torch', 'dcp')
        >>> output_format(Path("merged"), directory="hf"), output_format(Path("m"), "hf")
        ('hf', 'hf')
    """
    suffix = out.suffix.lower()
    named = _SUFFIX_FORMAT.get(suffix) if suffix else directory
    if requested is None:
        if named is None:
            raise CheckpointWriteError(
                f"{out}: the name does not say a format ({suffix!r}); name it .pt, .pth or "
                ".bin (torch), .safetensors, or a directory without a suffix (DCP, or a "
                "Hugging Face directory), or ask for a format: torch, safetensors, dcp or hf"
            )
        return named
    if not suffix and requested in ("dcp", "hf"):
        return requested
    if named is not None and named != requested:
        raise CheckpointWriteError(
            f"{out}: the name says {named} but the format {requested} was asked for; for "
            f"{requested} use {_NAMES[requested]}, or ask for none to write {named}"
        )
    return requested


_DCP_FILES = re.compile(r"\.metadata|__[0-9]+_[0-9]+\.distcp")
"""What DCP's ``FileSystemWriter`` writes in one process: ``.metadata`` and its data files."""


def _not_a_dcp_checkpoint(out: Path) -> str | None:
    """Why directory ``out`` is not a DCP checkpoint (``None`` when it is one)."""
    try:
        names = sorted(os.listdir(out))
    except OSError as err:
        return f"cannot be listed ({' '.join(str(err).split())})"
    if ".metadata" not in names:
        return "has no .metadata file"
    for name in names:
        if not _DCP_FILES.fullmatch(name):
            return f"holds {name!r}, which is not a DCP checkpoint file"
        if not stat.S_ISREG(os.lstat(out / name).st_mode):
            return f"holds {name!r}, which is not a regular file"
    return None


def _not_an_hf_checkpoint(out: Path) -> str | None:
    """Why directory ``out`` is not a Hugging Face model directory (``None`` when it is one).

    One holds regular files only, of the names dsdmerge writes (:func:`is_hf_file`):
    weights (at least one), their index, and the small files a merge copies.
    """
    try:
        names = sorted(os.listdir(out))
    except OSError as err:
        return f"cannot be listed ({' '.join(str(err).split())})"
    if not any(n.endswith(".safetensors") for n in names):
        return "holds no .safetensors file"
    for name in names:
        if not is_hf_file(name):
            return (
                f"holds {name!r}, which dsdmerge does not write (it writes weights, their "
                "index, config and tokenizer files)"
            )
        if not stat.S_ISREG(os.lstat(out / name).st_mode):
            return f"holds {name!r}, which is not a regular file"
    return None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def check_destination(out: Path, *, force: bool, fmt: str | None = None) -> None:
    """Refuse an ``out`` that exists (without ``force``) or that ``force`` may not replace.

    ``force`` replaces a regular file (for torch and safetensors) or a directory that
    is a DCP checkpoint (``.metadata`` and ``*.distcp`` files only, for DCP); never a
    directory of anything else, a link, a device or a FIFO.
    """
    if not out.parent.is_dir():
        raise CheckpointWriteError(f"{out}: directory {out.parent} does not exist")
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise CheckpointWriteError(
            f"{out}: cannot be checked: {' '.join(str(err).split())}"
        ) from err
    if not force:
        raise CheckpointWriteError(f"{out}: already exists; pass force=True to replace it")
    nothing = "nothing was replaced"
    if stat.S_ISREG(mode):
        if fmt in ("dcp", "hf"):
            kind = "a DCP checkpoint" if fmt == "dcp" else "a Hugging Face model"
            raise CheckpointWriteError(
                f"{out}: is a file, and {kind} is a directory; remove it or choose "
                f"another OUT ({nothing})"
            )
        return
    if stat.S_ISDIR(mode):
        if fmt not in (None, "dcp", "hf"):
            raise CheckpointWriteError(
                f"{out}: is a directory; a {fmt} checkpoint is one file ({nothing})"
            )
        if fmt == "hf":
            problem = _not_an_hf_checkpoint(out)
            kind = "a Hugging Face model directory"
        else:
            problem = _not_a_dcp_checkpoint(out)
            kind = "a DCP checkpoint directory"
        if problem:
            raise CheckpointWriteError(
                f"{out}: force=True replaces only {kind}, and this one {problem} ({nothing})"
            )
        return
    raise CheckpointWriteError(
        f"{out}: is a {_kind(mode)}, not a checkpoint file or directory; force=True replaces "
        f"only those ({nothing})"
    )


def write_checkpoint(
    state_dict: Mapping[str, Any],
    out: Path,
    fmt: str,
    *,
    force: bool,
    metadata: Mapping[str, str] | None = None,
    hf: HFPlan | None = None,
) -> None:
    """Write ``state_dict`` to ``out`` in format ``fmt``, atomically.

    The data goes to a temporary file (or directory) next to ``out``, which is
    renamed over ``out`` only once complete (see the module docstring for what a
    crash leaves), so a failure part-way leaves ``out`` as it was (absent, or the
    old checkpoint) and no temporary behind. First, an old checkpoint an interrupted
    replace moved aside is put back (:func:`recover_interrupted`). With ``force``,
    ``out`` may be replaced if it is a regular file (torch, safetensors) or a
    directory holding only what dsdmerge writes there (dcp: ``.metadata`` and
    ``__R_N.distcp``; hf: :func:`is_hf_file`), even a read-only one the user may
    rename (as ``mv`` would); anything else is refused. The new file keeps the old
    one's permission bits (never setuid, setgid or sticky).

    Args:
        state_dict: The state dict to write.
        out: The destination.
        fmt: ``"torch"``, ``"safetensors"``, ``"dcp"`` or ``"hf"`` (a Hugging Face
            model directory: safetensors shards and their index).
        force: Replace an existing ``out``.
        metadata: safetensors only: the header's ``__metadata__`` strings.
        hf: ``"hf"`` only: the shards, their metadata, the index and the files to
            copy (by default one ``model.safetensors``).

    Raises:
        CheckpointWriteError: ``out`` exists and ``force`` is false or it may not be replaced,
            or the state dict cannot be written in that format.

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from dsdmerge.integrations.writing import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_checkpoint({"w": torch.ones(2)}, Path(tmp, "m.pt"), "torch", force=False)
        ...     sorted(p.name for p in Path(tmp).iterdir())
        ['m.pt']
    """
    writers: dict[str, Callable[[Mapping[str, Any], Path], None]] = {
        "torch": _write_torch,
        "safetensors": lambda sd, tmp: _write_safetensors(sd, tmp, metadata),
        "dcp": _write_dcp,
        "hf": lambda sd, tmp: _write_hf(sd, tmp, hf),
    }
    if fmt not in writers:
        raise CheckpointWriteError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    write = writers[fmt]
    recover_interrupted(out)
    check_destination(out, force=force, fmt=fmt)
    parent = out.parent
    directory = fmt in ("dcp", "hf")
    mode = _file_mode(out, directory=directory)
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.", suffix=".tmp"))
    else:
        fd, name = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    try:
        os.chmod(tmp, 0o700 if directory else 0o600)  # private until complete
        write(state_dict, tmp)
        os.chmod(tmp, mode)  # after writing: a writer may have made the file anew
        _replace(tmp, out, force=force, fmt=fmt)
    except BaseException:
        _remove(tmp)
        raise


def _file_mode(out: Path, *, directory: bool = False) -> int:
    """The permission bits of what is being replaced, else what ``open()``/``mkdir()`` make.

    Never the setuid, setgid or sticky bit.
    """
    with contextlib.suppress(OSError):
        return os.stat(out).st_mode & 0o777
    umask = os.umask(0o022)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def _replace(tmp: Path, out: Path, *, force: bool, fmt: str | None = None) -> None:
    """Put the complete ``tmp`` in place of ``out``, by one rename where the system has one.

    A file: ``os.link`` when ``out`` does not exist (fails instead of replacing one that
    appeared meanwhile), else ``os.replace``. A directory: ``renameat2`` with
    ``RENAME_NOREPLACE`` when ``out`` does not exist, with ``RENAME_EXCHANGE`` when it
    does (Linux: the old and the new swap places in one step, then the old is renamed
    to ``.OUT.<random>.old`` and removed);
    elsewhere, or on a file system without it, ``out`` is renamed aside to
    ``.OUT.<random>.old`` first, and a run that finds ``out`` missing beside it renames
    it back (:func:`recover_interrupted`). The parent directory is synced after each
    rename.
    """
    with _parent_locked(out.parent):
        if not (out.exists() or out.is_symlink()):
            if tmp.is_dir():
                if not _renameat2(tmp, out, _RENAME_NOREPLACE):
                    os.rename(tmp, out)
            else:
                try:
                    os.link(tmp, out)
                except FileExistsError:
                    raise CheckpointWriteError(
                        f"{out}: already exists; pass force=True to replace it", path=str(out)
                    ) from None
                except OSError:  # no hard links on this file system
                    os.replace(tmp, out)
                else:
                    tmp.unlink()
            _fsync_dir(out.parent)
            return
        check_destination(out, force=force, fmt=fmt or ("dcp" if tmp.is_dir() else None))
        if not tmp.is_dir():
            os.replace(tmp, out)
            _fsync_dir(out.parent)
            return
        old = out.parent / f".{out.name}.{secrets.token_hex(6)}{_OLD}"
        if _renameat2(tmp, out, _RENAME_EXCHANGE):  # tmp now holds the old checkpoint
            os.rename(tmp, old)  # named as replaced: the next run removes it, if this one dies
            _fsync_dir(out.parent)
            _remove_tree(old)
            return
        # A directory cannot be renamed over a non-empty one: move the old one aside first.
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        _fsync_dir(out.parent)
        _remove_tree(old)


_OLD = ".old"
_ASIDE_NAME = re.compile(r"[0-9a-f]{12}")  # the random part of .OUT.<random>.old


def recover_interrupted(out: Path, /) -> Path | None:
    """Restore ``out`` if a replace of it was interrupted between its two renames.

    Where directories are replaced in two renames (no ``renameat2``), ``out`` is missing
    between them, the old checkpoint renamed to ``.OUT.<random>.old`` beside it. If
    ``out`` is missing and exactly one such directory is there, it is renamed back (a
    :class:`~dsdmerge.DSDMergeWarning` says so) and its path returned. If ``out``
    exists, such a directory is a checkpoint that ``out`` replaced, whose removal was
    interrupted: it is removed now. :func:`write_checkpoint` calls this first.

    Raises:
        CheckpointWriteError: ``out`` is missing and several such copies are there
            (which to keep cannot be told).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from dsdmerge.integrations.writing import recover_interrupted
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     recover_interrupted(Path(tmp, "merged")) is None
        True
    """
    from dsdmerge.errors import DSDMergeWarning

    parent = out.parent
    with _parent_locked(parent):
        try:
            names = os.listdir(parent)
        except OSError:
            return None
        prefix = f".{out.name}."
        aside = [
            parent / n
            for n in sorted(names)
            if n.startswith(prefix)
            and n.endswith(_OLD)
            and _ASIDE_NAME.fullmatch(n[len(prefix) : -len(_OLD)])
            and not (parent / n).is_symlink()
            and (parent / n).is_dir()
        ]
        if not aside:
            return None
        if out.exists() or out.is_symlink():  # the replace was done, not its clean-up
            for each in aside:
                _remove_tree(each)
            return None
        if len(aside) > 1:
            raise CheckpointWriteError(
                f"{out}: is missing, and {len(aside)} interrupted replaces left copies of it "
                f"({', '.join(str(p) for p in aside)}); move the one to keep to {out}",
                path=str(out),
            )
        os.rename(aside[0], out)
        _fsync_dir(parent)
        warnings.warn(
            f"{out}: restored from {aside[0]}, where an interrupted replace had moved it",
            DSDMergeWarning,
            stacklevel=2,
        )
        return out


@contextlib.contextmanager
def _parent_locked(parent: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``parent`` while renaming in it (where there is one).

    Two dsdmerge processes on this machine then never swap and restore the same OUT at
    once; a file system without locks on directories is renamed in without one.
    """
    try:
        import fcntl

        fd = os.open(parent, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


@functools.cache
def _libc_renameat2() -> Any:
    """The C library's ``renameat2``, or ``None`` (another system, or a libc without it).

    Python's ``os`` has no ``renameat2``: it is called through ctypes.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; ``False`` where there is no such rename.

    ``False`` when the system or the file system lacks it: then nothing was done.
    """
    import ctypes

    function = _libc_renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    if err == errno.EEXIST and flags == _RENAME_NOREPLACE:
        raise CheckpointWriteError(
            f"{dst}: already exists; pass force=True to replace it", path=str(dst)
        )
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where directories can be synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_tree(path: Path) -> None:
    """Delete a replaced checkpoint directory, read-only or not."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_torch(state_dict: Mapping[str, Any], tmp: Path) -> None:
    import torch

    try:
        torch.save(state_dict, tmp)
    except RecursionError:
        raise CheckpointWriteError(
            "cannot write a torch checkpoint: a value is nested too deeply for torch.save"
        ) from None
    _fsync(tmp)


def _write_safetensors(
    state_dict: Mapping[str, Any], tmp: Path, metadata: Mapping[str, str] | None = None
) -> None:
    import torch
    from safetensors.torch import save_file

    bad = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if bad:
        from dsdmerge.report import format_keys

        raise CheckpointWriteError(
            f"cannot write safetensors: {len(bad)} value(s) are not tensors "
            f"({format_keys(bad, limit=3)}); merge into a torch checkpoint instead"
        )
    try:
        save_file(dict(state_dict), str(tmp), metadata=dict(metadata) if metadata else None)
    except (RuntimeError, ValueError) as err:
        raise CheckpointWriteError(
            f"cannot write safetensors: {' '.join(str(err).split())}"
        ) from err
    _fsync(tmp)


def _write_hf(state_dict: Mapping[str, Any], tmp: Path, plan: HFPlan | None) -> None:
    """A Hugging Face model directory: shards as planned, their index, the copied files."""
    if plan is None:
        plan = HFPlan(
            dict.fromkeys(state_dict, HF_SINGLE), {HF_SINGLE: {"format": "pt"}}, None, {}, {}
        )
    shards: dict[str, dict[str, Any]] = {}
    for key, value in state_dict.items():
        shards.setdefault(plan.shard_of.get(key, HF_SINGLE), {})[key] = value
    if plan.index is None and len(shards) > 1:
        raise CheckpointWriteError(
            f"cannot write {len(shards)} shards without an index that lists them"
        )
    total = 0
    weight_map: dict[str, str] = {}
    for name in sorted(shards):
        part = shards[name]
        metadata = plan.shard_metadata.get(name) or {"format": "pt"}
        _write_safetensors(part, tmp / name, metadata)
        total += sum(v.numel() * v.element_size() for v in part.values())
        weight_map.update(dict.fromkeys(part, name))
    if plan.index is not None:
        index = {
            "metadata": {**plan.index_metadata, "total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(tmp / plan.index, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    for name, source in plan.extra_files.items():
        _copy_small_file(source, tmp / name)


def _copy_small_file(source: str, dest: Path) -> None:
    """Copy a small file, checked again when copied.

    It is read through a descriptor that the final path component cannot redirect
    (``O_NOFOLLOW`` on the resolved path).
    """
    directory, name = os.path.split(source)
    _small_file(directory, name)
    real = os.path.realpath(source)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)
    except OSError as err:
        raise CheckpointWriteError(
            f"{directory}: {name} cannot be read: {' '.join(str(err).split())}", path=directory
        ) from err
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise CheckpointWriteError(
                f"{directory}: {name} is not a regular file; nothing was written",
                path=directory,
            )
        with open(dest, "xb") as out:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())


def _write_dcp(state_dict: Mapping[str, Any], tmp: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from dsdmerge._torch_api import dcp_save

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
            dcp_save(dict(state_dict), storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
    except CheckpointException as err:  # a BaseException: would escape `except Exception`
        cause: BaseException = err
        for pair in getattr(err, "failures", {}).values():
            if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
                cause = pair[0]
                break
        if isinstance(cause, OSError):
            raise cause from None
        raise CheckpointWriteError(
            f"cannot write a DCP checkpoint: {type(cause).__name__}: "
            f"{' '.join(str(cause).split())[:300]}"
        ) from None
