"""moestream: serve Mixture-of-Experts models whose experts live on SSD and in host RAM. `LLM` and
`SamplingParams` are imported on first use, so that `import moestream` stays light."""

__version__ = "0.1.0"

_LAZY = {"LLM": "moestream.serving.llm", "SamplingParams": "moestream.serving.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
