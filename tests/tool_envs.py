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
