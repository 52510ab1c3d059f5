"""Call formats parsed from what each family's template writes, schemas from typed functions, and
the environment's tokens as the template renders them."""

from __future__ import annotations

import pytest

from rlalign.agents.episodes import TemplateError, environment_tokens
from rlalign.agents.tool_calls import FORMATS, HERMES, LLAMA3, MISTRAL, TAGS, ToolCall, call_format, tool_schemas, typed_arguments
from rlalign.tasks.lookup import lookup
from rlalign.tasks.tiny_model import build_char_tokenizer
from tests.agents.families import family_tokenizer

USER = [{"role": "user", "content": "Which is heavier, the brom or the tiva?"}]
CALLS = [{"type": "function", "id": "abc123XYZ", "function": {"name": "lookup", "arguments": {"name": "brom"}}}]


def assistant_text(tokenizer, tool_calls) -> str:
    """What the template writes for an assistant turn of ``tool_calls``, after the generation prompt."""
    schemas = tool_schemas([lookup])
    before = tokenizer.apply_chat_template(USER, tools=schemas, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(USER + [{"role": "assistant", "content": "", "tool_calls": tool_calls}], tools=schemas, tokenize=False)
    assert after.startswith(before)
    return after[len(before):]


@pytest.mark.parametrize("family, fmt", [("hermes", HERMES), ("llama3", LLAMA3), ("mistral", MISTRAL)])
def test_each_family_is_detected_and_its_rendered_calls_parse(family, fmt):
    tokenizer = family_tokenizer(family)
    assert call_format("auto", tokenizer) is fmt
    text = assistant_text(tokenizer, CALLS)
    calls = fmt.parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("lookup", {"name": "brom"}, None)], text
    assert fmt.parse("the brom") == []  # a final answer has no call
    for other in {HERMES, LLAMA3, MISTRAL} - {fmt}:  # another family's syntax is not a call here
        assert other.parse(text) == [] or other is LLAMA3 and text.lstrip().startswith("{")


def test_two_calls_in_a_turn():
    tokenizer = family_tokenizer("hermes")
    two = CALLS + [{"type": "function", "id": "def456XYZ", "function": {"name": "lookup", "arguments": {"name": "tiva"}}}]
    assert [c.arguments["name"] for c in HERMES.parse(assistant_text(tokenizer, two))] == ["brom", "tiva"]
    assert [c.arguments["name"] for c in MISTRAL.parse(assistant_text(family_tokenizer("mistral"), two))] == ["brom", "tiva"]
    assert [c.arguments for c in LLAMA3.parse('{"name": "lookup", "parameters": {"name": "a"}}; {"name": "lookup", "parameters": {"name": "b"}}')] == [{"name": "a"}, {"name": "b"}]
    assert MISTRAL.parse('[TOOL_CALLS]lookup[ARGS]{"name": "brom"}') == [ToolCall("lookup", {"name": "brom"})]  # the v11 layout
    assert LLAMA3.parse('<|python_tag|>{"name": "lookup", "parameters": {"name": "x"}}<|eom_id|>') == [ToolCall("lookup", {"name": "x"})]


@pytest.mark.parametrize("fmt, text, error", [
    (HERMES, '<tool_call>{"name": "lookup", "arguments": {"name": "brom"}', "<tool_call> without </tool_call>"),
    (HERMES, "<tool_call>{name: lookup}</tool_call>", "not JSON"),
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', 'expected a JSON object {"name"'),
    (HERMES, '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>', "must be a JSON object, got list"),
    (HERMES, '<tool_call>{"name": "lookup", "arguments": "{bad"}</tool_call>', "are not JSON"),
    (LLAMA3, '{"name": "lookup", "parameters": {"name": ', "not JSON"),
    (LLAMA3, "<|python_tag|>lookup(name='x')", "not JSON"),
    (MISTRAL, "[TOOL_CALLS][{'name': 'lookup'}]", "not JSON"),
    (MISTRAL, '[TOOL_CALLS]lookup[ARGS]{"name"', "not JSON"),
    (TAGS, "<tool>lookup brom</tool>", "expected NAME: ARGUMENT"),
    (TAGS, "<tool>lookup: {oops</tool>", "are not JSON"),
    (TAGS, "<tool>lookup: brom", "<tool> without </tool>"),
])
def test_malformed_calls_are_calls_with_an_error(fmt, text, error):
    calls = fmt.parse(text)
    assert len(calls) == 1 and calls[0].error is not None and error in calls[0].error, calls


def test_tag_calls_take_a_string_or_json_arguments_and_unknown_formats_are_refused():
    assert TAGS.parse("x <tool>lookup: brom</tool> y") == [ToolCall("lookup", "brom")]
    assert TAGS.parse('<tool>lookup: {"name": "brom"}</tool>') == [ToolCall("lookup", {"name": "brom"})]
    assert call_format("auto", build_char_tokenizer()) is TAGS  # a template without tools
    assert set(FORMATS) == {"hermes", "llama3", "mistral", "tags"}
    with pytest.raises(ValueError, match="unknown tool-call format 'json'"):
        call_format("json")


def test_schemas_from_typed_functions_and_dicts():
    def add(a: int, b: int = 0) -> int:
        """Add two numbers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    schema = tool_schemas([add, {"type": "function", "function": {"name": "x"}}])
    assert schema[0]["function"]["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first."}, "b": {"type": "integer", "description": "The second."}}
    assert schema[0]["function"]["parameters"]["required"] == ["a"] and schema[1] == {"type": "function", "function": {"name": "x"}}
    with pytest.raises(ValueError, match="needs type hints and a docstring"):
        tool_schemas([lambda x: x])


def _typed(a: int, x: float, flag: bool, items: list, opt: int | None, text: str) -> str:
    """A tool with one parameter of each JSON type.

    Args:
        a: An integer.
        x: A number.
        flag: A boolean.
        items: A list.
        opt: An optional integer.
        text: A string.
    """
    return ""


def test_string_arguments_are_cast_to_their_parameters_types_as_transformers_types_trls_calls():
    # transformers' response parser (TRL 1.16's parse_response(tools=...)) casts a string to its parameter's JSON type;
    # a string parameter, a failed cast and an unlisted key keep the text
    schema = tool_schemas([_typed])[0]
    got = typed_arguments({"a": "3", "x": "2.5", "flag": "true", "items": "[1, 2]", "opt": "null", "text": "7", "extra": "9"}, schema)
    assert got == {"a": 3, "x": 2.5, "flag": True, "items": [1, 2], "opt": None, "text": "7", "extra": "9"}
    assert typed_arguments({"a": "3.0", "x": "4", "flag": "maybe", "items": "{}", "opt": "5"}, schema) == {"a": 3, "x": 4, "flag": "maybe", "items": "{}", "opt": 5}
    assert typed_arguments({"a": "3.5", "x": "nan"}, schema) == {"a": "3.5", "x": "nan"}  # 3.5 is no integer, NaN no JSON number
    assert typed_arguments({"a": 3, "items": [1]}, schema) == {"a": 3, "items": [1]} and typed_arguments({"a": "3"}, {}) == {"a": "3"}


@pytest.mark.parametrize("family, turn, expected", [
    # the sampled turn ends with the end-of-turn token: the template's newline after it is the environment's
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call><|im_end|>',
     "\n<|im_start|>user\n<tool_response>\nweight=30 price=47\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    # cut before the end-of-turn token: the template's token is the environment's
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call>',
     "<|im_end|>\n<|im_start|>user\n<tool_response>\nweight=30 price=47\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("llama3", '{"name": "lookup", "parameters": {"name": "brom"}}<|eot_id|>',
     "<|start_header_id|>ipython<|end_header_id|>\n\nweight=30 price=47<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("mistral", '[TOOL_CALLS][{"name": "lookup", "arguments": {"name": "brom"}, "id": "c00000000"}]</s>',
     '[TOOL_RESULTS]{"content": "weight=30 price=47", "call_id": "c00000000"}[/TOOL_RESULTS]'),
])
def test_environment_tokens_are_the_templates_suffix(family, turn, expected):
    tokenizer = family_tokenizer(family)
    ids = tokenizer(turn, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token
    conversation = USER + [{"role": "assistant", "content": turn.removesuffix(eos)}]
    reply = [{"role": "tool", "name": "lookup", "tool_call_id": "c00000000", "content": lookup("brom")}]
    tokens = environment_tokens(tokenizer, conversation, reply, ids, tool_schemas([lookup]))
    assert tokenizer.decode(tokens) == expected
    # prompt + sampled turn + environment tokens == the template's rendering of the whole conversation, token for token
    whole = tokenizer(tokenizer.apply_chat_template(conversation + reply, tools=tool_schemas([lookup]), tokenize=False, add_generation_prompt=family != "mistral"),
                      add_special_tokens=False)["input_ids"]
    prompt = tokenizer(tokenizer.apply_chat_template(USER, tools=tool_schemas([lookup]), tokenize=False, add_generation_prompt=family != "mistral"),
                       add_special_tokens=False)["input_ids"]
    if turn.endswith(eos):
        assert prompt + ids + tokens == whole


def test_a_template_that_rewrites_history_is_an_error():
    tokenizer = family_tokenizer("hermes")
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}{{ messages | length }}:{{ m.content }}\n{% endfor %}"  # the count changes earlier turns
    with pytest.raises(TemplateError, match="not a prefix"):
        environment_tokens(tokenizer, USER + [{"role": "assistant", "content": "x"}], [{"role": "tool", "content": "y"}], [], None)
