"""How `select` turns per-choice logprobs into a decision.

A backend computes, for every choice, the logprobs of the choice's own tokens given the prompt
(`input_token_logprobs[i]`, entries `[logprob, token_id, text]`) and their mean
(`normalized_prompt_logprobs[i]`). A `ChoicesSamplingMethod` picks the winner from those; the
names and meta-info keys follow SGLang so that `choices_method=` arguments port unchanged.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _argmax_first(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def mean_logprob(entries: list[list[Any]]) -> float:
    """Mean of the logprobs in `[logprob, token_id, text]` entries; None logprobs are skipped."""
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else -math.inf


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision: ...


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (ties go to the first)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        })


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compares choices token by token and keeps those with the best logprob at each position;
    a shorter choice is padded with its own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(entries) for entries in input_token_logprobs)
        matrix = []
        for entries in input_token_logprobs:
            row = [e[0] if e[0] is not None else 0.0 for e in entries]
            fill = sum(row) / len(row) if row else -math.inf
            matrix.append(row + [fill] * (width - len(row)))
        remaining = list(range(len(choices)))
        for col in range(width):
            best = max(matrix[i][col] for i in remaining)
            remaining = [i for i in remaining if matrix[i][col] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix,
        })


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Mean of (logprob given the prompt - logprob of the choice on its own); the backend supplies
    `unconditional_token_logprobs` (the choice's tokens scored without the prompt)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs cover different token counts")
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]
            scores.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        return ChoicesDecision(choices[_argmax_first(scores)], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        })


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(method: ChoicesSamplingMethod, temperature: float, rng: random.Random | None = None,
           **scores: Any) -> ChoicesDecision:
    """Runs `method`; with temperature > 0 the default method samples from softmax(score / T)."""
    decision = method(**scores)
    if temperature <= 1e-5:
        return decision
    if not isinstance(method, TokenLengthNormalized):
        raise ValueError("select(temperature > 0) is only supported with token_length_normalized")
    values = scores["normalized_prompt_logprobs"]
    top = max(values)
    weights = [math.exp((v - top) / temperature) for v in values]
    index = (rng or random).choices(range(len(values)), weights=weights)[0]
    return ChoicesDecision(scores["choices"][index], decision.meta_info)
