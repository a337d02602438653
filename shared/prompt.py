"""How a request (instruction, context, question) becomes token ids.

One rendering for every method: vanilla sees ``[BOS] instruction context query``; Prefilling-dLLM
sees the same instruction and query, with the context split into BOS-prefixed chunks between them.
The query suffix format is the one the shipped model was trained on.

User text (context, question, instruction) is normalized first (:func:`normalize_text`): the same words
typed with compatibility forms or invisible format characters give the same tokens.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

QUERY_TEMPLATE = "\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class PromptIds:
    instruction: list[int]
    context: list[int]
    query: list[int]

    def vanilla(self, bos_id: int | None) -> list[int]:
        """The full prompt a vanilla decoder encodes every step."""
        head = [bos_id] if bos_id is not None else []
        return head + self.instruction + self.context + self.query


def normalize_text(text: str) -> str:
    """Unicode NFKC, then every format character (category Cf: zero-width space / joiners, word joiner, BOM,
    soft hyphen, bidi marks) removed: a name pasted with a zero-width space inside it is the same name."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def encode_prompt(
    tokenizer: Any,
    context: str,
    question: str,
    instruction: str | None = None,
    query_template: str = QUERY_TEMPLATE,
) -> PromptIds:
    """Tokenize the three parts separately (so chunk boundaries never straddle the query), each normalized
    (:func:`normalize_text`)."""
    context, question = normalize_text(context), normalize_text(question)
    instruction = normalize_text(instruction) if instruction else instruction
    if not context.strip():
        raise ValueError("context is empty")
    if not question.strip():
        raise ValueError("question is empty")

    def enc(text: str) -> list[int]:
        # User text is text: "[MASK]" typed in a question must not become the mask token (special tokens
        # come only from the prompt template and chunking).
        if not text:
            return []
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    return PromptIds(
        instruction=enc(instruction or ""),
        context=enc(context),
        query=enc(query_template.format(question=question.strip())),
    )
