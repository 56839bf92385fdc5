"""OpenAI's predicted outputs: the `prediction` field of chat and completions requests.

    "prediction": {"type": "content", "content": "the text the output is expected to repeat"}
    "prediction": {"type": "content", "content": [{"type": "text", "text": "..."}, ...]}

The predicted text is tokenized and drafted from (engine/speculation.py): it changes how fast the
output comes, never what it is; usage reports its accepted and rejected tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from convoy.api.protocol_base import RequestModel

# Characters of predicted text; its tokens are bounded again by SamplingParams (32,768).
MAX_PREDICTION_CHARS = 256 * 1024


class PredictionTextPart(RequestModel):
    type: Literal["text"]
    text: str = Field(max_length=MAX_PREDICTION_CHARS)


class Prediction(RequestModel):
    type: Literal["content"]
    content: str | list[PredictionTextPart] = Field(max_length=MAX_PREDICTION_CHARS)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)
