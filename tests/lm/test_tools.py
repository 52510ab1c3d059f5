"""Tool-call parsing, the built-in tools, the registry and the default tool environment."""

import pytest

from rlalign.lm.sandbox import isolation_available
from rlalign.lm.tools import (
    HERMES, MAX_DIGITS, TAG, ToolCall, ToolEnvironment, ToolRegistry, calculator, format_for, parse_tool_calls, python_tool, render_observation,
)


def test_parse_one_tag_call_with_text_around():
    assert parse_tool_calls("let me see <tool>calculator: 12 * 34</tool> so", TAG) == [ToolCall("calculator", "12 * 34")]


def test_parse_several_calls_in_order():
    text = "<tool>calculator: 1+1</tool> and <tool>python: print(2)</tool>"
    assert parse_tool_calls(text, TAG) == [ToolCall("calculator", "1+1"), ToolCall("python", "print(2)")]


def test_parse_text_without_a_call_is_no_call():
    assert parse_tool_calls("1776", TAG) == []
    assert parse_tool_calls("a </tool> alone is not a call", TAG) == []


@pytest.mark.parametrize("text, error", [
    ("<tool>calculator 12*3</tool>", "expected NAME: ARGUMENT"),  # no colon
    ("<tool>: 12*3</tool>", "expected NAME: ARGUMENT"),  # no name
    ("<tool>calculator: 12*3", "without </tool>"),  # never closed
])
def test_parse_malformed_tag_calls_carry_their_error(text, error):
    [call] = parse_tool_calls(text, TAG)
    assert call.error is not None and error in call.error


def test_parse_hermes_json_calls():
    text = 'x<tool_call>{"name": "calculator", "arguments": {"expression": "2**10"}}</tool_call>y<tool_call>{"name": "f", "arguments": "s"}</tool_call>'
    assert parse_tool_calls(text, HERMES) == [ToolCall("calculator", "2**10"), ToolCall("f", "s")]
    [bad] = parse_tool_calls("<tool_call>{not json}</tool_call>", HERMES)
    assert "not JSON" in bad.error
    [two] = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1, "b": 2}}</tool_call>', HERMES)
    assert "one argument" in two.error


def test_format_for_picks_hermes_from_a_chat_template_with_tool_calls():
    class Tok:
        chat_template = "{% if tools %}<tool_call>{{ ... }}</tool_call>{% endif %}"

    assert format_for("auto", Tok()) is HERMES
    assert format_for("auto", object()) is TAG
    with pytest.raises(ValueError, match="unknown tool-call format"):
        format_for("xml")


@pytest.mark.parametrize("expression, value", [
    ("123456789*987654321", "121932631112635269"),  # exact integers
    ("12*(3+4) - 5", "79"),
    ("-7 // 2", "-4"),
    ("7 / 2", "3.5"),
    ("2**10 % 1000", "24"),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("1/0", "division by zero"),
    ("__import__('os').system('true')", "unsupported expression: Call"),
    ("x + 1", "unsupported expression: Name"),
    ("(1).__class__", "unsupported expression: Attribute"),
    ("12 *", "invalid syntax"),
    ("9**9**9", "too large"),  # refused before it is computed
    (f"{'9' * 600}*{'9' * 600}", "too large"),
    ("(-8) ** 0.5", "complex"),
])
def test_calculator_errors_are_messages(expression, error):
    result = calculator(expression)
    assert result.startswith("error:") and error in result


def test_calculator_allows_numbers_up_to_the_digit_bound():
    assert len(calculator(f"10**{MAX_DIGITS - 1}")) == MAX_DIGITS


def test_registry_calls_user_tools_and_turns_failures_into_messages():
    def boom(_: str) -> str:
        raise RuntimeError("bad input")

    registry = ToolRegistry.builtin(["calculator"]).register_tool("upper", str.upper).register_tool("boom", boom)
    assert registry.call(ToolCall("upper", "abc")) == "ABC"
    assert registry.call(ToolCall("boom", "x")) == "error: RuntimeError: bad input"
    assert registry.call(ToolCall("nope", "x")) == "error: unknown tool 'nope'; available: boom, calculator, upper"
    assert registry.call(ToolCall("", "", "malformed tool call: x")) == "error: malformed tool call: x"
    assert registry.call(ToolCall("upper", "a" * 50), max_chars=10) == "A" * 10
    with pytest.raises(ValueError, match="unknown built-in tool"):
        ToolRegistry.builtin(["shell"])


def test_tool_environment_runs_calls_until_an_answer_or_max_turns():
    env = ToolEnvironment(ToolRegistry.builtin(["calculator"]), TAG, max_turns=3)
    assert env.reset({"prompt": "37*48="}) == "37*48="
    assert env.step("<tool>calculator: 37*48</tool>") == ([{"role": "tool", "name": "calculator", "content": "1776"}], False, None)
    assert env.step("<tool>calculator: 1/0</tool>") == ([{"role": "tool", "name": "calculator", "content": "error: division by zero"}], False, None)
    assert env.step("<tool>calculator: 1+1</tool>") == ([], True, None)  # third turn: max_turns reached, the call is not run
    env.reset({"prompt": "2*3="})
    assert env.step("6") == ([], True, None)  # no call: the final answer


def test_render_observation_uses_the_format_result_tags():
    messages = [{"role": "tool", "name": "calculator", "content": "1776"}, {"role": "user", "content": " go on"}]
    assert render_observation(messages, TAG) == "<result>1776</result> go on"
    assert render_observation(messages[:1], HERMES) == "<tool_response>1776</tool_response>"


@pytest.mark.skipif(isolation_available() is not None, reason="needs bubblewrap")
def test_python_tool_runs_in_the_sandbox_and_reports_errors():
    python = python_tool(timeout_s=5)
    assert python("print(6 * 7)") == "42"
    assert python("raise ValueError('no')") == "error: ValueError: no"
    assert python("import os; print(os.path.exists('/work'))") == "False"  # the project is not visible
