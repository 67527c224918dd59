"""vLLM's chat-template request fields, as the engine's tokenizer renders them: add_generation_prompt,
continue_final_message and chat_template_kwargs."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from inference_engine.tokenizer import Tokenizer

CHATML = (
    "{% if enable_thinking is defined and not enable_thinking %}NO-THINK\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, "}]


@pytest.fixture
def tokenizer() -> Tokenizer:
    return Tokenizer(HFTokenizer(models.BPE()), eos_token_ids=[0], chat_template=CHATML)


def test_continue_final_message_leaves_the_last_turn_open(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=False, continue_final_message=True
    )
    assert prompt == "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n1, 2,"
    closed = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert closed.endswith("1, 2, <|im_end|>\n")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tokenizer.apply_chat_template(CONVERSATION, continue_final_message=True)


def test_chat_template_kwargs_are_template_variables_but_never_replace_ours(tokenizer: Tokenizer) -> None:
    plain = tokenizer.apply_chat_template(CONVERSATION[:1])
    assert not plain.startswith("NO-THINK")
    prompt = tokenizer.apply_chat_template(CONVERSATION[:1], chat_template_kwargs={"enable_thinking": False})
    assert prompt == "NO-THINK\n" + plain
    kept = tokenizer.apply_chat_template(
        CONVERSATION[:1], chat_template_kwargs={"messages": [], "add_generation_prompt": False}
    )
    assert kept == plain
