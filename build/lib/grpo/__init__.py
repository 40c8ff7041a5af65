"""GRPO core, one package per concern (README "Layout", docs/ALGORITHM.md):

- grpo.algo: the math (advantages, policy loss, log-probs), pure tensor functions;
- grpo.config: the one typed config;
- grpo.data: datasets and the training order; grpo.models: loading, prompts, generation;
- grpo.eval: metrics (pure) and evaluation runs;
- grpo.engine: the training loop and its steps, SFT, DeepSpeed, checkpoints;
- grpo.launch: running a stage in this process or as DeepSpeed ranks.

Importing this package imports nothing; import the module you need.
"""
