"""A NIXL transfer's state never raises into the loader: NIXL raises its own errors when asked
about a READ whose peer died (``nixlRemoteDisconnectError``, seen killing a decode engine's
worker while it tore the failed load down); such a transfer is FAILED, as vLLM's NixlConnector
counts it. The agent is a stand-in: only the state mapping is under test (the real agents are
exercised in tests/integration and tests/e2e/test_faults_e2e.py)."""

from __future__ import annotations

import pytest

from turbowire.connector.transports.base import TransferState
from turbowire.connector.transports.nixl import NixlTransfer


class RemoteDisconnectError(Exception):
    """Stands in for ``nixl._bindings.nixlRemoteDisconnectError``."""


class Agent:
    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.asked = 0

    def check_xfer_state(self, handle: object) -> str:
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize("answers,final", [
    (["PROC", "DONE"], TransferState.DONE),
    (["PROC", "ERR"], TransferState.FAILED),
    (["PROC", RemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")], TransferState.FAILED),
])
def test_the_state_settles_once_and_an_error_raised_while_asking_is_a_failure(answers, final):
    agent = Agent(list(answers))
    xfer = NixlTransfer(agent, handle=object(), nbytes=16)
    assert xfer.state() is TransferState.PENDING
    assert xfer.state() is final
    assert xfer.state() is final and agent.asked == 2  # settled: NIXL is not asked again
