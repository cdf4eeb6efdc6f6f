"""The recall channels of the `default` routing model, registered by name in CHANNELS: each picks the
stored routing rows a token recalls. Every channel is weighed and recalled alike (`recall.py`), in
training, in whole-trace scoring and online; a channel only picks the rows.

- "recall": the sequence's earlier tokens (its last WINDOW);
- "repeat": those of them that are the same token (the unknown token repeats nothing);
- "memory": the training prompts' rows of the same token (`memory.py`); while training, a token
  never recalls its own sequence's rows.
ModelConfig turns a channel on with its `use_<name>` flag. Knows arrays; not traces, events or caches.
"""

from __future__ import annotations

import numpy as np

from moestream.policies.default.memory import TokenMemory
from moestream.policies.default.recall import History, Sources, same_token
from moestream.registry import Registry


class Channel:
    """Picks, for n token rows (vocabulary indices tokens [n]; while training their seq_ids [n]),
    the rows each recalls: from the history, or from the model's token memory."""

    def sources(self, history: History, memory: TokenMemory | None, tokens: np.ndarray,
                seq_ids: np.ndarray | None = None) -> Sources:
        raise NotImplementedError


CHANNELS: Registry[Channel] = Registry("recall channel")


@CHANNELS.register("recall")
class InSequence(Channel):
    def sources(self, history, memory, tokens, seq_ids=None):
        return Sources(history.bit_sets, history.experts, history.earlier, history.valid)


@CHANNELS.register("repeat")
class Repeats(Channel):
    def sources(self, history, memory, tokens, seq_ids=None):
        valid = history.valid & same_token(np.asarray(tokens), history.tokens[history.earlier])
        return Sources(history.bit_sets, history.experts, history.earlier, valid)


@CHANNELS.register("memory")
class Memory(Channel):
    def sources(self, history, memory, tokens, seq_ids=None):
        index, valid = memory.rows(tokens, seq_ids)
        return Sources(memory.bit_sets, memory.experts, index, valid)
