import os

from grpo.launch.environment import quiet_environment

# before torch is imported anywhere (grpo.launch.environment says why)
quiet_environment()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
