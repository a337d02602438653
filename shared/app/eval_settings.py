"""What one ``pdllm eval`` decode is made of: the tasks, pdllm's settings (:class:`EvalSettings`), a
sample made for a task, length, depth and seed, its generation settings (sized per sample for long-answer
and infilling), and the short-answer tasks' exact match.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.eval.infilling import INFILLING, InfillSample, infill_gen_length
from pdllm.shared.eval.infilling import make_eval_sample as make_infill_sample
from pdllm.shared.eval.long_answer import LONG_ANSWER, LongAnswerSample, answer_gen_length, make_eval_sample
from pdllm.shared.eval.tasks import TASKS, Sample, make_sample
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import LoadedModel

EVAL_TASKS = (*TASKS, LONG_ANSWER, INFILLING)
# Tasks whose generation length is sized per sample (the rest use --gen-length).
PER_SAMPLE_LENGTH = (LONG_ANSWER, INFILLING)
# Long-answer and infilling generation lengths are whole multiples of this where no --block-length is given.
LONG_ANSWER_ROUND = 32
AnySample = Sample | LongAnswerSample | InfillSample


@dataclass(frozen=True)
class EvalSettings:
    """pdllm's settings; None = the checkpoint's pdllm.json, else the rules below / EngineConfig's."""

    gen_length: int = 8
    chunk_size: int | None = None  # else: train_length // 4
    top_k: int | None = None  # else: as many chunks as fit in the training length with the query
    score_mode: str | None = None
    kv_mode: str | None = None
    chunk_boundary: str | None = None
    block_length: int | None = None  # None: one block of gen_length
    threshold: float | None = None  # None: one token per step; else unmask every position above it
    decode_policy: DecodePolicyConfig = DecodePolicyConfig()  # both methods' decode (none: the plain loops)

    def engine_config(
        self, loaded: LoadedModel, train_length: int, query_tokens: int, gen_length: int | None = None
    ) -> EngineConfig:
        model = loaded.serving.engine
        c = self.chunk_size or model.get("chunk_size") or max(train_length // 4, 16)
        gen = gen_length or self.gen_length
        k = self.top_k or model.get("top_k") or max(1, (train_length - query_tokens - gen) // (c + 1))
        return EngineConfig.from_settings(
            model,
            chunk_size=c,
            top_k=k,
            score_mode=self.score_mode,
            kv_mode=self.kv_mode,
            chunk_boundary=self.chunk_boundary,
        )


def generation(settings: EvalSettings, tokenizer: object, sample: AnySample) -> GenerationConfig:
    """The sample's generation settings: the flags', or for long-answer (infilling) its passage's (span's)
    length in blocks. One step per answer token, or under a threshold as many as its confidences take
    (``steps`` is then unused by the sampler)."""
    n = settings.gen_length
    if isinstance(sample, LongAnswerSample):
        n = answer_gen_length(tokenizer, sample, settings.block_length or LONG_ANSWER_ROUND)
    elif isinstance(sample, InfillSample):
        n = infill_gen_length(sample, settings.block_length or LONG_ANSWER_ROUND)
    gen = GenerationConfig(
        gen_length=n, steps=n, block_length=settings.block_length, threshold=settings.threshold
    )
    gen.validate()
    return gen


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip() == answer.strip()


def eval_sample(task: str, length: int, depth: float, seed: int, tokenizer: object) -> AnySample:
    if task == LONG_ANSWER:
        return make_eval_sample(tokenizer, length, depth, seed)
    if task == INFILLING:
        return make_infill_sample(tokenizer, length, depth, seed)
    return make_sample(task, length, depth, seed, tokenizer)
