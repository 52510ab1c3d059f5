"""Chat templates in the tool-calling styles of three model families, written for these tests (the
layout of each family's calls, tool replies and headers; not the vendors' files), on the character
tokenizer with each family's special tokens added."""

from __future__ import annotations

from rlalign.tasks.tiny_model import build_char_tokenizer

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>{{ "\\n" }}{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{{ '\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'To call a function, respond with JSON {"name": NAME, "parameters": ARGS}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{ {'name': m.tool_calls[0].function.name, 'parameters': m.tool_calls[0].function.arguments} | tojson }}<|eot_id|>"
    "{%- elif m.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>\n\n{{ m.content | trim }}"
    "{%- if m.content.startswith('<|python_tag|>') %}<|eom_id|>{% else %}<|eot_id|>{% endif %}"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)

FAMILIES = {
    "hermes": (HERMES_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3": (LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|eot_id|>"),
    "mistral": (MISTRAL_TEMPLATE, ["[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "</s>"], "</s>"),
}


def family_tokenizer(family: str):
    """The character tokenizer with ``family``'s template, special tokens and end-of-turn token as EOS."""
    template, specials, eos = FAMILIES[family]
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer
