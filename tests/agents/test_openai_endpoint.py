"""The policy behind an OpenAI-compatible endpoint, asked by the ``openai`` client on the loopback
address: messages, n, greedy decoding equal to rlalign's sampler, max_tokens, stop, tool calls (in
the families' formats, special-token markers included; all or nothing, and a last call left open by a
stop string or EOS, as vLLM's parsers; 9-character ids a Mistral template takes back), the token-exact
record, the run's sampling settings, calls whose client left, batching of concurrent requests, and
OpenAI-style errors. The request fields: test_openai_request_fields.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from rlalign.agents.agent_source import Episode, episode_rows  # noqa: E402
from rlalign.agents.openai_server import PolicyServer, _stop_cut, model_generate, render_chat  # noqa: E402
from rlalign.agents.tool_calls import TAGS, tool_schemas  # noqa: E402
from rlalign.lm.models import load_tokenizer  # noqa: E402
from rlalign.lm.rollout import Rollout  # noqa: E402
from rlalign.lm.sampling import SamplingParams, sample  # noqa: E402
from rlalign.tasks import lookup as lk  # noqa: E402
from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_checkpoint  # noqa: E402
from rlalign.train.passes import rollout_token_logprobs  # noqa: E402
from tests.agents.families import MISTRAL_TEMPLATE, family_tokenizer  # noqa: E402

torch.set_num_threads(1)
USER = [{"role": "user", "content": "Which is heavier, the brom or the tiva?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)
    return AutoModelForCausalLM.from_pretrained(path).eval(), load_tokenizer(path)


def scripted(tokenizer, replies: list[list[int]]):
    """A Generate that answers every prompt of batch k with ``replies[k % len]`` (ids), log-prob -0.25 a token."""
    count = iter(range(1 << 20))

    def generate(prompts, params, noise):
        ids = replies[next(count) % len(replies)][: params.max_new_tokens]
        B, C = len(prompts), len(ids)
        completion = torch.tensor([ids] * B)
        ended = ids[-1] == tokenizer.eos_token_id
        return Rollout(torch.ones((B, 1), dtype=torch.long), torch.ones((B, 1), dtype=torch.long), completion, torch.ones_like(completion),
                       torch.full((B, C), -0.25), torch.arange(B), torch.full((B,), not ended))

    return generate


def chars(tokenizer, text: str, eos: bool = True) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])


def client(server, episode=None):
    return openai.OpenAI(base_url=server.url(episode), api_key="unused", max_retries=0)


def test_n_choices_usage_and_the_record_of_each(tiny):
    model, tok = tiny
    with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8) as server:
        server.open_episode("e")
        reply = client(server, "e").chat.completions.create(model="policy", messages=USER, n=3, max_tokens=6)
        calls = server.close_episode("e")
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len(calls) == 3
    prompt = render_chat(tok, USER, None)
    assert all(c.prompt_ids == prompt for c in calls)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == sum(len(c.completion_ids) for c in calls)
    for choice, call in zip(reply.choices, calls):
        assert choice.message.content == tok.decode(call.completion_ids, skip_special_tokens=True)
        assert len(call.logprobs) == len(call.completion_ids) <= 6
        assert choice.finish_reason == ("length" if call.truncated else "stop")


def test_temperature_zero_equals_rlalign_greedy_sample_and_logprobs(tiny):
    model, tok = tiny
    prompt = render_chat(tok, USER, None)
    greedy = sample(model, [prompt], SamplingParams(8, 0.0), tok.pad_token_id, [tok.eos_token_id])
    expected = greedy.completion_ids[0][greedy.completion_mask[0].bool()].tolist()
    with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8, temperature=0.0) as server:  # a run at temperature 0
        server.open_episode("e")
        reply = client(server, "e").chat.completions.create(model="policy", messages=USER, temperature=0)
        (call,) = server.close_episode("e")
    assert call.completion_ids == expected
    torch.testing.assert_close(torch.tensor(call.logprobs), greedy.logprobs[0][: len(expected)], rtol=0, atol=1e-6)
    assert reply.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)


def test_a_call_draws_the_same_tokens_whatever_else_is_in_its_batch(tiny):
    """Uniforms seeded by (seed, episode, call index): the same episode's first call, alone or among
    seven concurrent requests, samples the same tokens at temperature 1."""
    model, tok = tiny
    with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8, batch_wait_s=0.2) as server:
        server.open_episode("x")
        alone = client(server, "x").chat.completions.create(model="policy", messages=USER, temperature=1.0)
        server.close_episode("x")
        batches = server.batches
        replies: dict[str, object] = {}

        def ask(name: str, messages):
            server.open_episode(name)
            replies[name] = client(server, name).chat.completions.create(model="policy", messages=messages, temperature=1.0)

        threads = [threading.Thread(target=ask, args=("x", USER))] + [
            threading.Thread(target=ask, args=(f"o{i}", [{"role": "user", "content": "q" * (i + 1)}])) for i in range(7)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gathered = server.batches - batches
    assert replies["x"].choices[0].message.content == alone.choices[0].message.content
    assert gathered < 8  # eight concurrent requests, sampled in fewer batches


def test_max_tokens_is_capped_and_ends_with_length(tiny):
    model, tok = tiny
    with PolicyServer(tok, scripted(tok, [chars(tok, "abcdefghij", eos=False)]), max_new_tokens=6) as server:
        server.open_episode("e")
        c = client(server, "e")
        short = c.chat.completions.create(model="policy", messages=USER, max_tokens=3)
        capped = c.chat.completions.create(model="policy", messages=USER, max_tokens=1000)
        calls = server.close_episode("e")
    assert (short.choices[0].message.content, short.choices[0].finish_reason) == ("abc", "length")
    assert capped.choices[0].message.content == "abcdef"  # max_tokens is capped at the run's max_new_tokens
    assert [len(c.completion_ids) for c in calls] == [3, 6] and all(c.truncated for c in calls)


def test_stop_strings_cut_the_content_and_the_record_keeps_the_tokens_up_to_the_stop(tiny):
    _, tok = tiny
    ids = chars(tok, "Answer: brom\nmore")
    with PolicyServer(tok, scripted(tok, [ids]), max_new_tokens=32) as server:
        server.open_episode("e")
        reply = client(server, "e").chat.completions.create(model="policy", messages=USER, stop=["\n", "zz"])
        (call,) = server.close_episode("e")
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("Answer: brom", "stop")
    assert call.completion_ids == ids[: len("Answer: brom\n")]  # through the token that completes the stop string
    assert call.logprobs == [-0.25] * len(call.completion_ids) and not call.truncated


def test_the_stop_string_completed_first_ends_the_reply(tiny):
    # "abcdef" starts first but "cd" is complete first (at character 6 against 8): decoding stops there, so the
    # content is "xxab" and the tokens kept are "xxabcd", never the "ef" a server would not have sampled
    _, tok = tiny
    text = "xxabcdefyy"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert _stop_cut(tok, ids, text, ["abcdef", "cd"]) == (6, 4, "cd")
    assert _stop_cut(tok, ids, text, ["cdef", "bcdef"]) == (8, 4, "cdef")  # both end at 8: the first listed (vLLM's order)
    assert _stop_cut(tok, ids, text, ["zz"]) is None

    class Pieces:  # a tokenizer whose tokens are "xxab", "cdef", "yy": one token completes both "cd" and "abcdef"
        pieces = ["xxab", "cdef", "yy"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    # vLLM checks the stop strings in the order listed after each token: the first listed that token completes wins,
    # though "cd" ends earlier in its text (the earliest end alone kept "xxab" where vLLM's content is "xx")
    assert _stop_cut(Pieces(), [0, 1, 2], text, ["abcdef", "cd"]) == (2, 2, "abcdef")
    assert _stop_cut(Pieces(), [0, 1, 2], text, ["cd", "abcdef"]) == (2, 4, "cd")


def test_tools_rendered_calls_parsed_and_sent_back_through_the_template(tiny):
    """The tiny template has no tool syntax, so calls are the tag format: the reply's call becomes
    OpenAI tool_calls (the plain argument given to lookup's only parameter), and the agent's assistant
    message with tool_calls is written back as the tag call in the next prompt."""
    _, tok = tiny
    tools = tool_schemas([lk.lookup])
    with PolicyServer(tok, scripted(tok, [chars(tok, "<tool>lookup: brom</tool>"), chars(tok, "brom")]), max_new_tokens=32) as server:
        server.open_episode("e")
        c = client(server, "e")
        first = c.chat.completions.create(model="policy", messages=USER, tools=tools)
        message = first.choices[0].message
        call = message.tool_calls[0]
        history = USER + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": lk.lookup(**json.loads(call.function.arguments))}]
        second = c.chat.completions.create(model="policy", messages=history, tools=tools)
        calls = server.close_episode("e")
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "lookup", {"name": "brom"})
    assert second.choices[0].message.content == "brom" and second.choices[0].finish_reason == "stop"
    rendered = tok.decode(calls[1].prompt_ids)
    assert rendered.endswith(f"assistant: <tool>lookup: brom</tool>\ntool: {lk.lookup('brom')}\nassistant: ")
    assert TAGS.parse(tok.decode(calls[0].completion_ids, skip_special_tokens=True))[0].name == "lookup"


def test_the_record_is_the_sampled_ids_where_decoding_and_encoding_again_would_differ(tiny):
    """The character model spells "<eos>" with five ordinary tokens; the text re-encoded is the one EOS
    token. The row trained on is the five sampled tokens (then the real EOS), not the re-encoding."""
    _, tok = tiny
    sampled = tok.convert_tokens_to_ids(list("ok <eos> done")) + [tok.eos_token_id]  # one token per character
    with PolicyServer(tok, scripted(tok, [sampled]), max_new_tokens=32) as server:
        server.open_episode("e")
        reply = client(server, "e").chat.completions.create(model="policy", messages=USER)
        (call,) = server.close_episode("e")
    text = reply.choices[0].message.content
    assert text == "ok <eos> done"
    assert call.completion_ids == sampled
    again = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert again != sampled and len(again) < len(sampled)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temperature": 5}, "temperature"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"),
        ({"stream": True}, "stream"), ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"tools": [{"type": "function"}]}, "tools"), ({"top_p": 2}, "top_p"), ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logit_bias": {"5": 10}}, "logit_bias"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(tiny, body, field):
    _, tok = tiny
    with PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4) as server:
        with pytest.raises(openai.BadRequestError) as err:
            client(server).chat.completions.create(**{"model": "policy", "messages": USER, **body})
    assert err.value.status_code == 400
    assert err.value.body["param"] == field and err.value.body["message"].startswith(field.split("[")[0])


def test_closed_episodes_get_404_and_max_calls_400(tiny):
    _, tok = tiny
    with PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4, max_calls=2) as server:
        with pytest.raises(openai.NotFoundError, match="not open"):
            client(server, "never").chat.completions.create(model="policy", messages=USER)
        server.open_episode("e")
        c = client(server, "e")
        for _ in range(2):
            c.chat.completions.create(model="policy", messages=USER)
        with pytest.raises(openai.BadRequestError, match="max_calls=2"):
            c.chat.completions.create(model="policy", messages=USER)
        assert len(server.close_episode("e")) == 2
        assert [m.id for m in client(server).models.list().data] == ["policy"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "policy.example.com"])
def test_the_endpoint_refuses_any_host_but_loopback(tiny, host):
    _, tok = tiny
    with pytest.raises(ValueError, match=f"PolicyServer: host must be a loopback address .the endpoint has no authentication., got '{host}'"):
        PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4, host=host)


def test_the_endpoint_listens_on_loopback_by_default_and_on_another_loopback_address_when_asked(tiny):
    _, tok = tiny
    for host, base in [(None, "http://127.0.0.1:"), ("127.0.0.2", "http://127.0.0.2:")]:
        kwargs = {} if host is None else {"host": host}
        with PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4, **kwargs) as server:
            assert server.url().startswith(base)
            assert [m.id for m in client(server).models.list().data] == ["policy"]


@pytest.mark.parametrize(("family", "reply", "content"), [
    ("mistral", 'Let me look.[TOOL_CALLS][{"name": "lookup", "arguments": {"name": "brom"}}]</s>', "Let me look."),  # [TOOL_CALLS]: a special token
    ("llama3", '<|python_tag|>{"name": "lookup", "parameters": {"name": "brom"}}<|eom_id|>', None),  # <|python_tag|>: one too
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call><|im_end|>', None),
])
def test_tool_calls_are_parsed_with_special_tokens_kept_and_the_content_has_none(family, reply, content):
    """As the episodes parse them (rlalign.agents.episodes): a marker that is a special token is still there to parse;
    the content returned is what the text holds before the call, without special tokens."""
    tok = family_tokenizer(family)
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True).count("[TOOL_CALLS]") + tok.decode(ids, skip_special_tokens=True).count("python_tag") == 0
    with PolicyServer(tok, scripted(tok, [ids]), max_new_tokens=128) as server:
        server.open_episode("e")
        choice = client(server, "e").chat.completions.create(model="policy", messages=USER, tools=tool_schemas([lk.lookup])).choices[0]
        (call,) = server.close_episode("e")
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("lookup", {"name": "brom"})]
    assert call.completion_ids == ids and call.finish_reason == "tool_calls"


@pytest.mark.parametrize(("body", "field", "run", "value"), [
    ({"temperature": 0.3}, "temperature", "1", "0.3"), ({"temperature": 0}, "temperature", "1", "0"), ({"top_p": 0.5}, "top_p", "1", "0.5"),
    ({"extra_body": {"top_k": 5}}, "top_k", "0", "5"),
])
def test_a_request_for_other_sampling_settings_than_the_runs_gets_400_naming_the_setting(tiny, body, field, run, value):
    """The calls are trained as the run's policy at sampling.temperature (log pi_old, the importance weights'
    behaviour policy): a request asking for other settings is refused, not served and trained as if it were."""
    _, tok = tiny
    with PolicyServer(tok, scripted(tok, [chars(tok, "x")]), max_new_tokens=4) as server:
        server.open_episode("e")
        with pytest.raises(openai.BadRequestError) as err:
            client(server, "e").chat.completions.create(model="policy", messages=USER, **body)
        assert server.close_episode("e") == []
    message = err.value.body["message"]
    assert err.value.body["param"] == field and message.startswith(f"{field}: this endpoint samples at the run's sampling.{field}={run}")
    assert f"got {value} (to sample at {value}, set sampling.{field}={value} in the run's config)" in message


def test_calls_are_sampled_at_the_runs_settings_and_their_logprobs_are_the_training_forwards(tiny):
    """A run at temperature 0.7: requests that leave the settings out, or give the run's, are served at 0.7, and
    the recorded log-probs equal the training forward's at 0.7. The evaluation's endpoint serves a request's own."""
    model, tok = tiny
    with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8, temperature=0.7) as server:
        server.open_episode("e")
        c = client(server, "e")
        c.chat.completions.create(model="policy", messages=USER)
        c.chat.completions.create(model="policy", messages=USER, temperature=0.7, top_p=1.0, extra_body={"top_k": 0})
        calls = server.close_episode("e")
    rollout, _ = episode_rows([Episode(calls, "")], tok.pad_token_id)
    with torch.no_grad():
        trained = rollout_token_logprobs(model, rollout, 0.7)  # (2, C)
    mask = rollout.completion_mask.bool()
    assert (trained - rollout.logprobs)[mask].abs().max() < 1e-5
    with PolicyServer(tok, model_generate(model, tok), max_new_tokens=8, temperature=0.7, sampling_from_requests=True) as server:
        greedy = client(server).chat.completions.create(model="policy", messages=USER, temperature=0)
    expected = sample(model, [render_chat(tok, USER, None)], SamplingParams(8, 0.0), tok.pad_token_id, [tok.eos_token_id])
    assert greedy.choices[0].message.content == tok.decode(expected.completion_ids[0][expected.completion_mask[0].bool()], skip_special_tokens=True)


def test_a_call_whose_client_left_is_not_recorded_and_its_retry_is(tiny):
    """The client times out while its call waits (the sampler busy), then retries, as the openai client does: the
    episode records the one call whose reply the agent got; the abandoned one does not count against max_calls=1."""
    import httpx

    _, tok = tiny
    busy, replies = threading.Event(), scripted(tok, [chars(tok, "first"), chars(tok, "second")])

    def generate(prompts, params, noise):
        busy.wait(60)  # the first batch waits until the test lets it go
        return replies(prompts, params, noise)

    with PolicyServer(tok, generate, max_new_tokens=8, max_calls=1) as server:
        server.open_episode("e")
        url, body = server.url("e") + "/chat/completions", {"model": "policy", "messages": USER}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json=body, timeout=0.3)
        deadline = time.monotonic() + 30
        while getattr(server, "abandoned", 0) == 0 and time.monotonic() < deadline:  # the handler sees the client go
            time.sleep(0.01)
        busy.set()
        retry = httpx.post(url, json=body, timeout=60)
        calls = server.close_episode("e")
    assert retry.status_code == 200, retry.text
    assert server.abandoned == 1 and [c.text for c in calls] == [retry.json()["choices"][0]["message"]["content"]] == ["second"]


# the family test template plus the id checks of Mistral v0.3 / Nemo / Small templates, on the calls and on the tool results
MISTRAL_CHECKED = MISTRAL_TEMPLATE.replace(
    "{% for c in m.tool_calls %}",
    "{% for c in m.tool_calls %}{%- if c.id is not defined or c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{% endif %}", 1,
).replace(
    "{%- elif m.role == 'tool' %}",
    "{%- elif m.role == 'tool' %}{%- if m.tool_call_id is not defined or m.tool_call_id|length != 9 %}{{ raise_exception('Tool call IDs should be "
    "alphanumeric strings with length 9!') }}{% endif %}", 1,
)


@pytest.mark.parametrize("episode", ["e", None])
def test_tool_call_ids_are_nine_alphanumerics_that_a_mistral_template_takes_back(episode):
    """Mistral's templates refuse a call id that is not 9 alphanumeric characters: the second call of an agent sends
    the ids of the first back (the assistant's tool_calls, the tool results), and is served with them in its prompt."""
    tok = family_tokenizer("mistral")
    tok.chat_template = MISTRAL_CHECKED
    first = tok('[TOOL_CALLS][{"name": "lookup", "arguments": {"name": "brom"}}, {"name": "lookup", "arguments": {"name": "tiva"}}]</s>',
                add_special_tokens=False)["input_ids"]
    tools = tool_schemas([lk.lookup])
    with PolicyServer(tok, scripted(tok, [first, chars(tok, "brom")]), max_new_tokens=256) as server:
        server.open_episode("e")
        c = client(server, episode)
        message = c.chat.completions.create(model="policy", messages=USER, tools=tools).choices[0].message
        ids = [call.id for call in message.tool_calls]
        history = USER + [message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": call.id, "content": lk.lookup(**json.loads(call.function.arguments))} for call in message.tool_calls]
        second = c.chat.completions.create(model="policy", messages=history, tools=tools)
        calls = server.close_episode("e")
    assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]
    assert second.choices[0].message.content == "brom"
    if episode is not None:
        prompt = tok.decode(calls[1].prompt_ids)
        assert all(prompt.count(f'"id": "{i}"') == 1 and prompt.count(f'"call_id": "{i}"') == 1 for i in ids)


def test_tool_call_ids_of_an_episode_are_the_same_in_a_run_with_the_same_seed():
    """The ids are rendered into later prompts: a hash of (seed, episode, call, choice, position), so a run is reproducible."""
    tok = family_tokenizer("hermes")
    reply = tok('<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call><|im_end|>', add_special_tokens=False)["input_ids"]
    seen = []
    for seed in (0, 0, 1):
        with PolicyServer(tok, scripted(tok, [reply]), max_new_tokens=128, seed=seed) as server:
            server.open_episode("e")
            choices = client(server, "e").chat.completions.create(model="policy", messages=USER, tools=tool_schemas([lk.lookup]), n=2).choices
            seen.append([ch.message.tool_calls[0].id for ch in choices])
    assert seen[0] == seen[1] and seen[0][0] != seen[0][1] and seen[2] != seen[0]


def reply_to(tok, reply_ids, max_new_tokens=256, **request):
    """(choice, recorded call) of one request with the look-up tool, served by a scripted policy."""
    with PolicyServer(tok, scripted(tok, [reply_ids]), max_new_tokens=max_new_tokens) as server:
        server.open_episode("e")
        choice = client(server, "e").chat.completions.create(model="policy", messages=USER, tools=tool_schemas([lk.lookup]), **request).choices[0]
        (call,) = server.close_episode("e")
    return choice, call


GOOD_HERMES = '<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call>'


@pytest.mark.parametrize(("family", "reply"), [
    ("hermes", GOOD_HERMES + '<tool_call>\n{"name": "lookup", "arguments": {"name": "tiva"\n</tool_call><|im_end|>'),  # broken JSON
    ("hermes", GOOD_HERMES + '<tool_call>\n{"arguments": {"name": "tiva"}}\n</tool_call><|im_end|>'),  # no name
    ("mistral", '[TOOL_CALLS][{"name": "lookup", "arguments": {"name": "brom"}}, {"name": "lookup", "arguments": 5}]</s>'),  # arguments not an object
    ("llama3", '<|python_tag|>{"name": "lookup", "parameters": {"name": "brom"}}; {"name": "lookup", "parameters": {"name": <|eot_id|>'),
])
def test_a_reply_with_a_malformed_call_is_plain_content_its_good_calls_with_it(family, reply):
    """vLLM's parsers are all or nothing: one malformed call makes the reply content, not the good calls alone
    (which would drop the malformed one unseen)."""
    tok = family_tokenizer(family)
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    choice, call = reply_to(tok, ids)
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert call.completion_ids == ids and call.finish_reason == "stop"


def test_a_malformed_call_cut_at_max_tokens_is_content_that_ends_with_length():
    tok = family_tokenizer("hermes")
    ids = tok(GOOD_HERMES + '<tool_call>\n{"name": "lookup", "arguments": {"name": "tiva"}}\n</tool_call>', add_special_tokens=False)["input_ids"]
    choice, call = reply_to(tok, ids, max_new_tokens=len(ids) - 20)  # the second call's JSON cut short
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None) and call.truncated
    assert choice.message.content == tok.decode(ids[: len(ids) - 20])


@pytest.mark.parametrize("stop", ["</tool_call>", ["more", "</tool_call>"], None])
def test_a_final_hermes_call_left_open_by_a_stop_string_or_eos_is_a_call(stop):
    """stop="</tool_call>" (an agent idiom) cuts the reply before the closing tag; without a stop string, EOS comes
    before it. vLLM's Hermes parser reads <tool_call>(.*) at the end: a call. The record keeps the stop string's tokens."""
    tok = family_tokenizer("hermes")
    text = 'Let me check.<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n' + ("</tool_call> and more<|im_end|>" if stop else "<|im_end|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    choice, call = reply_to(tok, ids, stop=stop)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("lookup", {"name": "brom"})]
    kept = len(tok(text[: text.index("</tool_call>") + len("</tool_call>")], add_special_tokens=False)["input_ids"]) if stop else len(ids)
    assert call.completion_ids == ids[:kept] and not call.truncated


def test_a_final_call_left_open_at_max_tokens_is_a_call_only_where_its_json_shows_it_ended():
    """Cut at max_tokens: a Hermes call whose JSON is whole is a call (as vLLM), a tag-format call is not, since its
    plain argument cut short ("bro") would still parse; at a stop string it is."""
    tok = family_tokenizer("hermes")
    ids = tok('<tool_call>\n{"name": "lookup", "arguments": {"name": "brom"}}\n</tool_call>', add_special_tokens=False)["input_ids"]
    choice, _ = reply_to(tok, ids, max_new_tokens=len(ids) - len("</tool_call>"))  # the JSON and its newline
    assert choice.finish_reason == "tool_calls" and json.loads(choice.message.tool_calls[0].function.arguments) == {"name": "brom"}
    tags = build_char_tokenizer()
    ids = chars(tags, "<tool>lookup: brom</tool>", eos=False)
    cut, _ = reply_to(tags, ids, max_new_tokens=len("<tool>lookup: bro"))
    assert (cut.finish_reason, cut.message.tool_calls, cut.message.content) == ("length", None, "<tool>lookup: bro")
    stopped, _ = reply_to(tags, ids, stop="</tool>")
    assert stopped.finish_reason == "tool_calls" and json.loads(stopped.message.tool_calls[0].function.arguments) == {"name": "brom"}
