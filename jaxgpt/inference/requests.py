"""A request's state inside the engine, and what a step streams back for it."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxgpt.inference.sampling import SamplingParams


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys/values are in the pages
    chain: list[int] = field(default_factory=list)  # prefix-cache entry ids of the leading full pages
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    seed: int = 0  # params.seed, or the fresh one the engine drew for an unseeded request: rerun with it
    counts: dict[int, int] = field(default_factory=dict)  # token id -> times in output (penalties)
    adjust: dict[int, float] = field(default_factory=dict)  # token id -> its logit shift: bias - penalties

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class RequestOutput:
    """What a step produced for one request. ``new_logprobs``: each new token's log-probability
    (0.0 unless ``logprobs``); ``new_top_logprobs``: one list per new token of its
    ``top_logprobs`` most likely (token id, log-probability) pairs, most likely first (empty lists
    when top_logprobs is 0); both the model's log-softmax before bias, penalties and temperature."""

    id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
