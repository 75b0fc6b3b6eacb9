"""How much one request may ask for (issue 19, item 2): its prompts and its sequences
(prompts x n). Past either it is refused before it is tokenised, with a 400 that names the
limit: waiting could never help it. The queue's own limits (K4, per tenant too) follow when
it is queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.server.errors import bad_request

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 512


@dataclass(frozen=True)
class FanOutLimits:
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST

    def check(self, req: Any, chat: bool) -> None:
        num_prompts = 1 if chat else count_prompts(req.prompt)
        if num_prompts > self.max_prompts_per_request:
            raise bad_request(f"'prompt' is a list of {num_prompts} prompts; this server "
                              f"accepts at most {self.max_prompts_per_request} per request "
                              "(--max-prompts-per-request); split it", param="prompt")
        num_sequences = num_prompts * req.n
        if num_sequences > self.max_sequences_per_request:
            raise bad_request(f"{num_prompts} prompt(s) x n={req.n} is {num_sequences} "
                              f"sequences; this server accepts at most "
                              f"{self.max_sequences_per_request} per request "
                              "(--max-sequences-per-request)", param="n")


def count_prompts(prompt: Any) -> int:
    """A string or a list of token ids is one prompt; otherwise a list of them."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)
