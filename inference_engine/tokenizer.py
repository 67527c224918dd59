"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the model's chat template and stop tokens.

The engine owns tokenization so that every front end counts tokens and applies chat templates the
same way; the web tier only ever sends text or messages.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead.")
        template = _jinja_env().from_string(self.chat_template)
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) or ""
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )


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
