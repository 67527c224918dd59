"""The mixed workload of the vLLM case study (../shared/seeds): 20 % short answers, 80 % long generations.

Short requests are questions answered in 48 tokens; long ones summarise a document in 192 tokens, so
their prompts are long too. Every request runs to its max_tokens (ignore_eos) under greedy decoding,
so all systems generate exactly the same amount of work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SHORT_TOKENS, LONG_TOKENS = 48, 192

_QUESTIONS = [
    "What is the capital of Australia?",
    "How many legs does a spider have?",
    "What does HTTP stand for?",
    "Who wrote Pride and Prejudice?",
    "What is the boiling point of water at sea level?",
    "Name three primary colours.",
    "What is 17 times 3?",
    "Which planet is known as the red planet?",
]
_SENTENCES = [
    "The city council met on Tuesday to discuss the new public transport plan.",
    "Ridership on the northern bus lines has grown by a third since last spring.",
    "Several members argued that the budget should favour cycling lanes instead.",
    "A consultant presented three options with different costs and timelines.",
    "The cheapest option reuses existing depots but delays new routes by two years.",
    "Local businesses asked for fewer road closures during the construction work.",
    "Residents of the old town raised concerns about noise from night buses.",
    "The council agreed to hold a public consultation before the final vote.",
    "Funding from the regional government depends on a decision before December.",
    "Engineers warned that the bridge on the river road needs repairs first.",
]


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int

    @property
    def is_short(self) -> bool:
        return self.max_tokens == SHORT_TOKENS


def mixed_workload(num_requests: int = 32, short_share: float = 0.2, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    num_short = round(num_requests * short_share)
    requests = [Request(f"Answer briefly. {rng.choice(_QUESTIONS)}", SHORT_TOKENS) for _ in range(num_short)]
    for i in range(num_requests - num_short):
        document = " ".join(rng.choice(_SENTENCES) for _ in range(rng.randint(12, 28)))
        requests.append(
            Request(f"Document {i}:\n{document}\n\nSummarise the document above in detail:", LONG_TOKENS)
        )
    rng.shuffle(requests)
    return requests
