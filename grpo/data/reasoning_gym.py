"""Tasks from reasoning-gym (procedural generators with their own answer checkers) as the
pipeline's sets.

Each generator of data.generators gets a share of every split by its weight (largest
remainders), and each (split, generator) pair draws from its own seed. reasoning-gym seeds item
i of a dataset with seed + i, so two seeds closer than a dataset's length would draw the same
items: the seeds are spaced by STRIDE, more than any split's length, seed = ((data.seed x 10 +
split index) x 1000 + generator index) x STRIDE (split_seed; a generator's held-out set,
`rg:<name>`, uses split index 9, which no training split has). Questions are deduplicated
across all sets by their text: a question already drawn for an earlier split (in SPLITS order,
held-out first) is skipped, so the sets are disjoint whatever the generators repeat.

Rows: id, prompt (the question), answer and solution (the generator's answer), generator,
rg_entry (the generator's whole entry, which its score_answer reads), and for the SFT splits
worked_solution, an answer-format example `<answer>...</answer>` (reasoning-gym has no worked
solutions: the reference learns where the answer goes, not how to find it); with
data.worked_solutions calculator, a call to the calculator with the expression that solves the
problem, built from the entry's metadata (CALCULATOR_EXPRESSIONS: the generators that have one).
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import Any

from grpo.data.files import DataError

# the order sets are drawn in (held-out first: its problems do not depend on training sizes)
SPLITS = ("heldout", "sft_val", "sft", "train", "select")
SPLIT_INDEX = {"heldout": 9, "sft_val": 1, "sft": 2, "train": 3, "select": 4}
EVAL_PREFIX = "rg:"
MIX = "mix"  # rg:mix, every training generator's held-out set
# rg:defaults:<name>: the generator at the library's defaults, trained on or not: for a
# generator trained on a narrower config, problems beyond it
DEFAULTS = "defaults:"
REWORDED = "reworded:"  # rg:reworded:<name>: the held-out set rg:<name> in other words
# how many entries past the wanted count a generator may give before it is called exhausted
SLACK = 10
# items between two splits' seeds: more than any split draws (SLACK x its size + 5000)
STRIDE = 10_000_000


def library_version() -> str:
    """The installed reasoning-gym's version (logged with every dataset input)."""
    import importlib.metadata as md

    return md.version("reasoning-gym")


def leg_counting_expression(entry: dict[str, Any]) -> str:
    """leg_counting: each kind's count times its legs (the generator's own table), summed.

    >>> leg_counting_expression({"metadata": {"animals": {"woodlouse": 5, "leech": 2}}})
    '5*14+2*0'
    """
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    return "+".join(f"{n}*{ANIMALS[a]}" for a, n in entry["metadata"]["animals"].items())


# the generators whose problems a calculator demonstration can solve, and the expression it
# passes (data.worked_solutions calculator)
CALCULATOR_EXPRESSIONS = {"leg_counting": leg_counting_expression}


def check_generators(specs: list[Any], worked_solutions: str = "columns") -> None:
    """Every generator name is one reasoning-gym knows and its config is one it accepts, and
    with calculator demonstrations, one that has them: one line naming the generator otherwise
    (before any set is drawn)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DataError(
            "data.task reasoning_gym needs the reasoning-gym package: "
            "pip install -c constraints.txt -e '.[real]'"
        ) from None
    for spec in specs:
        if spec.name not in DATASETS:
            close = sorted(n for n in DATASETS if n[:3] == spec.name[:3]) or sorted(DATASETS)[:8]
            raise DataError(
                f"data.generators: {spec.name!r} is not a reasoning-gym generator (try "
                f"{', '.join(close)})"
            )
        _, config_cls = DATASETS[spec.name]
        try:
            config_cls(**spec.config, seed=0, size=1).validate()
        except (TypeError, ValueError, AssertionError) as e:
            raise DataError(f"data.generators: {spec.name} config {spec.config}: {e}") from None
        if worked_solutions == "calculator" and spec.name not in CALCULATOR_EXPRESSIONS:
            raise DataError(
                f"data.worked_solutions calculator: {spec.name} has no calculator "
                f"demonstration (generators that have one: {', '.join(CALCULATOR_EXPRESSIONS)})"
            )


def shares(n: int, weights: list[float]) -> list[int]:
    """n split by weight, largest remainders first (ties to the earlier generator).

    >>> shares(10, [1.0, 1.0, 1.0]), shares(5, [3.0, 1.0]), shares(0, [1.0])
    ([4, 3, 3], [4, 1], [0])
    """
    total = sum(weights)
    exact = [n * w / total for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


def split_seed(base: int, split: str, generator_index: int) -> int:
    """The seed of one generator's share of one split, STRIDE items from any other's.

    >>> split_seed(1234, "train", 0), split_seed(1234, "heldout", 1)
    (123430000000000, 123490010000000)
    """
    return ((base * 10 + SPLIT_INDEX[split]) * 1000 + generator_index) * STRIDE


def _draw(
    name: str, config: dict[str, Any], seed: int, n: int, seen: set[str], split: str
) -> list[dict[str, Any]]:
    import reasoning_gym

    if n == 0:
        return []
    ds = reasoning_gym.create_dataset(name, seed=seed, size=n * SLACK + 5000, **config)
    rows = []
    for i in range(len(ds)):
        entry = ds[i]
        q = entry["question"]
        if q in seen:
            continue
        seen.add(q)
        answer = str(entry["answer"])
        rows.append({"id": f"{split}-{name}-{len(rows):06d}", "prompt": q, "answer": answer,
                     "solution": answer, "generator": name, "rg_entry": entry})  # fmt: skip
        if len(rows) == n:
            return rows
    raise DataError(
        f"data.generators: {name} {config or '(defaults)'} gave only {len(rows)} distinct new "
        f"questions of the {n} its share of {split} needs (seed {seed}); lower the sizes or "
        "widen its config"
    )


def _key(cfg: Any) -> str:
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True)


def make_sets(data: Any) -> dict[str, list[dict[str, Any]]]:
    """The training splits (sft, sft_val, train, select) and each generator's held-out set
    ("heldout:<name>", data.num_heldout problems each) of a DataConfig with task
    reasoning_gym. Cached per config: the sets are drawn once per process."""
    return _make_sets(_key(data))


@functools.cache
def _make_sets(key: str) -> dict[str, list[dict[str, Any]]]:
    from grpo.config import DataConfig

    data = DataConfig.model_validate(json.loads(key))
    specs = data.generators
    check_generators(specs, data.worked_solutions)
    weights = [s.weight for s in specs]
    sizes = {"sft": data.num_sft, "sft_val": data.num_sft_val, "train": data.num_train,
             "select": data.num_select}  # fmt: skip
    seen: set[str] = set()
    out: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        if split == "heldout":
            for j, s in enumerate(specs):
                out[f"heldout:{s.name}"] = _draw(s.name, s.config,
                                                 split_seed(data.seed, split, j),
                                                 data.num_heldout, seen, split)  # fmt: skip
            continue
        rows: list[dict[str, Any]] = []
        for j, (s, n) in enumerate(zip(specs, shares(sizes[split], weights), strict=True)):
            rows += _draw(s.name, s.config, split_seed(data.seed, split, j), n, seen, split)
        # generators interleaved by a seeded shuffle: a batch mixes them as the weights say
        import random

        random.Random(split_seed(data.seed, split, 99)).shuffle(rows)
        out[split] = rows
    for split in ("sft", "sft_val"):
        for r in out[split]:
            r["worked_solution"] = _worked_solution(r, data.worked_solutions)
    return out


def _worked_solution(row: dict[str, Any], kind: str) -> str:
    if kind != "calculator":
        return f"<answer>{row['answer']}</answer>"
    from grpo.data.demonstrations import calculator_demo

    expression = CALCULATOR_EXPRESSIONS[row["generator"]](row["rg_entry"])
    try:
        return calculator_demo(expression, row["answer"])
    except ValueError as e:
        raise DataError(f"{row['id']}: calculator demonstration: {e}") from None


def eval_rows(name: str, data: Any) -> list[dict[str, Any]]:
    """The held-out set `rg:<generator>`: a training generator's own held-out set, or (a
    generator never trained on: out of distribution) data.num_heldout problems of it at its
    defaults, drawn at the held-out seed past every training generator's index and
    deduplicated against every training set. `rg:mix`: every training generator's held-out
    set together, one problem of each in turn (evaluation then reports each generator's
    accuracy beside the whole's).
    `rg:reworded:<generator>` / `rg:reworded:mix`: the same problems in other words, the
    out-of-format check (grpo.data.rewording). `rg:defaults:<generator>`: the generator at the
    library's defaults even when it is trained on (problems beyond a narrower training config),
    drawn and deduplicated as an untrained generator's set is."""
    gen = name.removeprefix(EVAL_PREFIX)
    if gen.startswith(DEFAULTS):
        return _ood_rows(gen.removeprefix(DEFAULTS), _key(data))
    if gen.startswith(REWORDED):  # the out-of-format check (grpo.data.rewording)
        from grpo.data.rewording import reword

        return [{**r, "prompt": reword(r["generator"], r["prompt"])}
                for r in eval_rows(EVAL_PREFIX + gen.removeprefix(REWORDED), data)]  # fmt: skip
    names = [s.name for s in data.generators] if data.task == "reasoning_gym" else []
    if gen == MIX:
        if not names:
            raise DataError(f"eval set {name}: needs data.task reasoning_gym with generators")
        sets = make_sets(data)
        # round robin across the generators: the first n problems (--limit, a quick look)
        # hold every generator, not the first one alone
        groups = itertools.zip_longest(*(sets[f"heldout:{n}"] for n in names))
        return [r for group in groups for r in group if r is not None]
    if gen in names:
        return make_sets(data)[f"heldout:{gen}"]
    return _ood_rows(gen, _key(data))


@functools.cache
def _ood_rows(gen: str, key: str) -> list[dict[str, Any]]:
    from grpo.config import DataConfig

    data = DataConfig.model_validate(json.loads(key))
    spec = type("Spec", (), {"name": gen, "config": {}})()
    check_generators([spec])
    seen: set[str] = set()
    if data.task == "reasoning_gym":
        seen = {r["prompt"] for rows in make_sets(data).values() for r in rows}
    index = len(data.generators) + 1 + sorted(_known()).index(gen)
    return _draw(gen, {}, split_seed(data.seed, "heldout", index), data.num_heldout, seen,
                 "heldout")  # fmt: skip


def _known() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return list(DATASETS)


def inputs_description(data: Any) -> dict[str, Any]:
    """What an MLflow dataset input records of these sets: the library's version, and each
    generator's name, weight, config and seed per split."""
    return {
        "library": "reasoning-gym", "version": library_version(),
        "generators": [
            {"name": s.name, "weight": s.weight, "config": s.config,
             "seeds": {split: split_seed(data.seed, split, j) for split in SPLITS}}
            for j, s in enumerate(data.generators)
        ],
    }  # fmt: skip
