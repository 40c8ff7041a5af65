"""GRPO core: advantages, the clipped policy loss with its aggregations, token log-probs.

Importing this package loads torch only; the trainer, data and model modules are imported by
name where they are used (`from grpo.trainer import ...`).
"""

from grpo.advantages import group_advantages, process_advantages, zero_std_groups
from grpo.logprobs import token_entropy, token_logprobs
from grpo.loss import aggregate, k3_kl, policy_loss

__all__ = [
    "aggregate",
    "group_advantages",
    "k3_kl",
    "policy_loss",
    "process_advantages",
    "token_entropy",
    "token_logprobs",
    "zero_std_groups",
]
