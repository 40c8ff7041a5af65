"""The GRPO math: pure functions over tensors and plain scalars, no frameworks and no I/O.

advantages (outcome estimators by name, process supervision), the policy loss with its
objectives (clip, CISPO, SAPO) and aggregations by name, and token log-probs / entropy.
docs/ALGORITHM.md has the formulas.
"""

from grpo.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_modes,
    group_advantages,
    process_advantages,
    zero_std_groups,
)
from grpo.algo.logprobs import token_entropy, token_logprobs
from grpo.algo.loss import (
    IMPORTANCE_LEVELS,
    LOSS_AGGREGATIONS,
    POLICY_OBJECTIVES,
    ObjectiveParams,
    aggregate,
    k3_kl,
    policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IMPORTANCE_LEVELS",
    "LOSS_AGGREGATIONS",
    "POLICY_OBJECTIVES",
    "ObjectiveParams",
    "advantage_modes",
    "aggregate",
    "group_advantages",
    "k3_kl",
    "policy_loss",
    "process_advantages",
    "token_entropy",
    "token_logprobs",
    "zero_std_groups",
]
