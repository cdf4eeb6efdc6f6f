from pathlib import Path

import torch

from moestream.checkpoint.layout import ExpertIndex, ExpertLocation, PartView, Segment
from moestream.topology import ExpertKey, Topology

K = ExpertKey
F = Path("shard.safetensors")


def index_of(*segment_lists, dtype=torch.bfloat16):
    layout = (PartView("gate_up_proj", (4, 1024), dtype, 0),)
    locations = {K(0, e): ExpertLocation(K(0, e), tuple(Segment(F, o, n) for o, n in segs))
                 for e, segs in enumerate(segment_lists)}
    return ExpertIndex(Topology((1,), len(segment_lists), 1, 8192), locations, layout)


def test_residue_makes_the_most_bytes_congruent_to_their_file_offsets():
    index = index_of([(4096 * 5 + 72, 8192)],  # one part
                     [(4096 * 9 + 200, 4096), (4096 * 3 + 200, 4096)],  # two parts in swapped order
                     [(100, 4000), (50_000, 4192)])  # no placement suits both parts: the larger wins
    assert index.residue(K(0, 0), 4096) == 72
    assert index.residue(K(0, 1), 4096) == 200
    assert index.residue(K(0, 2), 4096) == (50_000 - 4000) % 4096


def test_residue_never_misaligns_a_view():
    assert index_of([(4096 + 6, 8192)], dtype=torch.float32).residue(K(0, 0), 4096) == 0  # 6 % 4 != 0
    assert index_of([(4096 + 6, 8192)], dtype=torch.bfloat16).residue(K(0, 0), 4096) == 6
