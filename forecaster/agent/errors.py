"""The node agent's one error type: a reason from the fixed set, and whether trying again may help."""

from __future__ import annotations

from forecaster.contracts.actions import FailureReason

# Reasons that are worth retrying unless an error says otherwise.
TEMPORARY_REASONS = frozenset({FailureReason.TIMEOUT, FailureReason.RUNTIME_UNAVAILABLE})


class AgentError(Exception):
    """A pre-pull or pre-load failed for ``reason``.

    Args:
        reason: one of :class:`~forecaster.contracts.actions.FailureReason`.
        message: what happened, for people.
        temporary: True when the same request may succeed later (network, a busy
            runtime, a deadline); defaults to whether ``reason`` is usually temporary.
    """

    def __init__(self, reason: FailureReason, message: str, *, temporary: bool | None = None) -> None:
        super().__init__(message)
        self.reason = FailureReason(reason)
        self.message = message
        self.temporary = self.reason in TEMPORARY_REASONS if temporary is None else temporary

    def as_dict(self) -> dict:
        return {"reason": str(self.reason), "message": self.message, "temporary": self.temporary}
