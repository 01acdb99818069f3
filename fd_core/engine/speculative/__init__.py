"""Speculative decoding: proposers guess a sequence's next tokens, and one target forward checks
them all (``verify``)."""
