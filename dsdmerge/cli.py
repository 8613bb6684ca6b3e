"""The ``dsdmerge`` command line.

Subcommands:

* ``dsdmerge inspect PATH``: layout, key and tensor counts, bytes, dtypes and
  compressed key patterns of a checkpoint, from its metadata only.
* ``dsdmerge diff CHECKPOINT REFERENCE``: what differs, as an exact compressed
  report; exit 0 when nothing differs, 1 when something does, 2 on error.
* ``dsdmerge merge CHECKPOINT REFERENCE -o OUT``: merge under a policy and write
  the result atomically, in the format OUT's name says (``--format`` must agree);
  ``--force`` replaces only a checkpoint file, or a directory holding only what dsdmerge
  writes there.
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
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from dsdmerge._text import escaped
from dsdmerge.errors import DSDMergeError, DSDMergeWarning, StateDictTypeError
from dsdmerge.integrations import writing

__all__ = [
    "EXIT_DIFFERS",
    "EXIT_ERROR",
    "EXIT_OK",
    "CLIError",
    "build_parser",
    "main",
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


class CLIError(DSDMergeError, ValueError):
    """A problem with the command line's arguments, reported in one line (exit 2)."""


@dataclasses.dataclass(frozen=True)
class _Style:
    """How to print to one stream: colours and aligned tables only on a terminal."""

    color: bool
    table: bool

    @classmethod
    def of(cls, stream: IO[str], mode: str = "auto") -> _Style:
        tty = _isatty(stream)
        return cls(color=_use_color(mode, tty), table=tty)

    def paint(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text


def _use_color(mode: str, tty: bool) -> bool:
    """``--color always|never``; ``auto``: ``NO_COLOR`` off, ``FORCE_COLOR`` on, else a terminal.

    ``NO_COLOR`` (no-color.org) wins over ``FORCE_COLOR`` (force-color.org) when both are
    set; ``FORCE_COLOR=0`` or ``false`` forces nothing.
    """
    if mode == "always":
        return True
    if mode == "never" or os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR", "").lower() not in ("", "0", "false"):
        return True
    return tty and os.environ.get("TERM") != "dumb"


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Progress:
    """Progress on stderr, through tqdm, for steps that take more than a moment.

    Nothing at all unless stderr is a terminal (pipes and logs stay clean), and nothing
    until the operation has run for ``DSDMERGE_PROGRESS_DELAY`` seconds (default 1.5):
    quick commands never flicker. A step such as reading a 2 GB file or merging 661k
    keys is one call with no progress of its own, so a ticker thread keeps the bar's
    elapsed time moving while it runs; the bar names the step.
    """

    def __init__(self, desc: str, total: int, *, unit: str = "step") -> None:
        self._bar: Any = None
        self._stop = threading.Event()
        if not _isatty(sys.stderr) or os.environ.get("DSDMERGE_PROGRESS", "1") == "0":
            return
        try:
            delay = max(0.0, float(os.environ.get("DSDMERGE_PROGRESS_DELAY", "1.5")))
        except ValueError:
            delay = 1.5
        from tqdm import tqdm

        try:  # a terminal that reports no width (some CI ptys) gets 80 columns
            width = os.get_terminal_size(sys.stderr.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):
            width = 80
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            leave=False,
            delay=delay,
            ncols=min(width, 120),
        )
        self._delay = delay
        self._start = time.monotonic()
        self._ticker = threading.Thread(target=self._tick, name="dsdmerge-progress", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            if time.monotonic() - self._start >= self._delay:
                with contextlib.suppress(Exception):  # a closed terminal: no progress
                    self._bar.refresh()

    def step(self, what: str) -> None:
        """Start step ``what`` (the previous one is done)."""
        if self._bar is not None:
            self._bar.set_postfix_str(escaped(what), refresh=False)

    def done(self, n: int = 1) -> None:
        """``n`` more units done."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._stop.set()
            self._ticker.join()
            self._bar.close()
            self._bar = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _keys_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(checkpoint key path, reference key path)`` from ``--key``/``--ckpt-key``/``--ref-key``."""
    both = getattr(args, "key", None)
    ckpt = getattr(args, "ckpt_key", None) or both
    ref = getattr(args, "ref_key", None) or both
    return ckpt, ref


def _view(path: str, *, trusted: bool | list[str], key: str | None = None) -> Any:
    from dsdmerge.integrations.checkpoints import read_metadata

    return read_metadata(path, trusted=trusted, key=key)


def _named(path: str, key: str | None) -> str:
    """``ckpt.pt`` or ``ckpt.pt [model]`` for headers."""
    return f"{path} [{key}]" if key else path


class _Filter:
    """``--only GLOB`` / ``--exclude GLOB``: which keys a report shows (globs or patterns)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from dsdmerge.policy import matcher

        self.only: list[str] = list(getattr(args, "only", None) or [])
        self.exclude: list[str] = list(getattr(args, "exclude", None) or [])
        self._only = matcher(self.only) if self.only else None
        self._exclude = matcher(self.exclude)

    def __bool__(self) -> bool:
        return bool(self.only or self.exclude)

    def __call__(self, key: str) -> bool:
        return (self._only is None or self._only(key)) and not self._exclude(key)

    def keys(self, keys: Iterable[str]) -> list[str]:
        return [k for k in keys if self(k)] if self else list(keys)

    def unmatched(self, keys: Collection[str]) -> list[tuple[str, str]]:
        """``(option, glob)`` for each glob that matches none of ``keys``."""
        return [
            (option, glob)
            for option, globs in (("--only", self.only), ("--exclude", self.exclude))
            for glob in globs
            if not _matches_any(glob, keys)
        ]


def _matches_any(glob: str, keys: Iterable[str]) -> bool:
    from dsdmerge.policy import matcher

    return any(map(matcher([glob]), keys))


def _warn_unmatched(pairs: Sequence[tuple[str, str]], where: str | None) -> None:
    """One warning per glob that matches no key (``where`` None: the side it applies to)."""
    sides = {"--allow-missing": "of the reference", "--allow-unexpected": "of the checkpoint"}
    for option, glob in pairs:
        place = where if where is not None else sides.get(option, "")
        _stderr(f"dsdmerge: warning: {option} {glob!r} matches no key {place} (a typo?)")


# -- inspect -------------------------------------------------------------------------


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


@dataclasses.dataclass
class _Summary:
    """What ``inspect`` shows of a checkpoint: its keys, and the tensors under each."""

    path: str
    format: str
    layout: str
    metadata: dict[str, str]
    tensors: dict[str, list[tuple[str, int]]]  # key -> (dtype name, bytes) per tensor
    keys: list[str]

    def only(self, keep: _Filter) -> _Summary:
        if not keep:
            return self
        keys = keep.keys(self.keys)
        kept = set(keys)
        tensors = {k: v for k, v in self.tensors.items() if k in kept}
        return dataclasses.replace(self, keys=keys, tensors=tensors)

    @property
    def count(self) -> int:
        return sum(map(len, self.tensors.values()))

    @property
    def nbytes(self) -> int:
        return sum(n for each in self.tensors.values() for _, n in each)

    @property
    def dtypes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for each in self.tensors.values():
            for name, _ in each:
                counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))


def _summary(path: str, *, trusted: bool | list[str], key: str | None) -> _Summary:
    """What ``inspect`` shows of a checkpoint.

    safetensors files and Hugging Face directories are read from their headers
    without importing torch, so ``dsdmerge inspect model.safetensors`` starts fast.
    """
    from dsdmerge.integrations import _files

    with _files.reading(path):
        fmt = _files.detect_format(path)
        if fmt in ("safetensors", "hf"):
            if fmt == "hf":
                entries, metadata, _ = _files.hf_header(_files.hf_layout(path), where=path)
            else:
                entries, metadata = _files.safetensors_header(path)
            if key is not None:
                from dsdmerge._paths import select_flat

                entries = select_flat(entries, key)
            tensors = {}
            for k, (shape, code) in entries.items():
                name, size = _files.DTYPES.get(code, (code, 0))
                tensors[k] = [(name, math.prod(shape) * size)]
            return _Summary(path, fmt, "flat", metadata, tensors, list(entries))
    view = _view(path, trusted=trusted, key=key)
    from dsdmerge._text import dtype_name
    from dsdmerge.integrations._view import meta_nbytes, tensor_metas

    tensors = {}
    for k, value in view.items():
        metas = list(tensor_metas(value))
        if metas:  # a tensor, or a list of them
            tensors[k] = [(dtype_name(m.dtype), meta_nbytes(m)) for m in metas]
    return _Summary(view.path, view.format, view.layout.value, view.metadata, tensors, list(view))


def _inspect(args: argparse.Namespace) -> int:
    from dsdmerge.report import compress, render_patterns

    _trust_warning(args)
    keep = _Filter(args)
    with _Progress("inspect", 2) as progress:
        progress.step(f"reading {args.path}")
        whole = _summary(args.path, trusted=_trusted(args), key=args.key)
        progress.done()
        data = whole.only(keep)
        _warn_unmatched(keep.unmatched(whole.keys), f"of {args.path}")
        progress.step("compressing keys")
        patterns = compress(data.keys, max_parts=16)
        progress.done()
    tensors = data.count
    stat = _stat_rows(data.keys, data.tensors) if args.stat else None
    if args.json:
        out: dict[str, Any] = {
            "path": data.path,
            "key": args.key,
            "format": data.format,
            "layout": data.layout,
            "keys": len(data.keys),
            "tensors": tensors,
            "bytes": data.nbytes,
            "dtypes": data.dtypes,
            "metadata": data.metadata,
            "patterns": [p.to_dict() for p in patterns],
        }
        if stat is not None:
            out["stat"] = [
                {"prefix": prefix, "keys": n, "tensors": t, "bytes": b} for prefix, n, t, b in stat
            ]
        _print_json(out)
        return EXIT_OK
    style = _Style.of(sys.stdout, args.color)
    dtypes = ", ".join(f"{name} x {n:,}" for name, n in data.dtypes.items()) or "-"
    rows = [
        ("format", data.format),
        ("layout", data.layout),
        ("keys", f"{len(data.keys):,}"),
        ("tensors", f"{tensors:,} ({_bytes(data.nbytes)})"),
        ("dtypes", dtypes),
    ]
    if data.metadata:  # a safetensors header's __metadata__, an HF index's "metadata"
        pairs = sorted(data.metadata.items())
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in pairs)))
    if keep:
        shown = " ".join(
            [*(f"--only {g!r}" for g in keep.only), *(f"--exclude {g!r}" for g in keep.exclude)]
        )
        rows.append(("filter", f"{shown} ({len(data.keys):,} of {len(whole.keys):,} keys)"))
    print(style.paint(escaped(_named(data.path, args.key)), "1"))
    if style.table:
        for name, value in rows:
            _say(f"  {name:<8} {value}")
    else:
        for name, value in rows:
            _say(f"  {name}: {value}")
    if stat is not None:
        print("  per top-level key:")
        table = [("", "keys", "tensors", "bytes")]
        table += [(prefix, f"{n:,}", f"{t:,}", _bytes(b)) for prefix, n, t, b in stat]
        for line in _aligned(table, right=(1, 2, 3)):
            _say(f"    {line}")
    n = len(patterns)
    print(f"  key patterns ({n:,}):" if n else "  no keys")
    lines = render_patterns(patterns, limit=args.limit, table=style.table, color=style.color)
    for line in lines:
        print(f"  {line}")
    return EXIT_OK


def _prefix(key: str) -> str:
    return key.split(".", 1)[0]


def _stat_rows(
    keys: Sequence[str], tensors: Mapping[str, list[tuple[str, int]]]
) -> list[tuple[str, int, int, int]]:
    """``(top-level key, keys, tensors, bytes)`` per top-level key, most keys first."""
    rows: dict[str, list[int]] = {}
    for k in keys:
        row = rows.setdefault(_prefix(k), [0, 0, 0])
        row[0] += 1
        for _, n in tensors.get(k, ()):
            row[1] += 1
            row[2] += n
    out = [(prefix, n, t, b) for prefix, (n, t, b) in rows.items()]
    return sorted(out, key=lambda r: (-r[1], r[0]))


def _aligned(rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            (cell.rjust(w) if i in right else cell.ljust(w))
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


# -- diff ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Allowed:
    """The allow-lists of ``diff``/``check``/``merge`` and what they allow of a diff."""

    missing: list[str]
    unexpected: list[str]

    @classmethod
    def of(cls, args: argparse.Namespace) -> _Allowed:
        return cls(list(args.allow_missing or []), list(args.allow_unexpected or []))

    def split(self, d: Any) -> tuple[list[str], list[str], list[str], list[str]]:
        """``(allowed missing, other missing, allowed unexpected, other unexpected)``."""
        from dsdmerge.policy import matcher

        m, u = matcher(self.missing), matcher(self.unexpected)
        return (
            [k for k in d.missing if m(k)],
            [k for k in d.missing if not m(k)],
            [k for k in d.unexpected if u(k)],
            [k for k in d.unexpected if not u(k)],
        )

    def unmatched(
        self, checkpoint: Collection[str], reference: Collection[str]
    ) -> list[tuple[str, str]]:
        """``(option, glob)`` for each glob that matches no key it could ever allow.

        A missing key is a key of the reference; an unexpected one, of the checkpoint
        (after renames).
        """
        return [
            *(("--allow-missing", g) for g in self.missing if not _matches_any(g, reference)),
            *(
                ("--allow-unexpected", g)
                for g in self.unexpected
                if not _matches_any(g, checkpoint)
            ),
        ]

    def json_unmatched(self, pairs: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
        return {
            "allow_missing": [g for o, g in pairs if o == "--allow-missing"],
            "allow_unexpected": [g for o, g in pairs if o == "--allow-unexpected"],
        }


def _renamed_keys(view: Mapping[str, Any], rules: Any, convert: Any = None) -> list[str]:
    """The checkpoint's keys after ``--rename``/``--strip-prefix``/``--preset``, ``--convert``."""
    if not rules and not convert:
        return list(view)
    from dsdmerge.convert import convert_checkpoint
    from dsdmerge.rename import rename_checkpoint

    try:
        renamed = rename_checkpoint(view, rules)[0] if rules else view
        if not convert:
            return list(renamed)
        # (quiet: the diff or merge itself reported what converting warns about)
        return list(convert_checkpoint(renamed, convert, stacklevel=2, quiet=True))
    except Exception:  # noqa: BLE001 - the diff or merge itself reports a bad rule
        return list(view)


def _filtered(d: Any, keep: _Filter) -> Any:
    """The diff with only the keys ``--only``/``--exclude`` keep."""
    if not keep:
        return d
    return dataclasses.replace(
        d,
        missing=tuple(filter(keep, d.missing)),
        unexpected=tuple(filter(keep, d.unexpected)),
        mismatched=tuple(m for m in d.mismatched if keep(m.key)),
        changed=tuple(c for c in d.changed if keep(c.key)),
        resized=tuple(r for r in d.resized if keep(r.key)),
    )


def _diff(args: argparse.Namespace) -> int:
    import dsdmerge as dm
    from dsdmerge.report import render, summary

    _trust_warning(args)
    ckpt_key, ref_key = _keys_of(args)
    keep = _Filter(args)
    allowed = _Allowed.of(args)
    with _Progress("diff", 3) as progress:
        progress.step(f"reading {args.checkpoint}")
        ckpt = _view(args.checkpoint, trusted=_trusted(args), key=ckpt_key)
        progress.done()
        progress.step(f"reading {args.reference}")
        ref = _view(args.reference, trusted=_trusted(args), key=ref_key)
        progress.done()
        progress.step("comparing")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", dm.DSDMergeWarning)
            whole = dm.diff(
                ckpt,
                ref,
                rename=_rename_rules(args),
                convert=_conversions(args),
                values=not args.ignore_values,
            )
        progress.done()
    _print_warnings(caught)
    ckpt_keys = _renamed_keys(ckpt, _rename_rules(args), _conversions(args))
    unmatched = allowed.unmatched(ckpt_keys, list(ref))
    _warn_unmatched(unmatched, None)
    filters_unmatched = keep.unmatched([*ckpt_keys, *ref])
    _warn_unmatched(filters_unmatched, "of either checkpoint")
    d = _filtered(whole, keep)
    ok_missing, missing, ok_unexpected, unexpected = allowed.split(d)
    differs = bool(missing or unexpected or d.mismatched or d.changed)
    # the status is the answer: a reader that stops early (`| head`) must not turn it into 0
    with _reader_may_leave():
        if args.json:
            out: dict[str, Any] = {
                "checkpoint": ckpt.path,
                "reference": ref.path,
                "checkpoint_key": ckpt_key,
                "reference_key": ref_key,
                "differs": differs,
                **d.to_dict(),
                "changed": [c.to_dict() for c in d.changed],
                "allowed": {"missing": ok_missing, "unexpected": ok_unexpected},
                "unmatched_globs": {
                    **allowed.json_unmatched(unmatched),
                    **{
                        option[2:]: [g for o, g in filters_unmatched if o == option]
                        for option in ("--only", "--exclude")
                    },
                },
                "summary": summary(d),
            }
            if args.stat:
                out["stat"] = _diff_stat(ckpt_keys, ref, d, keep)
            _print_json(out)
        else:
            style = _Style.of(sys.stdout, args.color)
            for label, view, key in (("checkpoint", ckpt, ckpt_key), ("reference", ref, ref_key)):
                _say(f"{label}: {_named(view.path, key)} ({view.format}, {len(view):,} keys)")
            if args.stat:
                _print_diff_stat(_diff_stat(ckpt_keys, ref, d, keep))
            print(render(d, limit=args.limit, table=style.table, color=style.color))
            if d.renames:
                _say(f"to apply: {_rename_options(d.renames)}")
            if d.conversions:
                _say(f"to convert: {' '.join(f'--convert {c}' for c in d.conversions)}")
            if ok_missing or ok_unexpected:
                parts = [
                    f"{n:,} {what}"
                    for n, what in (
                        (len(ok_missing), "missing (--allow-missing)"),
                        (len(ok_unexpected), "unexpected (--allow-unexpected)"),
                    )
                    if n
                ]
                verdict = "nothing else differs" if not differs else "other differences remain"
                _say(f"allowed: {', '.join(parts)}; {verdict}")
    return EXIT_DIFFERS if differs else EXIT_OK


def _diff_stat(
    ckpt: Iterable[str], ref: Iterable[str], d: Any, keep: _Filter
) -> list[dict[str, Any]]:
    """Per top-level key: keys on each side and differences of each kind.

    Only keys ``--only``/``--exclude`` keep are counted; the checkpoint's after renames.
    """
    rows: dict[str, dict[str, Any]] = {}

    def row(key: str) -> dict[str, Any]:
        prefix = _prefix(key)
        got = rows.get(prefix)
        if got is None:
            got = rows[prefix] = {
                "prefix": prefix,
                "checkpoint": 0,
                "reference": 0,
                "missing": 0,
                "unexpected": 0,
                "mismatched": 0,
                "changed": 0,
            }
        return got

    for k in keep.keys(ckpt):
        row(k)["checkpoint"] += 1
    for k in keep.keys(ref):
        row(k)["reference"] += 1
    for name, keys in (
        ("missing", d.missing),
        ("unexpected", d.unexpected),
        ("mismatched", d.mismatched_keys),
        ("changed", [c.key for c in d.changed]),
    ):
        for k in keys:
            row(k)[name] += 1
    return sorted(rows.values(), key=lambda r: (-max(r["checkpoint"], r["reference"]), r["prefix"]))


def _print_diff_stat(rows: Sequence[Mapping[str, Any]]) -> None:
    columns = ("checkpoint", "reference", "missing", "unexpected", "mismatched", "changed")
    table = [("top-level key", *columns)]
    table += [(r["prefix"], *(f"{r[c]:,}" for c in columns)) for r in rows]
    for line in _aligned(table, right=range(1, len(columns) + 1)):
        _say(f"  {line}")


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
        choices=_PRESET_NAMES,
        metavar="NAME",
        help="a named rename rule for a wrapper: " + ", ".join(_PRESET_NAMES) + "; repeatable",
    )


def _add_convert_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--convert",
        action="append",
        dest="conversions",
        choices=_CONVERSION_NAMES,
        metavar="PRESET",
        help="convert the checkpoint's layout next (after renames), optimizer state included: "
        + ", ".join(_CONVERSION_NAMES)
        + " (see docs/conversions.md); repeatable, applied in order",
    )


def _conversions(args: argparse.Namespace) -> list[str] | None:
    found: list[str] | None = getattr(args, "conversions", None)
    return found or None


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


# -- check ---------------------------------------------------------------------------


def _findings(err: Exception) -> list[str]:
    """The reasons of a policy's refusal, one per line, in command-line terms."""
    lines = str(err).splitlines()[1:]
    out: list[str] = []
    for line in lines:
        if line.startswith("  - "):
            out.append(line[4:])
        elif out:
            out[-1] += " " + line.strip()
    return [_cli_advice(_rename_advice(err, f)) for f in out] or [_cli_advice(str(err))]


def _rename_advice(err: Any, text: str) -> str:
    d = getattr(err, "diff", None)
    if d is not None and d.renames:
        from dsdmerge._verdict import rename_hint

        text = text.replace(
            rename_hint(d.renames), f" Some look renamed: pass {_rename_options(d.renames)}."
        )
    return text


def _renamed_pairs(view: Mapping[str, Any], rules: Any) -> list[tuple[str, str]]:
    """``(old key, new key)`` for each checkpoint key the rename rules change."""
    if not rules:
        return []
    from dsdmerge.rename import rename_checkpoint

    try:
        renamed = rename_checkpoint(view, rules)[0]
    except Exception:  # noqa: BLE001 - the check itself reports a bad rule
        return []
    if len(renamed) != len(view):
        return []
    return [(a, b) for a, b in zip(view, renamed, strict=True) if a != b]


def _plan(d: Any, policy: Any, shapes: str) -> dict[str, Any]:
    """What a merge would do with these differences, as ``check --json`` reports it."""
    shape = [m for m in d.mismatched if m.shape_differs]
    return {
        "backfilled": list(d.missing),
        "kept": [] if policy.drop_unexpected else list(d.unexpected),
        "dropped": list(d.unexpected) if policy.drop_unexpected else [],
        "resized": [m.to_dict() for m in shape] if shapes == "resize" else [],
        "replaced": [m.to_dict() for m in shape] if shapes == "take_reference" else [],
        "cast": [m.to_dict() for m in d.mismatched if not m.shape_differs],
    }


def _check(args: argparse.Namespace) -> int:
    import dsdmerge as dm
    from dsdmerge.report import format_keys, render, summary

    _trust_warning(args)
    ckpt_key, ref_key = _keys_of(args)
    allowed = _Allowed.of(args)
    policy = dm.resolve_policy(args.policy)
    shapes = args.on_shape_mismatch.replace("-", "_")
    rules = _rename_rules(args)
    errors: list[str] = []
    with _Progress("check", 3) as progress:
        progress.step(f"reading {args.checkpoint}")
        ckpt = _view(args.checkpoint, trusted=_trusted(args), key=ckpt_key)
        progress.done()
        progress.step(f"reading {args.reference}")
        ref = _view(args.reference, trusted=_trusted(args), key=ref_key)
        progress.done()
        progress.step("checking")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", dm.DSDMergeWarning)
            try:
                d = dm.check(
                    ckpt,
                    ref,
                    policy=policy,
                    allow_missing=allowed.missing,
                    allow_unexpected=allowed.unexpected,
                    rename=rules,
                    convert=_conversions(args),
                    on_shape_mismatch=shapes,
                )
            except dm.MergeError as err:
                d = err.diff if err.diff is not None else dm.KeyDiff()
                errors = _findings(err)
        progress.done()
    # check merges nothing: what a merge would resize is said so
    warned = [
        _cli_advice(str(w.message).removeprefix("dsdmerge: ")).replace(
            " tensor(s) resized (", " tensor(s) would be resized ("
        )
        for w in caught
    ]
    renamed = _renamed_pairs(ckpt, rules)
    ckpt_keys = [dict(renamed).get(k, k) for k in ckpt] if renamed else list(ckpt)
    if _conversions(args):
        ckpt_keys = _renamed_keys(ckpt, rules, _conversions(args))
    unmatched = allowed.unmatched(ckpt_keys, list(ref))
    ok_missing, _missing, ok_unexpected, _unexpected = allowed.split(d)
    accepted = not errors
    if args.json:
        _print_json(
            {
                "checkpoint": ckpt.path,
                "reference": ref.path,
                "checkpoint_key": ckpt_key,
                "reference_key": ref_key,
                "policy": policy.name,
                "accepted": accepted,
                "errors": errors,
                "warnings": warned,
                **_plan(d, policy, shapes),
                "renamed": [{"from": a, "to": b} for a, b in renamed],
                "missing": list(d.missing),
                "unexpected": list(d.unexpected),
                "mismatched": [m.to_dict() for m in d.mismatched],
                "allowed": {"missing": ok_missing, "unexpected": ok_unexpected},
                "unmatched_globs": allowed.json_unmatched(unmatched),
                "suggested_renames": [r.to_dict() for r in d.renames],
                "summary": summary(d),
            }
        )
        return EXIT_OK if accepted else EXIT_DIFFERS
    for line in warned:
        _stderr(f"dsdmerge: warning: {line}")
    _warn_unmatched(unmatched, None)
    style = _Style.of(sys.stdout, args.color)
    for label, view, key in (("checkpoint", ckpt, ckpt_key), ("reference", ref, ref_key)):
        _say(f"{label}: {_named(view.path, key)} ({view.format}, {len(view):,} keys)")
    print(render(d, limit=args.limit, table=style.table, color=style.color))
    if renamed:
        _say(
            f"{len(renamed):,} checkpoint keys renamed first, e.g. {renamed[0][0]} -> "
            f"{renamed[0][1]} ({format_keys([a for a, _ in renamed], limit=3)})"
        )
    if accepted:
        print(style.paint(f"policy {policy.name!r} accepts the merge", "32"))
        return EXIT_OK
    print(style.paint(f"policy {policy.name!r} rejects the merge:", "31"))
    for line in errors:
        _say(f"  - {line}")
    return EXIT_DIFFERS


# -- merge ---------------------------------------------------------------------------


def _merge(args: argparse.Namespace) -> int:
    import dsdmerge as dm
    from dsdmerge._paths import replace_part, state_dict_part
    from dsdmerge.integrations.checkpoints import detect_format, load_checkpoint, read_metadata
    from dsdmerge.report import render

    _trust_warning(args)
    out = Path(args.out)
    ckpt_key, ref_key = _keys_of(args)
    ckpt_format = detect_format(args.checkpoint)
    fmt = writing.output_format(out, args.format, directory="hf" if ckpt_format == "hf" else "dcp")
    writing.recover_interrupted(out)
    writing.check_destination(out, force=args.force, fmt=fmt)
    if fmt == "hf":  # the files it would copy, checked before anything is loaded
        writing.hf_plan({}, args.checkpoint, args.reference, ckpt_format)
    trusted = _trusted(args)
    allowed = _Allowed.of(args)
    with _Progress("merge", 4) as progress:
        progress.step(f"reading {args.checkpoint}")
        whole = load_checkpoint(args.checkpoint, trusted=trusted)
        ckpt = state_dict_part(args.checkpoint, whole, ckpt_key) if ckpt_key else whole
        progress.done()
        progress.step(f"reading {args.reference}")
        ref = load_checkpoint(args.reference, trusted=trusted, key=ref_key)
        progress.done()
        metadata: dict[str, str] = {}
        if fmt == "safetensors":  # keep the files' own __metadata__ (format, step, notes ...)
            for source in (args.checkpoint, args.reference):
                if not metadata and detect_format(source) == "safetensors":
                    metadata = read_metadata(source).metadata
        policy = dm.resolve_policy(args.policy)
        progress.step("merging")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", dm.DSDMergeWarning)
            try:
                merged = dm.merge_with_diff(
                    ckpt,
                    ref,
                    policy=policy,
                    allow_missing=allowed.missing,
                    allow_unexpected=allowed.unexpected,
                    rename=_rename_rules(args),
                    convert=_conversions(args),
                    on_shape_mismatch=args.on_shape_mismatch.replace("-", "_"),
                    max_resize_bytes=args.max_bytes,
                )
            except dm.MergeError as err:
                progress.close()
                _stderr(f"dsdmerge: {_cli_advice(_rename_advice(err, str(err)))}")
                _stderr(f"dsdmerge: nothing written to {out}")
                return EXIT_DIFFERS
        progress.done()
        _print_warnings(caught)
        ckpt_keys = _renamed_keys(ckpt, _rename_rules(args), _conversions(args))
        _warn_unmatched(allowed.unmatched(ckpt_keys, list(ref)), None)
        result = merged.state_dict
        if ckpt_key:  # the whole checkpoint, its part at --ckpt-key merged
            result = replace_part(whole, ckpt_key, result)
        writing.check_destination(
            out, force=args.force, fmt=fmt
        )  # again: it may have appeared meanwhile
        progress.step(f"writing {out}")
        plan = (
            writing.hf_plan(result, args.checkpoint, args.reference, ckpt_format)
            if fmt == "hf"
            else None
        )
        writing.write_checkpoint(result, out, fmt, force=args.force, metadata=metadata, hf=plan)
        progress.done()
    # OUT is written: the status says so, whatever becomes of the report
    try:
        with _reader_may_leave():
            style = _Style.of(sys.stdout, args.color)
            part = f"; {ckpt_key!r} merged, the rest as it was" if ckpt_key else ""
            _say(f"wrote {out} ({fmt}, {len(dm.flatten(result)):,} keys{part})")
            if merged.diff:
                print(render(merged.diff, limit=args.limit, table=style.table, color=style.color))
    except (OSError, ValueError):  # stdout gone (EIO, closed)
        with contextlib.suppress(Exception):
            _stderr(f"dsdmerge: wrote {out}; its report could not be printed")
    return EXIT_OK


_ADVICE = (
    ("allow_missing=[<glob>, ...]", "--allow-missing GLOB"),
    ("allow_unexpected=[<glob>, ...]", "--allow-unexpected GLOB"),
    ("on_shape_mismatch='resize'", "--on-shape-mismatch resize"),
    ("on_shape_mismatch='take_reference'", "--on-shape-mismatch take-reference"),
    ("Pass max_resize_bytes=<bytes>", "Pass --max-bytes BYTES"),
    ("pass rename={", "pass --rename PATTERN=REPLACEMENT for each of {"),
    ("pass force=True", "pass --force"),
    ("force=True replaces only", "--force replaces only"),
    ("or ask for a format: ", "or pass --format "),
    ("or ask for none to write", "or drop --format to write"),
)
_ASKED = re.compile(r"the format (\w+) was asked for")


def _cli_advice(text: str) -> str:
    """The library's advice, spelled as command-line options."""
    for api, option in _ADVICE:
        text = text.replace(api, option)
    return _ASKED.sub(r"--format \1 was given", text)


# -- reference -----------------------------------------------------------------------


def _load_builder(spec: str) -> Callable[[], Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names (imports it)."""
    import importlib
    import importlib.util

    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name.isidentifier():
        raise CLIError(f"BUILDER {spec!r}: expected module:function or path/to/file.py:function")
    if where.endswith(".py") or os.sep in where:
        path = Path(where)
        if not path.is_file():
            raise CLIError(f"BUILDER {spec!r}: {where} is not a file")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise CLIError(f"BUILDER {spec!r}: {where} cannot be imported")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))  # its own imports, as `python file.py`
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        sys.path.insert(0, os.getcwd())  # as `python -m` finds the module
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise CLIError(f"BUILDER {spec!r}: cannot import {where}: {err}") from err
        finally:
            sys.path.remove(os.getcwd())
    builder = getattr(module, name, None)
    if not callable(builder):
        raise CLIError(f"BUILDER {spec!r}: {where} has no function {name!r}")
    return builder  # type: ignore[no-any-return]


def _reference(args: argparse.Namespace) -> int:
    import dsdmerge as dm

    out = Path(args.out)
    fmt = writing.output_format(out, args.format)
    writing.recover_interrupted(out)
    writing.check_destination(out, force=args.force, fmt=fmt)
    from dsdmerge.integrations.reference import reference_state_dict

    built = _load_builder(args.builder)()
    try:
        state_dict = reference_state_dict(built, optimizer_layout=args.optimizer_layout)
    except StateDictTypeError as err:
        raise CLIError(f"BUILDER {args.builder!r} returned {err}") from None
    writing.write_checkpoint(state_dict, out, fmt, force=args.force)
    n = len(dm.flatten(state_dict))
    if isinstance(built, (Mapping, tuple, list)):
        _say(f"wrote {out} ({fmt}, {n:,} keys; parts {', '.join(map(repr, state_dict))})")
    else:
        _say(f"wrote {out} ({fmt}, {n:,} keys: the model's state_dict())")
    return EXIT_OK


# -- demo ----------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from dsdmerge.demo import run_demo

    for line in run_demo(steps=args.steps):
        print(line)
    return EXIT_OK


# -- plumbing ------------------------------------------------------------------------


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2))


def _say(line: str) -> None:
    """Print a line that holds names from a checkpoint (keys, paths, metadata), escaped.

    A character that does not print (ESC, CR, LF, a bidirectional override) is
    written as its escape, so a crafted name cannot move the cursor, recolour the
    terminal or print a fake line; ``--json`` keeps every name exact.
    """
    print(escaped(line))


def _stderr(text: str) -> None:
    """Print a message on stderr, its own lines kept.

    Anything else that does not print (ESC, CR, a name's control characters) is escaped.
    """
    print("\n".join(map(escaped, text.split("\n"))), file=sys.stderr)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


_DESCRIPTION = """\
Inspect, diff, check and merge PyTorch checkpoint state dicts.

PATH, CHECKPOINT and REFERENCE may be a torch .pt/.pth/.bin file, a .safetensors file,
a torch.distributed.checkpoint (DCP) directory, or a Hugging Face model directory
(save_pretrained: model.safetensors, or shards and model.safetensors.index.json; or
the index file itself). inspect, diff and check read metadata only (no tensor bytes).
Torch files load with weights_only=True and DCP .metadata through a restricted
unpickler: a pickle that would run code is refused (exit 2), never run. --key PATH
picks one part of a whole checkpoint ({"model": ..., "optim": ..., "step": ...}).

Exit status: 0 success (diff: nothing differs but what is allowed; check: the policy
accepts), 1 diff: differences / check, merge: rejected by the policy (nothing
written), 2 error (one line on stderr).
"""

_EXAMPLES = {
    "inspect": """\
examples:
  dsdmerge inspect step-1000.pt
  dsdmerge inspect checkpoints/step-1000/             # a DCP directory
  dsdmerge inspect Llama-3-8B/                        # a Hugging Face model directory
  dsdmerge inspect step-1000.pt --key optim --stat    # one part; counts per top-level key
  dsdmerge inspect model.safetensors --only 'layers.0.*' --json | jq .patterns
""",
    "diff": """\
examples:
  dsdmerge diff step-1000.pt fresh.pt
  dsdmerge diff checkpoints/step-1000/ fresh/ --limit 30
  dsdmerge diff full-step-1000.pt model.safetensors --ckpt-key model
  dsdmerge diff old.safetensors new.safetensors --json | jq '.missing | length'
  dsdmerge diff step-1000.pt fresh.pt --allow-missing 'state.*.indexer.*' && echo ok
  dsdmerge diff a.pt b.pt --ignore-values > /dev/null || echo "keys, shapes or dtypes differ"

Non-tensor values (lr, betas, weight_decay, step) are compared too: a changed value
is a difference (exit 1) unless --ignore-values. With --allow-missing/--allow-unexpected
the exit status is 0 when every remaining difference is allowed.
""",
    "check": """\
examples:
  dsdmerge check step-1000.pt fresh.pt --policy strict --allow-missing 'state.*.indexer.*'
  dsdmerge check ckpt/ fresh/ --key optim --policy strict --json | jq .backfilled
  dsdmerge check old/ new/ --on-shape-mismatch resize --policy strict || exit 1

A dry run of merge for CI: the policy's verdict (exit 0 accepts, 1 rejects, 2 error)
and what the merge would do (--json: "backfilled", "kept", "dropped", "resized",
"replaced", "cast", "renamed", "errors", "warnings"), from metadata only.
""",
    "merge": """\
examples:
  dsdmerge merge step-1000.pt fresh.pt -o resumable.pt
  dsdmerge merge step-1000.pt fresh.pt -o resumable.pt --policy strict \\
      --allow-missing '*.indexer.*'
  dsdmerge merge ckpt/ fresh/ -o merged/ --policy warn --allow-unexpected 'ema.*' --force
  dsdmerge merge old.safetensors new.safetensors -o grown.safetensors \\
      --on-shape-mismatch resize      # a model that grew: keep every trained row
  dsdmerge merge Llama-old/ Llama-new/ -o Llama-merged   # HF shards and index, as the checkpoint's
  dsdmerge merge full-step-1000.pt fresh-model.pt -o resumable.pt --ckpt-key model
  dsdmerge merge ddp-step-1000.pt fresh.pt -o resumable.pt --strip-prefix module.
  dsdmerge merge old.pt new.pt -o renamed.pt --rename '\\.attn\\.wq\\.=.attn.q_proj.'

The result has the checkpoint's layout, in the format OUT's name says (.pt/.pth/.bin
torch, .safetensors, a directory without a suffix: DCP, or a Hugging Face directory
when the checkpoint is one; --format must agree): every checkpoint value kept, every
key only the reference has taken from it. With --ckpt-key (or --key) the whole
checkpoint is written, its part at that key merged. OUT is written atomically (a
temporary next to it, renamed when complete) and never replaced without --force;
--force replaces only a checkpoint file, or a directory holding only what dsdmerge writes
there (.metadata and __R_N.distcp; model*.safetensors, the index, config and tokenizer
files). A Hugging Face result copies only the reference's config, tokenizer, processor and
model-code files, each a regular file inside its directory; a link out is refused.
""",
    "reference": """\
examples:
  dsdmerge reference train.py:build -o fresh.pt --optimizer-layout flat
  dsdmerge reference my_project.model:make_model -o fresh-model.safetensors

BUILDER is your function (module:function or file.py:function, run with no arguments)
that returns a model, (model, optimizer), or a dict such as {"model": model, "optim":
optimizer, "step": 0}. OUT gets what a fresh model and optimizer hold: model.state_dict(),
and DSD's get_optimizer_state_dict (a fresh optimizer's own state_dict() has no state;
DSD's zero-gradient step gives every parameter its state, Adam step == 1). This runs
BUILDER's code, and the step changes the throwaway optimizer only.
""",
    "demo": """\
example:
  dsdmerge demo
""",
}

_PRESET_NAMES = (
    "ddp",
    "compile",
    "checkpoint_wrapper",
    "fsdp1",
    "peft",
    "lora",
    "to_peft",
    "lora_adapter_name",
    "to_lora_adapter_name",
)
"""``--preset`` choices: the names of ``dsdmerge.RENAME_PRESETS``, spelled here so that
building the parser imports nothing heavy (a test keeps the two equal)."""
# dsdmerge.CONVERSION_PRESETS' names, spelled here so that building the parser imports no torch
_CONVERSION_NAMES = ("qkv", "gate_up", "stack_experts", "stack_experts_w123", "transpose_experts")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dsdmerge`` command.

    Examples:
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
        p.add_argument(
            "--color",
            choices=("auto", "always", "never"),
            default="auto",
            help="colours: auto (default) on a terminal, unless NO_COLOR is set; "
            "FORCE_COLOR forces them in auto",
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

    def keys(p: argparse.ArgumentParser, *, sides: bool) -> None:
        p.add_argument(
            "--key",
            metavar="PATH",
            help="use one part of a whole checkpoint: a dot-separated path such as 'model', "
            "'optim' or 'optim.state'"
            + (" (for both sides; --ckpt-key/--ref-key for one)" if sides else ""),
        )
        if sides:
            p.add_argument("--ckpt-key", metavar="PATH", help="--key for the checkpoint only")
            p.add_argument("--ref-key", metavar="PATH", help="--key for the reference only")

    def filters(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--only",
            action="append",
            default=[],
            metavar="GLOB",
            help="report only keys matching this glob or pattern (as reports print them); "
            "repeatable",
        )
        p.add_argument(
            "--exclude",
            action="append",
            default=[],
            metavar="GLOB",
            help="leave keys matching this glob or pattern out of the report; repeatable",
        )
        p.add_argument("--stat", action="store_true", help="add counts per top-level key")

    def allow(p: argparse.ArgumentParser, *, what: str) -> None:
        p.add_argument(
            "--allow-missing",
            action="append",
            default=[],
            metavar="GLOB",
            help=f"keys the checkpoint may lack{what}: an fnmatch glob over flat keys (* "
            "crosses dots) or a pattern as reports print it ('layers.{0..5}.indexer."
            "{bias,weight}'); repeatable; a glob that matches nothing is reported",
        )
        p.add_argument(
            "--allow-unexpected",
            action="append",
            default=[],
            metavar="GLOB",
            help="keys the reference may lack, as for --allow-missing; repeatable",
        )

    def policy(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--policy",
            choices=("default", "strict", "warn"),
            default="default",
            help="default: backfill and keep quietly; warn: the same, with warnings; strict: "
            "fail on any difference not allowed (default: default)",
        )
        p.add_argument(
            "--on-shape-mismatch",
            choices=("raise", "take-reference", "resize"),
            default="raise",
            help="a tensor whose shape differs: fail (default); resize, for a model that grew "
            "or shrank (vocabulary, experts, a wider head): keep the checkpoint's overlapping "
            "slice of the tensor and of its optimizer moments, the rest from the reference "
            "(same rank only); take-reference: take the reference's tensor with a warning "
            "(the trained values are dropped)",
        )

    inspect = add(
        "inspect",
        "layout, counts, bytes, dtypes and key patterns of a checkpoint",
        "Show a checkpoint's format, layout, key count, tensor count and bytes, dtypes, "
        "metadata and its keys compressed into exact patterns, from its metadata only.",
    )
    inspect.add_argument(
        "path", metavar="PATH", help="checkpoint file, DCP or Hugging Face directory"
    )
    keys(inspect, sides=False)
    filters(inspect)
    common(
        inspect,
        json_help='print JSON: "path", "key", "format", "layout", "keys" (the count), '
        '"tensors", "bytes", "dtypes", "metadata", "patterns" (and "stat")',
    )
    inspect.set_defaults(func=_inspect)

    diff = add(
        "diff",
        "what differs between a checkpoint and a reference",
        "Report keys missing from the checkpoint, keys unexpected in it, tensors whose "
        "shape or dtype differ and non-tensor values that differ, compressed into exact "
        "patterns (every key a pattern names exists). Reads metadata only. Exit 0: nothing "
        "differs (but what is allowed), 1: something does, 2: error.",
    )
    diff.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint you resume from")
    diff.add_argument("reference", metavar="REFERENCE", help="the state dict you have now")
    keys(diff, sides=True)
    filters(diff)
    diff.add_argument(
        "--ignore-values",
        action="store_true",
        help="compare keys, shapes and dtypes only, not non-tensor values (lr, step ...)",
    )
    allow(diff, what=" (exit 0 if only allowed differences remain)")
    common(
        diff,
        json_help='print JSON with lists "missing", "unexpected", "mismatched", "changed" '
        '({"key", "checkpoint", "reference"}), "allowed", and a compressed "summary"',
    )
    _add_rename_options(diff)
    _add_convert_option(diff)
    diff.set_defaults(func=_diff)

    check = add(
        "check",
        "the policy's verdict on a merge, without merging (for CI)",
        "Apply a policy to what differs between CHECKPOINT and REFERENCE and say what a "
        "merge would do, from metadata only; nothing is written. Exit 0: the policy "
        "accepts, 1: it rejects, 2: error.",
    )
    check.add_argument("checkpoint", metavar="CHECKPOINT", help="the checkpoint you resume from")
    check.add_argument("reference", metavar="REFERENCE", help="the state dict you have now")
    keys(check, sides=True)
    policy(check)
    allow(check, what="")
    _add_rename_options(check)
    _add_convert_option(check)
    common(
        check,
        json_help='print JSON: "accepted", "errors", "warnings", and what the merge would '
        'do: "backfilled", "kept", "dropped", "resized", "replaced", "cast", "renamed"',
    )
    check.set_defaults(func=_check)

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
        "a directory without a suffix DCP (a Hugging Face directory when the checkpoint is "
        "one)",
    )
    merge.add_argument(
        "--format",
        choices=writing.FORMATS,
        default=None,
        help="the format to write; must agree with OUT's name (default: what the name says)",
    )
    keys(merge, sides=True)
    policy(merge)
    allow(merge, what="")
    _add_rename_options(merge)
    _add_convert_option(merge)
    merge.add_argument(
        "--max-bytes",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="the most bytes the tensors --on-shape-mismatch resize makes may take together "
        "(default: as many as the checkpoint's and the reference's tensors hold); e.g. "
        "'64MiB', '2GiB', '1e9'",
    )
    merge.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it exists and is a checkpoint: a regular file, or a directory "
        "holding only what dsdmerge writes there (a DCP or Hugging Face checkpoint); never "
        "anything else",
    )
    common(merge, json_help=None)
    merge.set_defaults(func=_merge)

    reference = add(
        "reference",
        "write what a fresh model and optimizer hold: the REFERENCE for diff/check/merge",
        "Run BUILDER (your function) and write the state dicts of the fresh model and "
        "optimizer it returns, the optimizer's as DSD's get_optimizer_state_dict makes it.",
    )
    reference.add_argument(
        "builder", metavar="BUILDER", help="module:function or path/to/file.py:function"
    )
    reference.add_argument("-o", "--out", required=True, metavar="OUT", help="where to write")
    reference.add_argument(
        "--optimizer-layout",
        choices=("flat", "fqn", "ids"),
        default="fqn",
        help="flat: DSD's flatten_optimizer_state_dict=True form; fqn (default): DSD's "
        "nested form keyed by fqn; ids: optimizer.state_dict() (int ids), after DSD's step",
    )
    reference.add_argument(
        "--format", choices=writing.FORMATS, default=None, help="as for merge (default: OUT's name)"
    )
    reference.add_argument("--force", action="store_true", help="replace OUT, as for merge")
    reference.set_defaults(func=_reference)

    demo = add(
        "demo",
        "run the resume story on a built-in tiny model",
        "Train a tiny model whose indexer never gets gradients, save its flattened "
        "optimizer state, show torch failing to resume from it and dsdmerge making it load.",
    )
    demo.add_argument("--steps", type=_positive, default=5, help="training steps (default: 5)")
    demo.set_defaults(func=_demo)
    return parser


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {f"{p}IB": 1024 ** (i + 1) for i, p in enumerate("KMGT")}


def _byte_count(text: str) -> int:
    """``--max-bytes``: a number of bytes, with an optional unit (``64MiB``, ``2GB``)."""
    upper = text.strip().upper()
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if u and upper.endswith(u)), "")
    try:
        value = float(upper[: len(upper) - len(unit)].strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}")
    return int(value * _UNITS[unit])


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
def _safe_streams() -> Iterator[None]:
    """Text that stdout or stderr cannot encode is written as escapes, never an error.

    A key with a lone surrogate, or any non-ASCII key under an ASCII locale
    (``LC_ALL=C``, ``PYTHONIOENCODING=ascii``), would otherwise stop a report half-way
    with an exception, after ``merge`` had written OUT. Each stream's error handler is
    restored afterwards.
    """
    restore = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if errors in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            with contextlib.suppress(Exception):  # a stream that cannot be reconfigured
                stream.reconfigure(errors="backslashreplace")
                restore.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in restore:
            with contextlib.suppress(Exception):
                stream.reconfigure(errors=errors)


@contextlib.contextmanager
def _printed_warnings() -> Iterator[None]:
    """Print the warnings of a command as it runs: each once, one escaped line on stderr."""
    seen: set[str] = set()
    original = warnings.showwarning

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if not issubclass(category, DSDMergeWarning):
            original(message, category, *args, **kwargs)
            return
        line = f"dsdmerge: warning: {_cli_advice(str(message).removeprefix('dsdmerge: '))}"
        if line not in seen:
            seen.add(line)
            _stderr(line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", DSDMergeWarning)
        warnings.showwarning = show
        yield


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

    Examples:
        >>> from dsdmerge.cli import main
        >>> main(["inspect", "/no/such/file.pt"])  # doctest: +SKIP
        2
    """
    from dsdmerge.errors import UnsafeCheckpointError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        with _safe_streams(), _printed_warnings(), _quiet_broken_pipe():
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
    except (DSDMergeError, OSError) as err:
        _stderr(f"dsdmerge: error: {_cli_advice(_one_line(err))}")
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


_MOVED = {
    "FORMATS": "dsdmerge.integrations.writing",
    "HFPlan": "dsdmerge.integrations.writing",
    "output_format": "dsdmerge.integrations.writing",
    "write_checkpoint": "dsdmerge.integrations.writing",
    "reference_state_dict": "dsdmerge.integrations.reference",
}


def __getattr__(name: str) -> Any:
    """The names that moved out of the command line, one release as deprecated aliases."""
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'dsdmerge.cli' has no attribute {name!r}")
    import importlib

    warnings.warn(
        f"dsdmerge.cli.{name} moved to {home}.{name}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
