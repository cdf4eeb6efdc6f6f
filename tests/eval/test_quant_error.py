"""`compare`'s figures over hand-written logits: top-1 agreement counts a tie in the reference's best logits as
agreed by any of them, and a real disagreement as not; KL and the largest logit error as defined."""

import math

import torch

from moestream.eval.quant_error import compare


def test_a_tie_in_the_reference_is_agreed_by_any_of_its_best_and_a_disagreement_is_not():
    reference = [torch.tensor([[1.0, 3.0, 3.0], [0.0, 2.0, 1.0]], dtype=torch.float64)]  # a tie, then index 1
    tied_other = [torch.tensor([[1.0, 2.9, 3.0], [0.0, 2.0, 1.0]], dtype=torch.float64)]  # the other best: agrees
    wrong = [torch.tensor([[3.5, 3.0, 3.0], [0.0, 1.0, 1.5]], dtype=torch.float64)]  # neither position agrees
    assert compare(reference, tied_other).top1_agreement == 1.0
    assert compare(reference, wrong).top1_agreement == 0.0
    assert compare(reference, reference).mean_kl == 0.0


def test_kl_and_the_largest_logit_error_are_as_defined():
    reference = [torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)]  # p = (1/4, 3/4)
    quantized = [torch.tensor([[0.0, 0.0]], dtype=torch.float64)]  # q = (1/2, 1/2)
    error = compare(reference, quantized)
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert error.positions == 1 and math.isclose(error.mean_kl, want, rel_tol=1e-12)
    assert math.isclose(error.max_abs_logit_error, math.log(3.0))
