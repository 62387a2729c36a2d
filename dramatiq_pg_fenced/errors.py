"""Errors of our own; everything else is one of Dramatiq's."""

from __future__ import annotations

from dramatiq.errors import BrokerError


class SchemaError(BrokerError):
    """The database has no schema, or an older one: run the migrate command."""


class PayloadTooLarge(BrokerError, ValueError):
    """An encoded message is larger than the broker's ``max_payload_bytes``."""


class DeadLetterError(BrokerError):
    """Raised by ``join(fail_fast=True)`` for a message dead-lettered elsewhere.

    When the message failed in this process, ``join`` raises the actor's own
    exception instead, as Dramatiq's StubBroker does.
    """

    def __init__(self, message_id: str, error: str | None) -> None:
        super().__init__(f"message {message_id} was dead-lettered: {error}")
        self.message_id = message_id
        self.error = error
