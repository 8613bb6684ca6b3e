"""Pausing the cyclic garbage collector while many acyclic containers are built.

Reading a DCP ``.metadata`` of 661k keys and compressing 661k keys into patterns both
build hundreds of thousands of tuples, lists and dicts that hold no cycles. The
collector's passes during such a build find nothing to free, but each traverses
everything built so far: at DeepSeek-V3 scale they are most of the time spent
(``compress`` of 661k keys: about 45% of it). Reference counting still frees every
temporary at once.

The rule: the pause changes nothing anyone else sets. It never calls ``gc.disable()``
or ``gc.enable()`` (a trainer that disables the collector and collects by hand keeps
exactly its own setting, whatever it does while a pause runs); it sets the first
generation's threshold to 0, which stops automatic collections only (``gc.collect()``
still works), and when the last overlapping pause ends, puts back the thresholds it
found, unless someone set other thresholds meanwhile (theirs stay). Overlapping pauses
in several threads share one pause, counted under a lock. An exception anywhere in a
pause (a ``KeyboardInterrupt`` from a signal, at any point of starting or ending it)
leaves the thresholds as if the pause had not begun: at once when it lands in this
module's code (ending is idempotent and is done again if interrupted), or, when it lands
in ``contextlib``'s frames around the pause, as soon as the exception is released (the
traceback holds the pause's generator until then; closing it ends the pause). Only a
second interrupt while one is being handled in the pause's clean-up can leave it on;
the next pause then puts the thresholds back.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_LOCK = threading.Lock()
_pausers: set[object] = set()  # the pauses running now, by token (changed under _LOCK)
_saved: tuple[int, ...] | None = None  # the thresholds the first of them found and changed


def _start(token: object) -> None:
    global _saved
    with _LOCK:
        if not _pausers:
            found = gc.get_threshold()
            if found[0] != 0:  # 0: automatic collections are off already: nothing to pause
                _saved = found
                gc.set_threshold(0, *found[1:])
        _pausers.add(token)


def _stop(token: object) -> None:
    """End ``token``'s pause; idempotent, so that an interrupted call can be made again."""
    global _saved
    with _LOCK:
        _pausers.discard(token)
        if _pausers or _saved is None:
            return
        if gc.get_threshold() == (0, *_saved[1:]):  # still the pause's own: put back the found
            gc.set_threshold(*_saved)
        _saved = None  # after the restore: an interrupt before this line is made good again


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause automatic collections for a block that builds only acyclic objects.

    Changes no setting of anyone else's (see the module docstring): not
    ``gc.isenabled()``, and thresholds set by others while it runs are kept.

    Examples:
        >>> import gc
        >>> from dsdmerge._gc import gc_paused
        >>> before = gc.get_threshold()
        >>> with gc_paused():
        ...     gc.get_threshold()[0]
        0
        >>> gc.get_threshold() == before
        True
    """
    token = object()
    try:  # everything after this line is undone by the finally, wherever it is interrupted
        _start(token)
        yield
    finally:
        interrupt: BaseException | None = None
        while True:  # an interrupt while the pause ends: end it again, then raise that
            try:
                _stop(token)
                break
            except BaseException as err:  # noqa: BLE001 - KeyboardInterrupt and kin
                interrupt = err
        if interrupt is not None:
            raise interrupt
