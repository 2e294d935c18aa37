"""2P2D in live `vllm serve` processes behind `kvplane proxy --policy kv-aware` (`kvplane.bench.serve.routing`):
two prefills with kvplane's host tier publishing vLLM's KV events, two decodes, pull over Mooncake. Conversations
that grow round by round go through the proxy: every answer equals one instance's (the first prefill asked plainly,
under a salt of its own), the router picked by prefix hit (its own metrics), and the prefills found cached blocks
for the later rounds (vLLM's own `/metrics`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import SERVE_PY

from kvplane.bench.serve import client
from kvplane.bench.serve.procs import metrics
from kvplane.bench.serve.routing import MAX_TOKENS, XPyD, conversations, run_policy, start_xpyd

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def xpyd(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[XPyD]:
    made = start_xpyd(SERVE_PY, model, tmp_path_factory.mktemp("routing"), ("kv-aware",))
    print(f"\n2P2D: server start {made.start_s}")
    try:
        yield made
    finally:
        made.close()


def test_2p2d_kv_aware_answers_as_one_instance_and_routes_later_rounds_to_their_prefix(xpyd: XPyD, model: Path
                                                                                        ) -> None:
    run = run_policy(xpyd, str(model), "kv-aware", conversations("kv-routing-test", count=4, rounds=3))
    want = {p: client.stream(xpyd.prefills[0].url, str(model), p, MAX_TOKENS).text for p in run.texts}
    seen = metrics(xpyd.proxies["kv-aware"].url)
    by_hit = seen.get('kvplane_proxy_kv_decisions_total{how="kv"}', 0.0)
    expected = seen.get('kvplane_proxy_kv_hit_tokens_total{source="expected"}', 0.0)
    reported = seen.get('kvplane_proxy_kv_hit_tokens_total{source="reported"}', 0.0)
    print(f"\nkv-aware: {by_hit:.0f} of {len(run.texts)} picks by hit; hit tokens expected {expected:.0f}, reported "
          f"{reported:.0f}; prefills computed {run.computed:.0f} of {run.prompt_tokens:.0f} prompt tokens "
          f"(hit rate {run.hit_rate:.2f}); decisions {[k for k in seen if 'kv_decisions' in k]}")
    assert run.texts == want
    assert by_hit > 0 and expected > 0 and reported > 0
    assert run.computed < run.prompt_tokens
