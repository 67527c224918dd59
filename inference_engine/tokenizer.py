"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the model's chat template and stop tokens.

The engine owns tokenization so that every front end counts tokens and applies chat templates the
same way; the web tier only ever sends text or messages.

Tools reach the template as its ``tools`` variable, and assistant ``tool_calls`` with their arguments as
objects, as Hugging Face templates expect them. A template that knows no tools (it never reads ``tools``)
gets them through the fallback of `_tools_in_messages`: the function list and the Hermes call format in the
system message, earlier calls written in that format, and tool results as user turns in
``<tool_response>`` tags (what Hermes-format templates render them as); the engine's ``hermes`` tool-call
parser reads the answers.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: list[int],
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = {
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        }

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the BOS token where the model wants one."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """The prompt of a conversation; `tools`: OpenAI's function tools (``{"type": "function",
        "function": {"name", "description", "parameters"}}``).

        As vLLM: `continue_final_message` ends the prompt with the last message's text, leaving its turn
        open for the model to continue (with no generation prompt); `chat_template_kwargs` are more
        variables for the template (``enable_thinking``, ...), never in place of the ones set here."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false.")
        env = _jinja_env()
        template = env.from_string(self.chat_template)
        messages = [_with_argument_objects(m) for m in messages]
        if not self.template_reads_tools:
            messages, tools = _tools_in_messages(messages, tools), None
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) or ""
        variables = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos,
            "eos_token": eos,
        }
        prompt = template.render({**(chat_template_kwargs or {}), **variables})
        if continue_final_message:
            final = (messages[-1].get("content") or "").strip() if messages else ""
            end = prompt.rfind(final) if final else -1
            if end == -1:
                raise ValueError("the template does not write the final message's text as it is.")
            prompt = prompt[: end + len(final)]
        return prompt

    @functools.cached_property
    def template_reads_tools(self) -> bool:
        return "tools" in meta.find_undeclared_variables(_jinja_env().parse(self.chat_template or ""))


def _with_argument_objects(message: dict) -> dict:
    """Templates write a call's arguments as an object; OpenAI clients send them as JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):  # not JSON: the template writes the text as it is
                function["arguments"] = json.loads(function["arguments"])
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


_TOOLS_PROMPT = """You can call functions to help you answer. Their signatures, one JSON object per line:
<tools>
{tools}
</tools>
To call a function, write a JSON object with its name and arguments between <tool_call> and </tool_call>, \
one block per call:
<tool_call>
{{"name": "function_name", "arguments": {{"argument_name": "value"}}}}
</tool_call>"""


def _tools_in_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template that knows no tools: the tools in the system message, calls and
    their results as text."""
    result = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"].get("name"), "arguments": c["function"].get("arguments")},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in message["tool_calls"]
            ]
            content = "\n".join([content, *blocks] if content else blocks)
            result.append({"role": "assistant", "content": content})
        elif role == "tool":
            result.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            result.append({**message, "content": content})
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        prompt = _TOOLS_PROMPT.format(tools=listing)
        if result and result[0]["role"] == "system":
            result[0] = {"role": "system", "content": result[0]["content"] + "\n\n" + prompt}
        else:
            result.insert(0, {"role": "system", "content": prompt})
    return result


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Chat templates come from model files: render them sandboxed, as transformers does.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env


def load_hf_tokenizer(folder: Path, eos_token_ids: list[int]) -> Tokenizer:
    """A Hugging Face folder: tokenizer.json, with special tokens and template from tokenizer_config.json."""
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}

    def token_id(name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return backend.token_to_id(token) if token else None

    template = config.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    eos = token_id("eos_token")
    if eos is not None and eos not in eos_token_ids:
        eos_token_ids = [*eos_token_ids, eos]
    return Tokenizer(
        backend,
        eos_token_ids=eos_token_ids,
        bos_token_id=token_id("bos_token"),
        add_bos_token=bool(config.get("add_bos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )
