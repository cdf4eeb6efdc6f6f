"""`moestream predict-eval`: a predictor's accuracy and GOODPRED on a trace (the lab's command)."""

from moestream.bench.commands.predict_eval import add_parser

__all__ = ["add_parser"]
