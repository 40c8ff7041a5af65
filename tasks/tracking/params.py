"""Run parameters: the flattened config, credentials left out, keys MLflow accepts."""

from __future__ import annotations

import re
from typing import Any

from grpo.config import Config

SECRET_WORDS = ("token", "password", "secret", "key")


def safe_params(cfg: Config) -> dict[str, str]:
    """Flattened config: keys that look like credentials left out, URL passwords masked."""
    return public_params(cfg.flat())


def section_params(cfg: Config, sections: tuple[str, ...]) -> dict[str, str]:
    """safe_params of the given top-level config sections, with the seed and run name that
    every stage depends on."""
    keep = tuple(f"{s}." for s in sections)
    return {k: v for k, v in safe_params(cfg).items()
            if k.startswith(keep) or k in ("seed", "run_name")}  # fmt: skip


def public_params(flat: dict[str, Any]) -> dict[str, str]:
    """Params without credentials: a key whose last part has a word of SECRET_WORDS is left
    out (a count of tokens is not a token), user:password@ in URLs masked, values cut to 500.

    >>> public_params({"eval.max_new_tokens": 8, "hub.hf_token": "t", "s3.Secret-Key": "k",
    ...                "tracking.uri": "http://me:pw@host:5000"})
    {'eval.max_new_tokens': '8', 'tracking.uri': 'http://***@host:5000'}
    """

    def secret(key: str) -> bool:
        words = re.split(r"[^a-z0-9]+", key.lower().rsplit(".", 1)[-1])
        return any(w in SECRET_WORDS for w in words)

    masked = {k: re.sub(r"://[^/@\s]+@", "://***@", str(v)) for k, v in flat.items()}
    return {k: v[:500] for k, v in masked.items() if not secret(k)}


def safe_key(name: str) -> str:
    """A metric, param or tag name MLflow accepts: "@" (pass@k) spelled "_at_", any other
    character outside letters, digits, _ - . / and space replaced by "_".

    >>> safe_key("grpo/eval/x/pass@2"), safe_key("a:b")
    ('grpo/eval/x/pass_at_2', 'a_b')
    """
    return re.sub(r"[^\w\-./ ]", "_", name.replace("@", "_at_"))


def log_params(c: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for s in range(0, len(items), 100):
        c.log_batch(run_id, params=items[s : s + 100])
