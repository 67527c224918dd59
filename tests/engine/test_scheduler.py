"""The scheduler's side of a step, without a model: bursts planned as a field of the batch (never as draft
tokens), the stop rules of its post-processing, and the KV slots it gives back afterwards."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from inference_engine.config import EngineConfig
from inference_engine.detokenizer import IncrementalDetokenizer
from inference_engine.sampler import SampleResult
from inference_engine.sampling_params import SamplingParams
from inference_engine.scheduler import Scheduler
from inference_engine.sequence import Sequence, SequenceGroup
from inference_engine.tokenizer import Tokenizer

BS = 8
EOS = 0
TOKENIZER = Tokenizer(HFTokenizer(models.BPE()), eos_token_ids=[EOS])


def _scheduler(num_blocks: int = 64, steps: int = 8) -> Scheduler:
    config = EngineConfig(block_size=BS, num_scheduler_steps=steps)
    return Scheduler(config, num_blocks, 0, max_model_len=64, eos_token_ids=[EOS], burst_rows=8)


def _add(scheduler: Scheduler, seq_id: int, prompt_len: int, **params) -> Sequence:
    prompt = list(range(1, prompt_len + 1))
    group = SequenceGroup(str(seq_id), None, prompt, SamplingParams(temperature=0.0, **params))
    seq = Sequence(seq_id, group, list(prompt), prompt_len)
    seq.detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, [])
    group.seqs.append(seq)
    scheduler.add(seq)
    return seq


def _tokens(*ids: int) -> list[SampleResult]:
    return [SampleResult(t, 0.0, None) for t in ids]


def test_a_burst_is_a_field_of_the_batch_and_gives_back_what_an_ended_sequence_left():
    scheduler = _scheduler()
    a, b = _add(scheduler, 0, 9, max_tokens=40), _add(scheduler, 1, 9, max_tokens=40)
    prefill = scheduler.schedule()
    assert prefill.num_steps == 1 and prefill.num_new_tokens == [9, 9]  # a first token may fork: no burst
    assert scheduler.postprocess(prefill, [(a, _tokens(7)), (b, _tokens(7))]) == []

    burst = scheduler.schedule()
    assert burst.num_steps == 8 and burst.num_new_tokens == [8, 8]
    assert a.draft_token_ids == b.draft_token_ids == []  # the burst's slots are no speculative proposals
    assert a.scheduled_token_ids(a.num_computed_tokens, 8) == [7] * 8  # later steps' slots: placeholders
    assert [len(s.block_table) for s in (a, b)] == [3, 3]  # 9 + 8 slots reserved
    finished = scheduler.postprocess(burst, [(a, _tokens(*[5] * 8)), (b, _tokens(5, 5, EOS, 5, 5, 5, 5, 5))])
    assert finished == [b] and b.finish_reason == "stop" and b.output_token_ids == [7, 5, 5, EOS]
    assert b.block_table == [] and scheduler.running == [a]
    assert len(a) == 18 and a.num_computed_tokens == 17 and len(a.block_table) == 3
    assert scheduler.block_manager.num_free_blocks == 64 - 3
    assert scheduler.num_generated_tokens == 2 + 8 + 3

    assert scheduler.schedule(burst=False).num_steps == 1  # e.g. while a request waits for its grammar


def test_a_burst_shrinks_to_the_free_blocks():
    scheduler = _scheduler(num_blocks=5)
    a, b = _add(scheduler, 0, 13, max_tokens=40), _add(scheduler, 1, 13, max_tokens=40)
    scheduler.postprocess(scheduler.schedule(), [(a, _tokens(7)), (b, _tokens(7))])
    # One free block: 3 more steps fit in the blocks both hold (13 + 3 slots), a fourth takes a block each.
    burst = scheduler.schedule()
    assert burst.num_steps == 3 and burst.num_new_tokens == [3, 3] and scheduler.num_preemptions == 0


def test_a_burst_ends_with_the_first_sequence_to_reach_max_tokens():
    scheduler = _scheduler()
    a, b = _add(scheduler, 0, 13, max_tokens=40), _add(scheduler, 1, 13, max_tokens=4)
    scheduler.postprocess(scheduler.schedule(), [(a, _tokens(7)), (b, _tokens(7))])
    burst = scheduler.schedule()
    assert burst.num_steps == 3 and burst.num_new_tokens == [3, 3]
    assert scheduler.postprocess(burst, [(a, _tokens(5, 5, 5)), (b, _tokens(5, 5, 5))]) == [b]
    assert b.finish_reason == "length" and b.num_output_tokens == 4
    assert scheduler.schedule().num_steps == 8  # a alone


def test_rejected_draft_tokens_leave_neither_kv_nor_blocks():
    scheduler = _scheduler(steps=1)
    seq = _add(scheduler, 0, 14, max_tokens=40)
    scheduler.postprocess(scheduler.schedule(), [(seq, _tokens(7))])
    seq.draft_token_ids = [9, 9, 9]
    step = scheduler.schedule()
    assert step.num_new_tokens == [4] and len(seq.block_table) == 3  # 14 + 4 slots
    scheduler.postprocess(step, [(seq, _tokens(3))])  # the model disagreed with the first draft
    assert seq.token_ids[-2:] == [7, 3] and seq.num_computed_tokens == 15 and seq.draft_token_ids == []
    assert len(seq.block_table) == 3 - 1 and scheduler.block_manager.num_free_blocks == 64 - 2


def test_stop_rules():
    scheduler = _scheduler(steps=1)
    early = _add(scheduler, 0, 4, min_tokens=2, stop_token_ids=[9])
    stopped = _add(scheduler, 1, 4, stop_token_ids=[9])
    scheduler.postprocess(scheduler.schedule(), [(early, _tokens(EOS)), (stopped, _tokens(9))])
    assert early.finish_reason is None  # neither EOS nor a stop token ends it before min_tokens
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", 9)
    scheduler.postprocess(scheduler.schedule(), [(early, _tokens(9))])
    assert (early.finish_reason, early.stop_reason) == ("stop", 9)
    ignoring = _add(scheduler, 2, 60, ignore_eos=True)
    for token in (EOS, EOS, EOS, EOS):
        scheduler.postprocess(scheduler.schedule(), [(ignoring, _tokens(token))])
    assert ignoring.finish_reason == "length" and len(ignoring) == 64  # the context's end
    assert scheduler.block_manager.num_free_blocks == 64
