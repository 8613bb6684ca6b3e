"""The ``dsdmerge`` command line.

Subcommands:

* ``dsdmerge inspect PATH``: layout, key and tensor counts, bytes, dtypes and
  compressed key patterns of a checkpoint, from its metadata only.
* ``dsdmerge diff CHECKPOINT REFERENCE``: what differs, as an exact compressed
  report; exit 0 when nothing differs, 1 when something does, 2 on error.
* ``dsdmerge merge CHECKPOINT REFERENCE -o OUT``: merge under a policy and write
  the result atomically, in the format OUT's name says (``--format`` must agree);
  ``--force`` replaces only a checkpoint file or a DCP checkpoint directory.
* ``dsdmerge demo``: the resume story on a built-in tiny model.

PATH may be a torch ``.pt``/``.pth``/``.bin`` file, a ``.safetensors`` file or
a ``torch.distributed.checkpoint`` directory. Pickles are never given an
unrestricted unpickler unless ``--trust`` is passed (``--safe-globals module.Name``
allows single globals). Errors print one line on stderr and exit 2. This is the only
module of dsdmerge that prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "EXIT_DIFFERS",
    "EXIT_ERROR",
    "EXIT_OK",
    "CLIError",
    "FORMATS",
    "build_parser",
    "main",
    "output_format",
    "write_checkpoint",
]

EXIT_OK = 0
"""Success; for ``diff``: nothing differs."""
EXIT_DIFFERS = 1
"""``diff``: something differs. ``merge``: the policy rejected the merge (nothing written)."""
EXIT_ERROR = 2
"""Bad usage, or a path that cannot be read or written (one line on stderr)."""

_LIMIT = 10

_TRUST_HELP = (
    "UNSAFE: unpickle torch files and DCP .metadata without restriction. A pickle can run "
    "any code on your machine; use this only for files you created yourself"
)


class CLIError(Exception):
    """A problem the command line reports in one line and exits 2 for."""


@dataclasses.dataclass(frozen=True)
class _Style:
    """How to print to one stream: colours and aligned tables only on a terminal."""

    color: bool
    table: bool

    @classmethod
    def of(cls, stream: IO[str]) -> _Style:
        tty = _isatty(stream)
        no_color = bool(os.environ.get("NO_COLOR")) or os.environ.get("TERM") == "dumb"
        return cls(color=tty and not no_color, table=tty)

    def paint(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# -- reading -------------------------------------------------------------------------


def _trust_warning(args: argparse.Namespace) -> None:
    if getattr(args, "trust", False):
        _stderr(
            "dsdmerge: warning: --trust given: pickles are loaded without restriction and "
            "can run code"
        )


def _trusted(args: argparse.Namespace) -> bool | list[str]:
    """``trusted=`` for the library: ``--trust``, else the ``--safe-globals`` list."""
    if getattr(args, "trust", False):
        return True
    return list(getattr(args, "safe_globals", None) or []) or False


def _read(path: str, *, trusted: bool | list[str]) -> tuple[Any, str]:
    """The metadata-only view of a checkpoint and the layout it was saved in."""
    view = _view(path, trusted=trusted)
    return view, view.layout.value


def _view(path: str, *, trusted: bool | list[str]) -> Any:
    from dsdmerge.integrations.checkpoints import read_metadata

    return read_metadata(path, trusted=trusted)


# -- inspect -------------------------------------------------------------------------


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _inspect(args: argparse.Namespace) -> int:
    from dsdmerge.report import compress, render_patterns

    _trust_warning(args)
    view, layout = _read(args.path, trusted=_trusted(args))
    patterns = compress(view, max_parts=16)
    if args.json:
        _print_json(
            {
                "path": view.path,
                "format": view.format,
                "layout": layout,
                "keys": len(view),
                "tensors": view.tensor_count,
                "bytes": view.nbytes,
                "dtypes": view.dtypes,
                "metadata": view.metadata,
                "patterns": [p.to_dict() for p in patterns],
            }
        )
        return EXIT_OK
    style = _Style.of(sys.stdout)
    dtypes = ", ".join(f"{name} x {n:,}" for name, n in view.dtypes.items()) or "-"
    rows = [
        ("format", view.format),
        ("layout", layout),
        ("keys", f"{len(view):,}"),
        ("tensors", f"{view.tensor_count:,} ({_bytes(view.nbytes)})"),
        ("dtypes", dtypes),
    ]
    if view.metadata:  # a safetensors header's __metadata__ (format, step, notes ...)
        pairs = sorted(view.metadata.items())
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in pairs)))
    print(style.paint(view.path, "1"))
    if style.table:
        for name, value in rows:
            print(f"  {name:<8} {value}")
    else:
        for name, value in rows:
            print(f"  {name}: {value}")
    n = len(patterns)
    print(f"  key patterns ({n:,}):" if n else "  no keys")
    lines = render_patterns(patterns, limit=args.limit, table=style.table, color=style.color)
    for line in lines:
        print(f"  {line}")
    return EXIT_OK


# -- diff ----------------------------------------------------------------------------


def _diff(args: argparse.Namespace) -> int:
    import dsdmerge as dm
    from dsdmerge.report import render, summary

    _trust_warning(args)
    ckpt = _view(args.checkpoint, trusted=_trusted(args))
    ref = _view(args.reference, trusted=_trusted(args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", dm.DSDMergeWarning)
        d = dm.diff(ckpt, ref, rename=_rename_rules(args))
    _print_warnings(caught)
    # the status is the answer: a reader that stops early (`| head`) must not turn it into 0
    with _reader_may_leave():
        if args.json:
            _print_json(
                {
                    "checkpoint": ckpt.path,
                    "reference": ref.path,
                    "differs": bool(d),
                    **d.to_dict(),
                    "summary": summary(d),
                }
            )
        else:
            style = _Style.of(sys.stdout)
            for label, view in (("checkpoint", ckpt), ("reference", ref)):
                print(f"{label}: {view.path} ({view.format}, {len(view):,} keys)")
            print(render(d, limit=args.limit, table=style.table, color=style.color))
            if d.renames:
                print(f"to apply: {_rename_options(d.renames)}")
    return EXIT_DIFFERS if d else EXIT_OK


# -- rename options --------------------------------------------------------------------


class _RuleAction(argparse.Action):
    """--rename / --strip-prefix / --preset, kept in command-line order in one list."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        value = str(values)
        if option_string == "--rename":
            pattern, eq, replacement = value.rpartition("=")
            if not eq or not pattern:
                raise argparse.ArgumentError(
                    self, f"expected PATTERN=REPLACEMENT (split at the last '='), got {value!r}"
                )
            rule: Any = {pattern: replacement}
        elif option_string == "--strip-prefix":
            from dsdmerge.rename import strip_prefix

            rule = strip_prefix(value)
        else:
            rule = value  # a preset name (argparse checked the choice)
        rules = list(getattr(namespace, self.dest, None) or [])
        rules.append(rule)
        setattr(namespace, self.dest, rules)


def _add_rename_options(p: argparse.ArgumentParser) -> None:
    from dsdmerge.rename import RENAME_PRESETS

    p.add_argument(
        "--rename",
        action=_RuleAction,
        dest="rename_rules",
        metavar="PATTERN=REPLACEMENT",
        help="rename the checkpoint's parameters first: a regular expression over fqns and its "
        "re.sub replacement, split at the last '=' (e.g. '\\.attn\\.wq\\.=.attn.q_proj.'); "
        "applied to model keys and optimizer state alike; repeatable, applied in order",
    )
    p.add_argument(
        "--strip-prefix",
        action=_RuleAction,
        dest="rename_rules",
        metavar="PREFIX",
        help="remove a leading prefix of whole segments from every fqn (e.g. 'module.' for a "
        "DDP checkpoint); repeatable",
    )
    p.add_argument(
        "--preset",
        action=_RuleAction,
        dest="rename_rules",
        choices=tuple(RENAME_PRESETS),
        metavar="NAME",
        help="a named rename rule for a wrapper: " + ", ".join(RENAME_PRESETS) + "; repeatable",
    )


def _rename_rules(args: argparse.Namespace) -> list[Any] | None:
    rules: list[Any] | None = getattr(args, "rename_rules", None)
    return rules or None


def _rename_options(renames: Sequence[Any]) -> str:
    import shlex

    return " ".join(f"--rename {shlex.quote(f'{r.pattern}={r.replacement}')}" for r in renames)


def _print_warnings(caught: Sequence[warnings.WarningMessage]) -> None:
    for w in caught:
        text = str(w.message).removeprefix("dsdmerge: ")
        _stderr(f"dsdmerge: warning: {_cli_advice(text)}")


# -- merge ---------------------------------------------------------------------------


def _merge(args: argparse.Namespace) -> int:
    import dsdmerge as dm
    from dsdmerge.integrations.checkpoints import detect_format, load_checkpoint, read_metadata
    from dsdmerge.report import render

    _trust_warning(args)
    out = Path(args.out)
    fmt = output_format(out, args.format)
    _check_out(out, force=args.force, fmt=fmt)
    trusted = _trusted(args)
    ckpt = load_checkpoint(args.checkpoint, trusted=trusted)
    ref = load_checkpoint(args.reference, trusted=trusted)
    metadata: dict[str, str] = {}
    if fmt == "safetensors":  # keep the files' own __metadata__ (format, step, notes ...)
        for source in (args.checkpoint, args.reference):
            if not metadata and detect_format(source) == "safetensors":
                metadata = read_metadata(source).metadata
    policy = dm.resolve_policy(args.policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", dm.DSDMergeWarning)
        try:
            merged = dm.merge_with_diff(
                ckpt,
                ref,
                policy=policy,
                allow_missing=args.allow_missing,
                allow_unexpected=args.allow_unexpected,
                rename=_rename_rules(args),
                on_shape_mismatch=args.on_shape_mismatch.replace("-", "_"),
            )
        except dm.MergeError as err:
            text = str(err)
            if err.diff is not None and err.diff.renames:
                from dsdmerge.merge import rename_hint

                renames = err.diff.renames
                text = text.replace(
                    rename_hint(renames), f" Some look renamed: pass {_rename_options(renames)}."
                )
            _stderr(f"dsdmerge: {_cli_advice(text)}")
            _stderr(f"dsdmerge: nothing written to {out}")
            return EXIT_DIFFERS
    _print_warnings(caught)
    _check_out(out, force=args.force, fmt=fmt)  # again: it may have appeared while we merged
    write_checkpoint(merged.state_dict, out, fmt, force=args.force, metadata=metadata)
    style = _Style.of(sys.stdout)
    print(f"wrote {out} ({fmt}, {len(dm.flatten(merged.state_dict)):,} keys)")
    if merged.diff:
        print(render(merged.diff, limit=args.limit, table=style.table, color=style.color))
    return EXIT_OK


_ADVICE = (
    ("allow_missing=[<glob>, ...]", "--allow-missing GLOB"),
    ("allow_unexpected=[<glob>, ...]", "--allow-unexpected GLOB"),
    ("merge with dsdmerge.Policy(shape='warn')", "pass --on-shape-mismatch take-reference"),
    ("on_shape_mismatch='resize'", "--on-shape-mismatch resize"),
    ("on_shape_mismatch='take_reference'", "--on-shape-mismatch take-reference"),
    ("pass rename={", "pass --rename PATTERN=REPLACEMENT for each of {"),
)


def _cli_advice(text: str) -> str:
    """The library's advice, spelled as command-line options."""
    for api, option in _ADVICE:
        text = text.replace(api, option)
    return text


FORMATS = ("torch", "safetensors", "dcp")
"""The formats ``merge`` writes (``--format``)."""

_SUFFIX_FORMAT = {".pt": "torch", ".pth": "torch", ".bin": "torch", ".safetensors": "safetensors"}
_NAMES = {
    "torch": "a .pt, .pth or .bin file name",
    "safetensors": "a .safetensors file name",
    "dcp": "a directory name without a suffix",
}


def output_format(out: Path, requested: str | None = None, /) -> str:
    """The format ``OUT``'s name says, checked against ``--format``.

    ``.pt``/``.pth``/``.bin``: torch; ``.safetensors``: safetensors; no suffix: a DCP
    directory. Another suffix says nothing, so ``--format`` must. Does not touch the
    file system.

    Args:
        out: The output path.
        requested: ``--format`` (``None`` when not given).

    Returns:
        ``"torch"``, ``"safetensors"`` or ``"dcp"``.

    Raises:
        CLIError: The name and ``--format`` disagree, or neither says a format.

    Example:
        >>> from pathlib import Path
        >>> from dsdmerge.cli import output_format
        >>> output_format(Path("resume.pt")), output_format(Path("merged"))
        ('torch', 'dcp')
    """
    suffix = out.suffix.lower()
    named = _SUFFIX_FORMAT.get(suffix) if suffix else "dcp"
    if requested is None:
        if named is None:
            raise CLIError(
                f"{out}: the name does not say a format ({suffix!r}); name it .pt, .pth or "
                ".bin (torch), .safetensors, or a directory without a suffix (DCP), or pass "
                "--format torch|safetensors|dcp"
            )
        return named
    if named is not None and named != requested:
        raise CLIError(
            f"{out}: the name says {named} but --format {requested} was given; for "
            f"{requested} use {_NAMES[requested]}, or drop --format to write {named}"
        )
    return requested


_DCP_FILES = re.compile(r"\.metadata|.+\.distcp")


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


def _check_out(out: Path, *, force: bool, fmt: str | None = None) -> None:
    """Refuse an OUT that exists (without ``--force``) or that ``--force`` may not replace.

    ``--force`` replaces a regular file (for torch and safetensors) or a directory that
    is a DCP checkpoint (``.metadata`` and ``*.distcp`` files only, for DCP); never a
    directory of anything else, a link, a device or a FIFO.
    """
    if not out.parent.is_dir():
        raise CLIError(f"{out}: directory {out.parent} does not exist")
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    except OSError as err:
        raise CLIError(f"{out}: cannot be checked: {' '.join(str(err).split())}") from err
    if not force:
        raise CLIError(f"{out}: already exists; pass --force to replace it")
    nothing = "nothing was replaced"
    if stat.S_ISREG(mode):
        if fmt == "dcp":
            raise CLIError(
                f"{out}: is a file, and a DCP checkpoint is a directory; remove it or choose "
                f"another OUT ({nothing})"
            )
        return
    if stat.S_ISDIR(mode):
        if fmt not in (None, "dcp"):
            raise CLIError(f"{out}: is a directory; a {fmt} checkpoint is one file ({nothing})")
        problem = _not_a_dcp_checkpoint(out)
        if problem:
            raise CLIError(
                f"{out}: --force replaces only a DCP checkpoint directory, and this one "
                f"{problem} ({nothing})"
            )
        return
    raise CLIError(
        f"{out}: is a {_kind(mode)}, not a checkpoint file or directory; --force replaces "
        f"only those ({nothing})"
    )


def write_checkpoint(
    state_dict: Mapping[str, Any],
    out: Path,
    fmt: str,
    *,
    force: bool,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``state_dict`` to ``out`` in format ``fmt``, atomically.

    The data goes to a temporary file (or directory) next to ``out``, which is
    renamed over ``out`` only once complete, so a failure part-way leaves
    ``out`` as it was (absent, or the old checkpoint) and no temporary behind.
    With ``force``, ``out`` may be replaced if it is a regular file (torch,
    safetensors) or a DCP checkpoint directory (dcp), even a read-only one the user
    may rename (as ``mv`` would); anything else is refused. The new file keeps the
    old one's permission bits (never setuid, setgid or sticky).

    Args:
        state_dict: The state dict to write.
        out: The destination.
        fmt: ``"torch"``, ``"safetensors"`` or ``"dcp"``.
        force: Replace an existing ``out``.
        metadata: safetensors only: the header's ``__metadata__`` strings.

    Raises:
        CLIError: ``out`` exists and ``force`` is false or it may not be replaced,
            or the state dict cannot be written in that format.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from dsdmerge.cli import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_checkpoint({"w": torch.ones(2)}, Path(tmp, "m.pt"), "torch", force=False)
        ...     sorted(p.name for p in Path(tmp).iterdir())
        ['m.pt']
    """
    writers: dict[str, Callable[[Mapping[str, Any], Path], None]] = {
        "torch": _write_torch,
        "safetensors": lambda sd, tmp: _write_safetensors(sd, tmp, metadata),
        "dcp": _write_dcp,
    }
    if fmt not in writers:
        raise CLIError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    write = writers[fmt]
    _check_out(out, force=force, fmt=fmt)
    parent = out.parent
    directory = fmt == "dcp"
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
    if not (out.exists() or out.is_symlink()):
        if tmp.is_dir():
            os.rename(tmp, out)
        else:
            # link, not rename: fails instead of replacing an OUT that appeared meanwhile
            try:
                os.link(tmp, out)
            except FileExistsError:
                raise CLIError(f"{out}: already exists; pass --force to replace it") from None
            except OSError:  # no hard links on this file system
                os.replace(tmp, out)
                return
            tmp.unlink()
        return
    _check_out(out, force=force, fmt=fmt or ("dcp" if tmp.is_dir() else None))
    if tmp.is_dir():
        # A directory cannot be renamed over a non-empty one: move the old one aside first.
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.rename(out, old / "ckpt")
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old / "ckpt", out)
            _remove_old(old)
            raise
        _remove_old(old)
        return
    os.replace(tmp, out)


def _remove_old(old: Path) -> None:
    """Delete a replaced DCP checkpoint (moved into ``old``), read-only or not."""
    ckpt = old / "ckpt"
    with contextlib.suppress(OSError):
        if ckpt.is_dir() and not ckpt.is_symlink():
            os.chmod(ckpt, stat.S_IMODE(os.lstat(ckpt).st_mode) | stat.S_IRWXU)
    shutil.rmtree(old, ignore_errors=True)


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
        raise CLIError(
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

        raise CLIError(
            f"cannot write safetensors: {len(bad)} value(s) are not tensors "
            f"({format_keys(bad, limit=3)}); merge into a torch checkpoint instead"
        )
    try:
        save_file(dict(state_dict), str(tmp), metadata=dict(metadata) if metadata else None)
    except (RuntimeError, ValueError) as err:
        raise CLIError(f"cannot write safetensors: {' '.join(str(err).split())}") from err
    _fsync(tmp)


def _write_dcp(state_dict: Mapping[str, Any], tmp: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
            save(dict(state_dict), storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
    except CheckpointException as err:  # a BaseException: would escape `except Exception`
        cause: BaseException = err
        for pair in getattr(err, "failures", {}).values():
            if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
                cause = pair[0]
                break
        if isinstance(cause, OSError):
            raise cause from None
        raise CLIError(
            f"cannot write a DCP checkpoint: {type(cause).__name__}: "
            f"{' '.join(str(cause).split())[:300]}"
        ) from None


# -- demo ----------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from dsdmerge.demo import run_demo

    for line in run_demo(steps=args.steps):
        print(line)
    return EXIT_OK


# -- plumbing ------------------------------------------------------------------------


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


_DESCRIPTION = """\
Inspect, diff and merge PyTorch checkpoint state dicts.

PATH, CHECKPOINT and REFERENCE may be a torch .pt/.pth/.bin file, a .safetensors file
or a torch.distributed.checkpoint (DCP) directory. inspect and diff read metadata only
(no tensor bytes). Torch files load with weights_only=True and DCP .metadata through a
restricted unpickler: a pickle that would run code is refused (exit 2), never run.

Exit status: 0 success (diff: no differences), 1 diff: differences / merge: rejected
by the policy (nothing written), 2 error (one line on stderr).
"""

_EXAMPLES = {
    "inspect": """\
examples:
  dsdmerge inspect step-1000.pt
  dsdmerge inspect checkpoints/step-1000/            # a DCP directory
  dsdmerge inspect model.safetensors --json | jq .layout
""",
    "diff": """\
examples:
  dsdmerge diff step-1000.pt fresh.pt
  dsdmerge diff checkpoints/step-1000/ fresh/ --limit 30
  dsdmerge diff old.safetensors new.safetensors --json | jq '.missing | length'
  dsdmerge diff a.pt b.pt > /dev/null || echo "they differ (or an error: exit 2)"
""",
    "merge": """\
examples:
  dsdmerge merge step-1000.pt fresh.pt -o resumable.pt
  dsdmerge merge step-1000.pt fresh.pt -o resumable.pt --policy strict \\
      --allow-missing '*.indexer.*'
  dsdmerge merge ckpt/ fresh/ -o merged/ --policy warn --allow-unexpected 'ema.*' --force
  dsdmerge merge old.safetensors new.safetensors -o grown.safetensors \\
      --on-shape-mismatch resize      # a model that grew: keep every trained row
  dsdmerge merge ddp-step-1000.pt fresh.pt -o resumable.pt --strip-prefix module.
  dsdmerge merge old.pt new.pt -o renamed.pt --rename '\\.attn\\.wq\\.=.attn.q_proj.'

The result has the checkpoint's layout, in the format OUT's name says (.pt/.pth/.bin
torch, .safetensors, a directory without a suffix DCP; --format must agree): every
checkpoint value kept, every key only the reference has taken from it. OUT is written
atomically (a temporary next to it, renamed when complete) and never replaced without
--force; --force replaces only a checkpoint file or a DCP checkpoint directory.
""",
    "demo": """\
example:
  dsdmerge demo
""",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dsdmerge`` command.

    Example:
        >>> from dsdmerge.cli import build_parser
        >>> build_parser().parse_args(["diff", "a.pt", "b.pt", "--json"]).json
        True
    """
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="dsdmerge", description=_DESCRIPTION, formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=description, epilog=_EXAMPLES[name], formatter_class=raw
        )

    def common(p: argparse.ArgumentParser, *, json_help: str | None) -> None:
        if json_help:
            p.add_argument("--json", action="store_true", help=json_help)
        p.add_argument(
            "--limit",
            type=_positive,
            default=_LIMIT,
            metavar="N",
            help=f"key patterns shown per section (default: {_LIMIT})",
        )
        p.add_argument("--trust", action="store_true", help=_TRUST_HELP)
        p.add_argument(
            "--safe-globals",
            action="append",
            default=[],
            metavar="module.Name",
            help="also allow this global in torch pickles (torch's safe_globals), e.g. "
            "--safe-globals argparse.Namespace; repeatable. Finer than --trust: only the "
            "named classes and functions, which must be safe to call",
        )

    inspect = add(
        "inspect",
        "layout, counts, bytes, dtypes and key patterns of a checkpoint",
        "Show a checkpoint's format, layout, key count, tensor count and bytes, dtypes and "
        "its keys compressed into exact patterns, from its metadata only.",
    )
    inspect.add_argument("path", metavar="PATH", help="checkpoint file or DCP directory")
    common(
        inspect,
        json_help='print JSON: "path", "format", "layout", "keys" (the count), "tensors", '
        '"bytes", "dtypes", "patterns"',
    )
    inspect.set_defaults(func=_inspect)

    diff = add(
        "diff",
        "what differs between a checkpoint and a reference",
        "Report keys missing from the checkpoint, keys unexpected in it and tensors whose "
        "shape or dtype differ, compressed into exact patterns (every key a pattern names "
        "exists). Reads metadata only. Exit 0: nothing differs, 1: something does, 2: error.",
    )
    diff.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint you resume from")
    diff.add_argument("reference", metavar="REFERENCE", help="the state dict you have now")
    common(
        diff,
        json_help='print JSON with lists "missing", "unexpected", "mismatched" (every key) '
        'and a compressed "summary"',
    )
    _add_rename_options(diff)
    diff.set_defaults(func=_diff)

    merge = add(
        "merge",
        "merge a checkpoint over a reference under a policy and write it",
        "Merge CHECKPOINT over REFERENCE under a policy and write the result to OUT in the "
        "format OUT's name says. A policy violation exits 1 and writes nothing.",
    )
    merge.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint you resume from")
    merge.add_argument("reference", metavar="REFERENCE", help="a fresh state dict to backfill from")
    merge.add_argument(
        "-o",
        "--out",
        required=True,
        metavar="OUT",
        help="where to write; the name says the format: .pt/.pth/.bin torch, .safetensors, "
        "a directory without a suffix DCP",
    )
    merge.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="the format to write; must agree with OUT's name (default: what the name says)",
    )
    merge.add_argument(
        "--policy",
        choices=("default", "strict", "warn"),
        default="default",
        help="default: backfill and keep quietly; warn: the same, with warnings; strict: "
        "fail on any difference not allowed below (default: default)",
    )
    merge.add_argument(
        "--allow-missing",
        action="append",
        default=[],
        metavar="GLOB",
        help="keys the checkpoint may lack (fnmatch over flat keys, * crosses dots); repeatable",
    )
    merge.add_argument(
        "--allow-unexpected",
        action="append",
        default=[],
        metavar="GLOB",
        help="keys the reference may lack; repeatable",
    )
    merge.add_argument(
        "--on-shape-mismatch",
        choices=("raise", "take-reference", "resize"),
        default="raise",
        help="a tensor whose shape differs: fail (default); resize, for a model that grew or "
        "shrank (vocabulary, experts, a wider head): keep the checkpoint's overlapping slice of "
        "the tensor and of its optimizer moments, the rest from the reference (same rank only); "
        "take-reference: take the reference's tensor with a warning (the trained values are "
        "dropped)",
    )
    _add_rename_options(merge)
    merge.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists and is a checkpoint: a regular file, or a DCP "
        "checkpoint directory (.metadata and .distcp files only); never anything else",
    )
    common(merge, json_help=None)
    merge.set_defaults(func=_merge)

    demo = add(
        "demo",
        "run the resume story on a built-in tiny model",
        "Train a tiny model whose indexer never gets gradients, save its flattened "
        "optimizer state, show torch failing to resume from it and dsdmerge making it load.",
    )
    demo.add_argument("--steps", type=_positive, default=5, help="training steps (default: 5)")
    demo.set_defaults(func=_demo)
    return parser


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _version() -> str:
    from dsdmerge import __version__

    return __version__


@contextlib.contextmanager
def _quiet_broken_pipe() -> Iterator[None]:
    """``dsdmerge inspect ... | head`` must not end in a traceback."""
    try:
        yield
    except BrokenPipeError:
        _stdout_to_devnull()
        raise


@contextlib.contextmanager
def _reader_may_leave() -> Iterator[None]:
    """Print, flush, and carry on if the reader has closed the pipe."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    """After a broken pipe: the interpreter's final flush must not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsdmerge`` command; return its exit status.

    Errors (a missing, corrupt, truncated, unsafe or unknown checkpoint, an
    OUT that exists) print one line on stderr and return :data:`EXIT_ERROR`;
    set ``DSDMERGE_TRACEBACK=1`` to see the traceback of an unexpected one.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 (success; for ``diff``, nothing differs), 1 (``diff``: something differs;
        ``merge``: the policy refused) or 2 (an error).

    Example:
        >>> from dsdmerge.cli import main
        >>> main(["inspect", "/no/such/file.pt"])  # doctest: +SKIP
        2
    """
    from dsdmerge.errors import DSDMergeError, UnsafeCheckpointError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        with _quiet_broken_pipe():
            status: int = args.func(args)
        return status
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        _stderr("dsdmerge: interrupted")
        return 130
    except UnsafeCheckpointError as err:
        text = _one_line(err).replace("trusted=['module.Name', ...]", "--safe-globals module.Name")
        text = text.replace("trusted=True", "--trust")
        if "--trust" not in text:
            text += " Pass --trust only if you trust where it came from."
        _stderr(f"dsdmerge: error: {text}")
        return EXIT_ERROR
    except (CLIError, DSDMergeError, OSError) as err:
        _stderr(f"dsdmerge: error: {_one_line(err)}")
        return EXIT_ERROR
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # e.g. DCP's CheckpointException, a BaseException
        if os.environ.get("DSDMERGE_TRACEBACK"):
            raise
        _stderr(
            f"dsdmerge: error: unexpected {type(err).__name__}: {_one_line(err)} "
            "(set DSDMERGE_TRACEBACK=1 to see where)"
        )
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
