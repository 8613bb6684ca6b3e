"""Reading checkpoints safely: metadata-only views and full loads, without running pickled code.

Four formats are understood:

* ``"dcp"``: a ``torch.distributed.checkpoint`` directory (it holds a
  ``.metadata`` file);
* ``"torch"``: a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``, or any file
  that is a torch zip archive or a pickle);
* ``"safetensors"``: a ``.safetensors`` file;
* ``"hf"``: a Hugging Face model directory (``save_pretrained``: ``model.safetensors``,
  or shards listed by ``model.safetensors.index.json``), or that index file
  (see :mod:`dsdmerge.integrations._files`, which reads them without torch).

:func:`read_metadata` returns a :class:`CheckpointView`, a read-only flat
mapping of every key (spelled as :func:`dsdmerge.flatten` spells the loaded
checkpoint) to a :class:`~dsdmerge.TensorMeta`, without reading tensor data, so
a trainer can :func:`dsdmerge.diff` or :func:`dsdmerge.check` a checkpoint
against its model before loading anything. :func:`load_checkpoint` loads the
whole state dict.

Nothing here runs code from a checkpoint unless asked to with ``trusted=True``:

* torch files go through ``torch.load(weights_only=True)``; ``trusted=[...]`` adds
  the named globals to its allow-list (``torch.serialization.safe_globals``);
* a DCP ``.metadata`` file goes through :mod:`dsdmerge.integrations._dcp_metadata`,
  a restricted and bounded unpickler that admits only DCP's metadata classes,
  ``torch.Size``, dtypes, layouts, memory formats and paths, never lets the pickle
  touch a real class or function, and validates every field (torch's own
  ``FileSystemReader.read_metadata`` unpickles it without restriction);
* DCP bytes entries (non-tensor values) go through ``torch.load(weights_only=True)``
  (torch's ``DefaultLoadPlanner`` uses ``weights_only=False``), read only from
  regular files inside the checkpoint directory, within their size;
* safetensors headers are read and validated by the ``safetensors`` library.

Anything outside those allow-lists raises :class:`~dsdmerge.UnsafeCheckpointError`
before it runs, naming what it needed; anything malformed raises
:class:`~dsdmerge.CheckpointReadError`. No other exception leaves these readers.

This module dispatches on the format and reads torch and safetensors files; DCP
directories are read by :mod:`dsdmerge.integrations._dcp`, the ``trusted=`` rule is
:mod:`dsdmerge.integrations._trust`, and the view is built in
:mod:`dsdmerge.integrations._view`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from dsdmerge._paths import select_flat
from dsdmerge._paths import state_dict_part as _state_dict_part
from dsdmerge.diff import TensorMeta
from dsdmerge.errors import CheckpointReadError
from dsdmerge.flatten import flatten
from dsdmerge.integrations._dcp import dcp_load_whole, dcp_part_layout, read_dcp_view
from dsdmerge.integrations._files import (
    DTYPES,
    CheckpointFormat,
    detect_format,
    hf_header,
    hf_layout,
    safetensors_header,
)
from dsdmerge.integrations._files import reading as _reading
from dsdmerge.integrations._files import reason as _reason
from dsdmerge.integrations._trust import Trust, allowing, check_trust, load_error
from dsdmerge.integrations._view import UNREAD as UNREAD  # where older pickles of it look
from dsdmerge.integrations._view import CheckpointView
from dsdmerge.layout import Layout, classify

__all__ = [
    "CheckpointFormat",
    "CheckpointView",
    "Trust",
    "detect_format",
    "load_checkpoint",
    "read_metadata",
]

# --------------------------------------------------------------------------------------
# formats


def read_metadata(
    path: str | os.PathLike[str],
    /,
    *,
    trusted: Trust = False,
    key: str | None = None,
    storage_reader: Any = None,
) -> CheckpointView:
    """Read a checkpoint's keys, shapes and dtypes without reading tensor data.

    * DCP directory: the ``.metadata`` file only, through a restricted unpickler
      (see the module docstring); the nesting DCP recorded in it is rebuilt and
      flattened as :func:`dsdmerge.flatten` would flatten the loaded checkpoint.
      The one exception: a *nested* optimizer state dict saved through DCP keeps
      its group membership only in its ``param_groups.<i>.params`` bytes entries,
      so those small lists are read (safely) from the data files; flattened
      optimizer state dicts need nothing but ``.metadata``.
    * torch file: ``torch.load(weights_only=True, mmap=True, map_location="meta")``,
      which reads the pickle but no tensor storage (files saved with
      ``_use_new_zipfile_serialization=False`` cannot be memory-mapped and are
      read whole).
    * safetensors file: the header, read and validated by the ``safetensors``
      library (``safe_open``); its ``__metadata__`` is the view's ``metadata``.

    * Hugging Face model directory (``save_pretrained``: ``model.safetensors``, or
      shards and ``model.safetensors.index.json``; or the index file itself): every
      shard's header, checked against the index (each key in the shard the index
      says, and in no other); the index's ``"metadata"`` and the first shard's
      ``__metadata__`` are the view's ``metadata``.

    Does not modify the checkpoint.

    Args:
        path: The checkpoint file or directory.
        trusted: ``False`` (default): nothing outside the allow-lists loads.
            A list of ``"module.Name"`` globals: those too, in torch files and DCP
            bytes entries (torch's ``safe_globals``), and the classes among them as
            storage entries of a DCP ``.metadata`` (another writer's ``_StorageInfo``,
            built without running its code). ``True``: unpickle without restriction
            (runs any code the pickle holds); only for checkpoints whose origin you trust.
        key: A dot-separated path to one part of a whole checkpoint (``"model"``,
            ``"optim"``, ``"optim.state"``): the view is of that part only, keyed
            as :func:`dsdmerge.flatten` of the part would be.
        storage_reader: A DCP ``StorageReader`` for a directory written by another
            storage writer (OLMo-core's ``RemoteFileSystemReader``): it reads the
            ``param_groups`` entries a nested optimizer needs; ``.metadata`` is still
            read by the safe reader when ``path`` holds one (with ``trusted=True`` and
            no local ``.metadata``, by the reader's own ``read_metadata()``).

    Returns:
        A :class:`CheckpointView`.

    Raises:
        CheckpointReadError: The path is missing, corrupt, truncated or of an
            unknown format.
        UnsafeCheckpointError: A pickle references something outside the
            allow-list (nothing in it has run).
        LayoutError: Nothing is at ``key`` (the message lists what is there).

    Examples:
        >>> import tempfile, torch, dsdmerge as dm
        >>> from dsdmerge.integrations import read_metadata
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"model": {"w": torch.zeros(2)}, "step": 3}, f"{tmp}/ckpt.pt")
        ...     view = read_metadata(f"{tmp}/ckpt.pt", key="model")
        >>> dm.diff(view, {"w": torch.zeros(2), "head": torch.zeros(3)}).missing
        ('head',)
    """
    trust = check_trust(trusted)
    where = str(path)
    with _reading(where):
        fmt = "dcp" if storage_reader is not None else detect_format(path)
        if fmt == "dcp":
            view, metadata = read_dcp_view(where, trusted=trust, storage_reader=storage_reader)
            if key is None:
                return view
            return CheckpointView(
                select_flat(view, key),
                path=where,
                format=fmt,
                layout=dcp_part_layout(metadata, key),
            )
        if fmt == "torch":
            entries, layout = _torch_entries(where, trusted=trust, key=key)
            return CheckpointView(entries, path=where, format=fmt, layout=layout)
        if fmt == "hf":
            hf_entries, metadata, _shards = hf_header(hf_layout(where), where=where)
            st_entries = {k: TensorMeta(s, _torch_dtype(c)) for k, (s, c) in hf_entries.items()}
        else:
            st_entries, metadata = _safetensors_header(where)
        if key is not None:
            st_entries = select_flat(st_entries, key)
        return CheckpointView(st_entries, path=where, format=fmt, metadata=metadata)


def load_checkpoint(
    path: str | os.PathLike[str],
    /,
    *,
    trusted: Trust = False,
    key: str | None = None,
    storage_reader: Any = None,
) -> dict[str, Any]:
    """Load a whole checkpoint, tensors included, without running pickled code.

    * torch file: ``torch.load(weights_only=True, mmap=True, map_location="cpu")``
      (tensors are memory-mapped, read on first use).
    * safetensors file: ``safetensors.torch.load_file`` (needs the
      ``safetensors`` extra).
    * DCP directory: every key, in this process only (no collectives even when
      ``torch.distributed`` is initialised), through ``dcp.load`` with a reader
      whose ``.metadata`` goes through the restricted unpickler and a planner
      that loads bytes entries with ``weights_only=True``. The nesting is
      rebuilt from the metadata's ``planner_data`` (dicts, and lists such as
      ``param_groups``); tensors are plain CPU tensors of the global shape, not
      DTensors; a checkpoint written by a planner that recorded no nesting
      comes back flat, keyed as in its metadata.
    * Hugging Face model directory (or its index file): every shard, after the
      index was checked against the shards' headers; one flat dict.

    Args:
        path: The checkpoint file or directory.
        trusted: ``False`` (default): nothing outside the allow-lists loads.
            A list of ``"module.Name"`` globals: those too, in torch files and DCP
            bytes entries (torch's ``safe_globals``), and the classes among them as
            storage entries of a DCP ``.metadata`` (another writer's ``_StorageInfo``,
            built without running its code). ``True``: unpickle without restriction
            (runs any code the pickle holds); only for checkpoints whose origin you trust.
        key: A dot-separated path to one part of a whole checkpoint
            (``"model"``, ``"optim"``): only that part is returned (the whole file
            is still read).
        storage_reader: A DCP ``StorageReader`` that reads the data of a directory
            written by another storage writer (OLMo-core's ``RemoteFileSystemReader``,
            whose data files hold ``torch.save`` archives): every entry is still
            checked first (inside ``path``, within its file, none overlapping), and
            ``.metadata`` is read as without it. What the reader does with the data is
            its own (OLMo-core's unpickles tensors with ``weights_only=False``).

    Returns:
        The state dict, nested as saved.

    Raises:
        CheckpointReadError: The path is missing, corrupt, truncated or of an
            unknown format, or ``safetensors`` is not installed for a
            safetensors file.
        UnsafeCheckpointError: A pickle references something outside the
            allow-list (nothing in it has run).

    Examples:
        >>> import tempfile, torch
        >>> from dsdmerge.integrations import load_checkpoint
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"model": {"w": torch.ones(2)}, "step": 7}, f"{tmp}/ckpt.pt")
        ...     sd = load_checkpoint(f"{tmp}/ckpt.pt")
        ...     sd["model"]["w"].tolist(), sd["step"]
        ([1.0, 1.0], 7)
    """
    trust = check_trust(trusted)
    where = str(path)
    with _reading(where):
        fmt = "dcp" if storage_reader is not None else detect_format(path)
        if fmt == "dcp":
            loaded = dcp_load_whole(where, trusted=trust, storage_reader=storage_reader)
        elif fmt == "torch":
            loaded = _torch_load(where, trusted=trust, map_location="cpu")
            if not isinstance(loaded, dict):
                raise CheckpointReadError(
                    f"{where}: holds a {type(loaded).__name__}, not a state dict", path=where
                )
        elif fmt == "hf":
            loaded = _hf_load(where)
        else:
            loaded = _safetensors_load(where)
        return loaded if key is None else _state_dict_part(where, loaded, key)


# --------------------------------------------------------------------------------------
# torch files


def _torch_load(where: str, *, trusted: Trust, map_location: str) -> Any:
    _import_dtensor()
    try:
        return _torch_load_file(where, trusted=trusted, map_location=map_location, mmap=True)
    except _MmapUnsupported:
        pass
    # a legacy (non-zip) torch.save file: cannot be memory-mapped, so it is read whole
    return _torch_load_file(where, trusted=trusted, map_location=map_location, mmap=False)


class _MmapUnsupported(Exception):
    pass


def _torch_load_file(where: str, *, trusted: Trust, map_location: str, mmap: bool) -> Any:
    try:
        with allowing(trusted), warnings.catch_warnings():
            # torch's note that a pickle protocol other than 2 "might not be supported": the
            # file is then either read faithfully or refused with a reason, so it says nothing
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(
                where, weights_only=trusted is not True, mmap=mmap, map_location=map_location
            )
    except RecursionError as err:
        raise CheckpointReadError(
            f"{where}: not a readable torch checkpoint: nested too deeply to load", path=where
        ) from err
    except RuntimeError as err:
        if mmap and "mmap can only be used" in str(err):
            raise _MmapUnsupported from None
        raise load_error(where, err, trusted=trusted, file=where) from err
    except Exception as err:  # anything else a corrupt file makes torch raise
        raise load_error(where, err, trusted=trusted, file=where) from err


def _import_dtensor() -> None:
    """Import ``torch.distributed.tensor``: ``weights_only`` loads admit DTensors only then."""
    with contextlib.suppress(ImportError):  # a torch built without distributed support
        import torch.distributed.tensor  # noqa: F401


def _torch_entries(
    where: str, *, trusted: Trust, key: str | None = None
) -> tuple[dict[str, Any], Layout]:
    loaded = _torch_load(where, trusted=trusted, map_location="meta")
    if not isinstance(loaded, Mapping):
        raise CheckpointReadError(
            f"{where}: holds a {type(loaded).__name__}, not a state dict", path=where
        )
    if key is not None:
        loaded = _state_dict_part(where, loaded, key)
    entries = {key: _to_meta(value) for key, value in flatten(loaded).items()}
    return entries, classify(loaded)


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value)
    if type(value) in (list, tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_to_meta(v) for v in value)
    return value


# --------------------------------------------------------------------------------------
# safetensors


def _torch_dtype(code: str) -> Any:
    """The torch dtype of a safetensors dtype code (the code itself when torch lacks it)."""
    name = DTYPES.get(code, ("", 0))[0]
    dtype = getattr(torch, name, None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else code


def _safetensors_header(where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Keys as :class:`TensorMeta`, and ``__metadata__``, read by the ``safetensors`` library."""
    entries, metadata = safetensors_header(where)
    return {k: TensorMeta(shape, _torch_dtype(code)) for k, (shape, code) in entries.items()}, (
        metadata
    )


def _safetensors_load(where: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    _safetensors_header(where)  # a clear error for a corrupt header
    try:
        return dict(load_file(where, device="cpu"))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointReadError(
            f"{where}: not a readable safetensors file (corrupt or truncated?): {_reason(err)}",
            path=where,
        ) from err


def _hf_load(where: str) -> dict[str, Any]:
    """Every tensor of a Hugging Face directory, shard by shard (the index checked first)."""
    layout = hf_layout(where)
    hf_header(layout, where=where)  # a clear error for a bad shard or an index that disagrees
    out: dict[str, Any] = {}
    for shard in layout.shards:
        out.update(_safetensors_load(os.path.join(layout.directory, shard)))
    return out


# --------------------------------------------------------------------------------------
# internal names this module used to hold, one release as deprecated aliases

_MOVED: dict[str, tuple[str, str, str]] = {
    # old name: (module, name there, what to call instead)
    "read_dcp_metadata": ("_dcp", "read_dcp_view", "read_metadata"),
    "run_dcp_load": ("_dcp", "dcp_load_into", "load_dcp or load_checkpoint"),
    "hf_shards": ("_files", "hf_shards", "read_metadata"),
    "state_dict_part": ("_paths", "state_dict_part", "load_checkpoint(path, key=...)"),
    "tensor_metas": ("_view", "tensor_metas", "CheckpointView.values()"),
    "meta_nbytes": ("_view", "meta_nbytes", "CheckpointView.nbytes"),
}


def __getattr__(name: str) -> Any:
    """Internal names this module held, one release as deprecated aliases."""
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new, instead = moved
    warnings.warn(
        f"dsdmerge.integrations.checkpoints.{name} is internal and goes in the next release; "
        f"use {instead}",
        DeprecationWarning,
        stacklevel=2,
    )
    home = f"dsdmerge.{module}" if module == "_paths" else f"dsdmerge.integrations.{module}"
    return getattr(importlib.import_module(home), new)
