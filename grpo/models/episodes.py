"""Multi-turn rollouts with tools on either engine: each prompt's G episodes (grpo.env), run a
turn at a time with the step's sampler (the fast sampler or transformers' generate, batched
across the unfinished episodes), then laid out as a Rollout whose completion is everything
after the prompt, the tool responses marked out of the loss (model_mask).

The prompt shows the tools as the model's chat template does (`tools=` of apply_chat_template,
Hermes/Qwen style), or, for a template without tool use or a model without a template, in the
format grpo.env.calls documents, inside the system prompt or before the problem.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.config import Config
from grpo.env.calculator import calculator
from grpo.env.calls import template_has_tools, tool_instructions
from grpo.env.episode import Episode, EpisodeLimits, GenerateTurn, TurnOutput, run_episodes
from grpo.env.render import ToolTurns, demo_turns
from grpo.env.sandbox import Limits, Sandbox
from grpo.env.tools import Tool, ToolSpecError, environment_tools, make_tool, reset_arguments
from grpo.models.generate import Rollout, generate
from grpo.models.prompts import SYSTEM_PROMPT, render_prompt


class ToolSetupError(ToolSpecError):
    """tools.functions or tools.environment cannot be loaded (the message names the entry)."""


def _import(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    if not attr:
        raise ToolSetupError(f"{what} {spec!r}: expected module:name")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ToolSetupError(f"{what} {spec!r}: cannot import it: {e}") from e


def python_tool(sandbox: Sandbox) -> Tool:
    def python(code: str) -> str:
        """Run Python code in a fresh, isolated process and return what it prints.

        Args:
            code: a Python program (standard library only); print what you want to see.
        """
        return sandbox.run(code).text()

    return make_tool(python)


def hidden_paths(cfg: Config) -> tuple[str, ...]:
    """What the python tool's code must not see: the project (its code and credentials), the
    output directory (runs, checkpoints) and the working directory (the MLflow store)."""
    project = Path(__file__).resolve().parents[2]
    return tuple(dict.fromkeys(str(p) for p in (project, Path(cfg.output_dir).resolve(),
                                                Path.cwd())))  # fmt: skip


class Toolbox:
    """The configured tools: shared stateless ones, and an environment class built per episode.

    Args:
        cfg: the config (section tools).
        hidden: directories the python tool's code must not see (default: hidden_paths).
    """

    def __init__(self, cfg: Config, hidden: tuple[str, ...] | None = None) -> None:
        hidden = hidden_paths(cfg) if hidden is None else hidden
        t = cfg.tools
        self.shared: dict[str, Tool] = {}
        self.isolation: tuple[str, ...] = ()
        for name in t.functions:
            if name == "calculator":
                tool = make_tool(calculator)
            elif name == "python":
                s = t.sandbox
                box = Sandbox(Limits(cpu_s=s.cpu_s, wall_s=s.wall_s, memory_mb=s.memory_mb,
                                     processes=s.processes, output_bytes=s.output_bytes),
                              hidden=hidden, require=tuple(s.require))  # fmt: skip
                self.isolation = box.isolation
                tool = python_tool(box)
            else:
                tool = make_tool(_import(name, "tools.functions"))
            if tool.name in self.shared:
                raise ToolSetupError(f"tools.functions: two tools are named {tool.name}")
            self.shared[tool.name] = tool
        self.env_cls = _import(t.environment, "tools.environment") if t.environment else None
        if self.env_cls is not None and not isinstance(self.env_cls, type):
            raise ToolSetupError(f"tools.environment {t.environment!r} is not a class")

    def episode(self, row: dict[str, Any]) -> tuple[dict[str, Tool], object | None, str]:
        """An episode's tools, its environment (reset from the row) and text for the prompt."""
        if self.env_cls is None:
            return self.shared, None, ""
        env = self.env_cls()
        reset = getattr(env, "reset", None)
        extra = reset(**reset_arguments(reset, row)) if callable(reset) else None
        tools = {**self.shared, **environment_tools(env)}
        if len(tools) < len(self.shared) + len(environment_tools(env)):
            raise ToolSetupError("a tool of tools.functions and a method of tools.environment "
                                 "have the same name")  # fmt: skip
        return tools, env, extra if isinstance(extra, str) else ""


def tool_metadata(cfg: Config) -> dict[str, Any]:
    """The tools a policy was trained with, for its registered model: the config's entries,
    the limits, and each tool's JSON schema as the prompts showed it."""
    box = Toolbox(cfg, hidden=())
    schemas = [t.schema for t in box.shared.values()]
    if box.env_cls is not None:
        schemas += [t.schema for t in environment_tools(box.env_cls()).values()]
    t = cfg.tools
    return {"functions": list(t.functions), "environment": t.environment,
            "max_turns": t.max_turns, "max_tool_tokens": t.max_tool_tokens,
            "max_calls_per_turn": t.max_calls_per_turn, "schemas": schemas}  # fmt: skip


def episode_prompt(tok: Any, cfg: Config, problem: str, tools: dict[str, Tool]) -> str:
    """The prompt text of an episode, the tools shown in the model's own format when it has
    one (the task's own prompt when tools.list_in_prompt is false)."""
    if not cfg.tools.list_in_prompt:
        return render_prompt(tok, problem, cfg)
    schemas = [t.schema for t in tools.values()]
    if not cfg.model.chat_template:
        return tool_instructions(schemas) + "\n\n" + problem
    system = cfg.model.system_prompt or SYSTEM_PROMPT
    if template_has_tools(getattr(tok, "chat_template", None)):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": problem}]
        return tok.apply_chat_template(msgs, tools=schemas, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    msgs = [{"role": "system", "content": system + "\n\n" + tool_instructions(schemas)},
            {"role": "user", "content": problem}]  # fmt: skip
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def turn_engine(
    policy: torch.nn.Module, tok: Any, cfg: Config, device: torch.device, eos_ids: list[int],
    *, do_sample: bool = True,
) -> GenerateTurn:  # fmt: skip
    """One turn of every unfinished episode, batched: contexts left-padded, sampled at GRPO's
    temperature/top-k/top-p (or greedy) by the configured engine, each row cut to its budget."""
    g = cfg.grpo

    def turn(contexts: list[list[int]], budgets: list[int]) -> list[TurnOutput]:
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c) :] = torch.tensor(c)
            mask[i, width - len(c) :] = 1
        ro = generate(policy, ids.to(device), mask.to(device), num_generations=1,
                      max_completion_length=max(budgets), eos_token_id=eos_ids,
                      pad_token_id=tok.pad_token_id, temperature=g.temperature, top_p=g.top_p,
                      top_k=g.top_k, do_sample=do_sample,
                      engine=cfg.model.generation_engine)  # fmt: skip
        outs = []
        for i, budget in enumerate(budgets):
            n = int(ro.completion_mask[i].sum())
            drawn = ro.completion_ids[i, :n].tolist()
            logps = ro.sampling_logps[i, :n].tolist()
            finished = not bool(ro.truncated[i]) and n <= budget
            outs.append(TurnOutput(drawn[:budget], logps[:budget], finished))
        return outs

    return turn


@dataclass
class EpisodeBatch:
    """A round's episodes as the trainer takes them."""

    rollout: Rollout
    episodes: list[Episode]
    texts: list[str]  # readable transcripts (completions.jsonl)
    completions: list[Any]  # what reward functions get: message lists, or the text after it
    responses_cut: int  # tool responses cut to tools.max_tool_tokens


def transcript_text(ep: Episode) -> str:
    return "\n".join(f"[{m['role']}] {m['content']}" for m in ep.transcript)


def final_answer(ep: Episode) -> str:
    """The text graded as the episode's answer: its last model turn."""
    turns = [m["content"] for m in ep.transcript if m["role"] == "assistant"]
    return turns[-1] if turns else ""


def run_tool_round(
    policy: torch.nn.Module, tok: Any, cfg: Config, rows: list[dict[str, Any]], toolbox: Toolbox,
    device: torch.device, eos_ids: list[int], *, samples: int | None = None,
    max_tokens: int | None = None, do_sample: bool = True,
) -> EpisodeBatch:  # fmt: skip
    """`samples` episodes (GRPO's G by default) for each row, run to their ends, as a Rollout
    (rows of a prompt contiguous); `max_tokens` after each prompt (grpo.max_completion_length
    by default); greedy turns with do_sample False (evaluation)."""
    g, t = cfg.grpo, cfg.tools
    samples = samples or g.num_generations
    budget = max_tokens or g.max_completion_length
    episodes = []
    for row in rows:
        for _ in range(samples):
            tools, env, extra = toolbox.episode(row)
            problem = row["prompt"] + (("\n" + extra) if extra else "")
            text = episode_prompt(tok, cfg, problem, tools)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            episodes.append(Episode(prompt_ids=ids, tools=tools, env=env))
    render = ToolTurns(tok, cfg.model.chat_template, t.max_tool_tokens)
    limits = EpisodeLimits(max_turns=t.max_turns, max_total_tokens=budget,
                           max_tool_tokens=t.max_tool_tokens,
                           max_calls_per_turn=t.max_calls_per_turn)  # fmt: skip
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    engine = turn_engine(policy, tok, cfg, device, eos_ids, do_sample=do_sample)
    run_episodes(episodes, engine, decode, render, limits)
    rollout = episodes_rollout(episodes, tok.pad_token_id, samples, device)
    if cfg.model.chat_template:
        completions: list[Any] = [list(ep.transcript) for ep in episodes]
    else:
        completions = [decode(ep.ids) for ep in episodes]
    texts = [transcript_text(e) for e in episodes]
    return EpisodeBatch(rollout, episodes, texts, completions, render.cut)


def episodes_rollout(episodes: list[Episode], pad_id: int, group_size: int,
                     device: torch.device) -> Rollout:  # fmt: skip
    """Episodes as a Rollout: prompts left-padded, everything after them right-padded; the
    completion mask covers model and tool tokens (the attention), model_mask the model's."""
    n = len(episodes)
    p = max(len(e.prompt_ids) for e in episodes)
    c = max(max(len(e.ids) for e in episodes), 1)
    prompt_ids = torch.full((n, p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p), dtype=torch.long)
    comp = torch.full((n, c), pad_id, dtype=torch.long)
    cmask, model, turn = (torch.zeros((n, c), dtype=torch.long) for _ in range(3))
    logps = torch.zeros((n, c))
    for i, e in enumerate(episodes):
        prompt_ids[i, p - len(e.prompt_ids) :] = torch.tensor(e.prompt_ids)
        prompt_mask[i, p - len(e.prompt_ids) :] = 1
        k = len(e.ids)
        if k:
            comp[i, :k] = torch.tensor(e.ids)
            cmask[i, :k] = 1
            model[i, :k] = torch.tensor(e.model_mask)
            turn[i, :k] = torch.tensor(e.turn)
            logps[i, :k] = torch.tensor(e.logprobs)
    truncated = torch.tensor([e.ended_by in ("max_turns", "max_total_tokens") for e in episodes])
    return Rollout(prompt_ids.to(device), prompt_mask.to(device), comp.to(device),
                   cmask.to(device), truncated.to(device), logps.to(device), group_size,
                   model.to(device), turn.to(device))  # fmt: skip


def episode_metrics(episodes: list[Episode], tool_turns_cut: int) -> dict[str, float]:
    """This rank's sums for the step's tool metrics (tools/*): turns, calls, errors, time,
    episodes ended by each limit, responses cut."""
    model = sum(sum(e.model_mask) for e in episodes)
    m = {"tools/episodes": float(len(episodes)),
         "tools/turns": float(sum(e.turns for e in episodes)),
         "tools/calls": float(sum(len(e.calls) for e in episodes)),
         "tools/errors": float(sum(e.tool_errors for e in episodes)),
         "tools/seconds": float(sum(e.tool_seconds for e in episodes)),
         "tools/responses_cut": float(tool_turns_cut),
         "tools/model_tokens": float(model),
         "tools/tool_tokens": float(sum(len(e.ids) for e in episodes) - model)}  # fmt: skip
    for why in ("answer", "max_turns", "max_total_tokens"):
        m[f"tools/ended_by/{why}"] = float(sum(e.ended_by == why for e in episodes))
    return m


def reduce_episode_metrics(tot: dict[str, float]) -> dict[str, float]:
    """The step's tool metrics from the sums over ranks: per episode, per call, and the share
    of episodes each ending had."""
    n = max(tot["tools/episodes"], 1.0)
    calls = max(tot["tools/calls"], 1.0)
    out = {"tools/turns_mean": tot["tools/turns"] / n, "tools/calls_mean": tot["tools/calls"] / n,
           "tools/error_rate": tot["tools/errors"] / calls if tot["tools/calls"] else 0.0,
           "tools/errors": tot["tools/errors"], "tools/seconds": tot["tools/seconds"],
           "tools/responses_cut": tot["tools/responses_cut"],
           "tools/model_tokens_mean": tot["tools/model_tokens"] / n,
           "tools/tool_tokens_mean": tot["tools/tool_tokens"] / n}  # fmt: skip
    out |= {k.replace("tools/ended_by/", "tools/ended_by_"): v / n
            for k, v in tot.items() if k.startswith("tools/ended_by/")}  # fmt: skip
    return out


class DemoError(ToolSpecError):
    """A worked solution that cannot be laid out as an episode (the message names its row)."""


def demo_ids(
    tok: Any, prompt: str, worked_solution: str, render: ToolTurns
) -> tuple[list[int], list[int]]:
    """(ids, trained) of one demonstration, laid out as an episode is: the prompt, then each
    model turn with its end-of-turn token (trained), and the tool responses between them as
    the chat format renders them (not trained)."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    trained = [0] * len(ids)
    turns = demo_turns(worked_solution)
    if turns[0][0] == "tool":
        raise ValueError("it starts with a <tool_response>: no model turn calls for it")
    i = 0
    while i < len(turns):
        if turns[i][0] == "assistant":
            t = tok(turns[i][1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids, trained, i = ids + t, trained + [1] * len(t), i + 1
            continue
        msgs = []
        while i < len(turns) and turns[i][0] == "tool":
            msgs.append({"role": "tool", "content": turns[i][1]})
            i += 1
        t = render(msgs)
        ids, trained = ids + t, trained + [0] * len(t)
    return ids, trained


def encode_demos(
    tok: Any, rows: list[dict[str, Any]], cfg: Config
) -> list[tuple[list[int], list[int]]]:
    """SFT's examples with tools: each row's prompt as an episode shows it (the tools listed),
    its worked solution's turns as demo_ids lays them out."""
    toolbox = Toolbox(cfg)
    render = ToolTurns(tok, cfg.model.chat_template, cfg.tools.max_tool_tokens)
    out = []
    for r in rows:
        tools, _env, extra = toolbox.episode(r)
        problem = r["prompt"] + (("\n" + extra) if extra else "")
        try:
            out.append(demo_ids(tok, episode_prompt(tok, cfg, problem, tools),
                                r["worked_solution"], render))  # fmt: skip
        except ValueError as e:
            raise DemoError(f"worked solution of row {r.get('id', '?')}: {e}") from e
    return out
