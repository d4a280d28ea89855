"""Output token ids → segments (offset by each window's true start, monotone, nothing lost at a cut) → formats."""

from __future__ import annotations

import json

import pytest

from pagedllm.audio.formats import Transcript, render
from pagedllm.audio.segments import WindowResult, join_windows, window_segments
from pagedllm.audio.whisper_tokens import WhisperVocab


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return WhisperVocab.from_tokenizer(tokenizer)


def _ids(tokenizer, vocab, *parts):
    """Build an output: floats are timestamps (seconds), strings are text."""
    out = []
    for p in parts:
        out += [vocab.timestamp_begin + round(p / 0.02)] if isinstance(p, float) else \
            tokenizer.encode(p, add_special_tokens=False)
    return [*out, vocab.eot]


def test_pairs_and_shared_boundaries(tokenizer, vocab):
    ids = _ids(tokenizer, vocab, 0.0, " Hello world.", 1.2, 1.2, " How are you?", 2.5, " Fine.", 3.0)
    segs = window_segments(vocab, tokenizer, ids, start_s=0.0, duration_s=10.0)
    assert [(s.start, s.end, s.text) for s in segs] == [
        (0.0, 1.2, " Hello world."), (1.2, 2.5, " How are you?"), (2.5, 3.0, " Fine.")]
    assert segs[0].tokens[0] == vocab.timestamp_begin and segs[0].tokens[-1] == vocab.timestamp_begin + 60


def test_offsets_clamping_and_text_without_closing_timestamp(tokenizer, vocab):
    # A window starting 29.4 s in, 20 s long; the model's last words run into the cut.
    ids = _ids(tokenizer, vocab, 0.5, " First part.", 25.0, 26.0, " and then it was cut")
    segs = window_segments(vocab, tokenizer, ids, start_s=29.4, duration_s=20.0, window=1)
    assert [(round(s.start, 2), round(s.end, 2), s.text) for s in segs] == [
        (29.9, 49.4, " First part."),  # 25.0 s is past the window's 20 s: clamped to its end
        (49.4, 49.4, " and then it was cut")]  # opened at 26.0 (clamped), ends with the window
    assert all(s.window == 1 for s in segs)


def test_join_never_goes_backwards_and_keeps_every_word(tokenizer, vocab):
    w0 = WindowResult(0.0, 29.5, _ids(tokenizer, vocab, 0.0, " one two", 29.0, 29.0, " three", 29.9))
    w1 = WindowResult(29.5, 10.0, _ids(tokenizer, vocab, 0.0, " four five", 2.0))
    for i, w in enumerate((w0, w1)):
        w.segments = window_segments(vocab, tokenizer, w.token_ids, w.start_s, w.duration_s, i)
    segs = join_windows([w0, w1])
    assert "".join(s.text for s in segs) == " one two three four five"
    starts_ends = [(s.start, s.end) for s in segs]
    assert starts_ends == [(0.0, 29.0), (29.0, 29.5), (29.5, 31.5)]
    assert all(a[1] <= b[0] for a, b in zip(starts_ends, starts_ends[1:]))


def test_no_timestamps_and_eot_only(tokenizer, vocab):
    assert window_segments(vocab, tokenizer, [vocab.eot], 0.0, 5.0) == []
    assert window_segments(vocab, tokenizer, [vocab.timestamp_begin, vocab.timestamp_begin + 5, vocab.eot],
                           0.0, 5.0) == []
    [seg] = window_segments(vocab, tokenizer, _ids(tokenizer, vocab, " plain"), 3.0, 5.0)
    assert (seg.start, seg.end, seg.text) == (3.0, 8.0, " plain")


def _transcript(tokenizer, vocab) -> Transcript:
    w0 = WindowResult(0.0, 29.5, _ids(tokenizer, vocab, 0.0, " Hello world.", 1.5), [-0.1, -0.2, -0.3, -0.2])
    w1 = WindowResult(29.5, 3700.0 - 29.5, _ids(tokenizer, vocab, 0.0, " Bye.", 1.0), None, temperature=0.2)
    for i, w in enumerate((w0, w1)):
        w.segments = window_segments(vocab, tokenizer, w.token_ids, w.start_s, w.duration_s, i)
        w.text = "".join(s.text for s in w.segments)
    return Transcript("transcribe", "english", 3700.0, "Hello world. Bye.", [w0, w1], join_windows([w0, w1]))


def test_formats(tokenizer, vocab):
    t = _transcript(tokenizer, vocab)
    assert render(t, "json") == {"text": "Hello world. Bye.", "usage": {"type": "duration", "seconds": 3700.0}}
    assert render(t, "text") == "Hello world. Bye.\n"
    verbose = render(t, "verbose_json")
    json.dumps(verbose)
    assert {k: verbose[k] for k in ("task", "language", "duration", "text")} == {
        "task": "transcribe", "language": "english", "duration": 3700.0, "text": "Hello world. Bye."}
    s0, s1 = verbose["segments"]
    assert set(s0) == {"id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                       "compression_ratio", "no_speech_prob"}
    assert (s0["id"], s0["seek"], s0["start"], s0["end"], s0["text"]) == (0, 0, 0.0, 1.5, " Hello world.")
    assert (s1["id"], s1["seek"], s1["start"], s1["end"], s1["temperature"]) == (1, 2950, 29.5, 30.5, 0.2)
    assert s0["avg_logprob"] == pytest.approx(-0.8 / 5) and s0["compression_ratio"] > 0
    assert render(t, "srt") == ("1\n00:00:00,000 --> 00:00:01,500\nHello world.\n\n"
                                "2\n00:00:29,500 --> 00:00:30,500\nBye.\n")
    assert render(t, "vtt") == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello world.\n\n"
                                "00:00:29.500 --> 00:00:30.500\nBye.\n")
    with pytest.raises(ValueError, match="response_format"):
        render(t, "xml")


def test_clock_over_an_hour(tokenizer, vocab):
    t = _transcript(tokenizer, vocab)
    t.segments[1].start, t.segments[1].end = 3661.25, 3662.0
    assert "01:01:01,250 --> 01:01:02,000" in render(t, "srt")
