"""Every private or version-dependent torch API dsdmerge relies on, in one place.

The rule: no other module names a private torch attribute (``torch.x._y``) or tests
the torch version; they call the functions here. Each entry says which torch
releases have it, and what dsdmerge does where they do not (a clear
:class:`TorchAPIError`). The supported range is :data:`MIN_TORCH` to the newest
release in ``tests/corpus/`` (one directory per release, read by
``tests/test_corpus.py`` on every torch the test matrix runs).

The floor is torch 2.10: before it, DSD's ``set_optimizer_state_dict`` refuses a
flattened optimizer state dict that holds no state for some parameter (a ``KeyError``
on a parameter that never got a gradient), which is what a merge keeps, and its
``get_optimizer_state_dict`` cannot flatten nested state (Shampoo-like optimizers).

=====================================  ==========  ==========================================
torch API                              releases    used for
=====================================  ==========  ==========================================
``dcp.load/save(no_dist=)``            >= 2.7      loads and writes without collectives
``serialization.safe_globals``         >= 2.5      ``trusted=[names]`` for torch files
``get_unsafe_globals_in_checkpoint``   >= 2.5      listing what a refused file needs
``_weights_only_unpickler`` allow-     >= 2.4      the same for a legacy (non-zip) file;
list (``_get_allowed_globals``)                    an empty set if it is missing
``state_dict._get_fqns``               >= 2.4      DSD's own parameter names
``_dynamo.eval_frame.OptimizedModule`` >= 2.0      ``torch.compile``'s ``_orig_mod.`` prefix
                                                   (None if ``torch._dynamo`` fails to import)
``filesystem._StorageInfo``            >= 2.0      DCP's storage entries in ``.metadata``
``TensorProperties`` pickled state     5 fields,   a state with more fields than the
                                       6 (with     installed torch knows is refused, as
                                       ``strides``) torch's own ``pickle.load`` fails on it
                                       >= 2.15
=====================================  ==========  ==========================================

``DefaultLoadPlanner``'s ``mappings``, ``original_state_dict`` and
``flatten_state_dict`` attributes (undocumented, unchanged from 2.4 to 2.15) are read
by the planner that loads bytes entries safely
(:func:`dsdmerge.integrations._dcp.dcp_load_into`).

Names the DCP ``.metadata`` pickle itself holds (``torch.serialization._get_layout``,
``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``,
``torch.distributed.checkpoint.filesystem._StorageInfo``) are never imported by the
safe reader; they are matched as strings (see
:mod:`dsdmerge.integrations._dcp_metadata`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Final

from dsdmerge.errors import DSDMergeError

__all__ = [
    "MIN_TORCH",
    "TENSOR_PROPERTIES_BASE",
    "dcp_load",
    "dcp_save",
    "get_fqns",
    "optimized_module_class",
    "safe_globals",
    "storage_info_class",
    "tensor_properties_fields",
    "torch_version",
    "unsafe_globals_in_checkpoint",
    "weights_only_allowed_globals",
]

MIN_TORCH: Final = (2, 10)
"""The oldest torch release dsdmerge supports (``pyproject.toml`` says the same)."""

TENSOR_PROPERTIES_BASE: Final = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
"""The five fields of DCP's ``TensorProperties`` state in every supported torch."""


def torch_version() -> tuple[int, int]:
    """The installed torch's ``(major, minor)``.

    Examples:
        >>> from dsdmerge._torch_api import torch_version, MIN_TORCH
        >>> torch_version() >= MIN_TORCH
        True
    """
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


class TorchAPIError(DSDMergeError, RuntimeError):
    """The installed torch lacks an API dsdmerge needs (the message names the release)."""


@functools.cache
def tensor_properties_fields() -> tuple[str, ...]:
    """The fields of the installed torch's DCP ``TensorProperties``, in pickled order.

    torch <= 2.14 pickles five (:data:`TENSOR_PROPERTIES_BASE`); 2.15 adds
    ``strides``. ``__getstate__`` writes the fields in declaration order.

    Examples:
        >>> from dsdmerge._torch_api import tensor_properties_fields, TENSOR_PROPERTIES_BASE
        >>> tensor_properties_fields()[:5] == TENSOR_PROPERTIES_BASE
        True
    """
    from torch.distributed.checkpoint.metadata import TensorProperties

    return tuple(f.name for f in dataclasses.fields(TensorProperties))


def storage_info_class() -> type:
    """DCP's ``FileSystemWriter`` storage entry class (private; in every supported torch)."""
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError as err:  # pragma: no cover - present in torch 2.0 .. 2.15
        raise TorchAPIError(
            f"this torch has no torch.distributed.checkpoint.filesystem._StorageInfo: {err}"
        ) from None
    return _StorageInfo


def dcp_load(
    state_dict: Any,
    /,
    *,
    storage_reader: Any,
    planner: Any,
    process_group: Any = None,
    no_dist: bool,
) -> None:
    """``dcp.load`` with ``no_dist``: in this process only, even if a process group exists.

    Examples:
        >>> import tempfile, warnings, torch
        >>> from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        >>> from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        >>> from dsdmerge._torch_api import dcp_load, dcp_save
        >>> with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     dcp_save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp), no_dist=True)
        ...     sd = {"w": torch.zeros(2)}
        ...     dcp_load(sd, storage_reader=FileSystemReader(tmp), planner=DefaultLoadPlanner(),
        ...              no_dist=True)
        >>> sd["w"]
        tensor([1., 1.])
    """
    from torch.distributed.checkpoint import state_dict_loader

    state_dict_loader.load(
        state_dict,
        storage_reader=storage_reader,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
    )


def dcp_save(state_dict: Any, /, *, storage_writer: Any, no_dist: bool) -> None:
    """``dcp.save`` with ``no_dist``: in this process only, even if a process group exists.

    Examples:
        >>> import tempfile, os, torch
        >>> from torch.distributed.checkpoint import FileSystemWriter
        >>> from dsdmerge._torch_api import dcp_save
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     dcp_save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(tmp), no_dist=True)
        ...     ".metadata" in os.listdir(tmp)
        True
    """
    import warnings

    from torch.distributed.checkpoint import state_dict_saver

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*intent is to save in a single process")
        state_dict_saver.save(state_dict, storage_writer=storage_writer, no_dist=no_dist)


_SAFE_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def safe_globals(objects: Sequence[Any]) -> Iterator[None]:
    """``torch.serialization.safe_globals(objects)``, one load at a time.

    Serialized by a lock: torch keeps the list in a module global, so two loads with
    different lists in two threads would see each other's otherwise.

    Examples:
        >>> import collections, io, torch
        >>> from dsdmerge._torch_api import safe_globals
        >>> buf = io.BytesIO()
        >>> torch.save(collections.OrderedDict(a=1), buf)
        >>> with safe_globals([collections.OrderedDict]):
        ...     _ = buf.seek(0)
        ...     dict(torch.load(buf, weights_only=True))
        {'a': 1}
    """
    import torch.serialization as ser

    with _SAFE_GLOBALS_LOCK, ser.safe_globals(list(objects)):
        yield


def unsafe_globals_in_checkpoint(file: str) -> list[str]:
    """The globals of a torch zip file that ``weights_only`` refuses.

    Examples:
        >>> import tempfile, torch
        >>> from dsdmerge._torch_api import unsafe_globals_in_checkpoint
        >>> with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        ...     torch.save({"w": torch.zeros(1)}, f.name)
        ...     unsafe_globals_in_checkpoint(f.name)
        []
    """
    import torch.serialization as ser

    return sorted(ser.get_unsafe_globals_in_checkpoint(file))


def weights_only_allowed_globals() -> set[str]:
    """``module.Name`` of every global torch's weights-only unpickler admits now.

    Private (``torch._weights_only_unpickler``); an empty set where it is missing, so
    an error message lists every global rather than none.

    Examples:
        >>> from dsdmerge._torch_api import weights_only_allowed_globals
        >>> "torch.Size" in weights_only_allowed_globals()
        True
    """
    try:
        from torch import _weights_only_unpickler as wou

        return set(wou._get_allowed_globals()) | set(wou._get_user_allowed_globals())  # type: ignore[no-untyped-call]
    except (ImportError, AttributeError):  # pragma: no cover - present in torch 2.4 .. 2.15
        return set()


def get_fqns(model: Any, name: str) -> set[str]:
    """DSD's own fqn resolution (``state_dict._get_fqns``, private; torch >= 2.4).

    Examples:
        >>> import torch
        >>> from dsdmerge._torch_api import get_fqns
        >>> get_fqns(torch.nn.Linear(1, 1), "weight")
        {'weight'}
    """
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError as err:  # pragma: no cover - present in torch 2.4 .. 2.15
        raise TorchAPIError(
            f"this torch has no torch.distributed.checkpoint.state_dict._get_fqns ({err}); "
            f"dsdmerge needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}"
        ) from None
    return set(_get_fqns(model, name))


def optimized_module_class() -> type | None:
    """``torch.compile``'s module wrapper class (private ``torch._dynamo``), or None.

    Examples:
        >>> from dsdmerge._torch_api import optimized_module_class
        >>> optimized_module_class().__name__
        'OptimizedModule'
    """
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - torch._dynamo fails to import on some builds
        return None
    return OptimizedModule
