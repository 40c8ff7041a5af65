"""How micro-batches combine: hand-computed weights for every kind of aggregation."""

import torch

from grpo.config import load_config
from grpo.engine.update import UpdatePlan, micro_weight

CPU = torch.device("cpu")


def _g(loss_type: str):
    return load_config(None, [f"grpo.loss_type={loss_type}"]).grpo


def test_row_mean_aggregations_weight_each_micro_batch_by_its_rows():
    # the case: 256 rows in micro-batches of 48 -> 5 full ones and 16 rows in the last
    plan = UpdatePlan(micro=48, n_micro=6, world=1, zero_stage=0, device=CPU)
    for lt in ("grpo", "bnpo", "dr_grpo"):
        assert micro_weight(_g(lt), plan, 48, 256) == 6 * 48 / 256 == 1.125
        assert micro_weight(_g(lt), plan, 16, 256) == 6 * 16 / 256 == 0.375
    # equal micro-batches: weight exactly 1 (the default run's numbers do not move)
    even = UpdatePlan(micro=64, n_micro=4, world=2, zero_stage=0, device=CPU)
    assert micro_weight(_g("grpo"), even, 64, 256) == 1.0


def test_the_weights_turn_deepspeeds_average_into_the_mean_over_rows():
    # per-sequence losses 1..5 in micro-batches of 2: (1, 2), (3, 4), (5)
    plan = UpdatePlan(micro=2, n_micro=3, world=1, zero_stage=0, device=CPU)
    parts = [[1.0, 2.0], [3.0, 4.0], [5.0]]
    g = _g("grpo")
    weighted = sum(micro_weight(g, plan, len(p), 5) * sum(p) / len(p) for p in parts) / 3
    # mean(1..5), DeepSpeed dividing by n_micro = 3; equal weights would give (1.5 + 3.5 + 5)
    # / 3 = 3.33, the 5th row counted twice
    assert weighted == 3.0


def test_a_global_normaliser_undoes_the_average_over_micro_batches_and_ranks():
    plan = UpdatePlan(micro=48, n_micro=6, world=4, zero_stage=2, device=CPU)
    assert micro_weight(_g("dapo"), plan, 16, 256) == 24
    assert micro_weight(_g("dapo"), plan, 48, 256) == 24
