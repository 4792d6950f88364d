"""The HF server's text stream, on a byte-level stand-in tokenizer (one token per UTF-8 byte, as byte-level BPE
splits a character it has no token for)."""
from steer.serve.hf_app import TextStream


def _decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: bytes, stops=()):
    s = TextStream(_decode, list(stops))
    pieces = [s.push(b) for b in text]
    return s, pieces + [s.finish()]


def test_pieces_never_split_a_character_and_add_up_to_the_text():
    s, pieces = _stream("sun 🌇 and 🌈".encode())
    assert "".join(pieces) == s.text() == "sun 🌇 and 🌈"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[4:7] == ["", "", ""] and pieces[7] == "🌇"  # the emoji's four bytes: sent once, whole


def test_a_last_character_cut_short_is_left_out_as_vllm_leaves_it_out():
    s, pieces = _stream("🌇🌈".encode()[:-2])  # max_tokens ran out two bytes into the rainbow
    assert s.text() == "🌇" and "".join(pieces) == "🌇"


def test_the_text_ends_before_the_first_stop_string_and_no_piece_sends_its_start():
    s, pieces = _stream(b"one. END two. END", stops=["END", "ZZZ"])
    assert s.stopped and s.text() == "one. " and "".join(pieces) == "one. "
    s, pieces = _stream(b"one. EN", stops=["END"])  # a stop's start that never completes is text after all
    assert not s.stopped and "".join(pieces) == s.text() == "one. EN"
    assert pieces[-3:-1] == ["", ""] and pieces[-1] == "EN"
