"""The results figure is a PNG written in place."""

from moestream.bench.tools.plots import plot_results


def test_plot_writes_a_png(tmp_path):
    results = {
        name: {ratio: {"hit_rate": ratio * k, "per_layer_hit_rate": [ratio * k] * 4} for ratio in (0.1, 0.25)}
        for k, name in ((1.0, "lru"), (2.0, "oracle"))
    }
    path = plot_results(results, tmp_path / "out" / "hits.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["hits.png"]
