"""The metadata-only view of a checkpoint: every flat key, a tensor's shape and dtype, no data.

A :class:`CheckpointView` is what every reader of
:mod:`dsdmerge.integrations.checkpoints` returns from ``read_metadata``, whatever the
format: a read-only flat mapping of each key (spelled as :func:`dsdmerge.flatten` spells
the loaded checkpoint) to a :class:`~dsdmerge.TensorMeta` for a tensor, with the totals a
report shows (tensor count, bytes, dtypes) computed once. Values a reader did not read
(DCP bytes entries) are one shared placeholder, :data:`UNREAD`, that never compares as a
value.

Internal to :mod:`dsdmerge.integrations`: the class is public as
``dsdmerge.integrations.CheckpointView``; it lives here, below the readers, so that the
DCP reader (:mod:`~dsdmerge.integrations._dcp`) and the format dispatch both build it.
"""

from __future__ import annotations

import collections
import math
import operator
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any, ClassVar, Final

from dsdmerge.diff import TensorMeta, dtype_name
from dsdmerge.integrations._files import CheckpointFormat
from dsdmerge.layout import Layout

__all__ = ["UNREAD", "CheckpointView", "meta_nbytes", "tensor_metas"]


class _Unread:
    """The type of :attr:`CheckpointView.UNREAD`: a non-tensor value that was not read."""

    __slots__ = ()
    __dsdmerge_unread__: ClassVar[bool] = True  # dsdmerge.diff never compares it as a value
    _instance: ClassVar[_Unread | None] = None

    def __new__(cls) -> _Unread:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<not read>"

    def __reduce__(self) -> str:
        return "UNREAD"


UNREAD: Final = _Unread()


# --------------------------------------------------------------------------------------
# the view


class CheckpointView(Mapping[str, Any]):
    """A read-only, flat, metadata-only view of a checkpoint.

    Maps every flat key (as :func:`dsdmerge.flatten` spells the loaded
    checkpoint) to a :class:`~dsdmerge.TensorMeta` for tensors. Non-tensor
    values are the values themselves for torch files (``torch.load`` had to
    read them anyway) and :attr:`UNREAD`, one shared placeholder object, for DCP
    bytes entries, whose values live in the data files. Pass it as the
    ``checkpoint`` (or ``reference``) of :func:`dsdmerge.diff` or
    :func:`dsdmerge.check`.

    Attributes:
        path: The checkpoint path, as a string.
        format: ``"dcp"``, ``"torch"`` or ``"safetensors"``.
        tensor_count: How many tensors the checkpoint holds.
        nbytes: Their total size in bytes, per the metadata: global sizes for
            sharded DCP tensors and for DTensors in a per-rank torch file (what
            the tensors describe, not what this file stores); views sharing a
            storage count once per view.
        dtypes: ``{dtype name: number of tensors}``, e.g. ``{"float32": 10}``.
        layout: The :class:`~dsdmerge.Layout` the checkpoint was saved in (the
            view itself is always flat): nested for a torch file holding
            ``optimizer.state_dict()`` or ``{"model": ..., "optim": ...}``, or a
            DCP directory of nested state; flat for safetensors.
        metadata: The file's own string metadata: a safetensors header's
            ``__metadata__`` (e.g. ``{"format": "pt", "step": "1000"}``); empty for
            other formats. A new dict each time.
        UNREAD: The placeholder for DCP non-tensor values (identical everywhere,
            so two of them always compare equal).

    Examples:
        >>> import tempfile, torch, dsdmerge as dm
        >>> from dsdmerge.integrations import read_metadata
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"w": torch.zeros(2, 3), "epoch": 4}, f"{tmp}/ckpt.pt")
        ...     view = read_metadata(f"{tmp}/ckpt.pt")
        >>> dict(view), view.format, view.nbytes
        ({'w': TensorMeta(shape=(2, 3), dtype=torch.float32), 'epoch': 4}, 'torch', 24)
        >>> view.layout
        <Layout.FLAT: 'flat'>
    """

    __slots__ = (
        "_dtypes",
        "_entries",
        "_format",
        "_layout",
        "_metadata",
        "_nbytes",
        "_path",
        "_tensor_count",
    )

    UNREAD: ClassVar[Any] = UNREAD

    def __init__(
        self,
        entries: dict[str, Any],
        *,
        path: str,
        format: CheckpointFormat,
        layout: Layout = Layout.FLAT,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._entries = entries
        self._metadata = dict(metadata or {})
        self._path = path
        self._format: CheckpointFormat = format
        self._layout = layout
        values = entries.values()
        metas = [v for v in values if type(v) is TensorMeta]  # the common case, in C
        for value in values:
            if type(value) in (list, tuple):
                metas.extend(tensor_metas(value))
        # column by column (a Python statement per tensor costs a tenth of a second at
        # DeepSeek-V3 scale): element counts, then each distinct dtype's item size once
        dtype_of = list(map(operator.attrgetter("dtype"), metas))
        numels = map(math.prod, map(operator.attrgetter("shape"), metas))
        by_dtype = collections.Counter(dtype_of)
        sizes = {d: _itemsize(d) for d in by_dtype}
        self._tensor_count = len(metas)
        self._nbytes: int = sum(map(operator.mul, numels, map(sizes.__getitem__, dtype_of)))
        dtypes: dict[str, int] = {}
        for dtype, n in by_dtype.items():
            name = dtype_name(dtype)
            dtypes[name] = dtypes.get(name, 0) + n
        self._dtypes = dict(sorted(dtypes.items()))

    @property
    def path(self) -> str:
        """The checkpoint path."""
        return self._path

    @property
    def format(self) -> CheckpointFormat:
        """``"dcp"``, ``"torch"`` or ``"safetensors"``."""
        return self._format

    @property
    def layout(self) -> Layout:
        """The layout the checkpoint was saved in (the view itself is flat)."""
        return self._layout

    @property
    def metadata(self) -> dict[str, str]:
        """The file's string metadata (safetensors ``__metadata__``), a new dict each time."""
        return dict(self._metadata)

    @property
    def tensor_count(self) -> int:
        """How many tensors the checkpoint holds."""
        return self._tensor_count

    @property
    def nbytes(self) -> int:
        """Total tensor bytes, per the metadata."""
        return self._nbytes

    @property
    def dtypes(self) -> dict[str, int]:
        """``{dtype name: number of tensors}``, sorted by name (a new dict each time)."""
        return dict(self._dtypes)

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> KeysView[str]:
        """The flat keys, in checkpoint order."""
        return self._entries.keys()

    def values(self) -> ValuesView[Any]:
        """The values (``TensorMeta`` for tensors)."""
        return self._entries.values()

    def items(self) -> ItemsView[str, Any]:
        """``(flat key, value)`` pairs."""
        return self._entries.items()

    def __repr__(self) -> str:
        return (
            f"CheckpointView({self._path!r}, format={self._format!r}, {len(self)} keys, "
            f"{self._tensor_count} tensors, {self._nbytes} bytes)"
        )


def tensor_metas(value: Any) -> Iterator[TensorMeta]:
    """The TensorMetas in ``value`` and in the lists and tuples it holds, at any depth.

    Iterative and cycle-safe: a crafted torch file can hold a 50,000-deep or cyclic list.
    """
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if type(item) is TensorMeta:
            yield item
        elif type(item) in (list, tuple) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(reversed(item))


def _itemsize(dtype: Any) -> int:
    itemsize = getattr(dtype, "itemsize", None)
    return int(itemsize) if isinstance(itemsize, int) else 0


def meta_nbytes(meta: TensorMeta) -> int:
    """The bytes a tensor of this shape and dtype takes (0 for a dtype without an itemsize)."""
    numel = math.prod(meta.shape)
    itemsize = getattr(meta.dtype, "itemsize", None)
    return numel * itemsize if isinstance(itemsize, int) else 0
