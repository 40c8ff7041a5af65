"""Reward functions, with TRL GRPOTrainer's calling contract (the one place it is written down).

    fn(completions, **kwargs) -> list[float | None]     one value per completion

The trainer calls every configured function once per scored batch, with keyword arguments only
(as TRL does: a function may take just the ones it needs, plus **kwargs). Lists have one entry
per completion, in order; a prompt's G completions are consecutive:

- completions: the completion texts (str), or, when the model uses its chat template
  (`model.chat_template: true`, TRL's "conversational" form), one message list per completion:
  [{"role": "assistant", "content": text}].
- prompts: the prompt as the dataset has it (str), or in conversational form the message list
  [{"role": "system", ...}, {"role": "user", "content": problem}].
- completion_ids: the completion's token ids (list[int], EOS included when it was sampled).
- every column of the dataset row except `worked_solution` (SFT's target, never shown to RL):
  prompt, answer, solution (the gold answer unless the file has its own `solution` column, the
  open-r1 convention), id, and any other scalar column of your files.
- trainer_state: a transformers.TrainerState with global_step (the step being sampled, from 0)
  and max_steps (grpo.steps).
- log_extra(column, values): adds a column to the step's completions.jsonl records.
- log_metric(name, value): a scalar logged with the step's metrics (metrics.jsonl and MLflow),
  averaged over the calls of the step on rank 0.

Return None for "not applicable": it is left out of that completion's weighted sum. TRL's own
functions (trl.rewards.accuracy_reward, think_format_reward, get_soft_overlong_punishment) work
unchanged (tests/integration/test_trl_compat.py). Functions given by import path run under
`grpo.reward_timeout_s`. Importing this package registers the built-in functions by name
(reward_fns.registry).
"""

from reward_fns.accuracy import accuracy, extract_answer, gold_parses, is_correct
from reward_fns.environment import environment_reward
from reward_fns.format import format_reward, soft_overlong_penalty
from reward_fns.process import arithmetic_steps, column_steps
from reward_fns.reasoning_gym import (
    lenient_entry,
    reasoning_gym_exact_reward,
    reasoning_gym_reward,
    score_entry,
)
from reward_fns.registry import PROCESS_REWARDS, REWARD_FUNCS
from reward_fns.scoring import RewardFunctionError, resolve, score, with_time_limit
from reward_fns.verdict import verdicts

__all__ = [
    "PROCESS_REWARDS",
    "REWARD_FUNCS",
    "RewardFunctionError",
    "accuracy",
    "arithmetic_steps",
    "environment_reward",
    "column_steps",
    "extract_answer",
    "format_reward",
    "gold_parses",
    "is_correct",
    "lenient_entry",
    "reasoning_gym_exact_reward",
    "reasoning_gym_reward",
    "score_entry",
    "resolve",
    "score",
    "soft_overlong_penalty",
    "verdicts",
    "with_time_limit",
]
