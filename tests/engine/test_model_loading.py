"""Both model formats load through our own loaders: the bundled GGUF file and a Hugging Face folder."""

from __future__ import annotations

import json

import pytest

from inference_engine import LLM

from .conftest import PROMPTS, assert_all_blocks_free, greedy


def test_hugging_face_folder_gives_the_same_tokens_as_the_gguf_file(hf_folder, llm):
    from_folder = LLM(model=str(hf_folder), dtype="float32")
    assert from_folder.get_tokenizer().eos_token_ids == llm.get_tokenizer().eos_token_ids
    prompts = [PROMPTS[0], PROMPTS[6], PROMPTS[12]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in from_folder.generate(prompts, greedy(12), use_tqdm=False)]
    assert got == expected
    chat = [{"role": "user", "content": "Hi"}]
    rendered = llm.get_tokenizer().apply_chat_template(chat)
    assert from_folder.get_tokenizer().apply_chat_template(chat) == rendered
    assert_all_blocks_free(from_folder)


def test_unknown_model_paths_and_formats_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file or folder at"):
        LLM(model=str(tmp_path / "missing.gguf"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported"):
        LLM(model=str(tmp_path))
