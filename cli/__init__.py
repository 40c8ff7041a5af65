"""The `grpo` command line: parses arguments and dispatches to flows, tasks and infra."""
