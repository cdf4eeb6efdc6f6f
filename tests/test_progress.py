"""Progress bars: plain whole lines when the stream is not a terminal."""

import io

from moestream.progress import LineWriter, progress_bar


def test_a_bar_writes_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    for _ in progress_bar(range(4), stream=stream, desc="replay", mininterval=0):
        pass
    text = stream.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and "\x1b" not in text
    assert lines and all(line.startswith("replay:") for line in lines) and "4/4" in lines[-1]


def test_the_line_writer_drops_cursor_escapes_and_blank_redraws():
    stream = io.StringIO()
    writer = LineWriter(stream)
    writer.write("\r\x1b[Aa: 10%   ")
    writer.write("\r      ")
    writer.write("\rb: 20%\n")
    assert stream.getvalue() == "a: 10%\nb: 20%\n"
