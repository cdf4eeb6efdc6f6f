"""Progress bars: plain whole lines when the stream is not a terminal."""

import io

from moestream.progress import DeferredBar, LineWriter, progress_bar


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


def test_a_deferred_bar_draws_nothing_until_its_total_is_known():
    stream = io.StringIO()
    with DeferredBar(stream=stream, desc="verify", mininterval=0) as bar:
        bar.update(5)  # before start: nothing to draw against
    assert stream.getvalue() == ""
    with DeferredBar(stream=stream, desc="verify", mininterval=0) as bar:
        bar.start(8)
        bar.update(4)
        bar.update(4)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("verify:   0%") and "0/8" in lines[0] and "8/8" in lines[-1]
    assert all("/8" in line for line in lines)


def test_commands_draw_no_cursor_escapes_into_a_log(tmp_path):
    """make-model and generate with stderr in a file: plain lines only (transformers' own bars too)."""
    import subprocess
    import sys

    model = tmp_path / "model"
    runs = [["make-model", "mixtral", "--out", str(model)],
            ["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--buffered-io"]]
    for args in runs:
        done = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "\r" not in done.stderr and "\x1b" not in done.stderr and done.stderr.strip()
