"""Incremental detokenization: clean UTF-8 deltas and stop strings that never leak into a stream."""

from __future__ import annotations

from itertools import pairwise

from inference_engine.detokenizer import IncrementalDetokenizer


def stream(tokenizer, text: str, stop: list[str] | None = None):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], stop or [])
    views, hit = [], None
    for token in ids:
        hit = detok.add_token(token)
        views.append(detok.visible_text)
        if hit:
            break
    if not hit:
        detok.finish()
        views.append(detok.visible_text)
    return views, hit


def test_multibyte_text_streams_without_broken_characters(llm):
    tokenizer = llm.get_tokenizer()
    text = "大语言模型推理：PagedAttention 把KV缓存分成块。🙂 naïve café"
    assert any(
        len(tokenizer.decode([t])) == 0 or "\ufffd" in tokenizer.decode([t]) for t in tokenizer.encode(text)
    )
    views, _ = stream(tokenizer, text)
    for before, after in pairwise(views):
        assert after.startswith(before)
    assert all("\ufffd" not in view for view in views)
    assert views[-1] == text


def test_stop_string_is_held_back_then_cut(llm):
    tokenizer = llm.get_tokenizer()
    views, hit = stream(tokenizer, "The answer is forty-two. END of story", stop=["END"])
    assert hit == "END"
    assert views[-1] == "The answer is forty-two. "
    assert all("END" not in v and not v.endswith("EN") for v in views)


def test_engine_stream_deltas_are_prefixes_of_the_final_text(clean_llm):
    engine = clean_llm.engine
    from inference_engine import SamplingParams

    engine.add_request("zh", "请用中文写一句关于大海的诗：", SamplingParams(temperature=0, max_tokens=24))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    assert texts[-1] and all("\ufffd" not in t for t in texts)
    for before, after in pairwise(texts):
        assert after.startswith(before)
    final_ids = out.outputs[0].token_ids
    assert texts[-1] == clean_llm.get_tokenizer().decode(final_ids)
