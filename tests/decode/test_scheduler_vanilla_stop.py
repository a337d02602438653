"""Sessions stepped alone (DyLLM's loop, SDAR's FOCUS groups; a plain denoising loop stands in for them
here) start no step that nobody waits for: not for a request cancelled while another session
stepped, nor once the scheduler is closing (a SIGTERM drain waits for the step in progress, so every
further step would delay the exit)."""

from __future__ import annotations

import threading

from pdllm.decode_service.request import DecodeRequest, Partial
from pdllm.decode_service.rounds import EagerRoundForward
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.shared.generation.plain import prompt_tensor, vanilla_logits_fn
from pdllm.shared.generation.sampler import DenoiseSession, GenerationConfig
from tests.decode.helpers import pool_for
from tests.engine.helpers import model

GEN = GenerationConfig(gen_length=4, steps=4)


def _vanilla_job(m, rid: str, on_step=None) -> DecodeRequest:  # type: ignore[no-untyped-def]
    def start() -> DenoiseSession:
        prompt = prompt_tensor(m, [1, 8, 9, 10, 11])
        fn = vanilla_logits_fn(m, prompt, GEN.gen_length)
        session = DenoiseSession(GEN, m.config.mask_token_id, m.config.eos_token_id, fn, prompt.device)
        if on_step is not None:  # runs during this session's step, like a client leaving meanwhile
            step = session.step
            session.step = lambda: (on_step(), step())[1]  # type: ignore[method-assign]
        return session

    return DecodeRequest(rid, start, threading.Event(), True)


def _partials(job: DecodeRequest) -> int:
    return sum(isinstance(job.events.get_nowait(), Partial) for _ in range(job.events.qsize()))


def _scheduler(m) -> DecodeScheduler:  # type: ignore[no-untyped-def]
    pool = pool_for(m, pages=16)
    return DecodeScheduler(m, pool, EagerRoundForward(m, pool, "torch"), start_thread=False)


def test_a_vanilla_request_cancelled_during_another_step_is_not_stepped() -> None:
    m = model("dream")
    sched = _scheduler(m)
    second = _vanilla_job(m, "second")
    first = sched.submit(_vanilla_job(m, "first", on_step=second.cancelled.set))
    sched.submit(second)
    sched.run_once()  # both join; the first's step cancels the second before its turn
    assert first.session.state.steps_taken == 1 and _partials(first) == 1  # type: ignore[union-attr]
    assert second.session.state.steps_taken == 0 and _partials(second) == 0  # type: ignore[union-attr]


def test_a_closing_scheduler_starts_no_further_vanilla_step() -> None:
    m = model("dream")
    sched = _scheduler(m)
    job = sched.submit(_vanilla_job(m, "r"))
    sched.run_once()
    assert job.session.state.steps_taken == 1  # type: ignore[union-attr]
    sched.close()  # no thread here: close() only marks the scheduler stopped
    sched.run_once()
    assert job.session.state.steps_taken == 1  # type: ignore[union-attr]
