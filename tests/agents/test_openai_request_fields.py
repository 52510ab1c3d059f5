"""The endpoint's request fields (rlalign.agents.chat_request): each is honoured, taken at a neutral value
only, or accepted without effect, and any other is a 400 naming it, never ignored. tool_choice "none",
logprobs (the model's own log-probs, equal to the training forward's at temperature 1) and
chat_template_kwargs are honoured; the constraints OpenAI keeps while decoding are refused."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from rlalign.agents.agent_source import Episode, episode_rows  # noqa: E402
from rlalign.agents.openai_server import PolicyServer, model_generate, render_chat  # noqa: E402
from rlalign.agents.tool_calls import tool_schemas  # noqa: E402
from rlalign.lm.models import load_tokenizer  # noqa: E402
from rlalign.tasks import lookup as lk  # noqa: E402
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint  # noqa: E402
from rlalign.train.passes import rollout_token_logprobs  # noqa: E402
from tests.agents.families import HERMES_TEMPLATE, family_tokenizer  # noqa: E402
from tests.agents.test_openai_endpoint import USER, chars, client, scripted  # noqa: E402

torch.set_num_threads(1)
TOOLS = tool_schemas([lk.lookup])
TWO_CALLS = ('Let me check.<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call>'
             '<tool_call>\n{"name": "lookup", "arguments": {"name": "tiva"}}\n</tool_call><|im_end|>')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(path)


def ask(tok, reply_ids, episode=True, server_kwargs=None, **request):
    """(reply, recorded calls) of one request served by a scripted policy."""
    with PolicyServer(tok, scripted(tok, [reply_ids]), max_new_tokens=256, **(server_kwargs or {})) as server:
        server.open_episode("e")
        reply = client(server, "e" if episode else None).chat.completions.create(model="policy", messages=USER, **request)
        return reply, server.close_episode("e")


def test_tool_choice_none_returns_the_reply_as_content_with_the_tools_still_in_the_prompt():
    """As vLLM: "none" renders the tools as "auto" does and never parses the reply, so its two calls stay text."""
    tok = family_tokenizer("hermes")
    ids = tok(TWO_CALLS, add_special_tokens=False)["input_ids"]
    auto, (auto_call,) = ask(tok, ids, tools=TOOLS, tool_choice="auto")
    none, (none_call,) = ask(tok, ids, tools=TOOLS, tool_choice="none")
    assert auto.choices[0].finish_reason == "tool_calls" and len(auto.choices[0].message.tool_calls) == 2
    choice = none.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert choice.message.content == TWO_CALLS.removesuffix("<|im_end|>")  # the text, special tokens skipped
    assert none_call.prompt_ids == auto_call.prompt_ids == render_chat(tok, USER, TOOLS)
    assert none_call.completion_ids == ids and none_call.finish_reason == "stop"


def test_logprobs_are_the_sampled_tokens_one_per_completion_token_in_openais_format():
    """The scripted policy's log-prob is -0.25 a token; the character tokenizer's tokens are its characters
    (the end-of-turn special token one of them), so the tokens joined are the completion with it."""
    tok = family_tokenizer("hermes")
    ids = chars(tok, "brom<x", eos=True)
    reply, (call,) = ask(tok, ids, logprobs=True, top_logprobs=0)
    content = reply.choices[0].logprobs.content
    assert [e.token for e in content] == ["b", "r", "o", "m", "<", "x", "<|im_end|>"]
    assert [e.logprob for e in content] == call.logprobs == [-0.25] * 7
    assert [e.bytes for e in content] == [list(e.token.encode()) for e in content] and all(e.top_logprobs == [] for e in content)
    assert len(content) == reply.usage.completion_tokens
    plain, _ = ask(tok, ids)
    assert plain.choices[0].logprobs is None


def test_logprobs_at_a_stop_string_cover_the_tokens_through_it():
    tok = family_tokenizer("hermes")
    reply, (call,) = ask(tok, chars(tok, "ab\ncd"), logprobs=True, stop="\n")
    assert reply.choices[0].message.content == "ab"
    assert [e.token for e in reply.choices[0].logprobs.content] == ["a", "b", "\n"] and len(call.completion_ids) == 3


def test_logprobs_at_temperature_one_are_the_models_own_as_the_training_forward_computes_them(tiny):
    """At temperature 1 the sampler's log-prob is log softmax(z)[y], the model's own (what OpenAI and vLLM return):
    equal to the training forward's at temperature 1 on the recorded row, and to the record."""
    model, tok = tiny
    with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8, temperature=1.0) as server:
        server.open_episode("e")
        reply = client(server, "e").chat.completions.create(model="policy", messages=USER, logprobs=True)
        calls = server.close_episode("e")
    rollout, _ = episode_rows([Episode(calls, "")], tok.pad_token_id)
    with torch.no_grad():
        trained = rollout_token_logprobs(model, rollout, 1.0)[rollout.completion_mask.bool()]  # (C,)
    served = torch.tensor([e.logprob for e in reply.choices[0].logprobs.content])
    assert served.tolist() == calls[0].logprobs
    torch.testing.assert_close(served, trained, rtol=0, atol=1e-5)


def test_logprobs_are_refused_at_a_temperature_where_the_server_has_only_the_tempered_ones(tiny):
    _, tok = tiny
    with PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4, temperature=0.7) as server:
        server.open_episode("e")
        with pytest.raises(openai.BadRequestError) as err:
            client(server, "e").chat.completions.create(model="policy", messages=USER, logprobs=True)
        assert server.close_episode("e") == []
    assert err.value.body["param"] == "logprobs" and "temperature 0.7" in err.value.body["message"]
    greedy, _ = ask(tok, chars(tok, "x"), server_kwargs={"temperature": 0.0}, logprobs=True)  # greedy: recorded at tau = 1
    assert [e.logprob for e in greedy.choices[0].logprobs.content] == [-0.25, -0.25]


@pytest.mark.parametrize(("request_fields", "field", "says"), [
    ({"tool_choice": "required"}, "tool_choice", "cannot promise"),
    ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice", "cannot promise"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "cannot promise at most one call"),
    ({"response_format": {"type": "json_object"}}, "response_format", "cannot be promised to be JSON"),
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs", "sampled token only"),
    ({"seed": 1}, "seed", "draws are the server's"),
    ({"functions": [TOOLS[0]["function"]]}, "functions", "tools="),
    ({"function_call": "auto"}, "function_call", "legacy"),
    ({"store": True}, "store", "keeps no completions"),
    ({"extra_body": {"stop_token_ids": [5]}}, "stop_token_ids", "stop strings"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens", "end of a turn"),
    ({"extra_body": {"ignore_eos": True}}, "ignore_eos", "end of a turn"),
    ({"extra_body": {"include_stop_str_in_output": True}}, "include_stop_str_in_output", "not a field this endpoint takes"),
    ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, "chat_template_kwargs", "not a variable the chat template reads"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "not a field this endpoint takes"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "give one of them"),
    ({"logprobs": "yes"}, "logprobs", "expected true or false"),
])
def test_fields_that_would_change_the_result_and_cannot_act_get_400_naming_the_field(request_fields, field, says):
    tok = family_tokenizer("hermes")
    with PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4) as server:
        server.open_episode("e")
        with pytest.raises(openai.BadRequestError) as err:
            client(server, "e").chat.completions.create(model="policy", messages=USER, tools=TOOLS, **request_fields)
        assert server.close_episode("e") == []  # not sampled, not recorded
    assert err.value.body["param"] == field and err.value.body["message"].startswith(f"{field}: ") and says in err.value.body["message"]


def test_a_run_may_serve_seed_and_a_required_tool_choice_without_their_effect():
    # smolagents' ToolCallingAgent always sends tool_choice "required", LangChain's ChatOpenAI(seed=...) a seed: refused by
    # default (they cannot act), served without their effect when the run says so (agent.serve_without_effect)
    tok = family_tokenizer("hermes")
    ids = tok(TWO_CALLS, add_special_tokens=False)["input_ids"]
    auto, (auto_call,) = ask(tok, ids, tools=TOOLS)
    lenient = {"serve_without_effect": ("seed", "tool_choice")}
    for fields in ({"tool_choice": "required", "seed": 7}, {"tool_choice": {"type": "function", "function": {"name": "lookup"}}}):
        reply, (call,) = ask(tok, ids, server_kwargs=lenient, tools=TOOLS, **fields)
        assert reply.choices[0].message.tool_calls is not None and len(reply.choices[0].message.tool_calls) == 2  # served as "auto"
        assert (call.prompt_ids, call.completion_ids) == (auto_call.prompt_ids, auto_call.completion_ids)
    with pytest.raises(openai.BadRequestError) as err:
        ask(tok, ids, server_kwargs={"serve_without_effect": ("seed",)}, tools=TOOLS, tool_choice="required")
    assert "agent.serve_without_effect: [tool_choice]" in err.value.body["message"]


def test_neutral_values_and_fields_without_effect_are_served_as_a_request_without_them(tiny):
    """user, metadata, safety_identifier and prompt_cache_key label a request; the neutral values are the defaults.
    The same episode's first call draws the same uniforms, so at temperature 1 the tiny model's reply is the same."""
    model, tok = tiny
    neutral = {"user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "c", "stream": False, "parallel_tool_calls": True,
               "response_format": {"type": "text"}, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "store": False,
               "tool_choice": "auto", "seed": None, "extra_body": {"min_p": 0, "repetition_penalty": 1, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": []}}
    records = []
    for fields in ({}, neutral):
        with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8) as server:
            server.open_episode("e")
            reply = client(server, "e").chat.completions.create(model="policy", messages=USER, **fields)
            records.append((reply.choices[0].message.content, server.close_episode("e")[0].completion_ids))
    assert records[0] == records[1]


def test_chat_template_kwargs_are_the_templates_own_variables_rendered_into_the_prompt():
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking): passed to the template, the prompt recorded as
    rendered with them; a key the template does not read, or one the renderer sets, is refused."""
    tok = family_tokenizer("hermes")
    tok.chat_template = HERMES_TEMPLATE.replace("<|im_start|>assistant\n{% endif %}",
                                                "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}{% endif %}")
    _, (call,) = ask(tok, chars(tok, "ok"), extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    expected = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert expected.endswith("assistant\n<nothink>") and call.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]
    _, (default,) = ask(tok, chars(tok, "ok"))
    assert tok.decode(default.prompt_ids).endswith("assistant\n")
    for kwargs, says in [({"thinking": False}, "'thinking' is not a variable the chat template reads"),
                         ({"add_generation_prompt": False}, "'add_generation_prompt' is set by the endpoint itself")]:
        with pytest.raises(openai.BadRequestError) as err:
            ask(tok, chars(tok, "ok"), extra_body={"chat_template_kwargs": kwargs})
        assert err.value.body["param"] == "chat_template_kwargs" and says in err.value.body["message"]
        assert "enable_thinking" in err.value.body["message"]  # the variables it does read


def test_the_message_of_a_refused_field_says_which_fields_are_taken():
    tok = family_tokenizer("hermes")
    with pytest.raises(openai.BadRequestError) as err:
        ask(tok, chars(tok, "x"), extra_body={"frobnicate": 1})
    message = err.value.body["message"]
    assert message.startswith("frobnicate: not a field this endpoint takes") and "tool_choice" in message and "user" in message
    assert json.dumps(err.value.body["param"]) == '"frobnicate"'
