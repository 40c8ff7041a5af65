"""Tools and multi-turn episodes (grpo/env): the calculator and the call parser on hand-made
text, including text that would run code if anything evaluated it; tools from typed functions
and from a TRL environment class; episodes that keep the sampler's ids where re-tokenizing would
change them, tool tokens masked out, and every limit; the Python sandbox against the attack each
of its limits stops."""

import json
import os
import re
from pathlib import Path
from textwrap import dedent

import pytest

from grpo.env.calculator import CalculatorError, calculator
from grpo.env.calls import Call, Malformed, parse_calls, template_has_tools
from grpo.env.episode import Episode, EpisodeLimits, TurnOutput, run_episodes
from grpo.env.render import ToolTurns
from grpo.env.tools import ToolCallError, ToolSpecError, environment_tools, make_tools, run_tool


@pytest.mark.parametrize("expr,want", [
    ("(12 + 30) * 3 / 4", "63/2 = 31.5"), ("0.1 + 0.2", "3/10 = 0.3"), ("1/3 * 3", "1"),
    ("2 ** 10 - 24", "1000"), ("7 // 2", "3"), ("-3 % 5", "2"), ("10 / 3", "10/3"),
    ("3 × 4 ÷ 6", "2"), ("2^3", "8"),
])  # fmt: skip
def test_the_calculator_is_exact(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('touch /tmp/grpo-pwned')", "not arithmetic: Call"),
    ("open('/etc/passwd').read()", "not arithmetic"), ("x + 1", "not arithmetic: Name"),
    ("'a' * 3", "not arithmetic: Constant"), ("9 ** 9 ** 9", "exponent above"),
    ("1 / 0", "division by zero"), ("2 ** 0.5", "whole-number exponents"),
    ("1e999", "too large"), ("(" * 150 + "1" + ")" * 150, "over 200 characters"),
    ("1 +", "cannot parse"), ("", "empty"),
])  # fmt: skip
def test_the_calculator_refuses_what_is_not_arithmetic_without_running_it(expr, why):
    with pytest.raises(CalculatorError, match=re.escape(why)):
        calculator(expr)
    assert not Path("/tmp/grpo-pwned").exists()


def test_calls_are_parsed_as_json_and_malformed_ones_are_named():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": '
            '"6*7"}}\n</tool_call> and <tool_call>{"name": "calculator", "arguments": '
            '"{\\"expression\\": \\"1+1\\"}"}</tool_call><tool_call>{name: calculator}'
            '</tool_call><tool_call>["calculator"]</tool_call><tool_call>{"name": "x"')  # fmt: skip
    calls = parse_calls(text)
    assert calls[0] == Call("calculator", {"expression": "6*7"})
    assert calls[1] == Call("calculator", {"expression": "1+1"})  # arguments as a JSON string
    assert isinstance(calls[2], Malformed) and "not valid JSON" in calls[2].error
    assert isinstance(calls[3], Malformed) and '{"name"' in calls[3].error
    assert isinstance(calls[4], Malformed) and "not closed" in calls[4].error
    assert parse_calls("The answer is 42.") == []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_tools_from_typed_functions_with_their_schemas_and_checked_arguments():
    tools = make_tools([calculator, add])
    assert tools["add"].parameters["properties"]["a"] == {"type": "integer",
                                                         "description": "the first"}  # fmt: skip
    assert run_tool(tools["add"], {"a": 2, "b": 3}) == "5"
    assert run_tool(tools["calculator"], {"expression": "2*21"}) == "42"
    for args, why in (({"a": 1}, "missing argument b"),
                      ({"a": 1, "b": 2, "c": 3}, "unknown argument c"),
                      ({"a": "1", "b": 2}, "a must be integer, got string"),
                      ({"a": True, "b": 2}, "a must be integer, got boolean"),
                      ([1, 2], "arguments must be a JSON object, got array")):  # fmt: skip
        with pytest.raises(ToolCallError, match=re.escape(why)):
            run_tool(tools["add"], args)
    with pytest.raises(ToolCallError, match="calculator failed: CalculatorError: division by zero"):
        run_tool(tools["calculator"], {"expression": "1/0"})


def test_tools_that_cannot_be_offered_are_refused_naming_them():
    async def fetch(url: str) -> str:
        """Fetch.

        Args:
            url: where
        """
        return url

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ToolSpecError, match="tool fetch: async tools are not supported"):
        make_tools([fetch])
    with pytest.raises(ToolSpecError, match="tool undocumented"):
        make_tools([undocumented])
    with pytest.raises(ToolSpecError, match="two tools are named add"):
        make_tools([add, add])


def test_an_untooled_evaluation_needs_tools_to_leave_out():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="eval.untooled evaluates models without their tools"):
        load_config(None, ["eval.untooled=true"])
    cfg = load_config(None, ["eval.untooled=true", "tools.functions=[calculator]",
                             "data.worked_solutions=calculator"])  # fmt: skip
    assert cfg.eval.untooled and cfg.tools.active


class Counter:
    """A TRL environment_factory class: state across turns, its public methods the tools."""

    def reset(self, **row):
        self.target, self.value = int(row["answer"]), 0
        return f"Reach {self.target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.value == self.target)

    def _private(self) -> None:
        raise AssertionError("never a tool")


# Qwen2.5's way of showing tools (role tool in <tool_response> blocks), on the test tokenizer
HERMES = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools <tools>' }}{%- for t in tools %}"
    "{{- t | tojson }}{%- endfor %}{{- '</tools> call with <tool_call></tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from tests.realistic_model import qwen_like_tokenizer

    t = qwen_like_tokenizer()
    t.chat_template = HERMES
    return t


def _scripted(tok, turns_by_episode):
    """An engine that writes the given turns, token by token as listed (a sampler may draw a
    word as several tokens where the tokenizer would write one), each ended by <|im_end|>."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    state = {i: 0 for i in range(len(turns_by_episode))}
    calls = []

    def generate(contexts, budgets):
        calls.append(len(contexts))
        outs = []
        for ctx, budget in zip(contexts, budgets, strict=True):
            i = next(k for k, pre in enumerate(prompts) if ctx[: len(pre)] == pre)
            pieces = turns_by_episode[i][state[i]]
            state[i] += 1
            ids = [t for p in pieces for t in tok(p, add_special_tokens=False)["input_ids"]] + [eot]
            outs.append(
                TurnOutput(ids[:budget], [-0.5] * min(len(ids), budget), len(ids) <= budget)
            )
        return outs

    prompts = []
    return generate, prompts, calls


def _episodes(tok, n, env_cls=None, tools=()):
    eps = []
    for i in range(n):
        env = env_cls() if env_cls else None
        extra = env.reset(answer=str(3 + i)) if env else ""
        msgs = [{"role": "user", "content": f"Problem {i}. {extra}"}]
        table = environment_tools(env) if env else make_tools(list(tools))
        text = tok.apply_chat_template(msgs, tools=[t.schema for t in table.values()],
                                       add_generation_prompt=True, tokenize=False)  # fmt: skip
        ids = tok(text, add_special_tokens=False)["input_ids"]
        eps.append(Episode(prompt_ids=list(ids), tools=table, env=env))
    return eps


def test_an_episode_keeps_the_sampled_ids_where_re_tokenizing_would_change_them(tok):
    """The model drew "the" as t-h-e; re-tokenizing the conversation would give one token and
    the trainer would score ids the model never drew. Ours keeps the drawn ids, marks the tool
    response's ids as not the model's, and the text still reads as the conversation."""
    assert template_has_tools(tok.chat_template)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    turns = [[["t", "h", "e", " sum: ", call], ["the", " answer is 42"]]]
    generate, prompts, _ = _scripted(tok, turns)
    eps = _episodes(tok, 1, tools=[calculator])
    prompts += [e.prompt_ids for e in eps]
    render = ToolTurns(tok, chat=True, max_tool_tokens=64)
    (ep,) = run_episodes(eps, generate, lambda ids: tok.decode(ids, skip_special_tokens=True),
                         render, EpisodeLimits())  # fmt: skip
    assert ep.ended_by == "answer" and ep.turns == 2 and ep.calls[0]["result"] == "42"
    t, h, e = (tok.convert_tokens_to_ids(c) for c in "the")
    assert ep.ids[:3] == [t, h, e]  # as drawn
    retok = tok(tok.decode(ep.prompt_ids + ep.ids), add_special_tokens=False)["input_ids"]
    assert retok != ep.prompt_ids + ep.ids  # re-tokenizing changes the tokens...
    assert tok.decode(retok) == tok.decode(ep.prompt_ids + ep.ids)  # ...of the same text
    # the tool turn: not the model's tokens, no behaviour log-prob, turn 1's
    tool = [i for i, m in enumerate(ep.model_mask) if m == 0]
    assert tool and tool == list(range(tool[0], tool[-1] + 1))
    assert "<tool_response>\n42\n</tool_response>" in tok.decode([ep.ids[i] for i in tool])
    assert tok.decode([ep.ids[i] for i in tool]).endswith("<|im_start|>assistant\n")
    assert all(ep.logprobs[i] == 0.0 for i in tool) and ep.logprobs[0] == -0.5
    assert {ep.turn[i] for i in tool} == {1} and ep.turn[-1] == 2
    # the whole conversation, as the template writes it, is what the ids read
    msgs = [{"role": "user", "content": "Problem 0. "}, *ep.transcript]
    rendered = tok.apply_chat_template(msgs, tools=[ep.tools["calculator"].schema], tokenize=False)
    assert tok.decode(ep.prompt_ids + ep.ids) == rendered.rstrip("\n")


def test_a_stateful_trl_environment_over_several_turns_scores_itself(tok):
    call = '<tool_call>{"name": "increment", "arguments": {"by": %d}}</tool_call>'
    turns = [[[call % 1], [call % 2], ["done"]], [[call % 1], ["done"]]]
    generate, prompts, batches = _scripted(tok, turns)
    eps = _episodes(tok, 2, env_cls=Counter)
    prompts += [e.prompt_ids for e in eps]
    assert set(eps[0].tools) == {"increment"}  # reset, get_reward and _private are not tools
    run_episodes(eps, generate, tok.decode, ToolTurns(tok, True, 64), EpisodeLimits())
    assert [e.env.get_reward() for e in eps] == [1.0, 0.0]  # 3 reached; 1 of 4
    assert batches == [2, 2, 1]  # turns batched across the unfinished episodes
    assert [c["result"] for c in eps[0].calls] == ["1", "3"]


def test_every_limit_ends_or_cuts_and_is_counted(tok):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    bad = ['<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>',
           "<tool_call>not json</tool_call>"]  # fmt: skip
    turns = [
        [[call % "1+1"]] * 5,  # keeps calling: max_turns
        [[call % "1" * 4], ["ok"]],  # 4 calls in a turn, 3 allowed
        [["".join(bad)], ["ok"]],  # unknown tool, bad arguments, malformed: errors, not crashes
        [[call % "2**999"], ["ok"]],  # a long result, cut
        [["x " * 500]],  # past the token budget
    ]
    generate, prompts, _ = _scripted(tok, turns)
    eps = _episodes(tok, 5, tools=[calculator])
    prompts += [e.prompt_ids for e in eps]
    render = ToolTurns(tok, True, max_tool_tokens=40)
    limits = EpisodeLimits(max_turns=3, max_total_tokens=400, max_tool_tokens=40,
                           max_calls_per_turn=3)  # fmt: skip
    run_episodes(eps, generate, tok.decode, render, limits)
    assert [e.ended_by for e in eps] == ["max_turns", "answer", "answer", "answer",
                                         "max_total_tokens"]  # fmt: skip
    assert eps[0].turns == 3 and len(eps[0].calls) == 2  # the last turn's call is not run
    assert [("error" in c) for c in eps[1].calls] == [False, False, False, True]
    assert eps[1].tool_errors == 1 and "more than 3 tool calls" in eps[1].calls[3]["result"]
    errors = [c["result"] for c in eps[2].calls]
    assert "no tool named 'rm'" in errors[0] and "unknown argument x" in errors[1]
    assert "not valid JSON" in errors[2] and eps[2].tool_errors == 3
    assert render.cut == 1 and "[cut]" in tok.decode(eps[3].ids)
    assert all(len(e.ids) <= 400 for e in eps) and len(eps[4].ids) == 400


# --- the sandbox: each limit against the attack it stops ---------------------------------

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and another user need root")


@pytest.fixture(scope="module")
def sandbox():
    from grpo.env.sandbox import Limits, Sandbox

    project = Path(__file__).resolve().parents[2]
    return Sandbox(Limits(cpu_s=1, wall_s=3, memory_mb=256, processes=8, output_bytes=4096),
                   hidden=(str(project),))  # fmt: skip


@pytest.mark.parametrize("attack,code,ended,says", [
    ("an infinite loop", "while True: pass", "cpu", "[stopped: cpu limit]"),
    ("sleeping past the wall clock", "import time; time.sleep(60)", "timeout", "timeout limit"),
    ("a 10 GB allocation", "x = bytearray(10 * 2 ** 30)", "memory", "MemoryError"),
    ("printing 100 MB", "print('x' * 10 ** 8)", "output", "output limit"),
    ("a normal call", "print(sum(range(10)))", "exit", "45"),
])  # fmt: skip
def test_each_limit_stops_its_attack(sandbox, attack, code, ended, says):
    r = sandbox.run(code)
    assert r.ended_by == ended, (attack, r)
    assert says in r.text() and len(r.stdout) <= 4096


def test_the_code_sees_an_empty_directory_and_environment(sandbox, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "secret")
    r = sandbox.run("import os, json; print(json.dumps([os.listdir('.'), sorted(os.environ)]))")
    files, env = json.loads(r.stdout)
    assert files == ["main.py"] and "MLFLOW_TRACKING_PASSWORD" not in env


@ROOT_ONLY
def test_no_network_no_project_no_fork_bomb_as_root(sandbox, tmp_path):
    import socket

    project = Path(__file__).resolve().parents[2]
    assert set(sandbox.isolation) == {"no-network", "user-nobody", "process-limit",
                                      "read-only-filesystem", "hidden-paths"}  # fmt: skip
    listener = socket.create_server(("127.0.0.1", 0))  # a port that listens on loopback
    port = listener.getsockname()[1]
    net = sandbox.run(
        dedent(f"""\
        import socket
        try:
            socket.create_connection(('127.0.0.1', {port}), 1)
            print('connected')
        except OSError as e:
            print(e.errno)""")
    )
    listener.close()
    assert net.stdout.strip() == "101"  # ENETUNREACH: not even loopback exists
    # a serve state directory's credentials (0600, root's): unreadable as nobody
    state = tmp_path / ".grpo-serve"
    state.mkdir()
    secret = state / "credentials.json"
    secret.write_text('{"mlflow_password": "s3cret"}')
    secret.chmod(0o600)
    read = sandbox.run(f"print(open({str(secret)!r}).read())")
    assert "s3cret" not in read.text() and "PermissionError" in read.stderr
    # writing anywhere but its own directory: the filesystem is read-only to it
    escape = tmp_path / "escaped"
    write = sandbox.run(
        dedent(f"""\
        open('mine.txt', 'w').write('ok')
        for p in ({str(escape)!r}, '/tmp/grpo-escaped', '/dev/shm/grpo-escaped',
                  {str(project / "escaped")!r}):
            try:
                open(p, 'w').write('x')
                print('wrote', p)
            except OSError as e:
                print('refused', e.errno)
        print(open('mine.txt').read())""")
    )
    assert "wrote" not in write.stdout and write.stdout.count("refused") == 4, write.text()
    assert write.stdout.strip().endswith("ok")
    assert not escape.exists() and not Path("/tmp/grpo-escaped").exists()
    peek = sandbox.run(f"import os\ntry:\n    print(os.listdir({str(project)!r}))\n"
                       "except OSError as e:\n    print('denied', e.errno)")  # fmt: skip
    assert peek.stdout.startswith("denied") and "README.md" not in peek.stdout
    forks = sandbox.run(
        dedent("""\
        import os, time
        n = 0
        try:
            while n < 200:
                if os.fork() == 0:
                    time.sleep(2)
                    os._exit(0)
                n += 1
        except OSError:
            pass
        print(n)""")
    )
    assert int(forks.stdout) < 8
    who = sandbox.run("import os; print(os.getuid())")
    assert who.stdout.strip() == "65534"


def test_attacks_through_the_python_tool_leave_the_episode_going(tok, sandbox):
    """The model's own calls: each attack ends within its limit, its result goes back to the
    model as the tool's answer, and the episode (the run) goes on to its next turn."""
    from grpo.models.episodes import python_tool

    python = python_tool(sandbox)
    attacks = ["while True: pass", "import os\nwhile True: os.fork()", "print('x' * 10 ** 8)"]
    call = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>'
    turns = [[[call % json.dumps(a)], ["done"]] for a in attacks]
    generate, prompts, _ = _scripted(tok, turns)
    eps = _episodes(tok, len(attacks))
    for e in eps:
        e.tools = {"python": python}
    prompts += [e.prompt_ids for e in eps]
    run_episodes(eps, generate, tok.decode, ToolTurns(tok, True, 64), EpisodeLimits())
    assert [e.ended_by for e in eps] == ["answer"] * 3 and all(e.turns == 2 for e in eps)
    results = [e.calls[0]["result"] for e in eps]
    assert "[stopped: cpu limit]" in results[0] and "[stopped: output limit]" in results[2]
    assert "[stopped:" in results[1] or "[exit code" in results[1]  # the fork bomb ended


def test_a_machine_without_a_required_protection_is_refused(monkeypatch):
    from grpo.env import sandbox as sb

    monkeypatch.setattr(sb, "_is_root", lambda: False)
    with pytest.raises(ValueError, match="cannot give no-network"):
        sb.Sandbox(require=("no-network",))


def test_a_demonstration_is_laid_out_as_the_episode_it_shows(tok):
    """SFT on a worked solution with tool use sees the ids a rollout of the same turns gets: the
    tool response rendered by the chat format and out of the loss, each model turn trained with
    its end-of-turn token; and the synthetic task's calculator demonstration splits as such."""
    from grpo.data.synthetic import calculator_solution
    from grpo.env.render import demo_turns
    from grpo.models.episodes import demo_ids

    demo = calculator_solution(47, 85)
    turns = demo_turns(demo)
    assert [r for r, _ in turns] == ["assistant", "tool", "assistant"] and turns[1][1] == "132"
    generate, prompts, _ = _scripted(tok, [[[turns[0][1]], [turns[2][1]]]])
    eps = _episodes(tok, 1, tools=[calculator])
    prompts += [e.prompt_ids for e in eps]
    render = ToolTurns(tok, True, 64)
    (ep,) = run_episodes(eps, generate, tok.decode, render, EpisodeLimits())
    prompt = tok.decode(ep.prompt_ids)
    ids, trained = demo_ids(tok, prompt, demo, render)
    assert ids == ep.prompt_ids + ep.ids  # the same tokens, the tool's answer included
    assert trained == [0] * len(ep.prompt_ids) + ep.model_mask
    assert ep.calls[0]["result"] == "132"  # the demonstration's response is the tool's own
    with pytest.raises(ValueError, match="starts with a <tool_response>"):
        demo_ids(tok, prompt, "<tool_response>1</tool_response>x", render)


def test_the_tools_are_in_the_prompt_unless_the_config_leaves_them_to_the_demonstrations(tok):
    from grpo.config import load_config
    from grpo.models.episodes import episode_prompt
    from grpo.models.prompts import render_prompt

    tools = make_tools([calculator])
    sets = ["model.chat_template=true", "tools.functions=[calculator]"]
    listed = episode_prompt(tok, load_config(None, sets), "2+2=", tools)
    assert '"name": "calculator"' in listed and listed.endswith("<|im_start|>assistant\n")
    cfg = load_config(None, [*sets, "tools.list_in_prompt=false"])
    bare = episode_prompt(tok, cfg, "2+2=", tools)
    assert bare == render_prompt(tok, "2+2=", cfg) and "calculator" not in bare
    # without a chat template the listing goes before the problem, or nowhere
    plain = ["tools.functions=[calculator]"]
    assert episode_prompt(tok, load_config(None, plain), "2+2=", tools).startswith("You may call")
    cfg = load_config(None, [*plain, "tools.list_in_prompt=false"])
    assert episode_prompt(tok, cfg, "2+2=", tools) == render_prompt(tok, "2+2=", cfg)
