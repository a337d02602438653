"""The router itself keeps document affinity (real gRPC on loopback, fake prefill workers): once a document's
prefill succeeded on a worker, the next request on the same context goes back to that worker although the
other one is as idle and would win the tie by address; another context goes by load. (``LoadTracker``'s
choice alone is ``test_document_affinity.py``; this is the servicer remembering and asking it.)

Planted: the router not remembering who served the prefill (``self.prefill_load.remember(doc, address)``
removed from ``RouterServicer._prefill``) -> this test fails; ``_prefill`` passing no document to the
worker choice (``self._with_retries("prefill", ..., call, None, tokens)``) -> this test fails;
``LoadTracker.choose`` ignoring ``doc`` -> this test fails.
"""

from __future__ import annotations

from tests.router.test_router_retries import CONTEXT, PDLLM, QUESTION, Cluster, cluster  # noqa: F401


def test_a_returning_document_goes_back_to_the_prefill_worker_that_served_it(cluster: Cluster) -> None:  # noqa: F811
    first, second = cluster.prefills  # idle workers tie; the tie goes to ``first`` (by address)
    first.mode = "busy"  # so the document's first prefill lands on ``second``, after a retry
    with cluster.client() as client:
        assert client.generate(CONTEXT, QUESTION, **PDLLM).trace.prefill_worker == second.address
        first.mode = "ok"
        again = client.generate(CONTEXT, "Who is Mira Halden?", **PDLLM)
        other = client.generate("Another document entirely. " * 4, QUESTION, **PDLLM)
    assert again.trace.prefill_worker == second.address  # its owner, though ``first`` is as idle
    assert other.trace.prefill_worker == first.address  # a new document: least load, then address
    assert (len(first.requests), len(second.requests)) == (2, 2)
