"""Hand-computed advantages for every mode, the zero-std group and process supervision."""

import math

import pytest
import torch

from grpo.algo import group_advantages, process_advantages, zero_std_groups


def test_zscore_worked_example_from_grpo_md():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    # mean 0.5, population std 0.5 -> 0.5 / (0.5 + 1e-4)
    expected = 0.5 / 0.5001
    assert torch.allclose(adv, torch.tensor([expected, -expected, expected, -expected]))


def test_zscore_uses_population_std_not_sample_std():
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, eps=0.0)
    # mean 2, population std 1 (sample std would be sqrt(2))
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]))


def test_center_mode_is_dr_grpo():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), 3, mode="center")
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]))


def test_leave_one_out():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, mode="loo")
    # r_i - mean(others): 1 - 1/3, 0 - 2/3
    assert torch.allclose(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # equals G/(G-1) * (r - mean)
    centered = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, mode="center")
    assert torch.allclose(adv, centered * 4 / 3)


@pytest.mark.parametrize("mode", ["zscore", "center", "loo"])
def test_equal_rewards_give_exact_zeros(mode):
    rewards = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.5])
    adv = group_advantages(rewards, 3, mode=mode)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert not torch.isnan(adv).any()
    assert zero_std_groups(rewards, 3).tolist() == [True, False]


def test_groups_are_independent():
    a = group_advantages(torch.tensor([1.0, 0.0, 5.0, 7.0]), 2, eps=0.0)
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="mode"):
        group_advantages(torch.zeros(4), 2, mode="bogus")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), 2)


def test_process_advantages_worked_two_completion_example():
    # completion 0: steps end at tokens 1 and 3 with rewards 1, 0;
    # completion 1: one step ending at token 2 with reward 0.
    # pooled rewards (1, 0, 0): mean 1/3, std sqrt(2)/3 -> normalised (sqrt2, -1/sqrt2, -1/sqrt2)
    adv = process_advantages([[1.0, 0.0], [0.0]], [[1, 3], [2]], 2, 5, eps=0.0)
    s = 2**0.5
    expected = torch.tensor(
        [
            [s - 1 / s, s - 1 / s, -1 / s, -1 / s, 0.0],  # t<=1: both steps; t in 2..3: step 2
            [-1 / s, -1 / s, -1 / s, 0.0, 0.0],  # tokens after the last step end get 0
        ]
    )
    assert torch.allclose(adv, expected, atol=1e-6)


def test_process_advantages_equal_rewards_zero_and_validation():
    adv = process_advantages([[1.0], [1.0, 1.0]], [[0], [0, 1]], 2, 3)
    assert torch.equal(adv, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="step_ends"):
        process_advantages([[1.0]], [[5]], 1, 3)


def test_batch_std_scales_by_the_whole_batchs_std():
    """TRL's scale_rewards="batch": rewards (1, 0) and (1, 1): group means 0.5 and 1, the
    batch's population std of (1, 0, 1, 1) is sqrt(3)/4 = 0.4330."""
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "batch_std", eps=0.0)
    s = math.sqrt(3) / 4
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.0, 0.0])


def test_process_advantages_mean_and_sum_hand_values():
    """One group of two completions. Completion 0: steps (1, 1) ending at tokens 1 and 3;
    completion 1: steps (0, 0) ending at 1 and 3. Pooled (1, 1, 0, 0): mean 0.5, std 0.5, so
    each step is +1 or -1. sum: tokens 0-1 get +2 (both steps end at or after them), 2-3 get +1;
    mean: every token of completion 0 gets +1, of completion 1 -1."""
    rewards, ends = [[1.0, 1.0], [0.0, 0.0]], [[1, 3], [1, 3]]
    s = process_advantages(rewards, ends, 2, 5, eps=0.0, reduce="sum")
    m = process_advantages(rewards, ends, 2, 5, eps=0.0, reduce="mean")
    assert s[0].tolist() == [2.0, 2.0, 1.0, 1.0, 0.0] and s[1].tolist() == [-2, -2, -1, -1, 0]
    assert m[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0] and m[1].tolist() == [-1, -1, -1, -1, 0]
    with pytest.raises(ValueError, match="reduce"):
        process_advantages(rewards, ends, 2, 5, reduce="max")
