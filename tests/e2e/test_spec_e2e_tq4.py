"""Speculative decoding on a decode engine that loads ``tq4``-compressed KV (ngram, K=3).

The decode engine's attention reads KV decoded from 4-bit codes, so greedy answers may drift
from the prefill engine's; what must hold: every request completes, the drafts are verified
against the loaded prefix (acceptance rate reported per request and in the metrics), and the
repetitive prompts keep a high acceptance rate. bench/spec.py compares the rates with ``raw``.
"""

from __future__ import annotations

import pytest
from conftest import metric_sum, scrape_metrics
from test_connector_e2e_raw import prompt_ids
from test_spec_e2e import PROMPTS, _complete, _engine, ngram

from turbowire.serving.launch import ProcessGroup, free_port, start_proxy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tq4(tiny_model, engine_slot, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs-spec-tq4")
    group = ProcessGroup()
    try:
        p = _engine(group, "tq4-prefill", tiny_model, 0, log_dir, preset="tq4")
        d = _engine(group, "tq4-decode-k3", tiny_model, 1, log_dir, ngram(3), preset="tq4")
        p.wait_healthy(900)
        d.wait_healthy(900)
        x = group.add(start_proxy([p.url], [d.url], free_port(), log_dir))
        x.wait_healthy(120)
        yield p, d, x
    finally:
        group.stop()


def test_tq4_loads_feed_speculative_decoding(tq4):
    p, d, x = tq4
    before = scrape_metrics(d.url)
    rates = {}
    for kind, prompts in PROMPTS.items():
        drafted = accepted = 0
        for prompt in prompts:
            out = _complete(x.url, prompt, max_tokens=48)
            assert out["choices"][0]["text"]
            load = out["kv_transfer_params"]["turbowire_load"]
            assert not load["failed"] and load["tokens"] == len(prompt)
            assert load["wire_bytes"] * 3 < load["dense_bytes"]  # compressed on the wire
            drafted += load["spec_drafted_tokens"]
            accepted += load["spec_accepted_tokens"]
        assert drafted > 0
        rates[kind] = accepted / drafted
    after = scrape_metrics(d.url)
    name = "turbowire_spec_positions_total"
    delta = {o: metric_sum(after, name, outcome=o) - metric_sum(before, name, outcome=o)
             for o in ("drafted", "accepted", "discarded")}
    assert delta["accepted"] + delta["discarded"] == delta["drafted"] > 0
    print(f"tq4 acceptance rates: {rates}")
    assert rates["repetitive"] > 0.5, rates


def test_tq4_short_prompt_below_one_block(tq4):
    _, _, x = tq4
    out = _complete(x.url, prompt_ids(9900, 7), max_tokens=24)
    assert out["choices"][0]["text"]
