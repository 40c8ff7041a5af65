"""Environments and tools that tests import by path (tools.environment, tools.functions), as a
user's own module would be."""


class Counter:
    """TRL's environment_factory form: one per episode, its public methods the tools."""

    def reset(self, **row):
        self.target, self.value, self.calls = int(row["answer"]) % 7, 0, 0
        return f"Reach {self.target} with increment."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.calls += 1
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.1 * self.calls


class Picky(Counter):
    """An environment that cannot start from some rows (a task it was not written for)."""

    def reset(self, **row):
        if row["answer"].endswith("7"):
            raise KeyError("no level for this row")
        return super().reset(**row)


class Increment:
    """TRL's documented environment_factory example (its IncrementEnv), in our words and with
    its tool as TRL shows it: a bare reset(self), one typed method with a docstring."""

    def __init__(self):
        self._total = 0

    def reset(self) -> None:
        self._total = 0

    def increment(self, a: int) -> int:
        """Add a number to the running total.

        Args:
            a: The number to add

        Returns:
            The total after the addition.
        """
        self._total += a
        return self._total


def no_reward(completions, **kwargs):
    """The example's reward function: zero for every completion."""
    return [0.0 for _ in completions]
