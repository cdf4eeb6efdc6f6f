"""default's storage: safetensors + JSON, loaded and run without torch."""

import subprocess
import sys

import numpy as np

from moestream.policies import POLICIES
from moestream.trace.format import save_trace
from tests.policies.default.common import TOPOLOGY


def test_save_and_load_give_the_same_scores(policy, traces, tmp_path):
    policy.save(tmp_path / "lean")
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "lean")
    for layer in range(TOPOLOGY.num_layers):
        np.testing.assert_array_equal(loaded.predictor.score_rows(traces[1], layer, 1),
                                      policy.predictor.score_rows(traces[1], layer, 1))


LOAD_AND_RUN = """
import sys
from moestream.policies import POLICIES
from moestream.trace.format import load_trace
from moestream.bench.sim.replay import decode_stream
trace = load_trace(sys.argv[2])
policy = POLICIES.create("default", trace.topology, predictor_dir=sys.argv[1])
policy.predictor.score_rows(trace, 2, 1)
it = next(decode_stream(trace))
policy.predictor.begin_iteration(it.ctx)
policy.predictor.observe(it.events[0])
assert policy.predictor.predict(0, 2)
print("torch" in sys.modules)
"""


def test_loading_and_running_import_no_torch(policy, traces, tmp_path):
    policy.save(tmp_path / "lean")
    save_trace(traces[1], tmp_path / "test.npz")
    done = subprocess.run([sys.executable, "-c", LOAD_AND_RUN, str(tmp_path / "lean"), str(tmp_path / "test.npz")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_a_directory_with_an_older_token_memory_asks_to_retrain(policy, tmp_path):
    import pytest
    from safetensors.numpy import load_file, save_file

    from moestream.policies.trained import PredictorFileError

    directory = policy.save(tmp_path / "old")
    tensors = load_file(str(directory / "weights.safetensors"))
    half = len(tensors["memory"]) // 2
    tensors["memory"] = tensors["memory"][:half].astype(np.float16)  # the first token memory's layout
    save_file(tensors, str(directory / "weights.safetensors"))
    with pytest.raises(PredictorFileError, match="retrain"):
        POLICIES.create("default", TOPOLOGY, predictor_dir=directory)


def test_a_directory_without_the_reuse_model_asks_to_retrain(policy, tmp_path):
    import pytest
    from safetensors.numpy import load_file, save_file

    from moestream.policies.trained import PredictorFileError

    directory = policy.save(tmp_path / "old")
    tensors = load_file(str(directory / "weights.safetensors"))
    del tensors["reuse"]  # saved before eviction waited by reuse distance
    save_file(tensors, str(directory / "weights.safetensors"))
    with pytest.raises(PredictorFileError, match="reuse model is none.*retrain"):
        POLICIES.create("default", TOPOLOGY, predictor_dir=directory)


def test_the_token_memory_is_a_map_of_the_file_and_the_rest_is_read(policy, tmp_path):
    import mmap

    policy.save(tmp_path / "lean")
    loaded = POLICIES.create("default", TOPOLOGY, predictor_dir=tmp_path / "lean").predictor
    np.testing.assert_array_equal(loaded.memory, policy.predictor.memory)
    assert isinstance(_buffer_owner(loaded.memory), mmap.mmap)
    assert not isinstance(_buffer_owner(loaded.weights.dense), mmap.mmap)


def _buffer_owner(array):
    while isinstance(getattr(array, "base", None), np.ndarray):
        array = array.base
    return array.base if array.base is not None else array


def test_a_truncated_weights_file_is_named(policy, tmp_path):
    import pytest

    from moestream.policies.trained import PredictorFileError

    directory = policy.save(tmp_path / "cut")
    weights = directory / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(PredictorFileError, match="weights.safetensors"):
        POLICIES.create("default", TOPOLOGY, predictor_dir=directory)


def test_the_first_directory_of_the_policys_kind_is_the_one_that_matches(policy, tmp_path):
    from moestream.policies.trained import load_matching, matching_directory

    policy.save(tmp_path / "lean")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "predictor.json").write_text('{"format_version": 1, "kind": "fmoe"}')
    directories = [tmp_path / "other", tmp_path / "lean"]
    assert matching_directory(policy, directories) == tmp_path / "lean"
    assert matching_directory(POLICIES.create("lru", TOPOLOGY), directories) is None
    fresh = POLICIES.create("default", TOPOLOGY)
    assert load_matching(fresh, directories) == tmp_path / "lean" and fresh.predictor.is_trained
