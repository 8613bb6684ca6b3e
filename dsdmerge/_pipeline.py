"""One merge, from the options to the result: the steps every entry point shares.

:func:`run` takes the two state dicts and a validated
:class:`~dsdmerge._options.MergeOptions` and goes, in order: both sides in one spelling
of their int keys (:mod:`dsdmerge._ids`), the checkpoint renamed then converted, the
engine's comparison (and merge) (:mod:`dsdmerge._engine`), the pipeline's own findings
(tensors that cannot be resized, resizes over budget), the suggested renames, the
verdict (:mod:`dsdmerge._verdict`: raise or warn), and then what the verdict let
through done: reshaped tensors resized or taken from the reference, fresh state left
out with ``fresh="as_fresh"``, module metadata carried. :func:`verdict` is the same
comparison without renames, suggestions or a merge, for a metadata-only view.

``stacklevel`` here is as for ``warnings.warn``, counted from the caller of the
function that takes it: 1 names the caller, 2 the caller's caller. Each public
function passes the one number that names its own caller's line.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from dsdmerge._engine import run as compare
from dsdmerge._ids import one_spelling
from dsdmerge._options import MergeOptions
from dsdmerge._records import KeyDiff, Outcome
from dsdmerge._trees import holds_value
from dsdmerge._verdict import Finding, judge, reshaped, unmatched_rename, unresizable
from dsdmerge.convert import Conversions, convert_checkpoint
from dsdmerge.diff import suggest
from dsdmerge.errors import MergeError
from dsdmerge.flatten import split_param_key
from dsdmerge.layout import (
    PARAM_GROUPS,
    PARAMS,
    PG_PREFIX,
    STATE,
    STATE_PREFIX,
    Layout,
    classify,
    is_optimizer_state_dict,
    optimizer_sections,
)
from dsdmerge.policy import Action, Policy
from dsdmerge.rename import Rule, Rules, compile_rules, renamed
from dsdmerge.resize import OnShapeMismatch, Resized, held_nbytes, resize, resize_nbytes

__all__ = ["Merged", "run", "surgery", "verdict"]


class Merged(NamedTuple):
    """The result of :func:`~dsdmerge.merge_with_diff`: the merged state dict and what differed.

    Attributes:
        state_dict: The merged state dict, in the checkpoint's layout.
        diff: The :class:`~dsdmerge.KeyDiff` of checkpoint against reference.
        conflicts: One line per param group whose checkpoint members disagree on
            a hyperparameter (looked for only when the policy's ``conflict``
            action is not ``"ignore"``).
    """

    state_dict: dict[Any, Any]
    diff: KeyDiff
    conflicts: tuple[str, ...] = ()


def run(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    options: MergeOptions,
    /,
    *,
    stacklevel: int,
    merge: bool = True,
) -> Merged:
    """Merge ``checkpoint`` over ``reference`` as ``options`` say (see the module docstring).

    With ``merge=False`` nothing is merged (either side may be a metadata-only view;
    ``"resize"`` is checked for ranks only) and ``state_dict`` is empty: what
    :func:`~dsdmerge.check` does. Does not modify its inputs.
    """
    policy = options.policy
    checkpoint, reference = one_spelling(checkpoint, reference)
    findings: list[Finding] = []
    if options.rename is not None or options.convert is not None:
        checkpoint, findings = surgery(
            checkpoint,
            policy,
            rename=options.rename,
            convert=options.convert,
            stacklevel=stacklevel + 1,
        )
    outcome = compare(
        checkpoint,
        reference,
        merge=merge,
        keep_unexpected=not (merge and policy.drop_unexpected),  # a comparison keeps all
        conflicts=policy.conflict != "ignore",
    )
    shapes = options.on_shape_mismatch
    if shapes == "resize":
        findings += unresizable(outcome, metadata_only=not merge)
        if merge and all(f.action != "raise" for f in findings):
            findings += _resize_budget(outcome, checkpoint, reference, options.max_resize_bytes)
    renames = (  # a rename needs a missing key and an unexpected one
        suggest(checkpoint, reference, outcome.missing, outcome.unexpected)
        if outcome.missing and outcome.unexpected
        else ()
    )
    diff, conflicts = judge(
        outcome,
        policy,
        stacklevel=stacklevel + 2,
        findings=findings,
        on_shape_mismatch=shapes,
        renames=renames,
        reference=reference,
    )
    if not merge:
        return Merged({}, diff, conflicts)
    return _carried_out(outcome, diff, conflicts, checkpoint, reference, options)


def verdict(
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    policy: Policy | MergeOptions,
    *,
    stacklevel: int,
    findings: Sequence[Finding | tuple[Action, str]] = (),
    on_shape_mismatch: OnShapeMismatch | None = None,
) -> KeyDiff:
    """The policy's verdict on the differences, without merging (warnings at ``stacklevel``).

    Like :func:`~dsdmerge.check` without renames (neither applied nor suggested):
    either side may be a metadata-only view. ``findings``: more findings to report
    with the others (as :func:`surgery` returns them); ``on_shape_mismatch``: as for a
    merge, ``"resize"`` checked for ranks only (by default the options', or
    ``"raise"``). Raises :class:`~dsdmerge.MergeError` when the policy rejects a
    difference. Does not modify its inputs.
    """
    if isinstance(policy, MergeOptions):
        shapes = on_shape_mismatch or policy.on_shape_mismatch
        policy = policy.policy
    else:
        shapes = on_shape_mismatch or "raise"
    checkpoint, reference = one_spelling(checkpoint, reference)
    outcome = compare(checkpoint, reference, merge=False, conflicts=policy.conflict != "ignore")
    found = list(findings)
    if shapes == "resize":
        found += unresizable(outcome, metadata_only=True)
    return judge(
        outcome,
        policy,
        stacklevel=stacklevel + 2,
        findings=found,
        on_shape_mismatch=shapes,
        reference=reference,
    )[0]


def surgery(
    checkpoint: Mapping[Any, Any],
    policy: Policy,
    *,
    rename: Rules | tuple[Rule, ...] | None,
    convert: Conversions | None,
    stacklevel: int,
    quiet: bool = False,
) -> tuple[Mapping[Any, Any], list[Finding]]:
    """``checkpoint`` renamed, then converted (each if given), and the findings about it.

    What ``rename=`` and ``convert=`` of :func:`~dsdmerge.merge` and
    :func:`~dsdmerge.check` do to the checkpoint side (a view is renamed and converted
    by shape, without reading any tensor); the findings (rename rules that matched
    nothing) go to the verdict. ``quiet``: no conversion warnings (a second pass over
    data whose view was converted already). Does not modify its input.
    """
    findings: list[Finding] = []
    if rename is not None:
        checkpoint, missed, example = renamed(checkpoint, compile_rules(rename))
        findings += unmatched_rename(policy.unmatched_rename, missed, example)
    if convert is not None:
        checkpoint = convert_checkpoint(checkpoint, convert, stacklevel=stacklevel + 2, quiet=quiet)
    return checkpoint, findings


def _carried_out(
    outcome: Outcome,
    diff: KeyDiff,
    conflicts: tuple[str, ...],
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    options: MergeOptions,
) -> Merged:
    """What the verdict let through, done: the reshaped tensors, fresh state, metadata."""
    resized: list[Resized] = []
    put: dict[str, Any] = {}  # what each reshaped key holds now
    for m in diff.mismatched:
        if not reshaped(m):  # a 0-d against a 1-element tensor keeps the checkpoint's
            continue
        slot = outcome.take_reference[m.key]
        if options.on_shape_mismatch == "resize":  # each new tensor made once, checkpoint's dtype
            try:
                put[m.key] = resize(slot.checkpoint, slot.reference, dtype=slot.checkpoint.dtype)
            except MergeError as err:  # allocating it failed
                raise MergeError(f"{m.key!r}: {err}", diff=diff) from err
            slot.put(put[m.key])
            resized.append(Resized.from_mismatch(m))
        else:  # not raised: torch would reject the checkpoint's tensor
            put[m.key] = slot.reference
            slot()
    for _, source, put_tied in outcome.ties:  # a tied key holds what its key holds
        if source in put:
            put_tied(put[source])
    if resized:
        diff = dataclasses.replace(diff, resized=tuple(resized))
    assert outcome.merged is not None
    merged = outcome.merged
    if options.fresh == "as_fresh" and diff.missing:
        merged = _without_fresh_state(merged, checkpoint, diff.missing)
    return Merged(_with_metadata(merged, checkpoint, reference), diff, conflicts)


def _resize_budget(
    outcome: Outcome,
    checkpoint: Mapping[Any, Any],
    reference: Mapping[Any, Any],
    max_bytes: int | None,
) -> list[Finding]:
    """A finding (raised) when the resizes would take more bytes than allowed.

    Allowed: ``max_bytes``, else the bytes the checkpoint's and the reference's tensors
    hold, the reference's counted in the widest dtype a resize makes from it (a resize
    keeps the checkpoint's dtype: a bfloat16 reference grown into a float64 checkpoint
    tensor takes four times its bytes). So a reference of a few bytes, an expanded
    tensor claiming any shape, cannot make a merge allocate more than a small multiple
    of what its inputs take.
    """
    needs: dict[str, int] = {}
    widen = 1.0  # the largest (result itemsize / reference itemsize) among the resizes
    for m in outcome.mismatches:
        if reshaped(m):
            slot = outcome.take_reference[m.key]
            dtype = slot.checkpoint.dtype
            needs[m.key] = resize_nbytes(slot.checkpoint, slot.reference, dtype=dtype)
            widen = max(widen, dtype.itemsize / slot.reference.element_size())
    total = sum(needs.values())
    if not total:
        return []
    allowed = (
        max_bytes
        if max_bytes is not None
        else held_nbytes(checkpoint, reference) + int((widen - 1) * held_nbytes(reference))
    )
    if total <= allowed:
        return []
    worst = max(needs, key=needs.__getitem__)
    whose = (
        "max_resize_bytes"
        if max_bytes is not None
        else "the bytes the checkpoint's and the reference's tensors hold"
    )
    detail = (total, allowed, whose, worst, needs[worst])
    return [Finding("resize_budget", "raise", tuple(needs), detail)]


def _without_fresh_state(
    merged: dict[Any, Any], checkpoint: Mapping[Any, Any], missing: Sequence[str]
) -> dict[Any, Any]:
    """``merged`` without the backfilled state of parameters the checkpoint has no state for.

    Nested optimizer state dicts (also inside whole checkpoints) lose those
    parameters' entries; flat ones their ``state.<fqn>.*`` keys. A checkpoint entry
    that holds no value (schedulefree's ``{}``, heavyball's ``{0: {}}``: made for a
    parameter that never got a gradient) is no state either: it is kept as it is, with
    nothing backfilled into it (heavyball's schedule-free step turns a zero-gradient
    step's state next to the checkpoint's step counters into NaN).
    """
    if classify(merged) is Layout.FLAT:
        return _flat_without_fresh_state(merged, checkpoint, missing)
    out = dict(merged)
    stack: list[tuple[dict[Any, Any], Any, str]] = [(out, checkpoint, "")]
    while stack:
        node, c_node, prefix = stack.pop()
        if is_optimizer_state_dict(node):
            c_state = c_node.get(STATE) if isinstance(c_node, Mapping) else None
            c_state = c_state if isinstance(c_state, Mapping) else {}
            members = {
                pid
                for g in node[PARAM_GROUPS]
                if isinstance(g, Mapping)
                for pid in g.get(PARAMS, ())
                if isinstance(pid, (int, str))
            }
            node[STATE] = {
                pid: (c_state[pid] if _hollow(c_state[pid]) else entry) if pid in c_state else entry
                for pid, entry in node[STATE].items()
                if pid in c_state or pid not in members
            }
            continue
        for k, v in node.items():
            if not isinstance(v, dict):
                continue
            c_child = c_node.get(k) if isinstance(c_node, Mapping) else None
            key = f"{prefix}{k}."
            if classify(v) is Layout.FLAT:  # a flattened optimizer inside a whole checkpoint
                if isinstance(c_child, Mapping):
                    sub = [m[len(key) :] for m in missing if m.startswith(key)]
                    node[k] = _flat_without_fresh_state(v, c_child, sub) if sub else v
                continue
            child = dict(v)
            node[k] = child
            stack.append((child, c_child, key))
    return out


def _hollow(entry: Any) -> bool:
    """Whether a state entry is mappings all the way down, without one value."""
    return isinstance(entry, Mapping) and not holds_value(entry)


def _flat_without_fresh_state(
    merged: dict[Any, Any], checkpoint: Mapping[Any, Any], missing: Sequence[str]
) -> dict[Any, Any]:
    """``merged`` without the backfilled ``P state.<fqn>.*`` keys of stateless parameters.

    Only under the prefixes ``P`` of flattened optimizers, told by their shape
    (:func:`~dsdmerge.layout.optimizer_sections`): a model's module named ``state`` is
    no optimizer state.
    """
    fqns: dict[str, set[str]] = {}  # "<prefix>state." -> the fqns of its param_groups keys
    stateful: dict[str, set[str]] = {}  # "<prefix>state." -> fqns the checkpoint has state for
    heads = [p + STATE_PREFIX for p in optimizer_sections(merged)]
    heads.sort(key=len, reverse=True)  # the longest first: the innermost section
    drop = []
    for key in missing:
        head = next((h for h in heads if key.startswith(h)), None)
        if head is None:
            continue
        if head not in fqns:
            groups = head[: -len(STATE_PREFIX)] + PG_PREFIX
            known = {k[len(groups) :].rpartition(".")[0] for k in merged if k.startswith(groups)}
            known.discard("")
            fqns[head] = known
            longest = max(map(len, known), default=0)
            have = set()
            for k in checkpoint:
                if type(k) is str and k.startswith(head):
                    found = split_param_key(k[len(head) :], known, longest)
                    if found is not None:
                        have.add(found[0])
            stateful[head] = have
        found = split_param_key(key[len(head) :], fqns[head])
        if found is not None and found[0] not in stateful[head]:
            drop.append(key)
    if not drop:
        return merged
    gone = set(drop)
    return {k: v for k, v in merged.items() if k not in gone}


def _with_metadata(
    merged: dict[Any, Any], checkpoint: Mapping[Any, Any], reference: Mapping[Any, Any]
) -> dict[Any, Any]:
    """``merged`` with the ``_metadata`` of module state dicts (the checkpoint's wins).

    ``nn.Module.state_dict()`` returns an ``OrderedDict`` whose ``_metadata``
    attribute holds each module's version, which ``load_state_dict`` passes to the
    modules' load hooks (quantized and older modules need it). A new
    ``OrderedDict`` carries the union; the per-module entries are shared.
    """
    c_meta = getattr(checkpoint, "_metadata", None)
    r_meta = getattr(reference, "_metadata", None)
    if not isinstance(c_meta, Mapping) and not isinstance(r_meta, Mapping):
        return merged
    out: dict[Any, Any] = OrderedDict(merged)
    meta: OrderedDict[Any, Any] = OrderedDict()
    for part in (r_meta, c_meta):
        if isinstance(part, Mapping):
            meta.update(part)
    out._metadata = meta  # type: ignore[attr-defined]
    return out
