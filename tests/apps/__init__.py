"""Dramatiq apps that tests run with the real ``dramatiq`` CLI."""
