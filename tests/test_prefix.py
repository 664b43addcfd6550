"""The prefix store's bookkeeping of a unified KV cache: shared cells counted once, freed when the
last sequence holding them lets go, longest prefixes found, least recently used evicted first.
(That the bookkeeping equals llama.cpp's own is checked on a real context in test_engine.py.)"""

from __future__ import annotations

from ctxq.runtime.prefix import PrefixStore
from ctxq.runtime.text import TextStream

DOC = list(range(100, 200))  # 100 tokens


def test_a_fork_shares_its_cells_and_the_last_holder_frees_them():
    st = PrefixStore(4)
    st.append(0, DOC)
    st.fork(0, 1, 100)
    st.append(1, [1, 2, 3])
    st.fork(0, 2, 60)
    st.append(2, [7] * 5)
    assert st.cells_used() == 100 + 3 + 5
    assert st.cells_shared() == 100  # cells 0..59 are held thrice, 60..99 twice: each counted once
    assert st.cells_freed_by(0) == 0  # 1 holds all of 0's cells
    st.clear(0)
    assert st.cells_used() == 108
    assert st.cells_freed_by(1) == 40 + 3  # 2 still holds the first 60
    st.clear(1)
    assert st.cells_used() == 65
    assert st.cells_shared() == 0


def test_truncate_then_append_does_not_reuse_cells_another_sequence_holds():
    st = PrefixStore(2)
    st.append(0, DOC)
    st.fork(0, 1, 80)
    st.truncate(0, 50)  # cells 50..79 stay (1 holds them), 80..99 are freed
    assert st.cells_used() == 80
    st.append(0, [5] * 10)  # new cells, not 50..59
    assert st.cells_used() == 90
    assert st.slots[0].tokens == DOC[:50] + [5] * 10


def test_a_sequence_grows_its_own_run_in_place():
    st = PrefixStore(2)
    for t in DOC:
        st.append(0, [t])
    assert len(st.slots[0].segments) == 1
    assert st.cells_used() == 100


def test_match_finds_the_longest_prefix_and_whole_only_for_recurrent_state():
    st = PrefixStore(3)
    st.append(0, DOC[:40])
    st.append(1, DOC + [1, 2])
    assert st.match(DOC + [9]) == (1, 100)
    assert st.match(DOC + [9], limit=70) == (1, 70)
    # recurrent: only a sequence whose every token is a prefix of the request
    assert st.match(DOC + [9], whole=True) == (0, 40)
    assert st.match([5, 6]) == (None, 0)


def test_match_prefers_an_idle_sequence_among_equals():
    st = PrefixStore(3)
    st.append(0, DOC)
    st.slots[0].busy = True
    st.fork(0, 1, 100)
    assert st.match(DOC + [1])[0] == 1


def test_least_recently_used_idle_sequence_goes_first():
    st = PrefixStore(4)
    for i in range(3):
        st.append(i, [i] * 10)
        st.touch(i)
    st.touch(0)  # 0 is now the most recent
    st.slots[1].busy = True  # never evicted while busy
    assert st.lru_idle() == 2
    assert st.lru_idle(exclude={2}) == 0
    assert st.free_slot() == 3


def test_text_stream_holds_back_a_stop_string_and_a_split_character():
    ts = TextStream(["END"])
    assert ts.feed(b"hello E") == "hello "  # "E" may start END
    assert ts.feed(b"x \xe2\x82") == "Ex "  # the euro sign is not whole yet
    assert ts.feed(b"\xac EN") == "\u20ac "
    assert ts.feed(b"D and more") == ""
    assert ts.stopped and ts.text == "hello Ex \u20ac "
    ts2 = TextStream(["END"])
    ts2.feed(b"an EN")
    assert ts2.finish() == "EN"  # the end came first: what was held back is shown
