"""The token grammar of the DCP ``.metadata`` reader is read the same by every Python >= 3.11.

Its runs of tokens are possessive repetitions (``(?:...)*+``: constant memory per run).
CPython 3.11.0 to 3.11.4 go on from where a failed attempt stopped instead of where it
began, so each run ends with an alternative that never matches (``|(?!)``). These tests
state what the runs must do on any Python: end where the greedy run ends (the two are
the same language, and nothing after a run can fail, so a greedy run never backtracks),
read every corpus file in one pass, and take bounded memory and time on a run of
millions of tokens.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import hostile_files as hf
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dsdmerge as dm
from dsdmerge.integrations import _dcp_metadata as dcp_md

CORPUS = Path(__file__).resolve().parent / "corpus"
FILES = sorted(CORPUS.glob("*/*/.metadata"))
# the greedy reference: the same alternatives, no possessive run, no last resort
GREEDY_GRAMMAR = re.compile(rb"(?:" + dcp_md._TOKEN_ALTS + rb")*", re.DOTALL)
GREEDY_EVENTS = re.compile(
    dcp_md._EVENTS.pattern.replace(dcp_md._LAST_RESORT + rb")*+)", rb")*)"), re.DOTALL
)


def test_the_reference_patterns_differ_from_the_readers_only_in_the_run():
    assert len(FILES) >= 40, FILES
    assert GREEDY_EVENTS.pattern != dcp_md._EVENTS.pattern
    assert GREEDY_EVENTS.pattern.count(rb")*)") == 1


@pytest.mark.parametrize(
    ("data", "end", "refused"),
    [
        (b"N)\x94.", 1, b")"),  # CLOSE's lookahead fails after the ")" is read
        (b"K\x01\x8c\x05ab", 2, b"\x8c"),  # a string cut short
        (b"N\x8a\x0b" + bytes(11), 1, b"\x8a"),  # an int longer than any DCP writes
        (b"K\x01ua\x94\x94", 3, b"a"),  # APPENDS then MEMOIZE twice
        (b"N\x86\x94\x85\x94.", 1, b"\x86"),  # a tuple opcode on a tuple
    ],
)
def test_a_run_ends_where_the_token_it_refuses_starts(data, end, refused):
    assert dcp_md._GRAMMAR.match(data).end() == end
    parts = dcp_md._EVENTS.split(data)
    assert parts[1] == data[:end]
    assert parts[2:6] == [None, None, None, refused]


def test_the_import_time_self_check_passes_here_and_catches_a_misread_grammar():
    assert dcp_md._GRAMMAR_FAULT is None
    assert dcp_md._grammar_fault(dcp_md._GRAMMAR, dcp_md._EVENTS) is None
    # a run that swallows what it cannot read, as 3.11.0-3.11.4 do without the last resort
    swallowing = re.compile(rb"(?:" + dcp_md._TOKEN_ALTS + rb"|.)*", re.DOTALL)
    assert "ends a run" in dcp_md._grammar_fault(swallowing, dcp_md._EVENTS)
    events = re.compile(dcp_md._EVENTS.pattern.replace(rb")*+)", rb"|[^\x94])*+)", 1), re.DOTALL)
    assert "splits" in dcp_md._grammar_fault(dcp_md._GRAMMAR, events)


def test_a_python_whose_re_misreads_the_grammar_reads_no_dcp_metadata(monkeypatch):
    data = FILES[0].read_bytes()
    monkeypatch.setattr(dcp_md, "_GRAMMAR_FAULT", "ends a run of b'N)' at 2, not 1")
    with pytest.raises(dm.CheckpointReadError, match=r"on Python 3\.\d+\.\d+.*3\.11\.5") as err:
        dcp_md.load_metadata(data, where="ckpt/.metadata")
    assert err.value.path == "ckpt/.metadata"


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_every_corpus_file_passes_the_grammar_in_one_pass(path):
    data = path.read_bytes()
    assert dcp_md._GRAMMAR.match(data, 2).end() == len(data)
    parts = dcp_md._EVENTS.split(data[2:])
    assert not any(parts[0::6]), "a gap between two matches"
    assert parts[5::6].count(None) == len(parts) // 6, "a refused token"
    # the one-pass rewrite, not the careful scan (which _Misaligned sends it to)
    dcp_md._rewrite([data[:2], data[2:]], frames=dcp_md._frames(data))


SPECIAL = b")\x94\x8c\x8a\x85\x86\x87t]}Nuesab\x95(cRK"


@st.composite
def mutated_metadata(draw):
    data = bytearray(draw(st.sampled_from(FILES)).read_bytes())
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["set", "cut", "insert"]))
        if kind == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at : at + draw(st.integers(1, 24))]
        else:
            data[at:at] = draw(
                st.binary(max_size=4) | st.lists(st.sampled_from(SPECIAL), max_size=4).map(bytes)
            )
    return bytes(data[: draw(st.integers(0, len(data)))])


@given(mutated_metadata(), st.data())
def test_the_possessive_runs_are_the_greedy_runs(stream, data):
    """Law: on any input, from any position, a run ends where the greedy run ends, and the
    split into runs and events is the greedy split."""
    pos = data.draw(st.integers(0, len(stream)))
    assert dcp_md._GRAMMAR.match(stream, pos).end() == GREEDY_GRAMMAR.match(stream, pos).end()
    assert dcp_md._EVENTS.split(stream) == GREEDY_EVENTS.split(stream)


LONG_RUN = textwrap.dedent(
    """
    import sys, time
    import hostile_files as hf
    from dsdmerge.integrations import _dcp_metadata
    import dsdmerge as dm
    data = open(sys.argv[1], "rb").read()
    hf.limit_memory(256 << 20)
    start = time.perf_counter()
    try:
        _dcp_metadata.load_metadata(data, where="long run")
    except dm.UnsafeCheckpointError as err:
        cause = err
        while cause is not None:
            assert not isinstance(cause, MemoryError), err
            cause = cause.__cause__ or cause.__context__
        print(str(err).splitlines()[0][:300])
    print("seconds", time.perf_counter() - start)
    """
)


@pytest.mark.parametrize("token", [b"N", b"K\x01", b")a"])
def test_a_run_of_millions_of_tokens_costs_bounded_memory_and_time(tmp_path, token):
    """8 MiB of one-token-long opcodes, then one DCP never writes: both grammar passes
    run over all of it before refusing. A greedy or atomic run would keep ~140 bytes of
    the regex engine's stack per token (over 1 GiB); the possessive run keeps none."""
    data = b"\x80\x04" + token * ((8 << 20) // len(token)) + b"B\x00\x00\x00\x00"
    path = tmp_path / "long.metadata"
    path.write_bytes(data)
    env = {**os.environ, "PYTHONPATH": f"{hf.ROOT}{os.pathsep}{hf.ROOT / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, "-c", LONG_RUN, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refusal, seconds = proc.stdout.strip().splitlines()
    assert "BINBYTES" in refusal, refusal
    assert float(seconds.split()[1]) < 60, (refusal, seconds)
