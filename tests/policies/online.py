"""A predictor wrapper that hides a predictor's whole-trace scoring, so that evaluation goes
through the online hooks (begin_iteration, observe, end_sequence, predict)."""

from moestream.contracts import Predictor


class OnlineOnly(Predictor):
    def __init__(self, inner):
        super().__init__(inner.topology)
        self.inner = inner

    def begin_iteration(self, ctx):
        self.inner.begin_iteration(ctx)

    def observe(self, event):
        self.inner.observe(event)

    def end_sequence(self, seq_id):
        self.inner.end_sequence(seq_id)

    def predict(self, layer_now, horizon_layers):
        return self.inner.predict(layer_now, horizon_layers)
