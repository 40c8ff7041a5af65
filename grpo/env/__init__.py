"""Environments and tools for multi-turn rollouts: typed Python functions as tools (TRL's
`tools=[...]` and `environment_factory`), tool calls parsed from what the model wrote (never
evaluated), episodes that keep the sampler's token ids, and two tools that ship: an exact
calculator and a sandboxed Python interpreter. Framework-free: no torch, no DeepSpeed."""
