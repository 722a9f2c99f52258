"""Speculative decoding as the connector sees it: which KV positions are final, and what drafts did.

A verify step writes K+1 positions into the paged cache (the last sampled token and K drafts);
the rejected ones are rolled back (``num_computed_tokens``) and rewritten by a later step. vLLM's
KV cache manager only caches ``min(num_computed + num_new, request.num_tokens)`` tokens, since
``request.num_tokens`` counts the prompt and *accepted* outputs while drafts live in
``spec_token_ids``. :func:`verified_tokens` is that same cap, less the drafter's lookahead: an
EAGLE-family drafter's KV at position ``t`` is computed from token ``t + 1``, so the last
position is held until the token after it is final. Everything the connector saves is cut at
this watermark, so a rejected draft never reaches the wire or the store.

Prefill backoff (EAGLE-family and MTP): a prefill engine stops short of the trailing
``num_prefill_lookahead_tokens - 1`` prompt tokens (1 for Mamba/bounded replay), which the
decode engine recomputes: otherwise unverified drafts would sit in the MTP layers' KV. This is
vLLM's NixlConnector rule (``_prefill_backoff``), applied the same way on both sides.

:class:`DraftLedger` counts drafted, accepted and discarded positions per request from what the
scheduler shows the connector (the scheduled draft tokens and the request's outputs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turbowire.connector.stats import TurboWireConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

TRUNCATED_PARAM = "_turbowire_prefill_truncated"  # set once a prefill request was cut (preemption)


@dataclass(frozen=True)
class SpeculativeSetup:
    """The speculative-decoding facts the connector acts on, read once from vLLM's config."""

    method: str | None = None
    num_speculative_tokens: int = 0
    draft_lookahead: int = 0  # positions held back from saves (KV that depends on later tokens)
    prefill_backoff: int = 0  # trailing prompt tokens the prefill engine leaves to the decoder

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> SpeculativeSetup:
        spec = vllm_config.speculative_config
        lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
        backoff = max(1 if _has_mamba(vllm_config) else 0, lookahead - 1)
        if spec is None:
            return cls(prefill_backoff=backoff)
        return cls(
            method=str(spec.method),
            num_speculative_tokens=int(spec.num_speculative_tokens or 0),
            draft_lookahead=lookahead,
            prefill_backoff=backoff,
        )


def _has_mamba(vllm_config: VllmConfig) -> bool:
    model_config = getattr(vllm_config, "model_config", None)
    try:
        return bool(model_config is not None and model_config.is_hybrid)
    except Exception:  # noqa: BLE001 - a config without the property has no Mamba layers
        return False


def verified_tokens(request: Request, num_scheduled: int, draft_lookahead: int = 0) -> int:
    """Tokens whose KV is final once this step ran (call before vLLM advances the request)."""
    cap = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
    return max(0, cap - draft_lookahead)


def remote_prefill_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """Prompt tokens a decode engine loads from its prefill peer; it recomputes the rest."""
    if backoff and num_prompt_tokens > backoff:
        return num_prompt_tokens - backoff
    return num_prompt_tokens


def truncate_for_prefill(request: Request, backoff: int) -> bool:
    """Prefill side: drop the trailing ``backoff`` prompt tokens of a ``do_remote_decode``
    request so this engine never computes what the decoder recomputes (once per request)."""
    params = request.kv_transfer_params
    if (
        not backoff
        or not isinstance(params, dict)
        or params.get(TRUNCATED_PARAM)
        or request.num_prompt_tokens <= backoff
        or request.prompt_token_ids is None
        or request.get_skip_reading_prefix_cache()
    ):
        return False
    del request.prompt_token_ids[-backoff:]
    del request._all_token_ids[-backoff:]
    request.num_prompt_tokens -= backoff
    request.max_tokens = 1
    params[TRUNCATED_PARAM] = True
    return True


@dataclass
class DraftCounts:
    """One request's speculative positions so far."""

    drafted: int = 0  # draft positions scheduled for verification
    sampling_steps: int = 0  # steps that sampled a token for it (each yields 1 + accepted)
    accepted: int = 0  # drafts that became output tokens
    reported_discarded: int = 0

    @property
    def discarded(self) -> int:
        return self.drafted - self.accepted


class DraftLedger:
    """Drafted / accepted / discarded positions, per request and in the connector's metrics.

    Each sampling step of a request yields one sampled token plus its accepted drafts, so once
    the outputs of the steps so far are applied (vLLM does that before it schedules the next
    step, without async scheduling) ``accepted = output tokens - sampling steps``. Settled when
    the request is scheduled again and when it finishes; drafts cut by a stop count as discarded.
    """

    def __init__(self, stats: TurboWireConnectorStats) -> None:
        self.stats = stats
        self._requests: dict[str, tuple[Request, DraftCounts]] = {}

    def track(self, request: Request) -> None:
        self._requests.setdefault(request.request_id, (request, DraftCounts()))

    def observe(self, scheduler_output: Any) -> None:
        """Settle the earlier steps of every scheduled request, then count this step's drafts."""
        spec_tokens: dict[str, list[int]] = getattr(
            scheduler_output, "scheduled_spec_decode_tokens", None
        ) or {}
        drafted_now = 0
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            entry = self._requests.get(req_id)
            if entry is None:
                continue
            request, counts = entry
            self._settle(request, counts)
            drafted = sum(1 for token in spec_tokens.get(req_id, ()) if token >= 0)
            # a step samples once the prompt is computed (a partial prefill chunk does not)
            if request.num_computed_tokens + num_scheduled - drafted >= request.num_prompt_tokens:
                counts.sampling_steps += 1
            counts.drafted += drafted
            drafted_now += drafted
        if drafted_now:
            self.stats.record_spec(drafted=drafted_now)

    def finished(self, request: Request) -> DraftCounts | None:
        entry = self._requests.pop(request.request_id, None)
        if entry is None:
            return None
        counts = entry[1]
        self._settle(request, counts)
        return counts

    def _settle(self, request: Request, counts: DraftCounts) -> None:
        accepted = min(max(request.num_output_tokens - counts.sampling_steps, 0), counts.drafted)
        new_accepted = max(0, accepted - counts.accepted)
        counts.accepted = max(counts.accepted, accepted)
        new_discarded = max(0, counts.discarded - counts.reported_discarded)
        if new_accepted or new_discarded:
            self.stats.record_spec(accepted=new_accepted, discarded=new_discarded)
            counts.reported_discarded += new_discarded
