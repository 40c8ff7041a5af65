"""Great Expectations suites for every dataset the pipeline reads (1.x API).

Each expectation is commented with the failure it guards against. A failing suite raises
DataValidationError naming the dataset, the expectation and example rows, before any training.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from grpo.config import Config, set_label
from grpo.data.sets import eval_set, training_sets
from grpo.launch.paths import base_model_dir
from grpo.models.loading import load_tokenizer
from grpo.models.prompts import (
    eval_prompt_limit,
    left_out_line,
    model_context,
    prompt_token_counts,
)
from grpo.progress import progress_bar
from reward_fns import gold_parses
from reward_fns.errors import UserError


class DataValidationError(UserError, ValueError):
    """A dataset failed its expectation suite."""


def normalise(text: str) -> str:
    """Text as compared for contamination: lower case, whitespace collapsed."""
    return re.sub(r"\s+", " ", text.strip().lower())


def _frame(
    rows: list[dict[str, Any]], train_prompts: set[str] | None, tok: Any, cfg: Config
) -> Any:
    import pandas as pd

    # a reasoning-gym entry is a nested dict: its generator checks answers, not math-verify
    df = pd.DataFrame([{k: v for k, v in r.items() if k != "rg_entry"} for r in rows])
    if "prompt" in df and cfg.tools.active:
        df["prompt_tokens"], df["episode_starts"] = _episode_prompts(rows, tok, cfg)
    elif "prompt" in df:
        df["prompt_tokens"] = prompt_token_counts(tok, cfg, [str(p) for p in df["prompt"]])
    if "answer" in df:
        df["answer_parses"] = [
            bool(str(r["answer"]).strip()) if r.get("rg_entry") is not None
            else gold_parses(r["answer"]) for r in rows
        ]  # fmt: skip
    if train_prompts is not None and "prompt" in df:
        df["in_training_data"] = [normalise(p) in train_prompts for p in df["prompt"]]
    return df


def _episode_prompts(rows: list[dict[str, Any]], tok: Any, cfg: Config) -> tuple[list, list]:
    """With tools: each row's prompt as its episode starts (the tools listed, the environment's
    reset text added), in tokens, and whether the environment could start from the row."""
    from grpo.models.episodes import Toolbox, episode_prompt

    box = Toolbox(cfg, hidden=())
    counts, starts = [], []
    for r in rows:
        try:
            tools, _env, extra = box.episode(r)
        except Exception as e:  # noqa: BLE001 - a user's environment failing on a row is a row's finding
            print(f"validation: the environment cannot start from row {r.get('id')}: "
                  f"{type(e).__name__}: {e}")  # fmt: skip
            counts.append(1)
            starts.append(False)
            continue
        text = episode_prompt(tok, cfg, r["prompt"] + (("\n" + extra) if extra else ""), tools)
        counts.append(len(tok(text, add_special_tokens=False)["input_ids"]))
        starts.append(True)
    return counts, starts


def _suite(
    name: str, df: Any, kind: str, min_rows: int, max_prompt_tokens: int,
    exact_rows: int | None = None,
) -> Any:  # fmt: skip
    import great_expectations as gx
    import great_expectations.expectations as gxe

    suite = gx.ExpectationSuite(name=name)
    suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=min_rows))  # empty sets
    if exact_rows is not None:  # a generated set: the size the config asked for
        suite.add_expectation(gxe.ExpectTableRowCountToEqual(value=exact_rows))
    for col in ("id", "prompt", "answer"):
        suite.add_expectation(gxe.ExpectColumnToExist(column=col))  # schema
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=col))
    suite.add_expectation(gxe.ExpectColumnValuesToBeUnique(column="id"))  # joins, paired eval
    suite.add_expectation(gxe.ExpectColumnValuesToBeOfType(column="prompt", type_="str"))
    suite.add_expectation(gxe.ExpectColumnValueLengthsToBeBetween(column="prompt", min_value=1))
    # counted in the model's own tokens, chat template included: a longer training prompt would
    # crowd out the completion or overflow the context. A held-out prompt that evaluation cannot
    # hold is left out of evaluation and reported instead (validate_datasets), so its suite
    # checks only that prompts are not empty.
    suite.add_expectation(
        gxe.ExpectColumnValuesToBeBetween(
            column="prompt_tokens", min_value=1,
            max_value=None if kind == "heldout" else max_prompt_tokens,
        )
    )  # fmt: skip
    # an unparseable gold answer makes every completion score 0: no signal, wrong accuracy
    suite.add_expectation(gxe.ExpectColumnValuesToBeInSet(column="answer_parses", value_set=[True]))
    if kind == "sft":
        suite.add_expectation(gxe.ExpectColumnToExist(column="worked_solution"))
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column="worked_solution"))
    if "episode_starts" in df:  # with tools: the environment starts from every row
        suite.add_expectation(
            gxe.ExpectColumnValuesToBeInSet(column="episode_starts", value_set=[True])
        )
    if kind == "heldout":
        # contamination: a held-out prompt seen in training makes accuracy meaningless
        suite.add_expectation(
            gxe.ExpectColumnValuesToBeInSet(column="in_training_data", value_set=[False])
        )
    return suite


def _validate_one(
    ctx: Any,
    source: Any,
    name: str,
    df: Any,
    kind: str,
    cfg: Config,
    eval_limit: int | None,
    exact_rows: int | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """One dataset's suite run as a checkpoint: its summary, and a line per failure."""
    import great_expectations as gx

    asset = source.add_dataframe_asset(name)
    batch_def = asset.add_batch_definition_whole_dataframe(f"{name}_all")
    suite = ctx.suites.add(_suite(f"{name}_suite", df, kind, 1, cfg.grpo.max_prompt_length,
                                  exact_rows))  # fmt: skip
    vd = ctx.validation_definitions.add(
        gx.ValidationDefinition(name=f"{name}_validation", data=batch_def, suite=suite)
    )
    # no actions: the Data Docs site is built once for all datasets, not once per dataset (each
    # build renders the whole site again, most of this stage's time on small sets)
    cp = ctx.checkpoints.add(gx.Checkpoint(name=f"{name}_checkpoint", validation_definitions=[vd]))
    res = cp.run(batch_parameters={"dataframe": df})
    summary: dict[str, Any] = {"success": bool(res.success), "rows": len(df), "failed": []}
    failures: list[str] = []
    if kind == "heldout" and "prompt_tokens" in df:
        over = df[df["prompt_tokens"] > eval_limit]
        summary["left_out"] = [str(i) for i in over["id"]]
        if len(over):
            print(left_out_line(name, summary["left_out"], len(df), eval_limit))
    for vr in res.run_results.values():
        summary["expectations"] = summary.get("expectations", 0) + len(vr.results)
        summary["passed"] = summary.get("passed", 0) + sum(bool(r.success) for r in vr.results)
        for r in vr.results:
            if not r.success:
                cfg_ = r.expectation_config
                col = cfg_.kwargs.get("column")
                bad = _failing_rows(df, col, r.result)
                desc = f"{cfg_.type}({col or ''})"
                summary["failed"].append({"expectation": desc, "rows": bad})
                failures.append(f"{name}: {desc} failed; e.g. rows {bad}")
    return summary, failures


def validate_datasets(cfg: Config, docs_dir: Path) -> dict[str, Any]:
    """Run every suite; write Data Docs HTML to docs_dir; raise on any failure."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    sets = training_sets(cfg)
    train_prompts = {
        normalise(r["prompt"]) for k in ("train", "sft", "sft_val") for r in sets.get(k, [])
    }
    datasets: dict[str, tuple[list[dict], str]] = {"train": (sets["train"], "train")}
    if "sft" in sets:
        datasets["sft"] = (sets["sft"], "sft")
        datasets["sft_val"] = (sets["sft_val"], "sft")
    if sets["select"]:  # checked as held-out data is: no problem shared with training
        datasets["select"] = (sets["select"], "heldout")
    for name in cfg.eval.sets:
        datasets[f"heldout_{set_label(name)}"] = (eval_set(name, cfg), "heldout")
    # generated sets have the sizes the config asked for (files have what they have)
    d = cfg.data
    sizes: dict[str, int] = {}
    if d.task == "reasoning_gym":
        sizes = {"train": d.num_train, "sft": d.num_sft, "sft_val": d.num_sft_val,
                 "select": d.num_select}  # fmt: skip
        # rg:mix holds every training generator's held-out set (reworded or not)
        mixes = ("rg:mix", "rg:reworded:mix")
        sizes |= {f"heldout_{set_label(n)}": d.num_heldout * (len(d.generators) if n in mixes
                                                              else 1)
                  for n in cfg.eval.sets if n.startswith("rg:")}  # fmt: skip

    ctx = gx.get_context(mode="ephemeral")
    # GE draws a bar per expectation batch ("Calculating Metrics", about ten lines per dataset
    # in a log); our own bar below counts the rows of every dataset instead
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    site = "grpo_data_docs"
    ctx.add_data_docs_site(
        site_name=site,
        site_config={
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend",
                              "base_directory": str(docs_dir.resolve())},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )  # fmt: skip
    source = ctx.data_sources.add_pandas("grpo")
    results: dict[str, Any] = {}
    failures: list[str] = []
    base = base_model_dir(cfg)
    tok = load_tokenizer(base)
    eval_limit = eval_prompt_limit(cfg, model_context(base))
    # progress in rows over every dataset: a million-row file takes most of a minute
    bar = progress_bar(sum(len(r) for r, _ in datasets.values()), "validate", "row")
    for name, (rows, kind) in datasets.items():
        bar.set_postfix_str(name)
        df = _frame(rows, train_prompts if kind == "heldout" else None, tok, cfg)
        results[name], failed = _validate_one(ctx, source, name, df, kind, cfg, eval_limit,
                                              sizes.get(name))  # fmt: skip
        failures += failed
        bar.update(len(rows))
    bar.close()
    ctx.build_data_docs(site_names=[site])
    if failures:
        raise DataValidationError(
            "data validation failed, no training started:\n  " + "\n  ".join(failures)
        )
    return results


def validation_markdown(results: dict[str, Any]) -> str:
    """One page a browser shows offline (Great Expectations' Data Docs take their CSS from
    CDNs): each dataset's rows, expectations met and problems left out of evaluation.

    >>> print(validation_markdown({"train": {"success": True, "rows": 3, "expectations": 5,
    ...                                      "passed": 5, "failed": []}}))
    | dataset | rows | expectations met | left out (too long) | result |
    |---|---|---|---|---|
    | train | 3 | 5 / 5 | 0 | passed |
    """
    lines = ["| dataset | rows | expectations met | left out (too long) | result |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        failed = "; ".join(f["expectation"] for f in r.get("failed", []))
        lines.append(
            f"| {name} | {r['rows']} | {r.get('passed', 0)} / {r.get('expectations', 0)} | "
            f"{len(r.get('left_out', []))} | {'passed' if r['success'] else 'FAILED: ' + failed} |"
        )
    return "\n".join(lines)


def _failing_rows(df: Any, column: str | None, result: dict) -> list[str]:
    vals = result.get("partial_unexpected_list") or []
    if column is None or column not in df or not vals:
        return []
    hit = df[df[column].isin(vals)] if not isinstance(vals[0], (list, dict)) else df.head(0)
    ids = hit["id"].astype(str).tolist() if "id" in hit else [str(i) for i in hit.index]
    return ids[:5]
