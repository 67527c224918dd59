"""Builds the per-machine test caches before the tests that first need them would: transformers' greedy
reference of the bundled model, its dense copy, llama.cpp's GGUF conversions of the tiny family checkpoints,
the quantized checkpoints and their reference perplexities.

    nice -n 19 .venv/bin/python -m tests.warm_caches

On a machine that has none of them yet they take some three minutes of one core (GPTQ's act-order
calibration alone over a minute), mostly Python loops that leave the second core idle. `scripts/test` runs
this beside pytest at the lowest priority, so the builds take the CPU time the tests leave idle (waiting on
servers, subprocesses and timers), in the order the tests first need them; a test that needs an entry still
being built waits for it under the entry's lock (`quant_checkpoints.building`) instead of building it again.
Where every entry exists it returns at once.
"""

from __future__ import annotations

import signal
import sys

import torch

from inference_engine.model_loader import default_model_path, load_model
from tests.engine import family_gguf
from tests.engine import quant_checkpoints as qc
from tests.engine.conftest import hf_greedy_continuations
from tests.engine.test_quantized_accuracy import CASES, TEXT


def main() -> None:
    # Stopped with the suite: SIGTERM unwinds, so a build in progress removes its scratch folder.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    torch.set_num_threads(1)
    tokenizer = load_model(None).tokenizer
    hf_greedy_continuations(tokenizer)
    for family in family_gguf.CONVERTED:  # test_families_gguf: llama.cpp's conversions of the tiny families
        family_gguf.gguf_path(family, "f32")
    token_ids = tokenizer.encode(TEXT)
    for checkpoint, kind, _ in CASES.values():
        qc.reference_logprobs(checkpoint() or default_model_path(), kind, token_ids)
    qc.gguf_file("Q4_0")  # test_quantized_loaders


if __name__ == "__main__":
    main()
